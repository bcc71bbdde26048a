"""Every end of a call or a session names its true cause, and docs/denials.md says so.

The table "How a call or a session ends" in docs/denials.md is pinned here: each row names a
cause (first column, in backticks), a phrase the model reads (second column, in double
quotes; empty when the model reads nothing) and what the operator gets (third column, the
first name in backticks: `RunResult.error.type`, or the exception the call raises). Each
cause is produced for real below and its row is checked against what the code says.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent_sandbox import CapacityError, Policy, Sandbox, SandboxClosed
from agent_sandbox._host.result import RunResult
from agent_sandbox.adapters._common import outcome
from agent_sandbox.providers import get_provider

DOCS = Path(__file__).resolve().parents[2] / "docs" / "denials.md"
HEADING = "## How a call or a session ends, and what each side reads"


def _table() -> dict[str, tuple[str, str]]:
    text = DOCS.read_text()
    section = text[text.index(HEADING) :].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        cause = re.findall(r"`([^`]+)`", cells[0])[0]
        phrase = re.findall(r'"([^"]+)"', cells[1])
        operator = re.findall(r"`([^`]+)`", cells[2])[0]
        rows[cause] = (phrase[0] if phrase else "", operator)
    return rows


def _policy(**limits: object) -> Policy:
    return Policy(
        name="test-ends",
        imports={"allow": ["math", "os", "sys", "time", "signal"]},
        api={"allow": ["process-control"]},
        code={"enabled": False},
        limits={"wall_seconds": 10, **limits},
        visible_names="accepted",  # read only under "landlock"
    )


def _native_policy() -> Policy:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Policy(
            name="danger-ends",
            imports={"allow": ["*"]},
            api={"allow": ["native-code", "process-control"]},
            code={"enabled": False},
            limits={"wall_seconds": 10},
        )


def _text(result: RunResult) -> tuple[str, str]:
    assert result.error is not None or result.notices, result
    return outcome(result).text, result.error.type if result.error else "RunResult.notices"


def _wait(predicate: Callable[[], object], bound: float = 15.0) -> None:
    deadline = time.monotonic() + bound
    while not predicate():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.01)


def _in_thread(fn: Callable[[], RunResult]) -> tuple[threading.Thread, dict[str, RunResult]]:
    out: dict[str, RunResult] = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", fn()))
    thread.start()
    return thread, out


def wall_timeout() -> tuple[str, str]:
    with Sandbox(_policy(wall_seconds=1), warm=0) as sb:
        return _text(sb.run("import time\ntime.sleep(10)"))


def cpu() -> tuple[str, str]:
    with Sandbox(_policy(cpu_seconds=1), warm=0) as sb:
        return _text(sb.run("while True:\n    pass"))


def memory() -> tuple[str, str]:
    with Sandbox(_policy(memory_mb=200), warm=0) as sb:
        return _text(sb.run("hold = []\nwhile True:\n    hold.append(bytearray(16 << 20))"))


def stopped() -> tuple[str, str]:
    """An idle worker stopped by SIGSTOP: the next call runs in a fresh one and says why."""
    with Sandbox(_policy(wall_seconds=3), warm=0) as sb:
        session = sb.session("s")
        assert session.run("x = 1").ok
        assert session.worker is not None
        pid = session.worker.worker_pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        # The stop is delivered when the kernel next schedules the worker: wait for it, else a
        # loaded machine has the call start first (and end as "stopped mid-call").
        worker = session.worker
        _wait(worker.stopped)
        result = session.run("1 + 1")  # (not a timeout: it runs, in a fresh interpreter)
        assert result.value == 2 and result.state_lost, result
        return _text(result)


def stopped_mid_call() -> tuple[str, str]:
    with Sandbox(_policy(wall_seconds=2), warm=0) as sb:
        session = sb.session("s")
        assert session.run("x = 1").ok
        worker = session.worker
        assert worker is not None
        thread, out = _in_thread(lambda: session.run("import time\ntime.sleep(30)"))
        _wait(lambda: worker._in_call)
        time.sleep(0.2)
        pid = worker.worker_pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        thread.join(20)
        return _text(out["r"])


def killed_by_signal() -> tuple[str, str]:
    with Sandbox(_policy(), warm=0) as sb:
        return _text(sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"))


def crashed() -> tuple[str, str]:
    with Sandbox(_policy(), warm=0) as sb:
        return _text(sb.run("import os\nos._exit(3)"))


# The worker closes every descriptor but its output (its connection to the host among them)
# and keeps running, in native code.
CLOSE_TRANSPORT = """
import ctypes
libc = ctypes.CDLL(None)
for fd in range(3, 1024):
    libc.close(fd)
