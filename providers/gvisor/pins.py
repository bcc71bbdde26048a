"""The grants a gVisor worker was given, walked again: on the host just before runsc
starts (`check_pins_on_host`), then in runsc's gofer's own root after the start
(`check_pins_in_gofer`), which is what the sandbox mounted. Each must be the object the build
pinned (`providers/_grants.py`); the Sentry's inode numbers are its own, so the worker cannot
check them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

from agent_sandbox.providers.gvisor.bundle import GvisorPlan

__all__ = ["check_pins_in_gofer", "check_pins_on_host"]


def check_pins_on_host(pins: Mapping[str, Any]) -> None:
    """Each granted path, walked again without following links, must still be the object
    the build pinned; raises WorkerStartError naming the path otherwise.

    runsc's gofer opens each bind source by path a few tens of milliseconds later; a swap
    inside that window is caught after the start by `check_pins_in_gofer`.
    """
    from agent_sandbox._errors import PolicyError, WorkerStartError
    from agent_sandbox.providers._grants import _walk

    for path, pin in pins.items():
        try:
            now: Any = _walk(path, "files", path, None)
        except PolicyError:
            now = "a link"
        if now != (list(pin) if pin is not None else None):
            raise WorkerStartError(
                f"the granted path {path} is not the object the policy check pinned (a link "
                "planted or a directory swapped between the check and the start); start the "
                "worker again, and see which tool can write there"
            )


def check_pins_in_gofer(plan: GvisorPlan, runsc_pid: int) -> None:
    """After the start, before any call: each granted path as runsc's gofer mounted it (in
    the gofer's own root, `/proc/<gofer>/root`, walked without following a link) must be
    the object the build pinned; raises WorkerStartError naming the path otherwise.

    This closes the window `check_pins_on_host` leaves: the gofer opens each bind source by
    path some tens of milliseconds after that check, and a swap inside that window mounts
    what the swapped-in link points to, which this walk sees (another device or inode).
    """
    from agent_sandbox._errors import WorkerStartError

    gofer = _gofer_pid(runsc_pid)
    if gofer is None:
        raise WorkerStartError(
            "runsc's gofer was not found, so the granted paths it mounted "
            "could not be checked; start the worker again"
        )
    masked = {
        m["destination"]
        for m in plan.config.get("mounts", ())
        if m.get("type") == "tmpfs" or m.get("source") == os.path.join(plan.bundle_dir, "empty")
    }
    try:
        root = os.open(f"/proc/{gofer}/root", os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise WorkerStartError(
            f"cannot read the root of runsc's gofer ({exc}), so the granted paths it mounted "
            "could not be checked"
        ) from None
    try:
        for path, pin in plan.pins.items():
            if pin is None or path in masked or path.startswith(("/proc/", "/dev/")):
                continue
            if _walk_in(root, path) != list(pin):
                raise WorkerStartError(
                    f"the granted path {path} as the sandbox mounted it is not the object the "
                    "policy check pinned (a link planted or a directory swapped between the "
                    "check and the mount); start the worker again, and see which tool can "
                    "write there"
                )
    finally:
        os.close(root)


def _gofer_pid(runsc_pid: int) -> int | None:
    """The pid of runsc's gofer: a descendant of the runsc process (a child as root; as a
    normal user runsc first runs itself again in a user namespace) whose command line starts
    with `runsc-gofer`."""
    from agent_sandbox._host.limits import _descendants

    for pid, _level in _descendants(runsc_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if fh.read().split(b"\0", 1)[0] == b"runsc-gofer":
                    return pid
        except OSError:
            continue
    return None


def _walk_in(root: int, path: str) -> list[int] | None:
    """[st_dev, st_ino] of `path` below the directory `root`, every component opened without
    following a link; None where a component is missing or a link."""
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.dup(root)
    try:
        for part in (p for p in path.split("/") if p):
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = child
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                return None
        info = os.fstat(fd)
        return [info.st_dev, info.st_ino]
    finally:
        os.close(fd)
