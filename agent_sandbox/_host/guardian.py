"""Nothing outlives the agent: the guardian process and the clean-up it shares with the host.

Every process and directory the agent makes for its workers carries the agent's *owner
tag*, `<pid>.<start time>` (the start time in clock ticks from `/proc/<pid>/stat`), which
no other process can take while the agent lives and which never names a later process:

* control directories are `<tmp>/agent-sandbox-<tag>-<random>` (0700, the agent's uid);
* every launched process (a worker, a launcher, a template) starts with
  `AGENT_SANDBOX_OWNER=<tag>` in its initial environment, which `/proc/<pid>/environ`
  keeps for the process's life and which a fork inherits (the worker drops the variable
  from `os.environ` at boot, so the code does not see it);
* the per-worker cgroups are `agent-sandbox-<pid>-<worker id>`, and a worker is placed in
  them before any of its code runs, so whatever it starts (a setsid double fork too) is in
  them.

`clean_owner(tag, ...)` ends all of it: `cgroup.kill` (or SIGKILL of every member) for the
agent's groups, SIGKILL for every process whose initial environment holds the tag (a
launcher the agent started but had not yet placed), then removes the groups and the
directories. The host calls it at interpreter exit; the **guardian** calls it when the agent
dies any other way. The guardian is one small process per agent, in its own session (a
signal to the agent's process group does not reach it), that blocks reading a pipe whose
only write end the agent holds: the kernel closes that end however the agent ends,
SIGKILL included. At its start the guardian also sweeps what agents that are gone left
behind (their guardian killed too, or a power cut): directories and groups whose owner no
longer runs.

Standard library only: the guardian runs as `python -I -S -B` with this file's folder on
its path, like the unshare launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import time

__all__ = [
    "OWNER_ENV",
    "clean_owner",
    "owner_alive",
    "owner_tag",
    "remove_tree",
    "sweep",
]

OWNER_ENV = "AGENT_SANDBOX_OWNER"
#: What the agent writes to the guardian's pipe, last, once its own exit clean-up ended with
#: no start in flight: the guardian then exits without scanning for the agent's leftovers
#: (a normal exit waits for the guardian; the scan of /proc was most of that wait).
CLEANED = b"cleaned\n"
DIR_PREFIX = "agent-sandbox-"
CGROUP_PREFIX = "agent-sandbox-"


# -- owners ----------------------------------------------------------------------------------


def start_time(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None  # a zombie has ended: its tag names nothing that still runs
    return fields[19].decode()


def owner_tag(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{start_time(pid)}"


def owner_alive(tag: str) -> bool:
    pid, _, start = tag.partition(".")
    return pid.isdigit() and start_time(int(pid)) == start


# -- files -----------------------------------------------------------------------------------


def remove_tree(path: str) -> bool:
    """Remove `path` and everything below it; never raises, never recurses (any depth).

    Descriptor-relative throughout (no path grows with the depth, no symlink is followed);
    a directory whose mode forbids listing or unlinking is given 0700 first (through an
    `O_PATH` descriptor, so a symlink swapped in cannot redirect the chmod). Returns
    whether the path is gone.
    """
    parent, name = os.path.split(os.path.abspath(path))
    try:
        top = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return not os.path.lexists(path)
    try:
        _remove_entry(top, name)
    finally:
        os.close(top)
    return not os.path.lexists(path)


def _open_dir(parent_fd: int, name: str) -> int | None:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except PermissionError:
        pass
    except OSError:
        return None
    with contextlib.suppress(OSError):
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            if stat.S_ISDIR(os.fstat(handle).st_mode):
                os.chmod(f"/proc/self/fd/{handle}", 0o700)
        finally:
            os.close(handle)
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except OSError:
        return None


def _remove_entry(parent_fd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent_fd)
        return
    fd = _open_dir(parent_fd, name)
    if fd is None:
        return
    # An explicit stack of (parent fd, name, own fd, pending entries): depth costs memory,
    # not recursion.
    stack: list[tuple[int, str, int, list[str]]] = [(parent_fd, name, fd, _list(fd))]
    while stack:
        up, own_name, own, pending = stack[-1]
        if not pending:
            stack.pop()
            os.close(own)
            with contextlib.suppress(OSError):
                os.rmdir(own_name, dir_fd=up)
            continue
        entry = pending.pop()
        try:
            st = os.stat(entry, dir_fd=own, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            child = _open_dir(own, entry)
            if child is not None:
                stack.append((own, entry, child, _list(child)))
            continue
        try:
            os.unlink(entry, dir_fd=own)
        except PermissionError:
            with contextlib.suppress(OSError):
                os.chmod(f"/proc/self/fd/{own}", 0o700)
                os.unlink(entry, dir_fd=own)
        except OSError:
            pass


def _list(fd: int) -> list[str]:
    try:
        return os.listdir(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.chmod(f"/proc/self/fd/{fd}", 0o700)
            return os.listdir(fd)
    return []


def owned_dirs(tempdir: str, tag: str | None = None) -> list[tuple[str, str]]:
    """(path, owner tag) of the control directories in `tempdir` (of `tag`, or all)."""
    out: list[tuple[str, str]] = []
    uid = os.geteuid()
    try:
        names = os.listdir(tempdir)
    except OSError:
        return out
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        owner = name[len(DIR_PREFIX) :].split("-", 1)[0]
        pid, dot, start = owner.partition(".")
        if not (pid.isdigit() and dot and start.isdigit()):
            continue
        if tag is not None and owner != tag:
            continue
        path = os.path.join(tempdir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            out.append((path, owner))
    return out


# -- processes and groups ----------------------------------------------------------------------


def kill_marked(tag: str) -> int:
    """SIGKILL every process whose initial environment carries the owner tag; how many."""
    marker = f"{OWNER_ENV}={tag}".encode() + b"\0"
    me = os.getpid()
    killed = 0
    for _ in range(20):  # a marked process may fork while we scan
        found = 0
        for entry in _pids():
            if entry == me:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    env = fh.read()
            except OSError:
                continue
            if (b"\0" + env).find(b"\0" + marker) >= 0:
                with contextlib.suppress(OSError):
                    os.kill(entry, signal.SIGKILL)
                    found += 1
        killed += found
        if not found:
            break
        time.sleep(0.005)
    return killed


def _pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def _group_dirs(bases: list[str], pid: int | None) -> list[str]:
    out = []
    for base in bases:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            if not name.startswith(CGROUP_PREFIX):
                continue
            owner = name[len(CGROUP_PREFIX) :].split("-", 1)[0]
            if not owner.isdigit():
                continue
            if pid is None and os.path.exists(f"/proc/{owner}"):
                continue  # sweeping: only groups whose owner is gone
            if pid is not None and int(owner) != pid:
                continue
            out.append(os.path.join(base, name))
    return out


def kill_groups(paths: list[str]) -> None:
    """End every process in the groups (cgroup.kill where there is one), then remove them."""
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(os.path.join(path, "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
    deadline = time.monotonic() + 2.0
    left = list(paths)
    while left and time.monotonic() < deadline:
        remaining = []
        for path in left:
            try:
                with open(os.path.join(path, "cgroup.procs")) as fh:
                    members = [int(w) for w in fh.read().split()]
            except OSError:
                members = []
            for member in members:
                with contextlib.suppress(OSError):
                    os.kill(member, signal.SIGKILL)
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                remaining.append(path)
        left = remaining
        if left:
            time.sleep(0.01)


def clean_owner(tag: str, bases: list[str], tempdir: str) -> None:
    """End every process and remove every group and directory of the agent `tag`."""
    pid = int(tag.partition(".")[0])
    groups = _group_dirs(bases, pid)
    kill_groups(groups)
    kill_marked(tag)
    kill_groups(_group_dirs(bases, pid))  # anything a marked process placed meanwhile
    for path, _owner in owned_dirs(tempdir, tag):
        remove_tree(path)


def sweep(bases: list[str], tempdir: str, *, skip: str = "") -> int:
    """Clean what agents that no longer run left behind; how many owners were cleaned."""
    owners = {owner for _path, owner in owned_dirs(tempdir)}
    cleaned = 0
    for owner in sorted(owners):
        if owner != skip and not owner_alive(owner):
            clean_owner(owner, bases, tempdir)
            cleaned += 1
    kill_groups(_group_dirs(bases, None))
    return cleaned


# -- the guardian --------------------------------------------------------------------------------


def main() -> None:
    """argv: pipe fd, owner tag, temp dir, cgroup hierarchy bases..."""
    fd, tag, tempdir, *bases = sys.argv[1:]
    with contextlib.suppress(OSError):
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        sweep(bases, tempdir, skip=tag)
    told = b""
    while True:
        try:
            data = os.read(int(fd), 4096)
        except InterruptedError:
            continue
        except OSError:
            break
        if not data:
            break
        told = (told + data)[-len(CLEANED) :]
    if told != CLEANED:
        clean_owner(tag, bases, tempdir)
    # Else the agent ended normally, cleaned up after itself at its exit with nothing in
    # flight, and said so last (`_host/lifecycle.py`): nothing is left to look for.


if __name__ == "__main__":
    main()
