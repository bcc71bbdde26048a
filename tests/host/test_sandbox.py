"""The core: sandbox, sessions, pool, limits, failures. Every worker started here is closed."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox, SandboxClosed


def test_returns_stdout_and_the_last_expression(sandbox: Sandbox) -> None:
    """It returns printed output and the value of the last expression as data."""
    result = sandbox.run("print('hello')\n{'a': [1, 2.5, None, 'x']}")
    assert result.ok
    assert result.stdout == "hello\n"
    assert result.value == {"a": [1, 2.5, None, "x"]}
    assert result.worker_id.startswith("w-")
    assert result.policy == "test-core"


def test_non_data_values_come_back_as_marked_repr(sandbox: Sandbox) -> None:
    """It marks a value that is not JSON-safe data with its repr and type."""
    result = sandbox.run("class Point:\n    def __repr__(self):\n        return 'P(1)'\nPoint()")
    assert result.value == {"__repr__": "P(1)", "__type__": "__main__.Point"}
    assert result.value_text() == "P(1)"


def test_session_keeps_variables_between_calls(sandbox: Sandbox) -> None:
    """It keeps a session's variables, and a stateless call starts fresh."""
    session = sandbox.session("s1")
    assert session.run("x = 41").ok
    assert session.run("x + 1").value == 42
    fresh = sandbox.run("try:\n    x\nexcept NameError:\n    'fresh'")
    assert fresh.value is None and fresh.ok


def test_stateless_calls_use_distinct_workers(sandbox: Sandbox) -> None:
    """It discards the worker after a stateless call."""
    a = sandbox.run("import math\nmath.marker = 1\nmath.marker")
    b = sandbox.run("import math\nhasattr(math, 'marker')")
    assert a.worker_id != b.worker_id
    assert a.value == 1 and b.value is False


def test_syntax_error_reports_line_and_column(sandbox: Sandbox) -> None:
    """It returns a SyntaxError with its line and column, without running anything."""
    result = sandbox.run("x = 1\nif x\n    print(x)\n")
    assert result.error is not None
    assert result.error.kind == "syntax"
    assert result.error.type == "SyntaxError"
    assert result.error.line == 2
    assert result.error.column is not None
    assert result.stdout == ""


def test_exception_traceback_shows_user_code_only(sandbox: Sandbox) -> None:
    """It reports the user's exception with a traceback of the user's frames only."""
    result = sandbox.run("def f():\n    return 1 / 0\nf()")
    assert result.error is not None and result.error.kind == "exception"
    assert result.error.type == "ZeroDivisionError"
    assert "<cell-1>" in result.error.traceback and "line 2" in result.error.traceback
    assert "_worker/run.py" not in result.error.traceback


def test_infinite_loop_is_killed_and_reported_as_timeout(sandbox: Sandbox) -> None:
    """It kills a call past its wall-clock limit and reports limits.timeout."""
    session = sandbox.session()
    session.run("x = 1")
    result = session.run("import time\ntime.sleep(60)", timeout=1.0)
    assert result.error is not None and result.error.rule == "limits.timeout"
    assert [d.rule for d in result.denials] == ["limits.timeout"]
    after = session.run("try:\n    x\n    seen = True\nexcept NameError:\n    seen = False\nseen")
    assert after.state_lost and after.value is False
    assert any("lost" in n for n in after.notices)


def test_timeout_kills_the_whole_process_group(sandbox: Sandbox, tmp_path: Path) -> None:
    """It kills children the code started, not only the worker."""
    pidfile = tmp_path / "child.pid"
    code = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        f"open({str(pidfile)!r}, 'w').write(str(pid))\n"
        "time.sleep(60)\n"
    )
    # Host pids are what the test follows: `landlock` (a plain child), not a pid namespace.
    policy = sandbox.policy.merged(
        {
            "provider": "landlock",
            "visible_names": "accepted",
            "files": {"write": [str(tmp_path)]},
            "api": {"allow": ["process-control"]},
        }
    )
    with Sandbox(policy, warm=0) as sb:
        result = sb.run(code, timeout=1.5)
    assert result.error is not None and result.error.rule == "limits.timeout"
    child = int(pidfile.read_text())
    # Reaped or gone: kill(0) fails, or the process is a zombie awaiting init.
    try:
        os.kill(child, 0)
        state = Path(f"/proc/{child}/stat").read_text().split()[2]
        assert state == "Z", f"child {child} survived the timeout (state {state})"
    except ProcessLookupError:
        pass