libc.sleep(30)
"""


def lost_transport() -> tuple[str, str]:
    with Sandbox(_native_policy(), warm=0) as sb:
        return _text(sb.run(CLOSE_TRANSPORT))


def closed_sandbox() -> tuple[str, str]:
    sb = Sandbox(_policy(), warm=0)
    session = sb.session("s")
    assert session.run("x = 1").ok
    thread, out = _in_thread(lambda: session.run("import time\ntime.sleep(30)"))
    _wait(lambda: session.worker is not None and session.worker._in_call)
    time.sleep(0.2)
    sb.close()
    thread.join(20)
    with pytest.raises(SandboxClosed):
        session.run("1")
    with pytest.raises(SandboxClosed):
        sb.run("1")
    with pytest.raises(SandboxClosed):
        asyncio.run(sb.arun("1"))
    return _text(out["r"])


def evicted() -> tuple[str, str]:
    with Sandbox(_policy(), warm=0, max_sessions=1, evict_idle=0.05) as sb:
        a = sb.session("a")
        assert a.run("x = 1").ok
        time.sleep(0.1)
        assert sb.session("b").run("1").ok
        time.sleep(0.1)
        return _text(a.run("1"))


def session_ttl() -> tuple[str, str]:
    with Sandbox(_policy(), warm=0, session_ttl=0.2) as sb:
        a = sb.session("a")
        assert a.run("x = 1").ok
        time.sleep(0.4)
        assert sb.session("b").run("1").ok
        return _text(a.run("1"))


def _interrupt(code: str, grace: float) -> tuple[str, str]:
    with Sandbox(_policy(wall_seconds=30), warm=0) as sb:
        session = sb.session("i")
        assert session.run("kept = 1").ok
        thread, out = _in_thread(lambda: session.run(code))
        _wait(lambda: session.worker is not None and session.worker._in_call)
        time.sleep(0.3)
        assert session.interrupt(grace=grace)
        thread.join(20)
        return _text(out["r"])


def interrupted() -> tuple[str, str]:
    return _interrupt("import time\ntime.sleep(30)", 2.0)


def interrupt_ignored() -> tuple[str, str]:
    code = (
        "import time\nwhile True:\n    try:\n        time.sleep(30)\n"
        "    except KeyboardInterrupt:\n        pass"
    )
    return _interrupt(code, 0.5)


def dead_template() -> tuple[str, str]:
    """The template the session's worker was forked from ended (its workers with it)."""
    name = "landlock" if get_provider("landlock").probe().available else "subprocess"
    policy = _policy().model_copy(update={"no_kernel_boundary": "accepted"})
    with Sandbox(policy, provider=name, warm=0) as sb:
        sb._pool.template()  # (a pool's first worker otherwise starts from scratch)
        session = sb.session("t")
        assert session.run("x = 1").ok
        template = sb._pool._template
        assert template is not None and template.proc is not None, "no template used"
        os.killpg(template.proc.pid, signal.SIGKILL)
        worker = session.worker
        assert worker is not None
        _wait(lambda: not worker.alive())
        result = session.run("1")
        assert result.ok and result.state_lost
        return _text(result)


def capacity() -> tuple[str, str]:
    with Sandbox(_policy(), warm=0, max_sessions=1, session_wait=0.3) as sb:
        busy = sb.session("busy")
        assert busy.run("1").ok
        thread, _out = _in_thread(lambda: busy.run("import time\ntime.sleep(2)"))
        _wait(busy._lock.locked)
        try:
            sb.session("new").run("1")
        except CapacityError as exc:
            return str(exc), type(exc).__name__
        finally:
            thread.join(20)
        raise AssertionError("no CapacityError")


SCENARIOS: dict[str, Callable[[], tuple[str, str]]] = {
    "wall timeout": wall_timeout,
    "cpu": cpu,
    "memory": memory,
    "stopped": stopped,
    "stopped mid-call": stopped_mid_call,
    "killed by signal": killed_by_signal,
    "crashed": crashed,
    "lost transport": lost_transport,
    "closed sandbox": closed_sandbox,
    "evicted for max_sessions": evicted,
    "session_ttl": session_ttl,
    "interrupted": interrupted,
    "interrupt not obeyed": interrupt_ignored,
    "dead template": dead_template,
    "capacity": capacity,
}


def test_the_table_has_a_row_for_every_cause_and_nothing_else() -> None:
    """It lists exactly the causes produced below (a new cause needs a row and a scenario)."""
    assert sorted(_table()) == sorted(SCENARIOS)


