"""The wire format shared by parent and worker: Server-Sent Events carrying JSON.

One event is `event: <kind>\\ndata: <json>\\n\\n`. Kinds: `start`, `stdout`, `stderr`,
`denial`, `counts`, `internal`, `image`, `files`, `notice`, `result`, `error`, `done`. The
worker writes events with `encode_event`; the host reads them with
`agent_sandbox._host.intake.framing` and judges them with `agent_sandbox._host.intake.events`.
Both apply the same budget of JSON values to an outcome (`value_budget`, `json_values`).

The typed records that cross before a worker serves (`BootConfig`, `WorkerSetup`, `Hello`,
`SetupChecks`) are in `agent_sandbox._wire_boot` (host to worker) and
`agent_sandbox._wire_records` (their base, and worker to host), re-exported here.

Standard library only: the worker imports it before arming.
"""

from __future__ import annotations

import json
import re

from agent_sandbox._wire_boot import (
    BootConfig,
    EgressRelay,
    EgressSetup,
    GrantPins,
    LandlockRuleset,
    LimitReport,
    ScratchTmpfs,
    SeccompProgram,
    WorkerSetup,
)
from agent_sandbox._wire_records import HELLO_BYTES, BootError, Hello, HelloError, SetupChecks

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "EVENT_KINDS",
    "HELLO_BYTES",
    "STAGING_PREFIX",
    "BootConfig",
    "BootError",
    "EgressRelay",
    "EgressSetup",
    "Event",
    "GrantPins",
    "Hello",
    "HelloError",
    "LandlockRuleset",
    "LimitReport",
    "ScratchTmpfs",
    "SeccompProgram",
    "SetupChecks",
    "encode_event",
    "json_values",
    "name_problem",
    "value_budget",
    "WorkerSetup",
]

#: The prefix of a session file upload's staging name in scratch (never a file's own name).
STAGING_PREFIX = ".agent-sandbox-upload-"
_NAME_BYTES = 255

EVENT_KINDS = frozenset(
    {
        "start",
        "stdout",
        "stderr",
        "denial",
        "counts",
        "image",
        "result",
        "error",
        "notice",
        "done",
        "files",
        # A request of the code to the host (a host tool's call), answered on the same
        # connection; never a part of the result (`_host/intake/transport.py`).
        "host_call",
    }
)

Event = tuple[str, "Any"]  # (a string: `typing` is not imported at run time)


#: One encoder for every event (`json.dumps` with these options builds one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_event(kind: str, data: Any) -> bytes:
    """Encode one event; the JSON is compact and on a single line (json never emits newlines)."""
    payload = _ENCODER.encode(data)
    # A lone surrogate (print('\ud800')) has no UTF-8 form; backslashreplace writes it as
    # the JSON escape `\ud800`, so it round-trips instead of failing the whole event.
    body = payload.encode("utf-8", "backslashreplace")
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


#: A JSON string, or an unterminated one up to the end. The closing quote is optional, so a
#: match never fails and `sub` never rescans: with it required, every `"` of `"\"\"\"...`
#: started a match that ran to the end and failed (quadratic: 2.7 s at 32 KB, hours at the
#: 4 MB cap). The quantifiers are possessive, so the engine keeps no backtracking state per
#: escape (286 MiB for one 4 MB string of escapes before, under 1 MiB now).
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)


def value_budget(result_bytes: int) -> int:
    """How many JSON values one `result` or `error` event may hold, from `limits.result_bytes`.

    Decoding JSON costs more memory than its text (`[{},{}]` is 3 bytes per dict of 64):
    a budget of one value per 32 bytes keeps a decoded result near twice `result_bytes`
    (text and values), whatever its shape. Worker and host apply the same budget.
    """
    return max(result_bytes // 32, 1024)


def json_values(
    data: bytes | bytearray, budget: int, start: int = 0, end: int | None = None
) -> int:
    """An upper bound on the number of values in the JSON text `data[start:end]`, exact
    past `budget`.

    Counting separators and openers is enough when the count is within the budget (those
    inside strings only make it larger); past it, strings are removed and the count redone.
    """
    end = len(data) if end is None else end
    count = sum(data.count(c, start, end) for c in (b",", b"[", b"{")) + 1
    if count <= budget or data.count(b'"', start, end) == 0:
        return count
    with memoryview(data) as view:
        bare = _JSON_STRING.sub(b"", view[start:end])
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{") + 1


def name_problem(name: object) -> str:
    """Why `name` is not a file name in scratch ("" when it is one): one path component,
    no NUL, no control character, not `.`/`..`, at most 255 bytes. Shared with the host."""
    if not isinstance(name, str) or not name:
        return "a file name must be a non-empty string"
    if "\x00" in name:
        return "a file name must not contain a NUL byte"
    if "/" in name or "\\" in name:
        return (
            "a file name is one path component: no '/' or '\\' (no directories, no absolute paths)"
        )
    if name in (".", ".."):
        return "'.' and '..' are not file names"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a file name must not contain control characters"
    if name.startswith(STAGING_PREFIX):
        return "names starting with " + repr(STAGING_PREFIX) + " are reserved"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "a file name must be valid UTF-8 text"
    if len(encoded) > _NAME_BYTES:
        return f"a file name is at most {_NAME_BYTES} bytes"
    return ""
