"""A kernel boundary by default; running without one takes an opt-out in so many words.

Pins: the default provider is `auto` (policies, presets, `Sandbox()`, the CLI); `auto` never
falls back to no boundary; `provider = "subprocess"` needs `no_kernel_boundary = "accepted"`;
a provider that is unknown or cannot run here fails at construction and at `policy check`;
every result names the boundary that ran; the opt-out logs one warning per pool.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from agent_sandbox import Policy, PolicyError, ProviderUnavailable, Sandbox
from agent_sandbox._host.boundary import boundary_name, resolve_boundary
from agent_sandbox.policies import list_presets, load_policy, resolve_policy
from agent_sandbox.providers import ProbeResult, Provider, WorkerSpec, _auto, get_provider

OPT_OUT = {"provider": "subprocess", "no_kernel_boundary": "accepted"}


def _kernel_here() -> bool:
    return get_provider("auto").probe().available


needs_kernel = pytest.mark.skipif(not _kernel_here(), reason="no kernel provider works here")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent_sandbox", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- the default ---------------------------------------------------------------------------


def test_the_default_provider_is_auto_everywhere() -> None:
    """It defaults the model and every shipped preset to `auto`."""
    assert Policy().provider == "auto"
    for name in list_presets():
        assert resolve_policy(name).provider == "auto", name


@needs_kernel
def test_a_default_sandbox_runs_behind_a_kernel_boundary() -> None:
    """It runs `Sandbox()` behind a kernel stack and every result names it."""
    with Sandbox(warm=0) as sb:
        assert sb.boundary.is_kernel and sb.boundary.name not in ("", "none")
        result = sb.run("1 + 1")
    assert result.ok and result.value == 2
    assert result.boundary == sb.boundary.name == "+".join(result.stack)
    assert result.to_dict()["boundary"] == result.boundary
    assert get_provider(result.provider).is_boundary


@needs_kernel
def test_cli_run_json_with_no_options_reports_a_kernel_boundary() -> None:
    """It reports a kernel boundary for `agent-sandbox run --json -c 1` on this machine."""
    proc = cli("run", "--json", "-c", "1")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["value"] == 1
    assert data["boundary"] not in ("", "none")
    assert data["boundary"] == "+".join(data["stack"])
    assert get_provider(data["provider"]).is_boundary


# -- the explicit opt-out ----------------------------------------------------------------


def test_subprocess_without_the_acknowledgement_is_refused(tmp_path: Path) -> None:
    """It refuses `provider = "subprocess"` alone, in Python and in TOML, naming the fix."""
    with pytest.raises(PolicyError, match='no_kernel_boundary = "accepted"'):
        Policy(provider="subprocess")
    path = tmp_path / "p.toml"
    path.write_text('name = "p"\nprovider = "subprocess"\n')
    with pytest.raises(PolicyError, match="no kernel boundary"):
        load_policy(path)
    with pytest.raises(PolicyError):
        Policy(provider="subprocess", no_kernel_boundary="yes")  # type: ignore[arg-type]


def test_a_subprocess_override_needs_the_policys_acknowledgement() -> None:
    """It refuses `Sandbox(policy, provider="subprocess")` unless the policy opts out."""
    with pytest.raises(PolicyError, match="no_kernel_boundary"):
        Sandbox(Policy(name="p"), provider="subprocess", warm=0)


def test_landlock_without_accepting_visible_names_is_refused(tmp_path: Path) -> None:
    """It refuses `provider = "landlock"` unless the policy says `visible_names =
    "accepted"`, in Python, in TOML (naming the file) and as an override of `Sandbox`,
    naming why and both ways out; accepted, the key is in the fingerprint, and left at its
    default it changes no fingerprint."""
    why = "Landlock cannot hide that a file exists"
    with pytest.raises(PolicyError, match=why):
        Policy(provider="landlock")
    path = tmp_path / "p.toml"
    path.write_text('name = "p"\nprovider = "landlock"\n')
    with pytest.raises(PolicyError, match=r'provider = "auto", "bwrap" or "unshare"') as info:
        load_policy(path)
    assert str(path) in str(info.value)
    with pytest.raises(PolicyError):
        Policy(provider="landlock", visible_names="yes")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match='visible_names = "accepted"'):
        Sandbox(Policy(name="p"), provider="landlock", warm=0)
    accepted = Policy(name="p", provider="landlock", visible_names="accepted")
    assert (
        Policy(name="p", visible_names="accepted").fingerprint() != Policy(name="p").fingerprint()
    )
    assert "visible_names" not in Policy(name="p").to_wire()
    assert accepted.to_wire()["visible_names"] == "accepted"


def test_auto_with_an_acknowledgement_still_takes_a_kernel_boundary() -> None:
    """It never reads the opt-out as leave to fall back: `auto` still needs a kernel."""
    policy = Policy(name="p", no_kernel_boundary="accepted")
    if _kernel_here():
        assert resolve_boundary(policy).is_kernel
    else:
        with pytest.raises(ProviderUnavailable):
            resolve_boundary(policy)


def test_the_opt_out_runs_says_none_and_warns_once_per_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It runs under the opt-out, names no boundary, and logs one warning per pool."""
    policy = Policy(name="opt-out-warning", **OPT_OUT)
    with caplog.at_level(logging.WARNING, logger="agent_sandbox"):
        with (
            Sandbox(policy, warm=0, share_workers=True) as a,
            Sandbox(policy, warm=0, share_workers=True) as b,
        ):
            assert a._pool is b._pool
            assert a.boundary.name == "none" and not a.boundary.is_kernel
            result = a.run("1")
            b.run("2")
    assert result.ok and result.provider == "subprocess" and result.boundary == "none"
    warnings = [r for r in caplog.records if r.name.startswith("agent_sandbox")]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert "no kernel boundary" in warnings[0].getMessage()
    assert "opt-out-warning" in warnings[0].getMessage()


