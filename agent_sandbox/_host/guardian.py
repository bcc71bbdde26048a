"""Nothing outlives the agent: the guardian process and the clean-up it shares with the host.

Ownership is proven, never guessed (docs/architecture.md, "Ownership"):

* Every agent process draws an **owner token** (16 random hex digits) the first time it
  makes anything, and before anything else it creates `<tmp>/agent-sandbox-<token>.lock`
  (0600, `O_EXCL`) and holds an exclusive `flock` on it for the rest of its life. Its
  guardian inherits that open file, so the lock stays held until the agent *and* its
  guardian are gone, however they end: the kernel drops a `flock` when the last descriptor
  of the open file closes, in whatever pid namespace the holders run.
* Everything the agent makes carries the token: control directories are
  `<tmp>/agent-sandbox-<token>-<random>` (0700), per-worker cgroups are
  `agent-sandbox-<token>-<worker id>`, and every launched process starts with
  `AGENT_SANDBOX_OWNER=<token>` in its initial environment (`/proc/<pid>/environ`).
* A sweeper proves an owner dead by taking its lock, non-blocking, on a lock file that is a
  regular file of its own uid opened without following links. Then, holding the lock, it
  ends the owner's groups (`cgroup.kill`; where there is none, each member it can see, by
  pidfd, never a `0`, never a group), the processes marked with the token that it can see,
  removes the directories, and last unlinks the lock file. A name whose lock is held is
  alive; a name without a lock file it can check (another container's `/tmp`, a planted
  lookalike, a symlink, another user's directory) is never touched: it is skipped, with one
  log line when it looks planted.

`clean_owner(tag, ...)` ends everything of one owner. The host calls it at interpreter exit;
the **guardian** calls it when the agent dies any other way. The guardian is one small
process per agent, in its own session (a signal to the agent's process group does not reach
it), that blocks reading a pipe whose only write end the agent holds: the kernel closes that
end however the agent ends, SIGKILL included. At its start the guardian also sweeps what
agents that are gone left behind (their guardian killed too, or a power cut).

Standard library only: the guardian runs as `python -I -S -B` with this file's folder on
its path, like the unshare launcher. It is longer than 600 lines for that reason: run as one
file, it carries what it needs (the owner lock, the sweep, the bounded tree removal) itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import stat
import sys
import time
from collections.abc import Callable

__all__ = [
    "OWNER_ENV",
    "claim_owner",
    "clean_owner",
    "hold_owner_lock",
    "lock_path",
    "owner_of_name",
    "release_owner",
    "remove_tree",
    "sweep",
    "tag_of_pid",
]

OWNER_ENV = "AGENT_SANDBOX_OWNER"
#: What the agent writes to the guardian's pipe, last, once its own exit clean-up ended with
#: no start in flight: the guardian then exits without scanning for the agent's leftovers
#: (a normal exit waits for the guardian; the scan of /proc was most of that wait).
CLEANED = b"cleaned\n"
DIR_PREFIX = "agent-sandbox-"
CGROUP_PREFIX = "agent-sandbox-"
LOCK_SUFFIX = ".lock"
TOKEN_LEN = 16
_HEX = frozenset("0123456789abcdef")

Log = Callable[[str], object]


def _stderr_log(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"agent-sandbox: {line}\n")
        sys.stderr.flush()


# -- owners ----------------------------------------------------------------------------------


def is_token(text: str) -> bool:
    return len(text) == TOKEN_LEN and set(text) <= _HEX


def owner_of_name(name: str) -> str | None:
    """The owner token in a control directory's or cgroup's name (None: not one of ours)."""
    if not name.startswith(DIR_PREFIX):
        return None
    rest = name[len(DIR_PREFIX) :]
    token, dash, tail = rest.partition("-")
    return token if dash and tail and is_token(token) else None


def lock_path(tempdir: str, tag: str) -> str:
    return os.path.join(tempdir, f"{DIR_PREFIX}{tag}{LOCK_SUFFIX}")


def hold_owner_lock(tempdir: str) -> tuple[str, int]:
    """Draw a new owner token and take its lock: (token, descriptor holding the lock).

    The lock file is new (`O_EXCL`) and locked before any name carrying the token exists,
    so no sweeper can learn the token while the lock is free.
    """
    import secrets

    while True:
        tag = secrets.token_hex(TOKEN_LEN // 2)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(lock_path(tempdir, tag), flags, 0o600)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        return tag, fd


def claim_owner(tempdir: str, tag: str, log: Log | None = None) -> int | None:
    """Prove owner `tag` dead by taking its lock: the descriptor holding it, or None.

    None when the owner (or its guardian) still holds the lock, when there is no lock file
    to check here, or when what is there is not a regular file of this uid (logged: planted).
    """
    path = lock_path(tempdir, tag)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None  # not provable from here (another /tmp, or already cleaned)
    except OSError as exc:
        if log is not None:
            log(f"sweep skipped {path}: cannot open it without following links ({exc.strerror})")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            if log is not None:
                log(f"sweep skipped {path}: not a lock file of uid {os.geteuid()} (planted?)")
            os.close(fd)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # held: the owner or its guardian lives
        try:
            now = os.stat(path, follow_symlinks=False)
        except OSError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            return None  # another sweeper finished with it meanwhile
        return fd
    except OSError:
        with contextlib.suppress(OSError):
            os.close(fd)
        return None


def release_owner(tempdir: str, tag: str, fd: int) -> None:
    """Unlink the lock file of `tag` (still the one `fd` holds) and close `fd`: last step."""
    path = lock_path(tempdir, tag)
    try:
        st = os.fstat(fd)
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def tag_of_pid(pid: int) -> str | None:
    """The owner token of a live agent process, read from the lock file it holds open (for
    tools and tests; the library never trusts a pid for ownership)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        name = os.path.basename(target)
        if name.startswith(DIR_PREFIX) and name.endswith(LOCK_SUFFIX):
            token = name[len(DIR_PREFIX) : -len(LOCK_SUFFIX)]
            if is_token(token):
                return token
    return None


