"""Files the host writes (the operator's refusal log): opened without following a link, and
never where a worker can write.

A worker can write its scratch directory (inside the host's control directories,
`agent-sandbox-*` under the temporary directory) and the paths its policy's
`files.write` grants. A file the host writes in such a place could be a link the worker
planted, sending the host's write anywhere the host may write. So `open_append`:

1. refuses a path whose directory (links resolved) lies under a worker-writable path;
2. walks that directory from `/` one component at a time with `O_NOFOLLOW`, so no
   component can be swapped for a link between the check and the open;
3. opens the file itself with `O_NOFOLLOW | O_NONBLOCK` (a planted FIFO cannot block the
   host) and keeps it only when it is a regular file with one link (a planted hard link
   to another file is refused).
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable

__all__ = ["HostFileRefused", "create_new", "open_append", "read_regular", "worker_writable"]


class HostFileRefused(OSError):
    """The host will not write this file (a link, not a regular file, or worker-writable)."""


def worker_writable(policy: object | None) -> list[str]:
    """The directories a worker under `policy` may write (the policy's write grants' fixed
    leading paths); the control directories holding scratch are always included."""
    from agent_sandbox._host import guardian
    from agent_sandbox.policies._paths import expand_entry, static_prefix

    out = [os.path.join(tempfile.gettempdir(), guardian.DIR_PREFIX + "*")]
    files = getattr(policy, "files", None)
    for entry in getattr(files, "write", ()) or ():
        if str(entry).startswith("$SCRATCH"):
            continue  # inside the control directory, above
        out.append(static_prefix(expand_entry(str(entry))))
    return out


def _under(path: str, roots: Iterable[str]) -> str | None:
    for root in roots:
        if root.endswith("*"):
            base, prefix = os.path.split(root[:-1])
            base = os.path.realpath(base)
            rel = os.path.relpath(path, base)
            if not rel.startswith("..") and rel.split(os.sep, 1)[0].startswith(prefix):
                return root
            continue
        real = os.path.realpath(root)
        if path == real or path.startswith(real.rstrip("/") + "/"):
            return root
    return None


def _walk(directory: str) -> int:
    """A descriptor of `directory` (absolute, links resolved), opened component by
    component without following any link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    try:
        for part in [p for p in directory.split("/") if p]:
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str, *, writable: Iterable[str] = (), mode: int = 0o600) -> int:
    """A descriptor appending to `path` (created with `mode`); HostFileRefused when the
    file is a link, not a regular file, hard-linked elsewhere, or in a worker-writable
    directory (see the module docstring)."""
    parent, name = os.path.split(os.path.abspath(path))
    if not name:
        raise HostFileRefused(f"{path!r} names a directory, not a file")
    real_parent = os.path.realpath(parent)
    root = _under(real_parent, writable)
    if root is not None:
        raise HostFileRefused(
            f"{path!r} is where a worker can write ({root}); the host writes its files "
            "only outside every worker's reach"
        )
    dfd = _walk(real_parent)
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(name, flags | os.O_CLOEXEC, mode, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (40, 6):  # ELOOP (a link), ENXIO (a FIFO with no reader)
                raise HostFileRefused(f"{path!r} is a link or a FIFO: not written") from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise HostFileRefused(f"{path!r} is not a regular file with one link: not written")
    os.set_blocking(fd, True)
    return fd


def create_new(directory: str, name: str, *, mode: int = 0o600) -> int:
    """A descriptor writing a new file `name` in `directory` (a control directory the host
    just made): the directory walked without following a link (its parent's path is
    resolved first), the file created with
    `O_CREAT | O_EXCL | O_NOFOLLOW`, so anything already there (a link, a FIFO, a file) is
    refused (HostFileRefused), never written through or truncated."""
    if not name or "/" in name or name in (".", ".."):
        raise HostFileRefused(f"{name!r} is not a file name")
    # The directory's parent is resolved (the system's temporary directory may be a link);
    # the directory itself, which the host just made, must not be one.
    parent, base = os.path.split(os.path.abspath(directory).rstrip("/"))
    dfd = _walk(os.path.join(os.path.realpath(parent), base))
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(name, flags, mode, dir_fd=dfd)
        except FileExistsError:
            raise HostFileRefused(
                f"{os.path.join(directory, name)!r} already exists (a planted file or link): "
                "not written"
            ) from None
    finally:
        os.close(dfd)


def read_regular(path: str, limit: int, *, own: bool = False) -> bytes:
    """At most `limit` bytes of `path`, a file a worker or another process may have planted
    something at: opened without following a link and without blocking on a FIFO, read only
    when it is a regular file (and, with `own`, one of this process's user).
    FileNotFoundError when there is nothing; HostFileRefused for anything else there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise HostFileRefused(f"{path!r} was not followed ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (own and st.st_uid != os.geteuid()):
            raise HostFileRefused(
                f"{path!r} is not a regular file" + (" of this process's user" if own else "")
            )
        return os.read(fd, limit)
    finally:
        os.close(fd)