@pytest.fixture(scope="module")
def table() -> Iterator[dict[str, tuple[str, str]]]:
    yield _table()


@pytest.mark.parametrize("cause", list(SCENARIOS))
def test_each_cause_reads_as_the_table_says(cause: str, table: dict[str, tuple[str, str]]) -> None:
    """It produces the cause for real: the model's text has the row's phrase and the
    operator gets the row's error type or exception."""
    text, operator = SCENARIOS[cause]()
    phrase, documented = table[cause]
    assert operator == documented, (cause, operator, text)
    assert phrase in text, (cause, phrase, text)


@pytest.mark.parametrize("provider", ["landlock", "subprocess"])
def test_a_stopped_worker_is_killed_without_the_term_grace(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It sends a worker stopped mid-call (SIGSTOP) straight SIGKILL when its wall limit
    passes: a stopped process cannot act on SIGTERM, so the 0.5 s TERM grace would only be
    waited out past the limit. The result names the stop, not a timeout."""
    from agent_sandbox._host import process

    if not get_provider(provider).probe().available:
        pytest.skip(f"{provider} is not available here")
    sent: list[int] = []
    real = process._signal_group

    def spy(pid: int, sig: int) -> None:
        sent.append(sig)
        real(pid, sig)

    monkeypatch.setattr(process, "_signal_group", spy)
    policy = _policy(wall_seconds=2).model_copy(update={"no_kernel_boundary": "accepted"})
    with Sandbox(policy, provider=provider, warm=0) as sb:
        session = sb.session("s")
        assert session.run("x = 1").ok
        worker = session.worker
        assert worker is not None
        thread, out = _in_thread(lambda: session.run("import time\ntime.sleep(30)"))
        _wait(lambda: worker._in_call)
        pid = worker.worker_pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        _wait(worker.stopped)
        thread.join(20)
        result = out["r"]
        assert result.error is not None and result.error.type == "WorkerStopped", result
        assert signal.SIGKILL in sent and signal.SIGTERM not in sent, sent


@pytest.mark.parametrize("provider", ["bwrap", "unshare", "landlock"])
def test_scratch_files_that_fill_memory_are_named_as_files(provider: str) -> None:
    """It names the scratch files when they, not the code's objects, filled `memory_mb`
    (scratch is a tmpfs under these providers: its files are memory), and does not when
    the code's own objects did."""
    from agent_sandbox._host.limits import cgroup_support

    if not get_provider(provider).probe().available:
        pytest.skip(f"{provider} is not available here")
    if not cgroup_support().get("memory"):
        pytest.skip("no memory cgroup here: memory_mb is not enforced by a group")
    write = (
        "f = open('big.bin', 'wb')\nfor i in range(300):\n    f.write(b'x' * (1 << 20))\n"
        "f.close()\n'done'"
    )
    hog = "hold = []\nwhile True:\n    hold.append(bytearray(16 << 20))"
    policy = _policy(memory_mb=150, scratch_mb=400)
    with Sandbox(policy, provider=provider, warm=0) as sb:
        files = sb.run(write)
        objects = sb.run(hog)
    assert files.error is not None and files.error.rule == "limits.memory", files
    assert "files in the scratch directory" in files.error.message
    assert "held in memory (not on disk)" in files.error.message
    assert objects.error is not None and objects.error.rule == "limits.memory", objects
    assert "scratch" not in objects.error.message


def test_a_memory_hint_proposes_what_the_failed_allocation_needed() -> None:
    """It proposes, for an array numpy could not allocate, the size numpy named plus the
    peak, not twice the limit; and for a balloon stopped at the limit, twice the limit
    with the measured peak and the word that it is a guess."""
    pytest.importorskip("numpy")
    policy = Policy(
        name="test-ends",
        imports={"allow": ["numpy"]},
        code={"enabled": False},
        limits={"wall_seconds": 20, "memory_mb": 300},
    )
    with Sandbox(policy, warm=0) as sb:
        big = sb.run("import numpy\nx = numpy.zeros((1 << 17, 1 << 14))")  # 16 GiB
        balloon = sb.run("hold = []\nwhile True:\n    hold.append(bytearray(16 << 20))")
    assert big.error is not None and big.error.rule == "limits.memory", big
    [denial] = big.denials
    assert "asked for 16384 MiB (numpy's report" in denial.detail, denial.detail
    value = int(denial.hint.rsplit("=", 1)[1])
    assert 16384 * 1.25 < value < 16384 * 1.5, denial.hint
    [denial] = balloon.denials
    assert denial.hint == "[[grant]]\nlimits.memory_mb = 600"
    assert "peak" in denial.detail and "a guess" in denial.detail, denial.detail