# -- files -----------------------------------------------------------------------------------

#: At most this many directory descriptors are open at once in `remove_tree`, at any depth.
MAX_TREE_FDS = 16


def remove_tree(path: str) -> bool:
    """Remove `path` and everything below it; never raises, never recurses (any depth).

    Descriptor-relative throughout (no path grows with the depth, no symlink is followed)
    and bounded: at most `MAX_TREE_FDS` directory descriptors are open at once, whatever the
    depth (a level whose descriptor was closed is reopened by name from the nearest open
    ancestor, never through `..`, and only if it is still the same directory). A directory
    whose mode forbids listing or unlinking is given 0700 first (through an `O_PATH`
    descriptor, so a symlink swapped in cannot redirect the chmod). Returns whether the
    path is gone.
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


class _Level:
    """One directory on `_remove_entry`'s path: its name, identity, descriptor (-1 while
    closed to stay in bounds) and the entries still to remove."""

    __slots__ = ("fd", "ident", "name", "pending")

    def __init__(self, name: str, fd: int) -> None:
        st = os.fstat(fd)
        self.name = name
        self.ident = (st.st_dev, st.st_ino)
        self.fd = fd
        self.pending = _list(fd)


def _remove_entry(top_fd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=top_fd)
        return
    fd = _open_dir(top_fd, name)
    if fd is None:
        return
    # An explicit stack of levels: depth costs memory, not recursion nor descriptors.
    stack: list[_Level] = [_Level(name, fd)]
    opened = [1]

    def fd_of(i: int) -> int | None:
        """The descriptor of stack[i] (top_fd for -1), reopened by name when closed."""
        if i < 0:
            return top_fd
        if stack[i].fd >= 0:
            return stack[i].fd
        j = i - 1
        while j >= 0 and stack[j].fd < 0:
            j -= 1
        cur = top_fd if j < 0 else stack[j].fd
        for k in range(j + 1, i + 1):
            nxt = _open_dir(cur, stack[k].name)
            if cur != top_fd and (j < 0 or cur != stack[j].fd):
                os.close(cur)
            if nxt is None:
                return None
            st = os.fstat(nxt)
            if (st.st_dev, st.st_ino) != stack[k].ident:
                os.close(nxt)  # swapped meanwhile: not the directory we were removing
                return None
            cur = nxt
        stack[i].fd = cur
        opened[0] += 1
        return cur

    def bound() -> None:
        for level in stack[:-2]:
            if opened[0] <= MAX_TREE_FDS - 2:  # room for fd_of's walk and the next child
                return
            if level.fd >= 0:
                os.close(level.fd)
                level.fd = -1
                opened[0] -= 1

    while stack:
        level = stack[-1]
        own = fd_of(len(stack) - 1)
        if own is None:
            stack.pop()  # gone or swapped: leave it
            continue
        if not level.pending:
            stack.pop()
            os.close(own)
            opened[0] -= 1
            up = fd_of(len(stack) - 1)
            if up is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(level.name, dir_fd=up)
            continue
        entry = level.pending.pop()
        try:
            st = os.stat(entry, dir_fd=own, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            child = _open_dir(own, entry)
            if child is not None:
                try:
                    stack.append(_Level(entry, child))
                except OSError:
                    os.close(child)
                    continue
                opened[0] += 1
                bound()
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


def _own_dir_at(base_fd: int, name: str) -> int | None:
    """A descriptor of the directory `name` in `base_fd` if it is a real directory (not a
    link) owned by this uid; else None."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base_fd
        )
    except OSError:
        return None
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def owned_names(
    folder: str, tag: str | None = None, log: Log | None = None
) -> list[tuple[str, str]]:
    """(name, owner token) of the directories in `folder` named for an owner (`tag`, or all)
    that are real directories of this uid; a lookalike (a link, a file, another uid's) is
    skipped, with one log line."""
    out: list[tuple[str, str]] = []
    try:
        base = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return out
    try:
        for name in os.listdir(base):
            owner = owner_of_name(name)
            if owner is None or (tag is not None and owner != tag):
                continue
            fd = _own_dir_at(base, name)
            if fd is None:
                if log is not None:
                    log(
                        f"sweep skipped {os.path.join(folder, name)}: not a directory of uid "
                        f"{os.geteuid()} (a link, a file or another user's: planted?)"
                    )
                continue
            os.close(fd)
            out.append((name, owner))
    except OSError:
        pass
    finally:
        os.close(base)
    return out


