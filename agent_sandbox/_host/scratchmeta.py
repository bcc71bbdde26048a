"""Metadata changes in scratch under the landlock provider, made by the host.

The landlock provider's seccomp filter refuses every change of a file's mode, owner, times
or extended attributes (`providers/_seccomp.py`, `metadata_rules`): Landlock has no right
for them and seccomp cannot see which file a call names, so the worker's kernel layer cannot
tell scratch (the code's own writable area) from a read grant. The host can: it knows where
scratch is (its own directory, or the worker's tmpfs over it, reached through
`/proc/<worker>/root`, as the host reads the worker's memory). For `os.chmod`, `os.utime`
and `os.chown` of a path the file guard judged to be in scratch, the worker asks the host (a
`host_call` request on the call's connection, `guards/_files.py`), and the host does it here:

* the path is opened beneath the host's own descriptor of the scratch directory with
  `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`:
  the kernel refuses `..` out of it, any symbolic link (a planted link to a read-granted
  file), and another mount; nothing the worker says moves the change outside scratch;
* only a regular file or a directory, only the permission bits (`mode & 0o777`: no setuid,
  setgid or sticky bit, which the host's user would be setting), only times, and a chown
  only to the owner and group the file has (a no-op: tarfile run as root asks for it);
* the worker is the code's side: it can ask for nothing a write grant of scratch does not
  allow already. Native code's own system calls stay refused by seccomp.

Without `openat2` (Linux before 5.6) every request is refused, as before.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
from typing import Any

__all__ = ["metadata_handler"]

_SYS_OPENAT2 = 437  # the same number on x86-64 and aarch64
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE_IN_ROOT = 0x10
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_MAX_PATH = 4096
_libc: Any = None


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(dir_fd: int, path: str, *, in_root: bool = False) -> int:
    """An O_PATH descriptor of `path` beneath `dir_fd`, through no link and no other mount
    (raises OSError with the kernel's errno). `in_root`: `dir_fd` is a root (`path` may
    cross mounts below it, as scratch's tmpfs is one), still through no link."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    resolve = _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
    resolve |= _RESOLVE_IN_ROOT if in_root else _RESOLVE_BENEATH | _RESOLVE_NO_XDEV
    how = _OpenHow(_O_PATH | os.O_CLOEXEC, 0, resolve)
    fd = _libc.syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(dir_fd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def _request(data: Any) -> dict[str, Any] | None:
    """The metadata request inside a `host_call` event, or None when it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("request"), str):
        return None
    if len(data["request"]) > _MAX_PATH * 2:
        return None
    try:
        request = json.loads(data["request"])
    except ValueError:
        return None
    if not isinstance(request, dict) or set(request) != {"scratch_metadata"}:
        return None
    inner = request["scratch_metadata"]
    return inner if isinstance(inner, dict) else {}


def _valid(request: dict[str, Any]) -> str:
    """Why `request` is malformed ("" when it is well formed)."""
    op, path = request.get("op"), request.get("path")
    if op not in ("chmod", "utime", "chown") or not isinstance(path, str):
        return "a metadata request names chmod, chown or utime and a path"
    if not path or len(path) > _MAX_PATH or "\x00" in path or path.startswith("/"):
        return "a metadata request's path is relative to scratch"
    if op == "chmod":
        mode = request.get("mode")
        if type(mode) is not int or set(request) != {"op", "path", "mode"}:
            return "a chmod request carries a mode"
    elif op == "chown":
        if set(request) != {"op", "path", "uid", "gid"} or not all(
            type(request[k]) is int for k in ("uid", "gid")
        ):
            return "a chown request carries a uid and a gid"
    else:
        ns = request.get("ns")
        if set(request) != {"op", "path", "ns"} or not (
            ns is None
            or (
                isinstance(ns, list)
                and len(ns) == 2
                and all(type(v) is int and abs(v) < 1 << 62 for v in ns)
            )
        ):
            return "a utime request carries two times in nanoseconds, or none"
    return ""


def metadata_handler(scratch: str, then: Any = None, *, root: str = "/") -> Any:
    """A `host_call` handler that serves the worker's scratch metadata requests (see the
    module docstring) and passes every other request to `then` (the host tools' handler,
    or None: refused as no tools served). `scratch` is an absolute path seen from `root`
    (`/proc/<worker>/root` for a scratch in the worker's mount namespace)."""

    def handle(data: Any, remaining: float) -> dict[str, Any]:
        request = _request(data)
        if request is None:
            if then is None:
                return {
                    "ok": False,
                    "rule": "tools",
                    "detail": "no host tools are served in this call",
                    "hint": "call it through an agent framework's executor that serves its tools",
                }
            return then(data, remaining)  # type: ignore[no-any-return]
        problem = _valid(request)
        if problem:
            return {"ok": False, "error": problem}
        return serve(scratch, request, root=root)

    return handle


def serve(scratch: str, request: dict[str, Any], *, root: str = "/") -> dict[str, Any]:
    """Do one well-formed request beneath `scratch` (seen from `root`): `{"ok": True}`, or
    the errno the kernel (or the bounds above) gave, with a reason."""
    op, path = request["op"], request["path"]
    if op == "chmod" and request["mode"] & ~0o777:
        return {
            "ok": False,
            "errno": errno.EPERM,
            "reason": "only the permission bits (0o777) can be set in scratch; setuid, setgid "
            "and the sticky bit cannot",
        }
    try:
        # `root` may be `/proc/<pid>/root`, the worker's mount namespace: a magic link the
        # host follows itself. From there no link is followed, not even on the way to
        # scratch (a folder above it the code can write could be swapped for one).
        root_fd = os.open(root, _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            dir_fd = open_beneath(root_fd, scratch.lstrip("/") or ".", in_root=True)
        finally:
            os.close(root_fd)
        if not stat.S_ISDIR(os.fstat(dir_fd).st_mode):
            os.close(dir_fd)
            raise OSError(errno.ENOTDIR, "not a directory")
    except OSError as exc:
        return {"ok": False, "errno": errno.EPERM, "reason": f"scratch cannot be opened ({exc})"}
    try:
        try:
            fd = open_beneath(dir_fd, path)
        except OSError as exc:
            why = {
                errno.EXDEV: "it leads out of scratch (`..`, an absolute link or another mount)",
                errno.ELOOP: "a symbolic link is on its way (never followed here)",
                errno.ENOSYS: "this kernel has no openat2 (Linux 5.6 or later is needed)",
            }.get(exc.errno or 0, os.strerror(exc.errno or errno.EIO))
            return {"ok": False, "errno": exc.errno or errno.EIO, "reason": why}
        try:
            kind = os.fstat(fd).st_mode
            if not (stat.S_ISREG(kind) or stat.S_ISDIR(kind)):
                return {
                    "ok": False,
                    "errno": errno.EPERM,
                    "reason": "only a regular file or a directory in scratch",
                }
            if op == "chown":
                # Only the owner it has (tarfile run as root sets the archive's, the same
                # user's most of the time): giving a file away is not what a write grant
                # allows, and the host's user could give it to anyone.
                st = os.fstat(fd)
                if request["uid"] in (-1, st.st_uid) and request["gid"] in (-1, st.st_gid):
                    return {"ok": True}
                return {
                    "ok": False,
                    "errno": errno.EPERM,
                    "reason": "a file in scratch keeps its owner and group (only a chown to "
                    "the ones it has is served)",
                }
            target = f"/proc/self/fd/{fd}"
            try:
                if op == "chmod":
                    os.chmod(target, request["mode"])
                else:
                    ns = request["ns"]
                    if ns is None:
                        os.utime(target)  # now
                    else:
                        os.utime(target, ns=(ns[0], ns[1]))
            except OSError as exc:
                return {"ok": False, "errno": exc.errno or errno.EIO, "reason": exc.strerror}
            return {"ok": True}
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