def test_a_kernel_pool_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """It stays quiet when a kernel boundary holds the workers."""
    if not _kernel_here():
        pytest.skip("no kernel provider works here")
    with caplog.at_level(logging.WARNING, logger="agent_sandbox"):
        with Sandbox(Policy(name="quiet"), warm=0):
            pass
    assert not [r for r in caplog.records if r.name.startswith("agent_sandbox")]


def test_boundary_names() -> None:
    """It names a stack with '+', the subprocess provider 'none', and no worker ''."""
    assert boundary_name(("bwrap", "landlock", "seccomp")) == "bwrap+landlock+seccomp"
    assert boundary_name(("subprocess",)) == "none"
    assert boundary_name(()) == ""


# -- auto never falls back -----------------------------------------------------------------


class _Missing(Provider):
    name: ClassVar[str] = "missing"
    strength: ClassVar[int] = 5
    is_boundary: ClassVar[bool] = True

    def probe(self) -> ProbeResult:
        return ProbeResult(self.name, False, reason="the test took it away")

    def build(self, policy: Any, spec: WorkerSpec) -> Any:
        raise AssertionError("never built")


def test_auto_with_no_kernel_provider_raises_and_names_doctor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It raises ProviderUnavailable naming what is missing and `agent-sandbox doctor`,
    at construction of a Sandbox and of a tool, and never runs without a boundary."""
    monkeypatch.setattr(_auto, "AUTO_CANDIDATES", (_Missing,))
    with pytest.raises(ProviderUnavailable) as info:
        Sandbox(warm=0)
    message = str(info.value)
    assert "missing: the test took it away" in message
    assert "agent-sandbox doctor" in message
    assert "subprocess" not in _auto.AutoProvider().probe().details["candidates"]
    pytest.importorskip("langchain_core")
    from agent_sandbox.adapters.langchain import SandboxedPythonTool

    with pytest.raises(ProviderUnavailable, match="doctor"):
        SandboxedPythonTool()


def test_auto_never_lists_subprocess_as_a_candidate() -> None:
    """It leaves the no-boundary provider out of auto's candidates."""
    names = [cls.name for cls in _auto.AUTO_CANDIDATES]
    assert "subprocess" not in names
    assert all(cls.is_boundary for cls in _auto.AUTO_CANDIDATES)


# -- construction-time validation --------------------------------------------------------


def test_an_unknown_provider_fails_at_construction() -> None:
    """It refuses an unknown provider in a policy and as an override, before any call."""
    with pytest.raises(PolicyError, match="unknown provider 'docker'"):
        Policy(provider="docker")
    with pytest.raises(ProviderUnavailable, match="no such provider"):
        Sandbox(Policy(name="p"), provider="docker", warm=0)


def test_a_provider_that_cannot_run_here_fails_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It raises at Sandbox() with the provider's reason when its probe fails here."""
    from agent_sandbox.providers import LandlockProvider

    monkeypatch.setattr(
        LandlockProvider,
        "probe",
        lambda self: ProbeResult("landlock", False, reason="no Landlock in this test"),
    )
    with pytest.raises(ProviderUnavailable, match="no Landlock in this test"):
        Sandbox(Policy(name="p", provider="landlock", visible_names="accepted"), warm=0)


def test_policy_check_validates_the_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It fails `policy check` for a provider that cannot run here or a bare subprocess,
    and names the boundary of a good one."""
    # qemu cannot run without its guest image or a kernel package to build one on first
    # use: an empty cache has no image, and the named package does not exist.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("AGENT_SANDBOX_QEMU_KERNEL_DEB", str(tmp_path / "no-kernel.deb"))
    bare = tmp_path / "bare.toml"
    bare.write_text('name = "bare"\nprovider = "subprocess"\n')
    proc = cli("policy", "check", str(bare))
    assert proc.returncode != 0
    assert "no_kernel_boundary" in proc.stderr
    qemu = tmp_path / "qemu.toml"
    qemu.write_text('name = "vm"\nprovider = "qemu"\n')
    proc = cli("policy", "check", str(qemu))
    assert proc.returncode != 0
    assert "qemu" in proc.stderr and "doctor" in proc.stderr
    opted = tmp_path / "opted.toml"
    opted.write_text('name = "opted"\nprovider = "subprocess"\nno_kernel_boundary = "accepted"\n')
    proc = cli("policy", "check", str(opted))
    assert proc.returncode == 0, proc.stderr
    assert "no kernel boundary" in proc.stdout
    if _kernel_here():
        good = tmp_path / "good.toml"
        good.write_text('name = "good"\n')
        proc = cli("policy", "check", str(good))
        assert proc.returncode == 0, proc.stderr
        assert f"provider auto: {resolve_boundary(Policy(name='good')).name}" in proc.stdout
