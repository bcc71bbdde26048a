"""The host's own check of a worker's guards: it reads the arming counter from outside.

The worker's guards keep their arming flag in C (`guards/_fastimport.c`), with a counter of
every write of it, in a small block of the worker's memory. The worker reports where the
block is in its handshake, before any user code ran; from then on the host reads the block
itself through `/proc/<pid>/mem` and never asks the worker. A call is one arming and one
disarming, so while the call runs the host expects exactly one write and the flag set, and
at its end exactly two and the flag clear. The host reads the block before it accepts each
event of the call:

* an event read while armed (one write) is passed on at once;
* an event read after the disarming (two writes, flag clear) is held back until the end of
  the call is verified: output produced after the guards went off is never handed on
  before the host knows the guards went off only once, at the end;
* anything else (three writes or more, a flag clear with one write, a sealed setting
  written, a block that no longer reads) is tampering: nothing more of the call is handed
  on, and the worker is discarded.

A call its caller abandoned (a cancelled `arun`) is not read to its end; the next call
counts its two writes too, when it reached the worker. That leaves one slack: when two
calls were abandoned and one of them never reached the worker, two extra writes in
another are not told apart from it.

So a flag cleared and set back within the call, a flag left clear, and a worker whose own
Python tamper check was replaced are all caught here, before the call's output is handed
back.

What it does NOT hold against: a worker is fully in control of its own memory. Native code
in it (ctypes, a C extension) can rewrite the block, and code that replaced the worker's
runner can skip the runner's own writes and make exactly the two the host expects around
unguarded work. The kernel boundary is what holds then. Where the host may not read the
worker's memory (a non-root host without ptrace rights over it), or the extension is not
built, there is no block to read, and only the worker's own check remains.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import TYPE_CHECKING

from agent_sandbox._host.exit_status import proc_children

if TYPE_CHECKING:
    from agent_sandbox._wire import Hello

__all__ = ["GuardWatch", "HOLD", "PASS", "TAMPERED"]

PASS = "pass"
HOLD = "hold"
TAMPERED = "tampered"

_LAYOUT = struct.Struct("<5Q")


class GuardWatch:
    """The host's reader of one worker's arming block."""

    def __init__(self, fd: int, pid: int, address: int, head: int, tail: int) -> None:
        self._fd = fd
        self.pid = pid
        self._address = address
        self._head = head
        self._tail = tail
        self._base = 0
        #: Calls begun since the last verified end (more than one after an abandoned call).
        self._calls = 0
        self.reason = ""
        self.writes = 0
        #: The worker ended before the call could be verified: what is held stays held.
        self.lost = False

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, launcher_pid: int, hello: Hello) -> GuardWatch | None:
        """Find the worker under `launcher_pid` and read its block once; None when the
        worker reported no block or the host cannot read it (see the module docstring)."""
        info = (hello.checks.guards or {}).get("block")
        if not isinstance(info, dict):
            return None
        inner_pid = hello.pid
        try:
            address, head, tail = int(info["address"]), int(info["head"]), int(info["tail"])
        except (KeyError, TypeError, ValueError):
            return None
        if int(info.get("size", 0)) != _LAYOUT.size:
            return None
        for pid in _candidates(launcher_pid, inner_pid):
            try:
                fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            watch = cls(fd, pid, address, head, tail)
            block = watch._read()
            if block is None:
                watch.close()
                continue
            transitions, armed, tampered = block
            if armed or tampered:
                watch.close()
                return None
            watch._base = transitions
            return watch
        return None

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    # -- per call ------------------------------------------------------------------------

    def begin_call(self) -> None:
        """A new call starts: its writes are counted from the last verified end."""
        self.reason = ""
        self.writes = 0
        self.lost = False
        self._calls += 1

    def judge(self, kind: str) -> str:
        """PASS, HOLD or TAMPERED for an event of `kind` that just arrived."""
        if self.reason:
            return TAMPERED
        if self.lost:
            return HOLD
        block = self._read()
        if block is None:
            if not _alive(self.pid):
                # Gone (or going): nothing more can be verified, so nothing more is passed
                # on; the host reports the end of the worker, not tampering.
                self.lost = True
                return HOLD
            return self._tampered("the guards' arming block could no longer be read")
        transitions, armed, tampered = block
        self.writes = transitions - self._base
        if tampered & 1:
            return self._tampered("a sealed guard setting was written")
        if tampered & 2:
            return self._tampered("the arming flag was found off when a call ended")
        # Normally one call since the last verified end: one write while it runs, two at its
        # end. A call the caller abandoned (a cancelled `arun`) was not seen to its end; if
        # it reached the worker, it made its two writes before this one started.
        most = 2 * self._calls
        if kind == "done":
            if not armed and self.writes % 2 == 0 and 2 <= self.writes <= most:
                self._base = transitions
                self._calls = 0
                return PASS
            return self._tampered(self._describe(armed))
        if armed and self.writes % 2 == 1 and self.writes < most:
            return PASS
        if not armed and self.writes % 2 == 0 and 2 <= self.writes <= most:
            return HOLD
        return self._tampered(self._describe(armed))

    def _describe(self, armed: int) -> str:
        state = "on" if armed else "off"
        return (
            f"the arming flag was written {self.writes} times during the call where the "
            f"sandbox writes it twice, and it was {state} when the host looked"
        )

    def _tampered(self, reason: str) -> str:
        self.reason = reason
        return TAMPERED

    def _read(self) -> tuple[int, int, int] | None:
        if self._fd < 0:
            return None
        try:
            data = os.pread(self._fd, _LAYOUT.size, self._address)
        except OSError:
            return None
        if len(data) != _LAYOUT.size:
            return None
        head, transitions, armed, tampered, tail = _LAYOUT.unpack(data)
        if head != self._head or tail != self._tail or armed not in (0, 1):
            return None
        return transitions, armed, tampered


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x", b"")


def _candidates(launcher_pid: int, inner_pid: int) -> list[int]:
    """The launcher and its descendants whose innermost pid is the worker's own pid."""
    found = []
    todo = [launcher_pid]
    seen: set[int] = set()
    while todo and len(seen) < 64:
        pid = todo.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        if _innermost_pid(pid) == inner_pid:
            found.append(pid)
        todo.extend(proc_children(pid))
    return found


def _innermost_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return -1
