"""The host's side of the session files API: checks, chunking, and reading the worker's answers.

`Session.put_file` / `get_file` / `list_files` / `remove_file` (and their async twins) land
here with the session's call lock held. The host never opens the worker's scratch directory:
each operation is a request over the worker's channel (`POST /files`, served by
`agent_sandbox._worker.files` between calls), so no name the code could have planted in
scratch (a link, a swapped directory) is ever followed by the host, and the same path works
under every local provider (a host directory, a tmpfs in the worker's mount namespace, the
QEMU guest's file system).

Checked here, before the worker is asked: the name (one component, no `..`, `/` or NUL, not
a hidden name of `files.hide`), the size (`limits.transfer_mb`), and a host file that changes
while it is read (its device, inode, size and modification time before and after, and the
byte count). The worker's replies are data: every field is type-checked and bounded, a
download's identity must be the same before and after every chunk, and its length must be
what the worker announced. A refusal is a `FileTransferRefused` carrying its `Denial`.
"""

from __future__ import annotations

import base64
import dataclasses
import fnmatch
import os
import secrets
import stat
import time
from typing import TYPE_CHECKING, Any

from agent_sandbox._denial import Denial
from agent_sandbox._errors import FileTransferRefused, TransportError, WorkerError
from agent_sandbox._wire import name_problem

if TYPE_CHECKING:
    from agent_sandbox._host.process import WorkerProcess
    from agent_sandbox.policies import Policy

__all__ = ["FileInfo", "get", "listing", "put", "remove", "with_output_files"]

#: Bytes per request (their base64 text stays well inside the worker's request bound).
CHUNK = 4 * 1024 * 1024
#: The rules a worker's refusal may carry (anything else is reported as `files.transfer`).
_WORKER_RULES = frozenset({"files.transfer", "limits.scratch", "limits.file-size"})
_MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One entry of a session's scratch directory: `kind` is file, link, dir or other."""

    name: str
    size: int
    mtime_ns: int
    kind: str = "file"


def _refused(
    policy: Policy, rule: str, action: str, target: str, detail: str, hint: str = ""
) -> FileTransferRefused:
    denial = Denial(rule, action, target, policy=policy.name, detail=detail, hint=hint)
    return FileTransferRefused(denial)


def check_name(policy: Policy, name: object, action: str) -> str:
    """`name` if it may be a file of scratch; else `FileTransferRefused`."""
    problem = name_problem(name)
    if problem:
        shown = name if isinstance(name, str) else repr(name)
        raise _refused(policy, "files.transfer", action, shown[:300], problem)
    assert isinstance(name, str)
    for pattern in policy.files.hide:
        if "/" not in pattern and fnmatch.fnmatchcase(name, pattern):
            raise _refused(
                policy,
                "files.hidden",
                action,
                name,
                f"the name matches the hidden pattern {pattern!r} (`files.hide`): the code "
                "could not see it",
                "choose another name, or remove the pattern from `files.hide`",
            )
    return name


def _limit(policy: Policy) -> int:
    return int(policy.limits.transfer_mb) * _MB


def _too_large(policy: Policy, action: str, name: str, size: int) -> FileTransferRefused:
    return _refused(
        policy,
        "limits.transfer",
        action,
        name,
        f"{size} bytes, more than limits.transfer_mb = {policy.limits.transfer_mb}",
        f"[limits]\ntransfer_mb = {size // _MB + 1}",
    )


