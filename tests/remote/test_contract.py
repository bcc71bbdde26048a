"""The worker contract over both transports: a local session on the Unix socket (h11) and a
remote session over TCP + mutual TLS to `agent-sandbox worker serve`, which runs the same
worker behind it (its calls on the client's own TLS socket with h11, or through httpx as
behind a proxy). Each test runs once per transport and expects the same result."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent_sandbox import Sandbox
from agent_sandbox._host.intake import remote_transport
from agent_sandbox._host.remote.provider import RemoteProvider

from .conftest import Certs, remote_policy

#: `tls`: calls over the client's own TLS socket (h11); `tls-httpx`: through httpx, the
#: path a proxy takes; `router`: through the upstream router's stand-in
#: (`upstream_router.py`, commit 2fd412d) to pods started from the generated template
#: (plain HTTP behind it, Landlock inside), claimed with the `k8s-agent-sandbox` SDK.
TRANSPORTS = ["uds", "tls", "tls-httpx", "router"]


@pytest.fixture(scope="module")
def routed(certs: Certs) -> Iterator[Any]:
    pytest.importorskip("k8s_agent_sandbox")
    from .routed_cluster import routed_cluster

    with routed_cluster(certs) as cluster:
        yield cluster


class _Local:
    def __init__(self, **policy_changes: Any) -> None:
        self.sandbox = Sandbox(remote_policy(**policy_changes), warm=0)
        self.session = self.sandbox.session()

    def run(self, code: str, **kwargs: Any) -> Any:
        return self.session.run(code, **kwargs)

    async def arun(self, code: str, **kwargs: Any) -> Any:
        return await self.session.arun(code, **kwargs)

    def interrupt(self) -> bool:
        return self.session.interrupt()

    def close(self) -> None:
        self.session.close()
        self.sandbox.close()


@pytest.fixture(params=TRANSPORTS)
def make(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    opened: list[Any] = []
    if request.param == "tls-httpx":
        monkeypatch.setattr(remote_transport, "DIRECT_RUNS", False)
    remote: RemoteProvider | None = None
    if request.param == "router":
        remote = request.getfixturevalue("routed").provider()
    elif request.param != "uds":
        remote = request.getfixturevalue("remote")

    def factory(**policy_changes: Any) -> Any:
        if remote is None:
            channel: Any = _Local(**policy_changes)
        else:
            channel = remote.session(
                remote_policy(**policy_changes), thread="t-" + secrets.token_hex(4)
            )
        opened.append(channel)
        return channel

    yield factory
    for channel in opened:
        channel.close()


def test_stdout_and_last_expression(make: Any) -> None:
    s = make()
    result = s.run("print('hello')\n6 * 7")
    assert result.ok and result.stdout == "hello\n" and result.value == 42


def test_variables_persist_between_calls(make: Any) -> None:
    s = make()
    s.run("x = 41")
    assert s.run("x + 1").value == 42


def test_exception_and_syntax_error(make: Any) -> None:
    s = make()
    result = s.run("def f():\n    return 1 / 0\nf()")
    assert result.error is not None and result.error.type == "ZeroDivisionError"
    assert "line 2" in result.error.traceback
    bad = s.run("x = (")
    assert bad.error is not None and bad.error.kind == "syntax"


def test_a_refused_import_is_a_denial(make: Any) -> None:
    s = make()
    result = s.run("import socket")
    assert result.error is not None and "imports" in result.rules()


def test_timeout_is_reported_and_the_next_call_starts_fresh(make: Any) -> None:
    s = make()
    s.run("x = 1")
    result = s.run("import time\ntime.sleep(60)", timeout=1.0)
    assert result.error is not None and result.error.rule == "limits.timeout"
    after = s.run("try:\n    x\n    seen = True\nexcept NameError:\n    seen = False\nseen")
    assert after.state_lost and after.value is False


def test_output_flood_is_capped(make: Any) -> None:
    s = make()
    result = s.run("while True:\n    print('x' * 1000)", timeout=10)
    assert "limits.output" in result.rules()
    assert len(result.stdout) <= 100_000


def test_oversized_result_is_refused(make: Any) -> None:
    s = make(limits={"wall_seconds": 10, "result_bytes": 4096})
    result = s.run("'x' * 100_000")
    assert result.error is not None and result.error.rule == "limits.result"


def test_a_crash_is_reported_and_the_next_call_recovers(make: Any) -> None:
    s = make()
    s.run("x = 1")
    result = s.run("import os\nos._exit(3)")
    assert result.error is not None and result.error.kind == "crashed"
    after = s.run("1 + 1")
    assert after.ok and after.value == 2 and after.state_lost


def test_live_events_arrive_in_order(make: Any) -> None:
    s = make()
    seen: list[str] = []
    result = s.run(
        "import time\nprint('a', flush=True)\ntime.sleep(0.1)\nprint('b')",
        on_event=lambda kind, data: seen.append(kind),
    )
    assert seen[0] == "stdout" and seen[-1] == "done"
    assert result.stdout == "a\nb\n"


async def test_async_call(make: Any) -> None:
    s = make()
    result = await s.arun("import asyncio\nawait asyncio.sleep(0)\n5")
    assert result.value == 5


def test_the_result_names_its_boundary(make: Any, request: pytest.FixtureRequest) -> None:
    s = make()
    result = s.run("1")
    if "router" in request.node.name:
        # The template's pod: Landlock inside (runc), as the pod reported it at bind.
        assert result.provider == "remote" and "landlock" in result.stack
        assert result.boundary != "none"
        return
    assert result.boundary == "none"  # the Python layer only, in both places (opted out)
    assert result.provider == ("remote" if "tls" in request.node.name else "subprocess")


def test_interrupt_stops_the_cell_and_keeps_the_variables(make: Any) -> None:
    s = make()
    assert s.run("kept = 41").ok
    out: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "r", s.run("import time\nprint('go', flush=True)\ntime.sleep(30)")
        )
    )
    t.start()
    deadline = time.monotonic() + 10
    sent = False
    while not sent and time.monotonic() < deadline:
        time.sleep(0.3)
        sent = s.interrupt()
    t.join(15)
    assert sent
    result = out["r"]
    assert result.error is not None and result.error.type == "KeyboardInterrupt"
    after = s.run("kept + 1")
    assert after.value == 42 and not after.state_lost


async def test_a_cancelled_async_call_interrupts_the_cell(make: Any) -> None:
    import asyncio

    s = make()
    assert s.run("kept = 1").ok
    task = asyncio.ensure_future(s.arun("import time\ntime.sleep(30)"))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):  # the interrupted call finishes in its thread
        after = s.run("kept + 1")
        if after.error is None or after.error.rule != "remote.busy":
            break
        await asyncio.sleep(0.1)
    assert after.value == 2 and not after.state_lost


async def test_async_calls_run_in_the_callers_loop(
    make: Any, request: pytest.FixtureRequest
) -> None:
    """Once a session has its worker, `arun` speaks asyncio itself (no thread): its events
    reach `on_event` on the loop's own thread (through a proxy, httpx's path, a thread)."""
    s = make()
    assert (await s.arun("n = 1")).ok  # the first call binds the worker (in a thread)
    threads: set[int] = set()
    for _ in range(3):  # the connection is kept between calls in one loop
        result = await s.arun(
            "n += 1\nprint(n)\nn", on_event=lambda kind, data: threads.add(threading.get_ident())
        )
        assert result.error is None, result.error
    assert result.value == 4 and result.stdout == "4\n"
    if "httpx" in request.node.name:
        assert threading.get_ident() not in threads
    else:
        assert threads == {threading.get_ident()}


def test_async_calls_from_two_event_loops_and_a_blocking_one_share_the_session(make: Any) -> None:
    import asyncio

    s = make()
    assert s.run("n = 1").ok
    assert asyncio.run(s.arun("n += 1\nn")).value == 2  # a loop, closed after the call
    assert asyncio.run(s.arun("n += 1\nn")).value == 3  # another loop: a new connection
    assert s.run("n").value == 3
