"""Claims: deterministic names, one worker per thread across processes, the per-process
bound, an exhausted pool, and nothing left behind."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent_sandbox._errors import CapacityError
from agent_sandbox._host.remote.claims import ClaimCapacityError, ClaimError, claim_name
from agent_sandbox._host.remote.local_claims import LocalClaimBackend
from agent_sandbox._host.remote.provider import RemoteProvider

from .conftest import BIND_SECRET, SESSION_KEY, Certs, remote_policy


def test_claim_names_are_deterministic_dns_labels() -> None:
    a = claim_name("acme", "thread-1", "0123456789abcdef")
    assert a == claim_name("acme", "thread-1", "0123456789abcdef")
    assert re.fullmatch(r"ags-[a-z2-7]{20}", a)
    others = {
        claim_name("acme2", "thread-1", "0123456789abcdef"),
        claim_name("acme", "thread-2", "0123456789abcdef"),
        claim_name("acme", "thread-1", "fedcba9876543210"),
        # No ambiguity from joining: ("a", "b\0c") vs ("a\0b", "c") differ by construction.
        claim_name("acme", "thread-1\x00", "0123456789abcdef"),
    }
    assert a not in others and len(others) == 4


def _provider(backend: LocalClaimBackend, certs: Certs, **kw: object) -> RemoteProvider:
    return RemoteProvider(
        backend,
        session_key=SESSION_KEY,
        bind_secret=BIND_SECRET,
        tls=certs.tls(),
        **kw,  # type: ignore[arg-type]
    )


def test_the_per_process_claim_bound_is_a_capacity_error(certs: Certs) -> None:
    with LocalClaimBackend(
        certs.files(), bind_secret=BIND_SECRET, warm=0, pool="bounded", provider="subprocess"
    ) as backend:
        provider = _provider(backend, certs, max_claims=1, claim_timeout=0.3)
        first = provider.session(remote_policy(), thread="one")
        with pytest.raises(ClaimCapacityError, match="max_claims = 1") as info:
            provider.session(remote_policy(), thread="two")
        assert isinstance(info.value, CapacityError) and info.value.pool == "bounded"
        first.close()
        second = provider.session(remote_policy(), thread="two")  # the slot came back
        second.close()


def test_an_exhausted_pool_is_a_capacity_error_and_never_a_local_worker(certs: Certs) -> None:
    with LocalClaimBackend(
        certs.files(),
        bind_secret=BIND_SECRET,
        warm=0,
        max_workers=1,
        pool="tiny",
        provider="subprocess",
    ) as backend:
        provider = _provider(backend, certs, claim_timeout=1.0)
        with provider.session(remote_policy(), thread="a") as a:
            assert a.run("1").value == 1
            b = provider.session(remote_policy(), thread="b")
            t0 = time.monotonic()
            with pytest.raises(ClaimCapacityError, match="'tiny'"):
                b.run("2")
            assert time.monotonic() - t0 > 0.9  # it waited for the claim (a lower bound only)
            b.close()
        assert backend.started == 1  # one server for `a`; none for `b`, local or remote


def test_release_ends_the_worker_and_close_leaves_nothing(certs: Certs) -> None:
    backend = LocalClaimBackend(
        certs.files(), bind_secret=BIND_SECRET, warm=1, provider="subprocess"
    )
    state = backend.state_dir
    provider = _provider(backend, certs)
    session = provider.session(remote_policy(), thread="r")
    session.run("x = 1")
    assert session.claim is not None and session.worker is not None
    server = backend._claimed[session.claim.name].proc
    assert os.path.exists(os.path.join(state, session.claim.name + ".json"))
    inner = session.worker.hello["pid"]
    session.close()
    assert server.poll() is not None
    assert not os.path.exists(f"/proc/{inner}") or _zombie(inner)
    backend.fill()
    warm = list(backend._ready)
    backend.close()
    assert all(s.proc.poll() is not None for s in warm)
    assert not os.path.exists(state)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


_RACER = textwrap.dedent(
    """
    import json, os, sys, time
    from agent_sandbox._host.intake.remote_transport import RemoteTLS
    from agent_sandbox._host.remote.local_claims import LocalClaimBackend, ServerFiles
    from agent_sandbox._host.remote.provider import RemoteProvider
    from agent_sandbox import Policy
    state, server, ca, client, secret, key, go, done = sys.argv[1:9]
    policy = Policy(name="race", provider="subprocess", no_kernel_boundary="accepted",
                    imports={"allow": ["os"]})
    with LocalClaimBackend(ServerFiles(server, server, ca), bind_secret=secret, warm=1,
                           provider="subprocess", state_dir=state) as backend:
        backend.fill()
        print("ready", flush=True)
        provider = RemoteProvider(backend, session_key=bytes.fromhex(key), bind_secret=secret,
                                  tls=RemoteTLS(ca_file=ca, client_cert=client))
        while not os.path.exists(go):
            time.sleep(0.01)
        session = provider.session(policy, thread="the-thread")
        result = session.run("import os\\nos.getpid()")
        while result.error is not None and result.error.rule == "remote.busy":
            time.sleep(0.05)  # the other process's call on the same worker: one at a time
            result = session.run("import os\\nos.getpid()")
        print(json.dumps({"pid": result.value, "url": session.claim.url,
                          "created": session.claim.created, "error": repr(result.error)}), flush=True)
        while not os.path.exists(done):
            time.sleep(0.05)
        session.close()
    """
)


def test_two_processes_racing_for_one_thread_share_one_worker(certs: Certs, tmp_path: Path) -> None:
    import json

    state = tmp_path / "claims"
    state.mkdir()
    go, done = tmp_path / "go", tmp_path / "done"
    argv = [
        sys.executable,
        "-c",
        _RACER,
        str(state),
        certs.server,
        certs.ca,
        certs.client,
        BIND_SECRET,
        SESSION_KEY.hex(),
        str(go),
        str(done),
    ]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:  # both have filled their warm pool
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        go.touch()  # released at once: both claim the same name concurrently
        lines = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        done.touch()
        for p in procs:
            assert p.wait(30) == 0
    finally:
        done.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert lines[0]["pid"] == lines[1]["pid"], lines
    assert lines[0]["url"] == lines[1]["url"]
    assert sorted(line["created"] for line in lines) == [False, True]
    assert list(state.iterdir()) == []  # the creator released the claim


def test_prewarm_loads_what_a_bind_needs_and_never_fails() -> None:
    """It loads the bind's modules before the pod is ready, and leaves an unusable provider
    for the bind to report (with the session's policy) instead of failing the pod."""
    import sys

    from agent_sandbox._tools.cli_worker import prewarm

    prewarm("no-such-provider")
    prewarm("subprocess")
    assert "agent_sandbox._host.process" in sys.modules


def test_a_link_planted_at_a_claim_file_is_never_followed(certs: Certs, tmp_path: Path) -> None:
    """It denies a planted claim: a link at `<state>/<name>.json` to a file naming the
    attacker's worker (owned by this process, so it would pass as live) is not followed:
    the claim is refused naming the path, no worker is started, the file is not read."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    bait = tmp_path / "bait.json"
    bait.write_text(json.dumps({"url": "https://192.0.2.66:443", "owner": os.getpid()}))
    name = claim_name("acme", "thread-1", "0123456789abcdef")
    (state / f"{name}.json").symlink_to(bait)
    with LocalClaimBackend(
        certs.files(),
        bind_secret=BIND_SECRET,
        warm=0,
        provider="subprocess",
        state_dir=str(state),
    ) as backend:
        with pytest.raises(ClaimError, match="not followed") as info:
            backend.claim(name, timeout=1.0)
        assert info.value.reason == "ClaimFileRefused" and str(state) in str(info.value)
        assert backend.started == 0
    assert (state / f"{name}.json").is_symlink()  # left for the operator, named above


def test_a_link_planted_at_a_claims_temporary_name_is_not_written_through(
    certs: Certs, tmp_path: Path
) -> None:
    """It denies writing through a link at the name a claim's temporary file used to have
    (`<name>.json.tmp-<pid>-<thread>`, predictable): the claim is written to a fresh file of
    a random name, the link's target is never created, and the claim is made."""
    import threading

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    name = claim_name("acme", "thread-1", "0123456789abcdef")
    old_tmp = state / f"{name}.json.tmp-{os.getpid()}-{threading.get_ident()}"
    old_tmp.symlink_to(victim)
    with LocalClaimBackend(
        certs.files(),
        bind_secret=BIND_SECRET,
        warm=0,
        provider="subprocess",
        state_dir=str(state),
    ) as backend:
        claim = backend.claim(name, timeout=15.0)
        assert claim.created and not victim.exists()
        recorded = state / f"{name}.json"
        assert stat.S_ISREG(recorded.lstat().st_mode)
        assert stat.S_IMODE(recorded.stat().st_mode) == 0o600
        backend.release(claim)
    assert not victim.exists()


def test_a_claim_folder_others_can_write_is_refused(certs: Certs, tmp_path: Path) -> None:
    """It denies a shared claim folder (anyone could plant a claim there): refused at
    construction, naming it and the mode to use."""
    state = tmp_path / "shared"
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(ValueError, match=r"not this user's alone.*mode 700"):
        LocalClaimBackend(
            certs.files(),
            bind_secret=BIND_SECRET,
            warm=0,
            provider="subprocess",
            state_dir=str(state),
        )