def read_host_file(policy: Policy, source: str | os.PathLike[str], name: str) -> bytes:
    """The bytes of a host file, read once and bounded; refused if it changed while read."""
    limit = _limit(policy)
    fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise _refused(
                policy,
                "files.transfer",
                "put",
                name,
                f"{os.fspath(source)!r} is not a regular file",
            )
        if before.st_size > limit:
            raise _too_large(policy, "put", name, before.st_size)
        chunks = []
        total = 0
        while True:
            data = os.read(fd, min(CHUNK, limit + 1 - total))
            if not data:
                break
            chunks.append(data)
            total += len(data)
            if total > limit:
                raise _too_large(policy, "put", name, total)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if _identity(before) != _identity(after) or total != before.st_size:
        raise _refused(
            policy,
            "files.transfer",
            "put",
            name,
            f"{os.fspath(source)!r} changed while it was read ({before.st_size} bytes before, "
            f"{total} read, {after.st_size} after); nothing was written",
            "put it again once it no longer changes",
        )
    return b"".join(chunks)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _ask(worker: WorkerProcess, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    reply = worker.file_request(payload, timeout)
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise TransportError("the worker's files reply is malformed")
    return reply


def _worker_refusal(
    policy: Policy, reply: dict[str, Any], action: str, name: str
) -> FileTransferRefused:
    rule = reply.get("rule")
    detail = reply.get("detail")
    return _refused(
        policy,
        rule if rule in _WORKER_RULES else "files.transfer",
        action,
        name,
        str(detail)[:500] if isinstance(detail, str) else "refused by the worker",
    )


def put(
    worker: WorkerProcess,
    policy: Policy,
    name: str,
    data: bytes,
    *,
    overwrite: bool,
    timeout: float,
) -> FileInfo:
    size = len(data)
    if size > _limit(policy):
        raise _too_large(policy, "put", name, size)
    upload = secrets.token_hex(8)
    offset = 0
    while True:
        chunk = data[offset : offset + CHUNK]
        last = offset + len(chunk) >= size
        payload = {
            "op": "put",
            "name": name,
            "upload": upload,
            "size": size,
            "data": base64.b64encode(chunk).decode("ascii"),
            "last": last,
            "overwrite": overwrite,
        }
        try:
            reply = _ask(worker, payload, timeout)
        except BaseException:
            _abort(worker, upload)
            raise
        if not reply["ok"]:
            raise _worker_refusal(policy, reply, "put", name)
        offset += len(chunk)
        if last:
            return FileInfo(name, size, _int(reply.get("mtime_ns")))


def _abort(worker: WorkerProcess, upload: str) -> None:
    try:
        worker.file_request({"op": "abort", "upload": upload}, 1.0)
    except Exception:
        pass  # a worker that does not answer is discarded; its scratch goes with it


def get(worker: WorkerProcess, policy: Policy, name: str, *, timeout: float) -> bytes:
    limit = _limit(policy)
    chunks: list[bytes] = []
    offset = 0
    first: list[Any] | None = None
    while True:
        reply = _ask(
            worker, {"op": "get", "name": name, "offset": offset, "length": CHUNK}, timeout
        )
        if not reply["ok"]:
            raise _worker_refusal(policy, reply, "get", name)
        before, after, text = reply.get("before"), reply.get("after"), reply.get("data")
        if not (_valid_identity(before) and _valid_identity(after) and isinstance(text, str)):
            raise TransportError("the worker's files reply is malformed")
        assert isinstance(before, list) and isinstance(after, list)
        size = before[2]
        if first is None:
            first = before
            if size > limit:
                raise _too_large(policy, "get", name, size)
        if before != first or after != first:
            raise _refused(
                policy,
                "files.transfer",
                "get",
                name,
                "the file changed while it was read (its size, time or inode moved); "
                "nothing was returned",
                "get it again once the code has stopped writing it",
            )
        try:
            chunk = base64.b64decode(text, validate=True)
        except ValueError:
            raise TransportError("the worker's files reply is malformed") from None
        if len(chunk) > CHUNK or offset + len(chunk) > size:
            raise TransportError("the worker sent more bytes than the file has")
        chunks.append(chunk)
        offset += len(chunk)
        if offset >= size:
            return b"".join(chunks)
        if not chunk:
            raise _refused(
                policy, "files.transfer", "get", name, "the file ended early: it changed while read"
            )


def listing(worker: WorkerProcess, policy: Policy, *, timeout: float) -> list[FileInfo]:
    reply = _ask(worker, {"op": "list"}, timeout)
    if not reply["ok"]:
        raise _worker_refusal(policy, reply, "list", "")
    entries = reply.get("files")
    if not isinstance(entries, list) or len(entries) > 10_000:
        raise TransportError("the worker's files reply is malformed")
    out = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise TransportError("the worker's files reply is malformed")
        name, kind = entry.get("name"), entry.get("kind")
        if name_problem(name) or kind not in ("file", "link", "dir", "other"):
            continue  # not a name the API can address: not listed
        assert isinstance(name, str)
        out.append(FileInfo(name, _int(entry.get("size")), _int(entry.get("mtime_ns")), kind))
    return sorted(out, key=lambda info: info.name)


def remove(worker: WorkerProcess, policy: Policy, name: str, *, timeout: float) -> None:
    reply = _ask(worker, {"op": "remove", "name": name}, timeout)
    if not reply["ok"]:
        raise _worker_refusal(policy, reply, "remove", name)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _valid_identity(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 5
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )


def deadline(timeout: float) -> float:
    return time.monotonic() + timeout


def unresponsive(what: str) -> WorkerError:
    return WorkerError(f"the worker did not answer the files request ({what}); it was discarded")


def with_output_files(worker: Any, policy: Policy, result: Any) -> Any:
    """`result` with `output_files`: the bytes of each file the call wrote or changed in
    scratch (`result.files`), read back over the files channel (`get`), together within
    `limits.result_bytes` (the bound a call's value and images have); each file left out
    says why. A call that wrote no file is returned as it is, with no request."""
    if not result.files:
        return result
    import dataclasses

    from agent_sandbox._host.result import OutputFile
    from agent_sandbox._render import quote

    budget = int(policy.limits.result_bytes)
    images = {image.name for image in result.images}
    timeout = float(policy.limits.wall_seconds)
    out: list[OutputFile] = []
    cap = budget

    def over(size: int, room: int, name: str) -> str:
        return (
            f"{size} bytes, more than the {room} bytes left for the call's files of "
            f"limits.result_bytes = {cap} (in a session, Session.get_file({quote(name)}) "
            "fetches it while the interpreter lives)"
        )

    for entry in result.files:
        name, size = entry["name"], entry["size"]

        def left(why: str, name: str = name, size: int = size) -> None:
            out.append(OutputFile(name, size, reason=why))

        if name in images:
            left("returned as an image (result.images)")
        elif getattr(worker, "dead", True) or not hasattr(worker, "file_request"):
            left(
                "the worker ended with the call, and its scratch with it"
                if getattr(worker, "dead", True)
                else "a remote worker's scratch is on another machine"
            )
        elif name_problem(name):
            left("its name cannot be asked for again (control characters, or not one name)")
        elif size > budget:
            left(over(size, budget, name))
        else:
            try:
                data = get(worker, policy, check_name(policy, name, "get"), timeout=timeout)
            except FileTransferRefused as exc:
                left(f"reading it back was refused: {exc.denial.detail}")
                continue
            except (WorkerError, TransportError) as exc:
                left(f"reading it back failed: {exc}")
                continue
            if len(data) > budget:
                left(over(len(data), budget, name))
                continue
            budget -= len(data)
            out.append(OutputFile(name, len(data), data))
    return dataclasses.replace(result, output_files=tuple(out))