def test_output_flood_is_capped_with_a_denial(sandbox: Sandbox) -> None:
    """It stops a flood of output at the cap and reports limits.output."""
    result = sandbox.run("while True:\n    print('x' * 1000)", timeout=10)
    assert "limits.output" in result.rules()
    assert len(result.stdout) <= sandbox.policy.limits.output_bytes
    assert result.error is not None and result.error.rule == "limits.output"


def test_worker_killed_by_a_signal_reports_crash_and_next_call_recovers(sandbox: Sandbox) -> None:
    """It reports worker.crashed with the signal, and the next call gets a fresh worker."""
    session = sandbox.session()
    session.run("x = 1")
    result = session.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.error is not None
    assert result.error.rule == "worker.crashed"
    assert "SIGKILL" in result.error.message
    after = session.run("1 + 1")
    assert after.ok and after.value == 2
    assert after.state_lost


def test_os_exit_reports_crash(sandbox: Sandbox) -> None:
    """It reports an os._exit() mid-call as a crash with its exit status."""
    result = sandbox.run("import os\nos._exit(3)")
    assert result.error is not None and result.error.kind == "crashed"
    assert "exit status 3" in result.error.message


def test_worker_killed_from_outside_mid_call(sandbox: Sandbox) -> None:
    """It reports a worker killed from outside while a call runs."""
    session = sandbox.session()
    session.run("1")
    worker = session.worker
    assert worker is not None
    timer = threading.Timer(0.5, lambda: os.kill(worker.pid, 9))
    timer.start()
    try:
        result = session.run("import time\ntime.sleep(5)")
    finally:
        timer.cancel()
    assert result.error is not None and result.error.rule == "worker.crashed"
    assert session.run("2").value == 2


def test_environment_holds_only_what_the_policy_passes(sandbox: Sandbox) -> None:
    """It does not pass host variables the policy does not name (checked from outside)."""
    session = sandbox.session()
    session.run("1")
    assert session.worker is not None
    environ = Path(f"/proc/{session.worker.pid}/environ").read_bytes()
    assert b"canary-7f3a9c1e" not in environ
    assert b"AGENT_SANDBOX_TEST_CANARY" not in environ


def test_policy_env_set_and_pass(tmp_path: Path) -> None:
    """It passes named host variables and sets the policy's values."""
    os.environ["AGENT_SANDBOX_PASS_ME"] = "yes"
    try:
        policy = Policy(
            name="env",
            imports={"allow": ["os"]},
            env={"pass": ["AGENT_SANDBOX_PASS_*"], "set": {"FIXED": "1"}},
        )
        with Sandbox(policy, warm=0) as sb:
            result = sb.run("import os\n[os.environ['AGENT_SANDBOX_PASS_ME'], os.environ['FIXED']]")
    finally:
        del os.environ["AGENT_SANDBOX_PASS_ME"]
    assert result.value == ["yes", "1"]


def test_worker_runs_in_its_own_process_group_and_scratch(policy: Policy) -> None:
    """It starts the worker in its own session, in a private scratch directory, with rlimits."""
    # Host pids and paths are what the test reads: `landlock` (a plain child, no namespace).
    accepted = policy.merged({"visible_names": "accepted"})  # landlock takes no other
    sandbox = Sandbox(accepted, provider="landlock", warm=0)
    try:
        _check_process_group_and_scratch(sandbox)
    finally:
        sandbox.close()


def _check_process_group_and_scratch(sandbox: Sandbox) -> None:
    session = sandbox.session()
    result = session.run("import os\n[os.getpid(), os.getpgid(0), os.getsid(0), os.getcwd()]")
    pid, pgid, sid, cwd = result.value
    assert pid == pgid == sid
    assert session.worker is not None
    assert cwd == session.worker.scratch
    assert oct(os.stat(session.worker.control_dir).st_mode & 0o777) == "0o700"
    limits = Path(f"/proc/{pid}/limits").read_text()
    cpu = next(line for line in limits.splitlines() if line.startswith("Max cpu time"))
    assert str(sandbox.policy.limits.cpu_seconds) in cpu


