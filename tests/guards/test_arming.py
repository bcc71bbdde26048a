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
