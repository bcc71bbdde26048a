"""The worker's denial recorder: every guard records here before it raises.

Recording first means a denial reaches the result even when user code swallows the
exception. The recorder also streams each denial to the parent as it happens, through the
sink the worker server installs for the duration of a call.

Standard library only (the worker imports it before arming).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent_sandbox._denial import Denial

__all__ = [
    "forget_raised",
    "handled_inside_libraries",
    "note_raised",
    "record",
    "set_policy_name",
    "set_sink",
    "take",
]

_lock = threading.Lock()
_denials: list[Denial] = []
_sink: Callable[[Denial], None] | None = None
_policy_name = ""
_MAX_RECORDED = 1000
_raised: list[tuple[int, BaseException]] = []


def set_policy_name(name: str) -> None:
    """The policy name stamped on denials that do not name one."""
    global _policy_name
    _policy_name = name


def set_sink(sink: Callable[[Denial], None] | None) -> None:
    """Install (or remove) the live sink that streams denials to the parent."""
    global _sink
    _sink = sink


def record(denial: Denial) -> Denial:
    """Record one denial (stamped with the policy name) and stream it; returns the record."""
    if not denial.policy and _policy_name:
        denial = Denial(
            rule=denial.rule,
            action=denial.action,
            target=denial.target,
            policy=_policy_name,
            hint=denial.hint,
            detail=denial.detail,
            learned=denial.learned,
        )
    with _lock:
        if len(_denials) >= _MAX_RECORDED:
            return denial
        _denials.append(denial)
        sink = _sink
    if sink is not None:
        sink(denial)
    return denial


def note_raised(denial: Denial, exc: BaseException) -> None:
    """Remember the exception raised for a recorded denial (see `handled_inside_libraries`)."""
    with _lock:
        # The denial was just recorded: its position is the last one holding this object
        # (a cached decision may record the very same object more than once).
        for i in range(len(_denials) - 1, -1, -1):
            if _denials[i] is denial:
                _raised.append((i, exc))
                break


def forget_raised(exc: BaseException) -> None:
    """Count the denial `exc` was raised for as reaching user code although its exception
    was caught inside the guards (a refusal turned into a failure of the user's own call,
    such as SQLite's "not authorized")."""
    with _lock:
        _raised[:] = [(i, e) for i, e in _raised if e is not exc]


def handled_inside_libraries(is_user: Callable[[str], bool]) -> list[int]:
    """Indices of this call's denials whose exception never reached user code.

    An exception's traceback holds the frames it unwound through, from the one that caught
    it down to the one that raised it. When none of them is user code, a library raised and
    handled the refusal itself (a font probe, a feature test), and the user never saw it.
    """
    with _lock:
        raised = list(_raised)
        _raised.clear()
    out = []
    for position, exc in raised:
        tb = exc.__traceback__
        reached_user = False
        while tb is not None:
            if is_user(tb.tb_frame.f_code.co_filename):
                reached_user = True
                break
            tb = tb.tb_next
        if not reached_user:
            out.append(position)
    return sorted(out)


def take() -> list[Denial]:
    """Return and clear the denials recorded since the last call."""
    with _lock:
        out = list(_denials)
        _denials.clear()
        _raised.clear()
    return out