def owned_dirs(
    tempdir: str, tag: str | None = None, log: Log | None = None
) -> list[tuple[str, str]]:
    """(path, owner token) of the control directories in `tempdir` (of `tag`, or all)."""
    return [(os.path.join(tempdir, n), o) for n, o in owned_names(tempdir, tag, log)]


# -- processes and groups ----------------------------------------------------------------------


def _launched_by(entry: int, marker: bytes, control: bytes) -> bool:
    """Whether process `entry` carries the owner mark in its initial environment, or is a
    `firejail` whose command line names one of the owner's control directories.

    A set-user-ID `firejail` run by a normal user cannot be read in /proc/<pid>/environ
    (nor the sandbox it starts: neither is dumpable), its parent-death signal is cleared by
    the exec, and it can still be signalled by that user (its real uid): its command line,
    which this agent wrote and which names the control directory, is what finds it."""
    try:
        with open(f"/proc/{entry}/environ", "rb") as fh:
            if (b"\0" + fh.read()).find(b"\0" + marker) >= 0:
                return True
    except OSError:
        pass
    try:
        with open(f"/proc/{entry}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    return os.path.basename(argv[0]) == b"firejail" and any(control in a for a in argv[1:])


def kill_marked(tag: str) -> int:
    """SIGKILL every process this pid namespace shows that this owner launched (its token,
    random, in the initial environment; or a `firejail` naming its control directory);
    how many."""
    if not is_token(tag):
        return 0
    marker = f"{OWNER_ENV}={tag}".encode() + b"\0"
    control = f"/{DIR_PREFIX}{tag}-".encode()
    me = os.getpid()
    killed = 0
    for _ in range(20):  # a marked process may fork while we scan
        found = 0
        for entry in _pids():
            if entry == me:
                continue
            if _launched_by(entry, marker, control):
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
        return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) > 0]
    except OSError:
        return []


def _members(group_fd: int) -> list[int]:
    try:
        fd = os.open("cgroup.procs", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=group_fd)
    except OSError:
        return []
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
    except OSError:
        return []
    finally:
        os.close(fd)
    return [int(w) for w in data.split() if w.isdigit()]


