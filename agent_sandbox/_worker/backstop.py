"""The worker's own end of a call that outlives its wall limit, for when the host cannot end it.

Standard library only, and no `signal` module (its enums cost the worker's start-up): the
signal is SIGKILL's number.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["BACKSTOP", "WallBackstop"]

_SIGKILL = 9


class WallBackstop:
    """A call's wall limit enforced in the worker by the kernel, for when the host cannot
    (the agent and its guardian died together, and no parent-death signal or life line
    reached the worker): a POSIX timer whose expiry is SIGKILL to this process, so nothing
    in it runs for it (a call that never yields, or blocks every signal, ends too). Armed at
    a call's start for the time the host's request names (`backstop`: what is left of the
    call's wall limit plus a grace, `transport.BACKSTOP_GRACE`), disarmed at its end; the
    host ends a call at its limit first. Timers are not inherited by a fork, so a child
    the cell forks does not carry it (its sandbox's pid namespace, keeper or template end
    it with the worker). Where the timer cannot be made (a filter refusing it), the worker
    runs without it.

    Everything `arm` uses is taken when the timer is made, before any user code: the code
    may replace `ctypes` in `sys.modules` (importing it again, `_ctypes` with it), and the
    disarming after the call must not meet its objects or fail on them."""

    def __init__(self) -> None:
        self._settime: Any = None
        self._spec: Any = None  # one struct itimerspec (four longs), filled for each arm
        self._timer: Any = None
        self._pid = 0  # the process the timer belongs to (a fork has none of its own)
        self._failed = False

    def prepare(self) -> None:
        """Make the timer now (the first call's one-time work, done ahead)."""
        if self._pid != os.getpid():
            self._timer, self._failed, self._pid = None, False, os.getpid()
        if self._timer is None and not self._failed:
            try:
                self._failed = not self._make()
            except Exception:
                self._failed = True

    def _make(self) -> bool:
        import ctypes

        class _Sigevent(ctypes.Structure):  # struct sigevent (64 bytes)
            _fields_ = [
                ("value", ctypes.c_void_p),
                ("signo", ctypes.c_int),
                ("notify", ctypes.c_int),
                ("rest", ctypes.c_int * 12),
            ]

        libc = ctypes.CDLL(None, use_errno=True)
        event = _Sigevent(signo=_SIGKILL, notify=0)  # SIGEV_SIGNAL
        timer = ctypes.c_void_p()
        if libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer)) != 0:  # MONOTONIC
            return False
        self._settime, self._spec, self._timer = libc.timer_settime, (ctypes.c_long * 4)(), timer
        return True

    def arm(self, seconds: float) -> None:
        """Expire `seconds` from now (0: disarm). Never raises: a backstop that fails is
        off for this worker's life (the host's own limit stays)."""
        try:
            self.prepare()
            if self._failed:
                return
            whole = int(seconds)
            spec = self._spec  # no interval; the first expiry
            spec[2], spec[3] = whole, int((seconds - whole) * 1e9)
            if self._settime(self._timer, 0, spec, None) != 0:
                self._failed = True
        except Exception:
            self._failed = True


#: The worker's one backstop (`_worker/server.py` arms it around each call).
BACKSTOP = WallBackstop()
