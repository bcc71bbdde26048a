"""Grants follow what the policy names, not what a link points to (issue 14).

Two tools in one process: W may write `project/`, R may read `project/data/**`. W plants
`project/data -> ../secret` with an ordinary `os.symlink`. R runs hostile native code (ctypes,
so the Python guards are not what stops it) under each kernel provider and `auto`. The
verdict is the effect: the secret's content must never reach R's output.

- planted before R's worker starts: the providers resolve each grant without following
  links, so R's policy is refused, naming the link;
- planted while R's worker runs: the grant was pinned to the directory when the worker
  started (a bind mount, a Landlock rule on its inode), so the new link leads nowhere R
  may read; the next worker R starts is refused.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, PolicyError, Sandbox, SandboxError

from .conftest import KERNEL_PROVIDERS, NATIVE, skip_unless_available

SECRET = "secret-key-material-14"


@pytest.fixture(params=(*KERNEL_PROVIDERS, "auto"))
def provider(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    if name != "auto":
        skip_unless_available(name)
    return name


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    project = tmp_path / "project"
    secret = tmp_path / "secret"
    project.mkdir()
    secret.mkdir()
    (secret / "key.txt").write_text(SECRET + "\n")
    return {"root": tmp_path, "project": project, "data": project / "data", "secret": secret}


def _tool(name: str, files: dict[str, list[str]]) -> Policy:
    """A tool policy that lets native code run, so only the kernel can refuse it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Policy(
            name=f"danger-{name}",
            imports={"allow": ["*"]},
            api={"allow": ["native-code"]},
            code={"enabled": False},
            files=files,
            limits={"wall_seconds": 20, "memory_mb": 512, "processes": 16},
            visible_names="accepted",  # read only under landlock, which takes no other
        )


def _writer(tree: dict[str, Path]) -> Policy:
    return _tool("w", {"write": [str(tree["project"])]})


def _reader(tree: dict[str, Path]) -> Policy:
    return _tool("r", {"read": [f"{tree['data']}/**"]})


def _plant(provider: str, tree: dict[str, Path]) -> None:
    """W replaces `project/data` with `project/data -> ../secret` (inside its own grant)."""
    code = (
        "import os\n"
        f"data = {str(tree['data'])!r}\n"
        "if os.path.isdir(data):\n"
        "    os.rename(data, data + '.old')\n"
        "os.symlink('../secret', data)\n"
        "print('planted', os.readlink(data))\n"
    )
    with Sandbox(_writer(tree), provider=provider, warm=0) as sandbox:
        result = sandbox.run(code)
    assert "planted ../secret" in result.stdout, (result.stdout, result.stderr, result.error)
    assert tree["data"].is_symlink()


def _steal(tree: dict[str, Path]) -> str:
    return (
        NATIVE
        + f"print(repr(nread({str(tree['data'] / 'key.txt')!r})))\n"
        + f"print(repr(nread({str(tree['secret'] / 'key.txt')!r})))\n"
    )


def _output(result: Any) -> str:
    return f"{result.stdout}\n{result.stderr}\n{result.value!r}\n{result.error!r}"


def test_a_link_planted_before_the_reader_starts_refuses_its_policy(
    provider: str, tree: dict[str, Path]
) -> None:
    """It refuses R's policy, naming the link, when `project/data` is a link W planted."""
    _plant(provider, tree)
    with pytest.raises(PolicyError) as info:
        with Sandbox(_reader(tree), provider=provider, warm=0) as sandbox:
            result = sandbox.run(_steal(tree))
            assert SECRET not in _output(result)
    message = str(info.value)
    assert str(tree["data"]) in message and "symbolic link" in message
    assert "files.read" in message