def test_oversized_result_is_refused_with_the_cap(tmp_path: Path) -> None:
    """It refuses a result over limits.result_bytes and names the setting."""
    policy = Policy(name="small", limits={"result_bytes": 4096})
    with Sandbox(policy, warm=0) as sb:
        result = sb.run("'x' * 100000")
    assert result.error is not None and result.error.rule == "limits.result"
    assert "result_bytes" in result.error.message


def _request(path: str, raw: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(raw)
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks)


@pytest.mark.parametrize("auth", [b"", b"authorization: Bearer wrong\r\n"])
def test_request_without_the_right_token_is_refused(sandbox: Sandbox, auth: bytes) -> None:
    """It denies a request on the worker's socket with a missing or wrong token."""
    session = sandbox.session()
    session.run("1")
    worker = session.worker
    assert worker is not None and worker.client is not None
    body = b"{\"code\": \"open('/tmp/pwned', 'w')\"}"
    raw = (
        b"POST /run HTTP/1.1\r\nhost: w\r\n"
        + auth
        + b"content-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    reply = _request(worker.client.path, raw)
    assert reply.startswith(b"HTTP/1.1 403")
    assert session.run("2").value == 2  # the worker keeps serving its parent


def test_socket_directory_is_private(sandbox: Sandbox) -> None:
    """It keeps the worker's socket in a 0700 directory."""
    session = sandbox.session()
    session.run("1")
    assert session.worker is not None and session.worker.client is not None
    folder = os.path.dirname(session.worker.client.path)
    assert os.stat(folder).st_mode & 0o077 == 0


def test_two_sessions_run_at_once(tmp_path: Path) -> None:
    """It runs calls on different sessions in parallel (one waits for the other's file)."""
    flag = tmp_path / "flag"
    policy = Policy(
        name="par",
        imports={"allow": ["os", "time"]},
        files={"read": [str(tmp_path)], "write": [str(tmp_path)]},
        limits={"wall_seconds": 20},
    )
    with Sandbox(policy, warm=0) as sb:
        a, b = sb.session("a"), sb.session("b")
        out = {}
        waiter = threading.Thread(
            target=lambda: out.setdefault(
                "a",
                a.run(
                    f"import os, time\nwhile not os.path.exists({str(flag)!r}):\n    time.sleep(0.01)\n'seen'"
                ),
            )
        )
        waiter.start()
        out["b"] = b.run(f"open({str(flag)!r}, 'w').close()\n'made'")
        waiter.join(20)
    assert out["b"].value == "made"
    assert out["a"].value == "seen"


def test_calls_on_one_session_are_serialized(sandbox: Sandbox) -> None:
    """It runs concurrent calls on one session one after the other."""
    session = sandbox.session()
    session.run("n = 0")
    code = "import time\nv = n\ntime.sleep(0.05)\nn = v + 1\nn"
    threads = [threading.Thread(target=session.run, args=(code,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert session.run("n").value == 4


def test_closing_the_sandbox_while_a_call_runs(sandbox: Sandbox) -> None:
    """It ends a running call with a clear error when the sandbox is closed, without hanging."""
    session = sandbox.session()
    session.run("1")
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault("r", session.run("import time\ntime.sleep(30)", timeout=30))
    )
    t.start()
    threading.Event().wait(0.5)
    sandbox.close()
    t.join(10)
    assert not t.is_alive()
    result = out["r"]
    assert result.error is not None and result.error.type == "SandboxClosed"
    with pytest.raises(SandboxClosed):
        sandbox.run("1")


def test_session_lru_eviction_and_ttl(policy: Policy) -> None:
    """It keeps at most max_sessions live and closes the least recently used."""
    with Sandbox(policy, warm=0, max_sessions=2, evict_idle=0) as sb:
        for key in ("a", "b", "c"):
            sb.session(key).run("1")
        assert sb.sessions() == ["b", "c"]
        sb.session_ttl = 0.0
        sb.session("d")
        assert sb.sessions() == ["d"]


def test_session_reset_drops_state(sandbox: Sandbox) -> None:
    """It starts from a clean interpreter after reset()."""
    session = sandbox.session()
    session.run("x = 1")
    session.reset()
    result = session.run("try:\n    x\n    seen = True\nexcept NameError:\n    seen = False\nseen")
    assert result.value is False and not result.state_lost


def test_warm_pool_hands_out_a_started_worker(policy: Policy) -> None:
    """It acquires a pre-started worker from the warm pool."""
    with Sandbox(policy, warm=1) as sb:
        sb.warm_up()
        pool = sb._pool
        started = pool.started
        assert pool.ready_count() == 1
        result = sb.run("1")
        assert result.ok
        assert pool.started >= started  # refill runs in the background


def _ready_within(pool: Any, count: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pool.ready_count() >= count:
            return True
        time.sleep(0.005)
    return False


def test_the_refill_waits_for_the_call_of_the_worker_it_replaces(
    policy: Policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm pool refills once the call of the worker it handed out has ended, not while
    that call runs (the refill's start competed with it: issue 19, the first call), and a
    worker handed out and discarded without a call lets the refill go too."""
    from agent_sandbox._host import pool as pool_module

    # A grace no test run reaches: only the call's end (or the discard) lets a refill go.
    monkeypatch.setattr(pool_module, "REFILL_GRACE", 60.0)
    with Sandbox(policy, warm=1) as sb:
        sb.warm_up()
        pool = sb._pool
        started = pool.started
        worker = pool.acquire()
        time.sleep(0.1)
        assert pool.started == started and pool.ready_count() == 0  # waiting for the call
        worker.discard()  # handed out, no call: the refill goes now
        assert _ready_within(pool, 1, 5.0)
        started = pool.started
        session = sb.session("refill")
        assert session.run("1").ok  # the call ends: the refill goes at once
        assert _ready_within(pool, 1, 5.0) and pool.started == started + 1


def test_a_refill_starts_after_its_grace_when_the_call_runs_long(
    policy: Policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long call does not keep the pool empty: the refill starts after `REFILL_GRACE`."""
    from agent_sandbox._host import pool as pool_module

    monkeypatch.setattr(pool_module, "REFILL_GRACE", 0.05)
    with Sandbox(policy, warm=1) as sb:
        sb.warm_up()
        pool = sb._pool
        worker = pool.acquire()  # and no call on it yet
        try:
            assert _ready_within(pool, 1, pool_module.REFILL_GRACE + 5.0)
        finally:
            worker.discard()


async def test_async_run_and_session(policy: Policy) -> None:
    """It runs calls from asyncio without threads for the transport."""
    with Sandbox(policy, warm=0) as sb:
        result = await sb.arun("print('a')\n6 * 7")
        assert result.value == 42 and result.stdout == "a\n"
        session = sb.session("async")
        await session.arun("y = 2")
        assert (await session.arun("y * 3")).value == 6
        results = await asyncio.gather(sb.session("p").arun("1"), sb.session("q").arun("2"))
        assert [r.value for r in results] == [1, 2]


async def test_async_timeout(policy: Policy) -> None:
    """It enforces the wall-clock limit on the async path too."""
    with Sandbox(policy, warm=0) as sb:
        result = await sb.arun("import time\ntime.sleep(30)", timeout=1.0)
    assert result.error is not None and result.error.rule == "limits.timeout"


def test_live_events_arrive_during_the_call(sandbox: Sandbox) -> None:
    """It streams stdout while the code runs."""
    seen: list[tuple[str, object]] = []
    result = sandbox.run(
        "import time\nprint('a', flush=True)\ntime.sleep(0.1)\nprint('b')",
        on_event=lambda kind, data: seen.append((kind, data)),
    )
    kinds = [k for k, _ in seen]
    assert kinds[0] == "stdout" and kinds[-1] == "done"
    assert result.stdout == "a\nb\n"


def test_top_level_await(sandbox: Sandbox) -> None:
    """It runs code with top-level await."""
    result = sandbox.run("import asyncio\nawait asyncio.sleep(0)\n5")
    assert result.value == 5


def test_png_written_to_scratch_comes_back_as_an_image(sandbox: Sandbox) -> None:
    """It returns PNG files the code wrote to its scratch directory; one whose headers do
    not measure as a PNG is listed as a file but not returned as an image, with a notice."""
    png = (
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x00\x00"
        b"\x00\x00:~\x9bU\x00\x00\x00\nIDATx\x9cc\xb8\x0e\x00\x00\x82\x00\x81\x1c\x0c\x1b\x0e"
        b"\x00\x00\x00\x00IEND\xaeB`\x82"
    )
    result = sandbox.run(f"open('plot.png', 'wb').write({png!r})\n1")
    assert [i.name for i in result.images] == ["plot.png"]
    assert any(f["name"] == "plot.png" for f in result.files)
    fake = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
    result = sandbox.run(f"open('fake.png', 'wb').write({fake!r})\n1")
    assert result.images == () and any(f["name"] == "fake.png" for f in result.files)
    assert any("'fake.png' was not returned" in n for n in result.notices)


def test_the_result_carries_the_files_the_code_wrote_as_data_with_their_names() -> None:
    """It gives each file a call wrote as `OutputFile(name, size, data)`, together within
    `limits.result_bytes`; one past the bound, a PNG returned as an image, and a session's
    input file are named with why they are not here (or not listed); `files` stays."""
    from agent_sandbox import OutputFile

    png = (
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x00\x00"
        b"\x00\x00:~\x9bU\x00\x00\x00\nIDATx\x9cc\xb8\x0e\x00\x00\x82\x00\x81\x1c\x0c\x1b\x0e"
        b"\x00\x00\x00\x00IEND\xaeB`\x82"
    )
    code = (
        "open('a.csv', 'w').write('x,y\\n1,2\\n')\n"
        "open('big.bin', 'wb').write(b'0' * 6000)\n"
        f"open('plot.png', 'wb').write({png!r})\n"
    )
    with Sandbox(Policy(name="p", limits={"result_bytes": 5000}), warm=0) as sb:
        result = sb.run(code)
        session = sb.session("s")
        session.put_file("in.txt", b"hello")
        copied = asyncio.run(session.arun("open('out.txt', 'w').write(open('in.txt').read() * 2)"))
    assert result.error is None, result.error
    assert [f["name"] for f in result.files] == ["a.csv", "big.bin", "plot.png"]
    by_name = {f.name: f for f in result.output_files}
    assert by_name["a.csv"] == OutputFile("a.csv", 8, b"x,y\n1,2\n")
    assert (
        by_name["big.bin"].data is None
        and "limits.result_bytes = 5000" in by_name["big.bin"].reason
    )
    assert by_name["plot.png"].data is None and "result.images" in by_name["plot.png"].reason
    first = {"name": "a.csv", "size": 8, "returned": True, "data": None, "not_returned": None}
    assert result.to_dict()["output_files"][0] == first
    assert result.to_dict(file_data=True)["output_files"][0] == {**first, "data": "eCx5CjEsMgo="}
    assert copied.output_files == (OutputFile("out.txt", 10, b"hellohello"),)


def test_a_worker_that_never_stops_sending_still_times_out(policy: Policy) -> None:
    """It enforces the deadline even while events keep arriving."""
    flood = Policy(
        name="flood",
        imports={"allow": ["sys", "time"]},
        limits={"wall_seconds": 10, "output_bytes": 100_000_000},
    )
    with Sandbox(flood, warm=0) as sb:
        result = sb.run(
            "import sys, time\nwhile True:\n    sys.stdout.write('x' * 10)\n    sys.stdout.flush()\n"
            "    time.sleep(0.0005)",
            timeout=1.5,
        )
    assert result.error is not None and result.error.rule == "limits.timeout"


def test_a_forked_child_never_writes_on_the_parents_connection(sandbox: Sandbox) -> None:
    """It keeps a forked child's prints and exceptions off the call's event stream."""
    code = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('from the child')\n"
        "    raise MemoryError('child only')\n"
        "os.waitpid(pid, 0)\n"
        "print('from the parent')\n"
        "'parent value'\n"
    )
    session = sandbox.session()
    result = session.run(code)
    assert result.error is None, result.error
    assert result.value == "parent value"
    assert "from the child" not in result.stdout and "from the parent" in result.stdout
    assert session.run("1 + 1").value == 2
