"""What `agent-sandbox run` writes to its output directory (`--out`, default the working
directory): the images and the scratch files the run produced.

Rules, for names a worker chose:

1. A name is written only as a *safe name*: one component of letters, digits, `.`, `_` and
   `-`, not starting with `.`; anything else is rewritten to one (each other character
   becomes `_`) and the original is shown quoted. A name holding control characters (the
   intake escaped them, so the original cannot be asked for again) is not returned.
2. A file is created inside the directory through its descriptor, never following a link,
   and never over an existing file unless `--force` (even then never through a link).
3. A scratch file's content is what the library's result carries (`RunResult.output_files`:
   read back over the files channel after the call, together within `limits.result_bytes`);
   a file the bound or the read left out is listed as not returned, with the reason.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
import stat
from typing import Any

__all__ = ["Output", "collect", "safe_name", "write_outputs"]

_SAFE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_ESCAPED = re.compile(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4})")


@dataclasses.dataclass
class Output:
    """One thing the run produced: its name as the worker gave it, and its bytes, or why
    it is not returned."""

    name: str
    kind: str  # "image" or "file"
    data: bytes | None = None
    reason: str = ""
    path: str = ""


def safe_name(name: str) -> str:
    """`name` as one safe file name (see the module docstring)."""
    if _SAFE.fullmatch(name):
        return name
    base = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "output"
    return base[:200]


def collect(result: Any, skip: set[str] | None = None) -> list[Output]:
    """The images of `result` (with their data) and its other scratch files (their bytes
    from `result.output_files`, or why each was not); names in `skip` (the run's `--in`
    files) are not outputs."""
    out: list[Output] = []
    seen = set(skip or ())
    for image in result.images:
        seen.add(image.name)
        try:
            data = base64.b64decode(image.data_base64, validate=True)
        except (binascii.Error, ValueError):
            out.append(Output(image.name, "image", reason="its data is not base64"))
            continue
        out.append(Output(image.name, "image", data))
    for notice in result.notices:
        if notice.startswith("image ") and " was not returned: " in notice:
            name_part, _, why = notice.partition(" was not returned: ")
            out.append(Output(name_part[6:].strip("'\""), "image", reason=why))
            seen.add(name_part[6:].strip("'\""))
    returned = {f.name: f for f in getattr(result, "output_files", ())}
    for entry in result.files:
        name, size = entry["name"], entry["size"]
        if name in seen:
            continue
        if _ESCAPED.search(name):
            out.append(Output(name, "file", reason="its name holds control characters"))
            continue
        got = returned.get(name)
        if got is not None and got.data is not None:
            out.append(Output(name, "file", got.data))
        else:
            why = got.reason if got is not None else f"{size} bytes, not read back"
            out.append(Output(name, "file", reason=why))
    return out


def write_outputs(outputs: list[Output], directory: str, *, force: bool) -> None:
    """Write each output that has data into `directory` (see the module docstring); set
    `path`, or `reason` when it was not written."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        for item in outputs:
            if item.data is not None:
                item.reason = f"the output directory cannot be opened ({exc.strerror})"
                item.data = None
        return
    try:
        used: set[str] = set()
        for item in outputs:
            if item.data is None:
                continue
            name = safe_name(item.name)
            stem, dot, ext = name.rpartition(".")
            n = 1
            while name in used:
                n += 1
                name = f"{stem}-{n}.{ext}" if dot else f"{ext}-{n}"
            used.add(name)
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            flags |= os.O_TRUNC if force else os.O_EXCL
            try:
                fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
            except FileExistsError:
                item.reason = f"{name} exists (use --force to replace it)"
                continue
            except OSError as exc:
                item.reason = f"{name} cannot be written ({exc.strerror})"
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    item.reason = f"{name} exists and is not a regular file"
                    continue
                view = memoryview(item.data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            item.path = os.path.join(directory, name)
    finally:
        os.close(dir_fd)