def _kill_member(group_fd: int, pid: int) -> None:
    """SIGKILL `pid` only if it is a process this namespace sees and, once pinned by a
    pidfd, still a member of the group (a pid freed and reused meanwhile is not signalled)."""
    if pid <= 0:
        return  # 0: a member in a pid namespace this one cannot see
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if pid in _members(group_fd):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def end_group(base: str, name: str, log: Log | None = None, timeout: float = 2.0) -> bool:
    """End every process in the cgroup `base/name` and remove it; whether it went.

    Only for a group whose owner is proven dead or is this process. Opened without following
    links and only when it is this uid's. `cgroup.kill` where there is one (it reaches
    members in every pid namespace); else each member this namespace can see, by pidfd.
    """
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = _own_dir_at(base_fd, name)
        if fd is None:
            if log is not None and os.path.lexists(os.path.join(base, name)):
                log(f"sweep skipped {os.path.join(base, name)}: not a group of uid {os.geteuid()}")
            return not os.path.lexists(os.path.join(base, name))
        try:
            with contextlib.suppress(OSError):
                kill = os.open("cgroup.kill", os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    os.write(kill, b"1")
                finally:
                    os.close(kill)
            deadline = time.monotonic() + timeout
            while True:
                for member in _members(fd):
                    _kill_member(fd, member)
                try:
                    os.rmdir(name, dir_fd=base_fd)
                    return True
                except FileNotFoundError:
                    return True
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                        if log is not None:
                            where = os.path.join(base, name)
                            log(f"could not remove the group {where} ({exc.strerror})")
                        return False
                time.sleep(0.01)
        finally:
            os.close(fd)
    finally:
        os.close(base_fd)


def clean_owner(tag: str, bases: list[str], tempdir: str, log: Log | None = None) -> bool:
    """End every process and remove every group and directory of the owner `tag`; whether
    all of it went (a group whose members this pid namespace cannot see, with no
    `cgroup.kill`, stays: the lock file is then kept for a sweeper that can).

    Only for this process's own token, or one whose lock `claim_owner` took.
    """
    if not is_token(tag):
        return True
    for base in bases:
        for name, _owner in owned_names(base, tag):
            end_group(base, name, log)
    kill_marked(tag)
    done = True
    for base in bases:  # anything a marked process placed meanwhile
        for name, _owner in owned_names(base, tag):
            done = end_group(base, name, log) and done
    for path, _owner in owned_dirs(tempdir, tag):
        done = remove_tree(path) and done
    return done


def sweep(bases: list[str], tempdir: str, *, skip: str = "", log: Log | None = None) -> int:
    """Clean what owners proven dead left behind; how many owners were cleaned.

    An owner is dead only when this process takes its lock (`claim_owner`); names whose lock
    is held, or missing here, or planted, are left alone.
    """
    owners = {owner for _name, owner in owned_dirs(tempdir, log=log)}
    for base in bases:
        owners |= {owner for _name, owner in owned_names(base, log=log)}
    cleaned = 0
    for owner in sorted(owners):
        if owner == skip:
            continue
        fd = claim_owner(tempdir, owner, log)
        if fd is None:
            continue
        done = False
        try:
            done = clean_owner(owner, bases, tempdir, log)
        finally:
            if done:
                release_owner(tempdir, owner, fd)
            else:
                os.close(fd)  # the lock file stays: the next sweeper tries again
        cleaned += 1
    return cleaned


# -- the guardian --------------------------------------------------------------------------------


def main() -> None:
    """argv: pipe fd, lock fd, owner token, temp dir, cgroup hierarchy bases..."""
    fd, lock_fd, tag, tempdir, *bases = sys.argv[1:]
    with contextlib.suppress(OSError):
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        sweep(bases, tempdir, skip=tag, log=_stderr_log)
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
    if told != CLEANED and clean_owner(tag, bases, tempdir, _stderr_log):
        release_owner(tempdir, tag, int(lock_fd))
    # Else the agent ended normally, cleaned up after itself at its exit with nothing in
    # flight, removed its lock file and said so last (`_host/lifecycle.py`): nothing is
    # left to look for. The lock is released as this process exits.


if __name__ == "__main__":
    main()
