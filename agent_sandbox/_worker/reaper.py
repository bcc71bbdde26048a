"""Ending every child of a subreaper: the worker's keeper (`_worker/boot.py`) and a plain
template (`_worker/template.py`), when the agent is gone or the worker ended.

Both are subreapers, so what a dying descendant leaves (a setsid double fork's grandchild)
is reparented to them and ended in a later round. Each pid signalled is an unreaped child of
the calling process, listed by the kernel (`/proc/self/task/*/children`), so it cannot have
been reused. Standard library only: the keeper imports it before it forks the worker.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["end_children"]


def _children() -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as fh:
                out += [int(w) for w in fh.read().split()]
    except OSError:
        pass
    return out


def end_children(bound: float) -> None:
    """SIGKILL every child until none is left, reaping as they end, for at most `bound`
    seconds (reaped, not only signalled, within it)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        children = _children()
        while True:  # reap what ended (zombies are listed as children too)
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
            if pid in children:
                children.remove(pid)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.001)