def test_a_link_planted_while_the_reader_runs_leads_nowhere(
    provider: str, tree: dict[str, Path]
) -> None:
    """It keeps R's running worker on the directory it was granted at start: after W swaps
    `project/data` for a link to the secret, native reads through either name fail; R's next
    worker is refused."""
    tree["data"].mkdir()
    (tree["data"] / "ok.txt").write_text("public\n")
    with Sandbox(_reader(tree), provider=provider, warm=0) as sandbox:
        session = sandbox.session("r")
        first = session.run(NATIVE + f"print(nread({str(tree['data'] / 'ok.txt')!r}))")
        assert "public" in first.stdout, _output(first)
        _plant(provider, tree)
        after = session.run(_steal(tree))
        assert after.error is None, after.error  # the attack ran; only the kernel refused it
        assert SECRET not in _output(after)
    with pytest.raises(PolicyError, match="symbolic link"):
        with Sandbox(_reader(tree), provider=provider, warm=0) as sandbox:
            sandbox.run("1")


def test_a_link_in_a_parent_component_is_refused_too(provider: str, tree: dict[str, Path]) -> None:
    """It refuses a grant whose parent directory is a link (`project/data/sub` through
    `project/data -> ../secret`), not only a grant that is one."""
    (tree["secret"] / "sub").mkdir()
    (tree["secret"] / "sub" / "k").write_text(SECRET)
    os.symlink("../secret", tree["data"])
    policy = _tool("r2", {"read": [str(tree["data"] / "sub")]})
    with pytest.raises(PolicyError, match="symbolic link"):
        with Sandbox(policy, provider=provider, warm=0) as sandbox:
            sandbox.run("1")


def test_a_link_swapped_in_after_the_check_stops_the_start(
    provider: str, tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It refuses to start R's worker when `project/data` is swapped for a link between the
    parent's check and the mount or Landlock rule (the race the pins close): the worker
    compares what it was granted with what the check pinned."""
    from agent_sandbox.providers import _bwrap, _firejail, _grants, _unshare

    tree["data"].mkdir()
    original = _grants.grant_pins

    def racing(policy: Any, spec: Any) -> dict[str, Any]:
        # Each check (auto builds several plans) sees the real directory; each start, the link.
        if tree["data"].is_symlink():
            tree["data"].unlink()
            os.rename(tree["root"] / "data.old", tree["data"])
        pins = original(policy, spec)
        os.rename(tree["data"], tree["root"] / "data.old")
        os.symlink("../secret", tree["data"])
        return pins

    for module in (_grants, _bwrap, _unshare, _firejail):
        monkeypatch.setattr(module, "grant_pins", racing)
    with pytest.raises(SandboxError) as info:
        with Sandbox(_reader(tree), provider=provider, warm=0) as sandbox:
            result = sandbox.run(_steal(tree))
            assert SECRET not in _output(result)
    assert SECRET not in str(info.value)
    assert "pinned" in str(info.value), str(info.value)


def test_a_link_swapped_in_after_the_hosts_last_check_stops_the_gvisor_start(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under gvisor the host walks the grants again just before runsc starts, and runsc's
    gofer opens each bind source by path some tens of milliseconds later: a swap inside that
    window is caught after the start, before any call, where the host walks each granted
    path in the gofer's own root (`check_pins_in_gofer`)."""
    from agent_sandbox.providers.gvisor import provider as gvisor_provider

    skip_unless_available("gvisor")
    tree["data"].mkdir()
    original = gvisor_provider.check_pins_on_host

    def then_swap(pins: Any) -> None:
        original(pins)  # the host's last check passes on the real directory...
        os.rename(tree["data"], tree["root"] / "data.old")
        os.symlink("../secret", tree["data"])  # ...and the gofer meets the link

    monkeypatch.setattr(gvisor_provider, "check_pins_on_host", then_swap)
    with pytest.raises(SandboxError) as info:
        with Sandbox(_reader(tree), provider="gvisor", warm=0) as sandbox:
            result = sandbox.run(_steal(tree))
            assert SECRET not in _output(result)
    assert tree["data"].is_symlink()  # the swap was made
    assert SECRET not in str(info.value)
    assert "as the sandbox mounted it is not the object the policy check pinned" in str(
        info.value
    ), str(info.value)
