"""`worker serve` in a simulated gVisor pod (its kernel's version string, `_host/placement.py`):
the runtime is detected and reported in every result, and the in-pod provider is the strongest
that works (probe-based), `subprocess` only where none does. A declared gVisor the kernel
contradicts refuses the start. The server runs in-process, so the simulation reaches it."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox._host import placement
from agent_sandbox._host.remote.serve import ServeConfig, WorkerServer
from agent_sandbox._host.remote.worker import RemoteWorker
from agent_sandbox.providers import AutoProvider, ProbeResult

from ..providers.conftest import NATIVE, hostile_policy
from .conftest import BIND_SECRET, Certs, remote_policy, serve_config
from .fakes import serving

pytestmark = pytest.mark.filterwarnings(
    "ignore:policy 'danger-hostile-test' grants native-code:UserWarning"  # its point
)

GVISOR = "Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016\n"


def _fake_root(tmp_path: Path, version: str) -> str:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "version").write_text(version)
    return str(tmp_path)


def _config(certs: Certs, **changes: object) -> ServeConfig:
    return serve_config(certs, **{"provider": "auto", **changes})


@pytest.fixture
def gvisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "ROOT", _fake_root(tmp_path, GVISOR))


@pytest.fixture
def pod(gvisor: None, certs: Certs) -> Iterator[WorkerServer]:
    with serving(_config(certs)) as server:
        yield server


def _connect(server: WorkerServer, certs: Certs, policy: object) -> RemoteWorker:
    return RemoteWorker.connect(
        policy,  # type: ignore[arg-type]
        f"https://127.0.0.1:{server.port}",
        token=secrets.token_hex(16),
        bind_secret=BIND_SECRET,
        tls=certs.tls(),
        start_timeout=15,
    )


def test_where_no_kernel_provider_works_the_detected_gvisor_is_the_boundary(
    certs: Certs, gvisor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No provider starts inside (simulated): `auto` becomes `subprocess`, the result says
    `gvisor+subprocess`, and a policy that did not opt out of a kernel boundary is served
    (the runtime is one)."""
    monkeypatch.setattr(
        AutoProvider, "probe", lambda self: ProbeResult("auto", False, "simulated: none")
    )
    strict = remote_policy(provider="auto", no_kernel_boundary="")
    with serving(_config(certs)) as server:
        worker = _connect(server, certs, strict)
        try:
            result = worker.run("1 + 1")
        finally:
            worker.close()
    assert result.value == 2
    assert server.remote_info["stack"] == ["gvisor", "subprocess"]
    assert server.remote_info["runtime_source"] == "detected"
    assert result.boundary == "gvisor+subprocess"


def test_where_a_kernel_provider_works_inside_gvisor_it_holds_the_pods_secrets(
    pod: WorkerServer, certs: Certs, tmp_path: Path
) -> None:
    """gVisor allows user and mount namespaces: where the probe finds a kernel provider,
    the worker runs under it (not `subprocess`) and reads neither the TLS key nor files
    outside its policy."""
    if not AutoProvider().probe().available:
        pytest.skip("no kernel provider works here")
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    arena = {"ro": ro, "rw": rw, "outside": tmp_path / "x", "root": tmp_path}
    worker = _connect(pod, certs, hostile_policy(arena, provider="auto"))
    try:
        result = worker.run(NATIVE + f"print('key', repr(nread({certs.server!r}))[:80])")
    finally:
        worker.close()
    assert result.error is None, result.error
    stack = pod.remote_info["stack"]
    assert stack[0] == "gvisor" and stack[1] in ("bwrap", "unshare", "landlock"), stack
    assert result.stdout.startswith("key ") and "PRIVATE KEY" not in result.stdout


def test_a_declared_gvisor_on_another_kernel_refuses_to_start(
    certs: Certs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The template says gVisor, the kernel says otherwise: the runtime class did not apply,
    so the pod must not claim gVisor as its boundary (nor run `subprocess` behind it)."""
    monkeypatch.setattr(placement, "ROOT", _fake_root(tmp_path, "Linux version 6.1.0 #1 SMP\n"))
    with pytest.raises(ValueError, match="runtimeClassName did not apply"):
        WorkerServer(_config(certs, runtime_boundary="gvisor", provider="subprocess"))


def test_a_landlock_pod_refuses_a_policy_that_does_not_accept_visible_names(
    certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`worker serve --provider landlock` (what the manifests give a runc pod for a policy
    that accepts visible names) refuses the bind of a policy that does not say
    `visible_names = "accepted"`: the host gets HTTP 422, the pod's log says why; no worker
    starts. The same pod serves the policy that accepts them."""
    from agent_sandbox import WorkerStartError
    from agent_sandbox.providers import get_provider

    if not get_provider("landlock").probe().available:
        pytest.skip("landlock unavailable here")
    arena = {"ro": tmp_path, "rw": tmp_path, "root": tmp_path}
    with serving(_config(certs, provider="landlock")) as server:
        with caplog.at_level("WARNING", logger="agent_sandbox"):
            with pytest.raises(WorkerStartError, match=r"refused the bind \(HTTP 422\)"):
                _connect(server, certs, hostile_policy(arena, visible_names=""))
        assert server.worker is None
    refused = [r.getMessage() for r in caplog.records if "refused a bind" in r.getMessage()]
    assert refused and "Landlock cannot hide that a file exists" in refused[0], refused
    assert 'visible_names = "accepted"' in refused[0]
    with serving(_config(certs, provider="landlock")) as server:
        worker = _connect(server, certs, hostile_policy(arena, visible_names="accepted"))
        try:
            assert worker.run("1 + 1").value == 2
        finally:
            worker.close()
        assert server.remote_info["stack"][0] == "landlock"
