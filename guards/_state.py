"""The arming state shared by every guard, and the one way a guard refuses.

Guards are installed once, at worker start, and enforce only while armed:

1. `armed` is true while a call of user code runs (the runner enters `arming()` around it).
2. Threads started while armed are remembered and stay armed after the call ends, so a
   thread cannot wait for the call to finish and then act unguarded.
3. The worker's own code between calls (transport, result encoding) runs disarmed.

`refuse()` records the denial before raising (so swallowed refusals still reach the result);
in learning mode it records the would-be denial as learned and lets the operation proceed.

`is_user_frame()` tells user code (the `<cell-N>` cells, strings it compiled) from the
standard library, installed packages and the worker itself, by the code's file name.

What it does NOT do: the state is a plain module global. Code that can reach this module
(through the class hierarchy or the module table) can flip it; the end-of-call check sees a
flag cleared during the call, not one cleared and set back. That is a documented limit.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from _thread import get_ident
from typing import Any, NoReturn

from agent_sandbox import _audit
from agent_sandbox._denial import Denial

_getframe = sys._getframe

__all__ = [
    "configure",
    "is_active",
    "is_user_frame",
    "refuse",
    "state",
]


class _State:
    """All mutable guard state in one object (read on every guarded call)."""

    def __init__(self) -> None:
        self.armed = False
        self.user_threads: set[int] = set()
        self.learn = False
        self.policy_name = ""
        self.trusted_roots: tuple[str, ...] = ()
        self.disarmed_mid_call = False
        #: File names the host gave the call's code (a script run from the CLI).
        self.user_files: set[str] = set()


state = _State()


def configure(*, learn: bool, policy_name: str, trusted_roots: tuple[str, ...]) -> None:
    """Set the mode, the policy name and the folders whose code is not user code."""
    state.learn = learn
    state.policy_name = policy_name
    roots = {os.path.join(os.path.realpath(r), "") for r in trusted_roots if r}
    roots |= {os.path.join(r, "") for r in trusted_roots if r}
    state.trusted_roots = tuple(sorted(roots))
    _audit.set_user_frame_test(is_user_frame)


def is_active() -> bool:
    """Whether the guards enforce in the calling thread right now."""
    return state.armed or (bool(state.user_threads) and get_ident() in state.user_threads)


def is_user_frame(filename: str) -> bool:
    """Whether code from `filename` is user code (a cell, a string it compiled, its files)."""
    if filename.startswith("<cell-") or filename in state.user_files:
        return True
    if filename.startswith("<frozen "):
        return False
    return not filename.startswith(state.trusted_roots)


def refuse(exc_class: type[BaseException], denial: Denial, *, always: bool = False) -> None:
    """Record `denial`, then raise `exc_class(denial)`; in learning mode record it as learned.

    Returns only in learning mode (the caller then lets the operation proceed), unless
    `always`: what no proposal may ever grant (the worker's control directory, the policy
    file, hidden names) is refused in learning mode too.
    """
    if state.learn and not always:
        _audit.record(dataclasses.replace(denial, learned=True))
        return
    _raise(exc_class, denial)


def _raise(exc_class: type[BaseException], denial: Denial) -> NoReturn:
    # Stamped first (policy name, origin), so the exception carries what the trace holds;
    # recorded before the raise, and classified by whether the raise reaches user code.
    stamped = _audit.stamp(denial)
    exc: Any = exc_class(stamped)
    _audit.record_raised(stamped, exc)
    raise exc
