"""`Sandbox(policy)` with `provider = "remote"` and a `[remote]` table, end to end through
`LocalClaimBackend` (loopback `worker serve` processes with mTLS), and the LangChain tool on it."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent_sandbox import Sandbox
from agent_sandbox._errors import CapacityError, PolicyError
from agent_sandbox._host.remote import pool as remote_pool
from agent_sandbox._host.remote.provider import ClaimCapacityError, LocalClaimBackend, claim_name
from agent_sandbox.policies import Policy, policy_from_toml

from .conftest import BIND_SECRET, SESSION_KEY, Certs, remote_policy


@pytest.fixture(scope="module")
def secrets_files(certs: Certs) -> dict[str, str]:
    """The session key and bind secret as files (in the session's certificate folder)."""
    paths = {
        "session_key_file": os.path.join(certs.dir, "session-key"),
        "bind_secret_file": os.path.join(certs.dir, "bind-secret"),
    }
    with open(paths["session_key_file"], "w") as fh:
        fh.write(SESSION_KEY.hex() + "\n")
    with open(paths["bind_secret_file"], "w") as fh:
        fh.write(BIND_SECRET + "\n")
    return paths


def table(certs: Certs, files: dict[str, str], **changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "backend": "local",
        "pool": "sandbox-local",
        "tenant": "acme",
        "server_cert": certs.server,
        "client_ca": certs.ca,
        "ca_file": certs.ca,
        "client_cert": certs.client,
        "worker_provider": "subprocess",
        "warm": 1,
        "max_workers": 4,
        "claim_timeout": 10.0,
        **files,
    }
    base.update(changes)
    return base


def on_remote(certs: Certs, files: dict[str, str], **changes: Any) -> Policy:
    return remote_policy(provider="remote", remote=table(certs, files, **changes))


@pytest.fixture
def policy(certs: Certs, secrets_files: dict[str, str]) -> Policy:
    return on_remote(certs, secrets_files)


@pytest.fixture
def sandbox(policy: Policy) -> Iterator[Sandbox]:
    sb = Sandbox(policy)
    try:
        yield sb
    finally:
        sb.close()


def test_a_remote_session_keeps_its_variables_and_says_where_it_ran(sandbox: Sandbox) -> None:
    """It runs a session's calls on one claimed remote worker: variables persist, and every
    result names the remote provider and the stack the pod reported."""
    assert sandbox.boundary.name == "remote"
    session = sandbox.session("conversation-1")
    first = session.run("x = 6 * 7\nimport os\nos.getpid()")
    second = session.run("x")
    assert first.error is None and second.error is None, (first.error, second.error)
    assert second.value == 42
    assert first.value != os.getpid()
    assert second.provider == "remote" and second.stack == ("subprocess",)
    worker = session.worker
    assert worker is not None and worker.claim is not None  # type: ignore[attr-defined]
    assert worker.claim.name == claim_name(  # type: ignore[attr-defined]
        "acme", "conversation-1", sandbox.policy.fingerprint()
    )


def test_stateless_and_async_calls_run_remotely(sandbox: Sandbox) -> None:
    """It runs `Sandbox.run` on a fresh remote worker per call (nothing kept), and
    `arun` on the session's and on a fresh one."""
    assert sandbox.run("y = 1\ny").value == 1
    assert "NameError" in str(sandbox.run("y").error)

    async def main() -> tuple[Any, Any, Any]:
        session = sandbox.session("async-thread")
        a = await session.arun("z = 5")
        b = await session.arun("z * 2")
        c = await sandbox.arun("3 + 4")
        return a, b, c

    a, b, c = asyncio.run(main())
    assert a.error is None and b.value == 10 and c.value == 7
    assert b.provider == c.provider == "remote"


def test_the_same_thread_from_two_sandboxes_reaches_one_worker(policy: Policy) -> None:
    """It sends one thread of two sandboxes (as two agent processes would) to one worker:
    the first binds it, the second adopts it with the same derived token."""
    with Sandbox(policy) as one, Sandbox(policy) as two:
        assert one.session("shared").run("seen = 'by one'").error is None
        result = two.session("shared").run("seen")
        assert result.value == "by one"
        assert two.session("shared").worker.adopted  # type: ignore[union-attr]
        assert two.session("other").run("seen").error is not None  # another thread: apart


def test_two_tools_never_share_a_thread_key(policy: Policy) -> None:
    """It keeps the same session key of two tools on different workers (as locally)."""
    with Sandbox(policy, tool="tool_a") as a, Sandbox(policy, tool="tool_b") as b:
        a.session("thread:t").run("secret = 'a'")
        assert "NameError" in str(b.session("thread:t").run("secret").error)


def test_an_exhausted_remote_pool_is_a_capacity_error_never_a_local_worker(
    certs: Certs, secrets_files: dict[str, str]
) -> None:
    """It raises `CapacityError` naming the pool when no worker can be claimed in time,
    and starts no local worker instead."""
    policy = on_remote(
        certs, secrets_files, pool="tiny-pool", warm=0, max_workers=1, claim_timeout=0.5
    )
    with Sandbox(policy) as sandbox:
        assert sandbox.session("a").run("1").value == 1
        with pytest.raises(ClaimCapacityError, match="'tiny-pool'") as info:
            sandbox.session("b").run("2")
        assert isinstance(info.value, CapacityError) and info.value.pool == "tiny-pool"
        assert sandbox.session("b").worker is None


def test_the_per_process_claim_bound_holds_across_sandboxes(
    certs: Certs, secrets_files: dict[str, str]
) -> None:
    """It counts `max_claims` per process (per [remote] table), not per sandbox."""
    policy = on_remote(certs, secrets_files, pool="bound-pool", max_claims=1, claim_timeout=0.3)
    with Sandbox(policy) as one, Sandbox(policy) as two:
        assert one.session("a").run("1").value == 1
        with pytest.raises(ClaimCapacityError, match="max_claims = 1"):
            two.session("b").run("2")
        one.session("a").close()
        assert two.session("b").run("2").value == 2


def test_remote_without_a_table_is_refused_at_construction() -> None:
    """It refuses `provider="remote"` for a policy with no [remote] table, naming it."""
    with pytest.raises(PolicyError, match=r"\[remote\] table"):
        Sandbox(remote_policy(), provider="remote")


def test_a_missing_secret_is_refused_at_construction(
    certs: Certs, secrets_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It names the key and the variable when the session key is nowhere, and the file
    when it cannot be read."""
    monkeypatch.delenv(remote_pool.SESSION_KEY_ENV, raising=False)
    with pytest.raises(PolicyError, match="AGENT_SANDBOX_SESSION_KEY") as info:
        Sandbox(on_remote(certs, secrets_files, session_key_file="", pool="no-key"))
    assert info.value.key == "remote.session_key_file"
    missing = os.path.join(certs.dir, "absent")
    with pytest.raises(PolicyError, match="absent"):
        Sandbox(on_remote(certs, secrets_files, session_key_file=missing, pool="no-key"))


def test_the_remote_table_is_validated() -> None:
    """It refuses a k8s table without a pool, keys another backend reads, and bad names."""
    with pytest.raises(PolicyError, match="needs `pool`"):
        Policy(provider="remote", remote={"backend": "k8s"})
    with pytest.raises(PolicyError, match="server_cert: not read by backend 'k8s'"):
        Policy(provider="remote", remote={"pool": "p", "server_cert": "/x.pem"})
    with pytest.raises(PolicyError, match="router_url: not read by backend 'local'"):
        Policy(
            provider="remote",
            remote={"backend": "local", "server_cert": "/x", "router_url": "https://r"},
        )
    with pytest.raises(PolicyError, match="DNS-1123"):
        Policy(provider="remote", remote={"pool": "Not_A_Label"})
    with pytest.raises(PolicyError, match="worker provider"):
        Policy(provider="remote", remote={"pool": "p", "worker_provider": "remote"})


def test_the_remote_table_is_not_part_of_the_fingerprint_nor_sent_to_workers() -> None:
    """It keeps where the workers run out of the fingerprint and the worker's wire policy,
    and reads and writes the table in TOML."""
    text = """
name = "analysis"
provider = "remote"

[remote]
pool = "ags-analysis"
namespace = "agents"
tenant = "acme"
router_url = "https://router.agents.example"
session_key_file = "/run/secrets/session-key"
max_claims = 32
claim_timeout = 20
"""
    policy = policy_from_toml(text)
    assert policy.remote is not None and policy.remote.claim_timeout == 20.0
    moved = policy.merged({"remote": {"router_url": "https://elsewhere.example"}})
    assert moved.fingerprint() == policy.fingerprint()
    assert "remote" not in policy.to_wire(pin=False)
    assert policy_from_toml(policy.to_toml()) == policy
    assert Policy().fingerprint() == Policy(remote=None).fingerprint()


def test_a_k8s_table_builds_the_k8s_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """It maps a k8s table onto `K8sClaimBackend` (router, its token, namespace, expiry),
    the secrets from the environment, without contacting any cluster."""
    monkeypatch.setenv(remote_pool.SESSION_KEY_ENV, "k" * 32)
    monkeypatch.setenv(remote_pool.BIND_SECRET_ENV, "bind")
    monkeypatch.setenv(remote_pool.ROUTER_TOKEN_ENV, "router-token")
    policy = Policy(
        provider="remote",
        remote={
            "pool": "ags-analysis",
            "namespace": "agents",
            "tenant": "acme",
            "router_url": "https://router.example/",
            "shutdown_after_seconds": 3600,
            "max_claims": 3,
        },
    )
    assert policy.remote is not None
    provider = remote_pool.build_provider(policy.remote)
    backend = provider.backend
    assert type(backend).__name__ == "K8sClaimBackend"
    assert (backend.pool, backend.namespace, backend.router_url) == (  # type: ignore[attr-defined]
        "ags-analysis",
        "agents",
        "https://router.example",
    )
    assert backend.router_token == "router-token"  # type: ignore[attr-defined]
    assert backend.shutdown_after_seconds == 3600  # type: ignore[attr-defined]
    assert (provider.tenant, provider.max_claims, provider.bind_secret) == ("acme", 3, "bind")


def test_a_k8s_claim_expires_after_a_day_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A claim whose agent crashed is reaped by its expiry even if its pod never idles out;
    none at all only in so many words (0)."""
    monkeypatch.setenv(remote_pool.SESSION_KEY_ENV, "k" * 32)
    monkeypatch.setenv(remote_pool.BIND_SECRET_ENV, "bind")
    for table, expected in (({}, 86_400), ({"shutdown_after_seconds": 0}, None)):
        policy = Policy(provider="remote", remote={"pool": "ags-a", **table})
        assert policy.remote is not None
        backend = remote_pool.build_provider(policy.remote).backend
        assert backend.shutdown_after_seconds == expected  # type: ignore[attr-defined]


def test_closing_the_last_sandbox_ends_the_local_servers(policy: Policy) -> None:
    """It ends a closed sandbox's claimed servers at once, and the shared provider's warm
    servers when its last sandbox closes."""
    one = Sandbox(policy)
    one.session("t").run("1")
    backend = one._pool.provider.backend  # type: ignore[union-attr]
    assert isinstance(backend, LocalClaimBackend)
    deadline = time.monotonic() + 30
    while not backend._ready and time.monotonic() < deadline:  # the refill thread's start
        backend.fill()
        time.sleep(0.05)
    warm = [s.proc for s in backend._ready]
    claimed = [s.proc for s in backend._claimed.values()]
    assert warm and claimed
    two = Sandbox(policy)
    one.close()
    assert all(p.poll() is not None for p in claimed)  # its session's worker ended
    assert all(p.poll() is None for p in warm)  # the warm ones still serve `two`
    two.close()
    assert all(p.poll() is not None for p in warm)


def test_the_langchain_tool_runs_threads_on_remote_workers(policy: Policy) -> None:
    """It runs `SandboxedPythonTool` on a remote policy exactly as locally: one worker per
    conversation thread, the provider in the artifact."""
    pytest.importorskip("langchain.agents", reason="the langchain extra is not installed")
    from agent_sandbox._tools.demo import tool_call
    from agent_sandbox.adapters.langchain import SandboxedPythonTool

    tool = SandboxedPythonTool(policy=policy, warm=0)
    try:
        assert tool.boundary == "remote"

        def call(code: str, thread: str) -> Any:
            return tool.invoke(
                tool_call(code, call_id="c"), config={"configurable": {"thread_id": thread}}
            )

        call("x = 'alpha'", "a")
        call("x = 'beta'", "b")
        alpha = call("x", "a")
        assert alpha.status == "success" and alpha.content == "'alpha'"
        assert alpha.artifact["provider"] == "remote"
        assert call("x", "b").content == "'beta'"
        assert sorted(tool.sessions()) == ["thread:a", "thread:b"]

        async def later() -> Any:
            return await tool.ainvoke(
                tool_call("x.upper()", call_id="d"), config={"configurable": {"thread_id": "a"}}
            )

        assert asyncio.run(later()).content == "'ALPHA'"
    finally:
        tool.close()


def test_the_langchain_tool_reports_an_exhausted_pool_to_the_model(
    certs: Certs, secrets_files: dict[str, str]
) -> None:
    """It hands the model a capacity error naming the pool, and runs nothing locally."""
    pytest.importorskip("langchain.agents", reason="the langchain extra is not installed")
    from agent_sandbox._tools.demo import tool_call
    from agent_sandbox.adapters.langchain import SandboxedPythonTool

    policy = on_remote(
        certs, secrets_files, pool="lc-tiny", warm=0, max_workers=1, claim_timeout=0.5
    )
    tool = SandboxedPythonTool(policy=policy, warm=0)
    try:
        first = tool.invoke(
            tool_call("1", call_id="a"), config={"configurable": {"thread_id": "one"}}
        )
        assert first.status == "success"
        refused = tool.invoke(
            tool_call("2", call_id="b"), config={"configurable": {"thread_id": "two"}}
        )
        assert refused.status == "error" and "'lc-tiny'" in refused.content
    finally:
        tool.close()


def test_a_stopped_local_server_is_named_as_stopped_and_ended_at_once(
    certs: Certs, secrets_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It names a call whose local `worker serve` was stopped (SIGSTOP) as a stopped
    server, not as the code's wall-clock timeout, and ends that server with SIGKILL at once
    (a stopped process cannot act on SIGTERM, so its grace would only be waited out)."""
    import signal
    import subprocess

    sent: list[tuple[int, int]] = []
    real = subprocess.Popen.send_signal

    def spy(self: subprocess.Popen[bytes], sig: int) -> None:
        sent.append((self.pid, sig))
        real(self, sig)

    monkeypatch.setattr(subprocess.Popen, "send_signal", spy)
    policy = remote_policy(provider="remote", remote=table(certs, secrets_files))
    policy = policy.model_copy(
        update={"limits": policy.limits.model_copy(update={"wall_seconds": 2})}
    )
    with Sandbox(policy) as sb:
        session = sb.session("stopped")
        assert session.run("x = 1").ok
        worker = session.worker
        assert worker is not None and worker.claim is not None  # type: ignore[attr-defined]
        backend = sb._pool.provider.backend  # type: ignore[union-attr]
        server = backend._claimed[worker.claim.name].proc  # type: ignore[attr-defined]
        os.kill(server.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 15
        while not backend.stopped(worker.claim):  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the stop never took effect"
            time.sleep(0.01)
        result = session.run("x")
        assert result.error is not None, result
        assert result.error.type == "WorkerStopped", result.error
        assert "server was stopped by a signal" in result.error.message
        again = session.run("1 + 1")
        assert again.value == 2 and again.state_lost
        assert server.poll() == -signal.SIGKILL
        assert (server.pid, signal.SIGTERM) not in sent
