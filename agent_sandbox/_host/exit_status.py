"""How a worker's process ended, read after its call's connection was lost.

What `agent_sandbox._host.call` asks when the transport of a call ended: whether the worker
exited (and with which status), is stopped by a signal or still runs (`status_now`); how
its VM ended, when its launcher saw QEMU end first (`vm_end`); whether it used up its CPU
time (`cpu_exhausted`). Read from `/proc`, the worker's cgroups and its control directory,
never from the worker.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from agent_sandbox._errors import describe_exit

if TYPE_CHECKING:
    from agent_sandbox._host.process import WorkerProcess

__all__ = [
    "cpu_exhausted",
    "live_children",
    "parse_stat",
    "proc_children",
    "proc_state",
    "status_now",
    "vm_end",
]

#: How long a worker seen exiting (after its connection closed) has to give its status.
_EXITING_WAIT = 2.0
_PF_EXITING = 0x4


def status_now(worker: WorkerProcess) -> tuple[str, int | None]:
    """After the transport was lost: ("exited", status), ("stopped", None) or
    ("running", None), decided now; the only wait is for a worker already exiting
    (its connection closes before its exit status exists), and it ends as soon as the
    status does."""
    assert worker.proc is not None
    status = worker.proc.poll()
    if status is not None:
        return "exited", status
    if worker.stopped():
        return "stopped", None
    inner = worker.worker_pid() if worker.hello is not None else worker.proc.pid
    state, flags = proc_state(inner) if inner is not None else ("", 0)  # None: gone
    template = getattr(worker.proc, "_template", None)
    exiting = (
        state in ("", "Z", "X")
        or bool(flags & _PF_EXITING)
        or (template is not None and not template.alive())
    )
    vm = worker.plan is not None and worker.plan.interrupt_launcher
    if not exiting and vm and not live_children(worker.proc.pid):
        # A VM: the launcher outlives its QEMU, its only child, by a moment. No live
        # child left means the VM itself ended: wait for the launcher's exit.
        return "exited", worker.wait_exit(_EXITING_WAIT)
    if not exiting:
        return "running", None
    return "exited", worker.wait_exit(_EXITING_WAIT)


def vm_end(worker: WorkerProcess) -> str | None:
    """How the worker's VM ended, when its launcher saw QEMU end before the guest said
    the worker ended (`qemu-ended.json`, written by the launcher in a directory the
    guest cannot write); None otherwise."""
    if worker.plan is None or not worker.plan.interrupt_launcher or not worker.control_dir:
        return None
    path = os.path.join(worker.control_dir, "vm", "qemu-ended.json")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            code = json.loads(fh.read(256)).get("returncode")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(code, int):
        return None
    return describe_exit(code)


def cpu_exhausted(worker: WorkerProcess) -> bool:
    # A death after the worker's group used up its CPU time: the hard RLIMIT_CPU's
    # SIGKILL (user code ignored SIGXCPU), however a launcher relays it.
    assert worker.policy is not None
    used = worker.cgroups.cpu_seconds() if worker.cgroups is not None else 0.0
    return used >= worker.policy.limits.cpu_seconds


def live_children(pid: int) -> list[int]:
    """The children of `pid` that have not ended (zombies excluded)."""
    return [child for child in proc_children(pid) if proc_state(child)[0] not in ("", "Z", "X")]


def proc_children(pid: int) -> list[int]:
    """The children of `pid` as /proc lists them, thread by thread (ended ones included;
    [] when it is gone)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as fh:
                out.extend(int(p) for p in fh.read().split())
        except (OSError, ValueError):
            continue
    return out


def proc_state(pid: int) -> tuple[str, int]:
    """A process's state letter and flags from /proc (("", 0) when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return "", 0
    return parse_stat(raw)


def parse_stat(stat: bytes) -> tuple[str, int]:
    fields = stat[stat.rfind(b")") + 2 :].split(None, 7)  # the state and the flags are enough
    try:
        return fields[0].decode(), int(fields[6])
    except (IndexError, ValueError):
        return "", 0
