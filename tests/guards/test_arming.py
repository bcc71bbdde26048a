"""Arming: guards enforce only while user code runs, threads stay armed, tampering is loud."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Sandbox
from agent_sandbox.guards._state import state

CANARY = "canary-arming-91b2"


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    path = tmp_path / "secret" / "canary.txt"
    path.parent.mkdir()
    path.write_text(CANARY)
    return path


def test_guards_are_disarmed_outside_a_call(armed: Callable[..., Any], canary: Path) -> None:
    """It does not judge the worker's own code between calls."""
    armed(imports={"allow": ["os"]})
    assert not state.armed
    assert canary.read_text() == CANARY


def test_a_thread_started_by_user_code_stays_armed_after_the_call(
    armed: Callable[..., Any], canary: Path
) -> None:
    """It denies a read from a user thread that waited for the call to end."""
    guard = armed(imports={"allow": ["threading"]})
    guard.namespace["CANARY_PATH"] = str(canary)
    guard.run(
        "import threading\n"
        "go = threading.Event()\n"
        "seen = []\n"
        "def later():\n"
        "    go.wait(10)\n"
        "    try:\n"
        "        seen.append(open(CANARY_PATH).read())\n"
        "    except OSError as exc:\n"
        "        seen.append(type(exc).__name__)\n"
        "worker = threading.Thread(target=later)\n"
        "worker.start()\n"
    )
    assert not state.armed  # the call is over
    guard.namespace["go"].set()
    guard.namespace["worker"].join(10)
    assert guard.namespace["seen"] == ["FileAccessDenied"]
    assert not state.user_threads


def test_replacing_a_wrapper_is_reported(armed: Callable[..., Any]) -> None:
    """It reports a guard wrapper replaced by user code."""
    guard = armed(imports={"allow": ["os"]})
    original = os.stat
    try:
        guard.run("import os\nos.stat = lambda *a, **k: None")
        reasons = guard.guards.tamper_check()
        assert any("os.stat" in r for r in reasons)
    finally:
        os.stat = original


def test_disarming_during_a_call_is_reported(armed: Callable[..., Any]) -> None:
    """It reports the armed flag cleared during the call."""
    guard = armed(imports={"allow": ["agent_sandbox.guards"]})
    guard.run("from agent_sandbox.guards._state import state\nstate.armed = False")
    assert "the guards were disarmed during the call" in guard.guards.tamper_check()


def test_swapping_the_namespace_builtins_is_reported(armed: Callable[..., Any]) -> None:
    """It reports user code that deletes or replaces its `__builtins__`."""
    guard = armed(imports={"allow": ["sys"]})
    guard.run("del __builtins__")
    assert any("__builtins__" in r for r in guard.guards.tamper_check())


def test_accidental_disarming_is_loud(armed: Callable[..., Any]) -> None:
    """It refuses to arm uninstalled guards and says so in the tamper check."""
    guard = armed(imports={"allow": ["os"]})
    guard.guards.uninstall()
    with pytest.raises(RuntimeError, match="uninstalled"):
        guard.run("1")
    assert guard.guards.tamper_check() == ["the guards were uninstalled"]


def test_the_workers_own_transport_is_not_charged() -> None:
    """It runs calls under a no-network, no-socket policy without charging the transport."""
    with Sandbox("pure-computation", warm=0) as sb, sb.session("s") as session:
        first = session.run("import json\njson.dumps([1, 2])")
        second = session.run("x = 40\nx + 2")
    assert first.ok and second.ok and second.value == 42
    assert first.worker_id == second.worker_id
    assert first.denials == () and second.denials == ()


def test_a_swallowed_denial_still_reaches_the_result(tmp_path: Path) -> None:
    """It records a refusal even when the code catches the exception."""
    with Sandbox("pure-computation", warm=0) as sb:
        result = sb.run(
            f"try:\n    open({str(tmp_path)!r} + '/x')\nexcept OSError:\n    pass\n'ok'"
        )
    assert result.value == "ok" and result.error is None
    assert [d.rule for d in result.denials] == ["files.read"]
    assert not result.ok


def test_thread_start_is_not_marked_when_disarmed(armed: Callable[..., Any]) -> None:
    """It leaves threads the worker itself starts between calls unarmed."""
    armed(imports={"allow": ["os"]})
    seen: list[bool] = []
    thread = threading.Thread(
        target=lambda: seen.append(threading.get_ident() in state.user_threads)
    )
    thread.start()
    thread.join()
    assert seen == [False]


#: Every route to a new thread, as user code can call it on this Python. Each target
#: reads the canary once `go` is set (after the call); `seen` gets what it read or the
#: exception's name.
THREAD_ROUTES = {
    "threading.Thread": "threading.Thread(target=later).start()",
    "_thread.start_new_thread": "_thread.start_new_thread(later, ())",
    "_thread.start_new": "_thread.start_new(later, ())",
    "_thread.start_joinable_thread": "_thread.start_joinable_thread(function=later)",
}


