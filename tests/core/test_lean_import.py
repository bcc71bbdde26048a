"""`import agent_sandbox` stays lean: the heavy parts load when first used (issue 19)."""

from __future__ import annotations

import subprocess
import sys

import agent_sandbox


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return set(out.split())


def test_importing_the_package_loads_neither_learning_nor_pydantic() -> None:
    """It imports neither the learning code, pydantic and the policy models, nor the
    denial shapes' regular expressions until they are used."""
    loaded = _modules_after("import agent_sandbox")
    assert not {m for m in loaded if m.startswith("agent_sandbox._tools.learn")}
    assert "pydantic" not in loaded
    assert "agent_sandbox.policies._model" not in loaded


def test_the_public_names_still_resolve() -> None:
    """Every name in `__all__` resolves, also the ones loaded on first use."""
    for name in agent_sandbox.__all__:
        assert getattr(agent_sandbox, name) is not None, name
    from agent_sandbox import Policy, Sandbox

    assert Sandbox.__module__ == "agent_sandbox._host.sandbox"
    assert Policy.__name__ == "Policy"


def test_using_a_sandbox_does_not_load_the_learning_code() -> None:
    loaded = _modules_after("from agent_sandbox import Policy, Sandbox")
    assert not {m for m in loaded if m.startswith("agent_sandbox._tools.learn")}


def test_a_sandbox_that_never_awaits_loads_no_asyncio_nor_the_qemu_provider() -> None:
    """It imports asyncio (and concurrent.futures, ssl) only for async calls or an egress
    proxy, and the qemu provider only when a policy names it."""
    loaded = _modules_after(
        "from agent_sandbox import Policy, Sandbox\n"
        "with Sandbox(Policy(name='lean'), warm=0) as sb:\n"
        "    assert sb.run('1+1').value == 2"
    )
    assert not {"asyncio", "concurrent.futures", "ssl"} & loaded
    assert "agent_sandbox.providers.qemu.provider" not in loaded
    assert not {m for m in loaded if m.startswith("agent_sandbox._host.egress.")}


def test_the_denial_shapes_compile_on_first_use() -> None:
    loaded = _modules_after(
        "import agent_sandbox._host.intake.events as i\nassert i.shapes.cache_info().currsize == 0"
    )
    assert "agent_sandbox._host.intake.events" in loaded


def test_a_first_result_loads_no_policy_file_machinery() -> None:
    """A process's first result with a policy built in Python imports nothing that only
    policy files or a misspelt key need (`tomllib`, `difflib`). (`importlib.resources`,
    which presets need, comes anyway with pydantic's plugin loader.)"""
    loaded = _modules_after(
        "from agent_sandbox import Policy, Sandbox\n"
        "with Sandbox(Policy(name='lean'), warm=0) as sb:\n"
        "    assert sb.run('1+1').value == 2"
    )
    assert not {"tomllib", "difflib"} & loaded


def test_the_channel_and_the_unpickler_load_with_the_first_worker_not_before() -> None:
    """It loads h11 and the restricted unpickler (about 11 ms of imports) only when a worker
    starts, after its launch, so a fresh process imports them while the worker boots: not
    with `Sandbox`, nor with a `Policy` that names no `result_types`."""
    deferred = {"h11", "agent_sandbox._host.intake.unpickle"}
    deferred |= {"agent_sandbox._host.intake.unpickle_classes"}
    loaded = _modules_after(
        "from agent_sandbox import Policy, Sandbox\nSandbox(Policy(name='lean'), warm=0).close()"
    )
    assert not deferred & loaded
    loaded = _modules_after(
        "from agent_sandbox import Policy, Sandbox\n"
        "with Sandbox(Policy(name='lean'), warm=0) as sb:\n"
        "    assert sb.run('1+1').value == 2"
    )
    assert deferred <= loaded
