"""The worker's side of the session files API: put, get, list and remove in its scratch.

The host never opens the worker's scratch itself: under the namespace providers scratch is a
tmpfs in the worker's own mount namespace, in the QEMU guest it is the guest's, and where it
is a host directory the worker (and so the code) can write it at any moment. Every transfer
is a request over the worker's channel, served between calls (the session's lock serializes
them with calls), and the worker does the file work under its own kernel bounds: nothing the
host does follows a name the code could have planted.

Every name is one path component, opened relative to a descriptor of the scratch directory
with `O_NOFOLLOW`; an upload is written to a fresh `O_EXCL` file and linked into place (a
name that exists is refused unless the host asks to replace it, and a replace renames over
the entry, never through it). A download reports the file's identity (device, inode, size,
modification time) before and after each chunk, so the host detects a file that changed
while it was read. The host checks names and sizes before it asks; the worker checks them
again here, and its answers are data to the host (`agent_sandbox._host.files`).

Standard library only; runs unarmed (between calls), in the worker's server thread.
"""

from __future__ import annotations

import base64
import os
import secrets
import stat

from agent_sandbox._wire import STAGING_PREFIX, name_problem

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["FileOps"]

#: At most this many entries are listed (and counted towards the scratch quota).
MAX_LIST = 10_000


class _Refused(Exception):
    def __init__(self, rule: str, action: str, target: str, detail: str) -> None:
        super().__init__(detail)
        self.reply = {"ok": False, "rule": rule, "action": action, "target": target}
        self.reply["detail"] = detail