@pytest.mark.parametrize("route", sorted(THREAD_ROUTES))
def test_blocks_a_thread_that_reads_after_the_call(
    armed: Callable[..., Any], canary: Path, route: str
) -> None:
    """It denies a read from a thread user code started by any route once the call ended.

    Python 3.13's `Thread.start` goes through `_thread.start_joinable_thread`, and
    `_thread.start_new` is an alias of `start_new_thread` that user code can call itself.
    """
    import _thread

    if not hasattr(_thread, route.partition(".")[2]) and route != "threading.Thread":
        pytest.skip(f"{route} does not exist on this Python")
    guard = armed(imports={"allow": ["threading", "_thread"]})
    guard.namespace["CANARY_PATH"] = str(canary)
    guard.run(
        "import threading, _thread\n"
        "go, done = threading.Event(), threading.Event()\n"
        "seen = []\n"
        "def later():\n"
        "    go.wait(30)\n"
        "    try:\n"
        "        seen.append(open(CANARY_PATH).read())\n"
        "    except OSError as exc:\n"
        "        seen.append(type(exc).__name__)\n"
        "    done.set()\n" + THREAD_ROUTES[route] + "\n"
    )
    assert not state.armed  # the call is over
    guard.namespace["go"].set()
    assert guard.namespace["done"].wait(30), "the thread never ran"
    # The attack ran (the thread read after the call) and the file guard stopped it.
    assert guard.namespace["seen"] == ["FileAccessDenied"]
    assert [d.rule for d in guard.denials()] == ["files.read"]


def test_the_thread_start_wrappers_cover_every_start_primitive() -> None:
    """It wraps every thread-starting attribute this Python has (a new one fails here)."""
    import _thread

    from agent_sandbox.guards._install import THREAD_STARTS

    covered = {(owner.__name__, name) for owner, name in THREAD_STARTS}
    present = {("_thread", n) for n in dir(_thread) if n.startswith("start")}
    present |= {("threading", n) for n in dir(threading) if n.startswith("_start")}
    assert present <= covered


#: User code that leaves a function to be run later, in the worker's own (unarmed)
#: threads: a trace or profile function for every thread, or a `sys.monitoring` callback.
#: Each entry: (the attack, how the test undoes it). Monitoring tool 4 is free by convention
#: (0, 1, 2 and 5 are the debugger's, coverage's, the profiler's and the optimizer's).
LATER_HOOKS = {
    "threading.settrace": ("threading.settrace(hook)", "threading.settrace(None)"),
    "threading.setprofile": ("threading.setprofile(hook)", "threading.setprofile(None)"),
    "threading.settrace_all_threads": (
        "threading.settrace_all_threads(hook)",
        "threading.settrace_all_threads(None)",
    ),
    "threading.setprofile_all_threads": (
        "threading.setprofile_all_threads(hook)",
        "threading.setprofile_all_threads(None)",
    ),
    "sys._settraceallthreads": ("sys._settraceallthreads(hook)", "sys._settraceallthreads(None)"),
    "sys._setprofileallthreads": (
        "sys._setprofileallthreads(hook)",
        "sys._setprofileallthreads(None)",
    ),
    "sys.monitoring.use_tool_id": ("sys.monitoring.use_tool_id(4, 'x')", ""),
    "sys.monitoring.register_callback": (
        "sys.monitoring.register_callback(4, sys.monitoring.events.PY_START, hook)",
        "",
    ),
    "sys.monitoring.set_events": (
        "sys.monitoring.set_events(4, sys.monitoring.events.PY_START)",
        "",
    ),
    "sys.monitoring.set_local_events": (
        "sys.monitoring.set_local_events(4, hook.__code__, sys.monitoring.events.PY_START)",
        "",
    ),
}
#: Tool 4 taken for the attacks that need a tool, and everything of it cleared after.
MONITORING_BEFORE = "sys.monitoring.use_tool_id(4, 'test')"
MONITORING_UNDO = (
    "sys.monitoring.set_local_events(4, hook.__code__, 0)\n"
    "sys.monitoring.set_events(4, 0)\n"
    "sys.monitoring.register_callback(4, sys.monitoring.events.PY_START, None)\n"
    "sys.monitoring.free_tool_id(4)"
)


def _exists(dotted: str) -> bool:
    import sys

    owner: Any = {"sys": sys, "threading": threading}[dotted.split(".")[0]]
    for part in dotted.split(".")[1:]:
        owner = getattr(owner, part, None)
    return owner is not None


@pytest.mark.parametrize("target", sorted(LATER_HOOKS))
def test_blocks_leaving_a_hook_that_runs_after_the_call(
    armed: Callable[..., Any], target: str
) -> None:
    """It denies user code a trace, profile or monitoring hook that would run unarmed later.

    The positive control: with the function granted the same line runs (the attack is real
    and reaches the interpreter); without, it is refused with `api.introspection`.
    """
    if not _exists(target):
        pytest.skip(f"{target} does not exist on this Python")
    attack, undo = LATER_HOOKS[target]
    monitoring = target.startswith("sys.monitoring.")
    before = MONITORING_BEFORE if monitoring and target != "sys.monitoring.use_tool_id" else ""
    undo = MONITORING_UNDO if monitoring else undo
    body = "import sys, threading\ndef hook(*a):\n    return None\n"
    scope: dict[str, Any] = {}
    exec(body + before, scope)  # unarmed: what the attack needs first
    try:
        refused = armed(imports={"allow": ["sys", "threading"]})
        refused.namespace["hook"] = scope["hook"]
        refused.run(
            "import sys, threading\n"
            f"try:\n    {attack}\n    result = 'ran'\n"
            "except PermissionError as exc:\n    result = type(exc).__name__\n"
        )
        assert refused.namespace["result"] == "CallDenied"
        assert [(d.rule, d.target) for d in refused.denials()] == [("api.introspection", target)]
        refused.guards.uninstall()
        granted = armed(imports={"allow": ["sys", "threading"]}, api={"allow": [target]})
        granted.namespace["hook"] = scope["hook"]
        granted.run(f"import sys, threading\n{attack}\nresult = 'ran'\n")
        assert granted.namespace["result"] == "ran"
        assert granted.denials() == []
    finally:
        if undo:
            exec(undo, scope)  # unarmed: put the interpreter back
