"""Containment inside `worker serve`: hostile native code in a remote worker meets the local
kernel provider the pod runs (Landlock here, as under runc), not only the Python guards.

The hostile code uses libc through ctypes (`NATIVE`), so the Python layer is not what stops
it. What it tries: the host's files outside the policy (a canary), the pod's own TLS key and
the bind secret's file (what a compromised worker would want to impersonate its pod)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox._host.remote.provider import LocalClaimBackend, RemoteProvider
from agent_sandbox.providers import get_provider

from ..providers.conftest import NATIVE, hostile_policy
from .conftest import BIND_SECRET, SESSION_KEY, Certs

pytestmark = pytest.mark.skipif(
    not get_provider("landlock").probe().available,
    reason="landlock: " + get_provider("landlock").probe().reason,
)


@pytest.fixture
def landlock_backend(certs: Certs) -> Iterator[LocalClaimBackend]:
    with LocalClaimBackend(
        certs.files(), bind_secret=BIND_SECRET, warm=0, provider="landlock"
    ) as backend:
        yield backend


def test_hostile_native_code_in_a_remote_worker_meets_landlock(
    landlock_backend: LocalClaimBackend, certs: Certs, tmp_path: Path
) -> None:
    canary = "canary-" + secrets.token_hex(8)
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    (ro / "data.txt").write_text("readable data\n")
    outside = tmp_path / "outside.txt"
    outside.write_text(canary)
    arena = {"ro": ro, "rw": rw, "outside": outside, "root": tmp_path}
    policy = hostile_policy(arena, provider="landlock")
    provider = RemoteProvider(
        landlock_backend, session_key=SESSION_KEY, bind_secret=BIND_SECRET, tls=certs.tls()
    )
    code = NATIVE + "\n".join(
        f"print({label!r}, repr(nread({str(path)!r}))[:60])"
        for label, path in (
            ("data", ro / "data.txt"),
            ("outside", outside),
            ("tls-key", Path(certs.server)),
        )
    )
    with provider.session(policy, thread="hostile") as session:
        result = session.run(code)
    assert result.error is None, result.error
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert "readable data" in lines["data"]
    assert lines["outside"].startswith("-") and canary not in result.stdout
    assert lines["tls-key"].startswith("-") and "PRIVATE KEY" not in result.stdout
    assert result.provider == "remote" and result.boundary.startswith("landlock")