class FileOps:
    """The scratch operations of one worker (one instance per server)."""

    def __init__(self, scratch: str, scratch_bytes: int, on_change: Any = None) -> None:
        self.scratch = scratch
        self.scratch_bytes = scratch_bytes
        #: Called with (name, signature or None) after a put or a remove, so the next
        #: call does not report an upload as a file the code produced.
        self.on_change = on_change
        #: Uploads in progress: id -> (descriptor, staging name, expected size, written).
        self._uploads: dict[str, list[Any]] = {}

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "list":
                return self._list()
            if op == "put":
                return self._put(request)
            if op == "get":
                return self._get(request)
            if op == "remove":
                return self._remove(request)
            if op == "abort":
                self._abort(str(request.get("upload", "")))
                return {"ok": True}
        except _Refused as refused:
            return refused.reply
        return {"ok": False, "rule": "files.transfer", "action": str(op)[:20], "target": "",
                "detail": "unknown operation"}  # fmt: skip

    # -- helpers -------------------------------------------------------------------------

    def _dir(self) -> int:
        try:
            fd = os.open(self.scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _Refused("files.transfer", "open", "", f"the scratch directory: {exc}") from None
        return fd

    @staticmethod
    def _name(request: dict[str, Any], action: str) -> str:
        name = request.get("name")
        problem = name_problem(name)
        if problem:
            raise _Refused("files.transfer", action, str(name)[:300], problem)
        return name  # type: ignore[return-value]

    def _entries(self, dfd: int) -> list[tuple[str, os.stat_result]]:
        out: list[tuple[str, os.stat_result]] = []
        with os.scandir(dfd) as it:
            for entry in it:
                if len(out) >= MAX_LIST:
                    break
                try:
                    out.append((entry.name, entry.stat(follow_symlinks=False)))
                except OSError:
                    continue
        return out

    # -- operations ----------------------------------------------------------------------

    def _list(self) -> dict[str, Any]:
        dfd = self._dir()
        try:
            files = []
            used = 0
            for name, st in self._entries(dfd):
                used += st.st_blocks * 512
                if name.startswith(STAGING_PREFIX):
                    continue
                kind = (
                    "file"
                    if stat.S_ISREG(st.st_mode)
                    else "link"
                    if stat.S_ISLNK(st.st_mode)
                    else "dir"
                    if stat.S_ISDIR(st.st_mode)
                    else "other"
                )
                files.append(
                    {"name": name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "kind": kind}
                )
            return {"ok": True, "files": files, "used": used}
        finally:
            os.close(dfd)

    def _used(self, dfd: int) -> int:
        return sum(st.st_blocks * 512 for _name, st in self._entries(dfd))

    def _put(self, request: dict[str, Any]) -> dict[str, Any]:
        name = self._name(request, "put")
        upload = request.get("upload")
        if not isinstance(upload, str) or not upload.isalnum() or len(upload) > 64:
            raise _Refused("files.transfer", "put", name, "a malformed upload id")
        try:
            data = base64.b64decode(request.get("data", ""), validate=True)
        except (ValueError, TypeError):
            raise _Refused("files.transfer", "put", name, "the chunk is not base64") from None
        dfd = self._dir()
        try:
            state = self._uploads.get(upload)
            if state is None:
                size = request.get("size")
                if not isinstance(size, int) or size < 0:
                    raise _Refused("files.transfer", "put", name, "a malformed size")
                if self._used(dfd) + size > self.scratch_bytes:
                    raise _Refused(
                        "limits.scratch",
                        "put",
                        name,
                        f"{size} bytes do not fit in what is left of the scratch directory "
                        f"({self.scratch_bytes} bytes in all)",
                    )
                staging = STAGING_PREFIX + secrets.token_hex(8)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    fd = os.open(staging, flags, 0o600, dir_fd=dfd)
                except OSError as exc:
                    raise _Refused("files.transfer", "put", name, f"cannot create: {exc}") from None
                state = [fd, staging, size, 0]
                self._uploads[upload] = state
            fd, staging, size, written = state
            if written + len(data) > size:
                self._abort(upload)
                raise _Refused("files.transfer", "put", name, "more bytes than announced")
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                self._abort(upload)
                # ENOSPC/EDQUOT: the scratch tmpfs is full; EFBIG: RLIMIT_FSIZE (file_size_mb).
                rule = {28: "limits.scratch", 122: "limits.scratch", 27: "limits.file-size"}.get(
                    exc.errno or 0, "files.transfer"
                )
                raise _Refused(rule, "put", name, f"cannot write: {exc.strerror}") from None
            state[3] = written + len(data)
            if not request.get("last"):
                return {"ok": True, "written": state[3]}
            if state[3] != size:
                self._abort(upload)
                raise _Refused("files.transfer", "put", name, "fewer bytes than announced")
            return self._place(upload, dfd, name, bool(request.get("overwrite")))
        finally:
            os.close(dfd)

    def _place(self, upload: str, dfd: int, name: str, overwrite: bool) -> dict[str, Any]:
        fd, staging, _size, _written = self._uploads.pop(upload)
        try:
            st = os.fstat(fd)
            if overwrite:
                try:
                    old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    old = None
                if old is not None and stat.S_ISDIR(old.st_mode):
                    raise _Refused("files.transfer", "put", name, "a directory has this name")
                # A rename replaces the entry itself: a link there is replaced, not followed.
                os.rename(staging, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                try:
                    os.link(staging, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    raise _Refused(
                        "files.transfer",
                        "put",
                        name,
                        "a file of this name exists in scratch; pass overwrite=True to replace it",
                    ) from None
                os.unlink(staging, dir_fd=dfd)
        except _Refused:
            _unlink_quietly(staging, dfd)
            raise
        except OSError as exc:
            _unlink_quietly(staging, dfd)
            raise _Refused("files.transfer", "put", name, f"cannot place: {exc.strerror}") from None
        finally:
            os.close(fd)
        if self.on_change is not None:
            self.on_change(name, (st.st_mtime_ns, st.st_size))
        return {"ok": True, "size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def _abort(self, upload: str) -> None:
        state = self._uploads.pop(upload, None)
        if state is None:
            return
        fd, staging = state[0], state[1]
        os.close(fd)
        try:
            dfd = self._dir()
        except _Refused:
            return
        try:
            _unlink_quietly(staging, dfd)
        finally:
            os.close(dfd)

    def _get(self, request: dict[str, Any]) -> dict[str, Any]:
        name = self._name(request, "get")
        offset, length = request.get("offset"), request.get("length")
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            raise _Refused("files.transfer", "get", name, "a malformed range")
        dfd = self._dir()
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, dir_fd=dfd)
            except FileNotFoundError:
                raise _Refused("files.transfer", "get", name, "no such file in scratch") from None
            except OSError as exc:
                if exc.errno == 40:  # ELOOP: the name is a symbolic link
                    raise _Refused(
                        "files.transfer", "get", name, "a symbolic link; links are not followed"
                    ) from None
                raise _Refused("files.transfer", "get", name, f"cannot open: {exc}") from None
        finally:
            os.close(dfd)
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise _Refused("files.transfer", "get", name, "not a regular file")
            data = os.pread(fd, length, offset)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        return {
            "ok": True,
            "before": _identity(before),
            "after": _identity(after),
            "data": base64.b64encode(data).decode("ascii"),
        }

    def _remove(self, request: dict[str, Any]) -> dict[str, Any]:
        name = self._name(request, "remove")
        dfd = self._dir()
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise _Refused(
                    "files.transfer", "remove", name, "no such file in scratch"
                ) from None
            if stat.S_ISDIR(st.st_mode):
                raise _Refused("files.transfer", "remove", name, "a directory, not a file")
            try:
                os.unlink(name, dir_fd=dfd)  # removes a link itself, never what it names
            except OSError as exc:
                raise _Refused("files.transfer", "remove", name, f"cannot remove: {exc}") from None
        finally:
            os.close(dfd)
        if self.on_change is not None:
            self.on_change(name, None)
        return {"ok": True}


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _unlink_quietly(name: str, dfd: int) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass
