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

Where the state lives: in the C extension (`_fastimport.state`, see `_fastimport.c`). Every
write of `armed` is counted there, in a block of memory the host reads from outside the
worker after each event of a call, so a flag cleared and set back within one call is seen
by the host even when the worker's own Python checks were replaced. The other settings are
sealed once the worker is set up (`seal()`); a later write is refused and reported to the
host the same way. Without the compiled extension the state is a plain Python object
(`_State`), and the host has no block to read (see docs/guards.md).

What it does NOT do: stop native code in the worker from rewriting its own memory, or
code that replaced the worker's runner from counting a legitimate-looking pair of writes;
the kernel boundary is what holds then.
"""

from __future__ import annotations

import os
import sys
from _thread import get_ident

from agent_sandbox._denial import Denial
from agent_sandbox._worker import audit

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any, NoReturn

_getframe = sys._getframe

__all__ = [
    "configure",
    "is_active",
    "is_user_frame",
    "refuse",
    "state",
]


class _State:
    """The Python stand-in for the C state, used only when the extension is not built."""

    def __init__(self) -> None:
        self.armed = False
        self.user_threads: set[int] = set()
        self.learn = False
        self.policy_name = ""
        self.trusted_roots: tuple[str, ...] = ()
        self.sealed = False

    def seal(self) -> None:
        self.sealed = True


def _c_state() -> Any:
    try:
        from agent_sandbox.guards import _fastimport
    except ImportError:
        return None
    if getattr(_fastimport, "VERSION", 0) < 2:
        return None  # built from an older _fastimport.c: rebuild (pip install -e .)
    return _fastimport


_c = _c_state()
#: All guard state in one object (read on every guarded call): the C one when built.
state: Any = _c.state if _c is not None else _State()


def block_read() -> tuple[int, int, int]:
    """(transitions, armed, tampered) of the C block, as this process sees them."""
    if _c is None:
        return (0, int(bool(state.armed)), 0)
    transitions, armed, tampered = _c.block_read()
    return int(transitions), int(armed), int(tampered)


def tampered_bits() -> int:
    """The C block's tamper bits as this process sees them (0 without the extension)."""
    return int(_c.block_read()[2]) if _c is not None else 0


def block_info() -> dict[str, int] | None:
    """Where the C arming block is in this process (the host reads it), or None."""
    return dict(_c.block_info()) if _c is not None else None


#: File names the host gave a call's code (a script run from the CLI): user code.
USER_FILES: set[str] = set()


def configure(*, learn: bool, policy_name: str, trusted_roots: tuple[str, ...]) -> None:
    """Set the mode, the policy name and the folders whose code is not user code."""
    state.learn = learn
    state.policy_name = policy_name
    roots = {os.path.join(os.path.realpath(r), "") for r in trusted_roots if r}
    roots |= {os.path.join(r, "") for r in trusted_roots if r}
    state.trusted_roots = tuple(sorted(roots))
    audit.set_user_frame_test(is_user_frame)


def is_active() -> bool:
    """Whether the guards enforce in the calling thread right now."""
    return state.armed or (bool(state.user_threads) and get_ident() in state.user_threads)


def is_user_frame(filename: str) -> bool:
    """Whether code from `filename` is user code (a cell, a string it compiled, its files)."""
    if filename.startswith("<cell-") or filename in USER_FILES:
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
        audit.record(denial.replace(learned=True))
        return
    _raise(exc_class, denial)


def _raise(exc_class: type[BaseException], denial: Denial) -> NoReturn:
    # Stamped first (policy name, origin), so the exception carries what the trace holds;
    # recorded before the raise, and classified by whether the raise reaches user code.
    stamped = audit.stamp(denial)
    exc: Any = exc_class(stamped)
    audit.record_raised(stamped, exc)
    raise exc
