"""`import agent_sandbox` stays lean: the heavy parts load when first used (issue 19)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

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
    assert "agent_sandbox.providers._qemu" not in loaded
    assert "agent_sandbox.providers._egress" not in loaded


def test_the_denial_shapes_compile_on_first_use() -> None:
    loaded = _modules_after(
        "import agent_sandbox._host.intake.events as i\nassert i.shapes.cache_info().currsize == 0"
    )
    assert "agent_sandbox._host.intake.events" in loaded


def test_a_first_result_loads_no_metadata_scan_nor_policy_file_machinery() -> None:
    """A process's first result with a policy built in Python imports neither
    `importlib.metadata` (pydantic's plugin loader read every installed distribution's entry
    points for each policy model) nor what only policy files, presets or a misspelt key need
    (`tomllib`, `importlib.resources`, `difflib`)."""
    loaded = _modules_after(
        "from agent_sandbox import Policy, Sandbox\n"
        "with Sandbox(Policy(name='lean'), warm=0) as sb:\n"
        "    assert sb.run('1+1').value == 2"
    )
    assert not {"importlib.metadata", "tomllib", "importlib.resources", "difflib"} & loaded


def test_the_policy_models_validate_without_pydantic_plugins_and_others_keep_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a pydantic plugin installed, a model of the caller's is built with it, while the
    policy models get pydantic's plain validator (the same schema, no plugin loader)."""
    from pydantic import BaseModel
    from pydantic.plugin import _loader
    from pydantic.plugin._schema_validator import PluggableSchemaValidator
    from pydantic_core import SchemaValidator

    from agent_sandbox.policies import CodeBudgets, Policy

    seen: list[str] = []

    class Plugin:
        def new_schema_validator(
            self, schema: object, schema_type: object, path: Any, *a: Any
        ) -> Any:
            seen.append(path.module)
            return None, None, None

    monkeypatch.setattr(_loader, "_plugins", {"test": Plugin()})

    class Mine(BaseModel):
        x: int = 1

    assert isinstance(Mine.__pydantic_validator__, PluggableSchemaValidator)
    assert seen == [__name__] and Mine(x=2).x == 2
    try:
        Policy.model_rebuild(force=True)
        assert type(Policy.__pydantic_validator__) is SchemaValidator
        assert seen == [__name__]
    finally:
        monkeypatch.undo()
        Policy.model_rebuild(force=True)
    assert type(Policy.__pydantic_validator__) is SchemaValidator
    assert type(CodeBudgets.__pydantic_validator__) is SchemaValidator
    with pytest.raises(ValueError, match=r"limits\.cpu_seconds"):
        Policy(limits={"cpu_seconds": 0})
