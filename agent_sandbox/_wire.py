"""The wire format shared by parent and worker: Server-Sent Events carrying JSON.

One event is `event: <kind>\\ndata: <json>\\n\\n`. Kinds: `start`, `stdout`, `stderr`,
`denial`, `internal`, `image`, `files`, `notice`, `result`, `error`, `done`. The parser is
incremental, caps the size of one event (per kind, once the kind line has arrived, so no
event is buffered past its own cap), and turns anything malformed into a `TransportError`;
it never evaluates what it reads. What an event may contain, in which order, and how much
of it the host keeps is judged by `agent_sandbox._intake`.

Standard library only: the worker imports it before arming.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from agent_sandbox._errors import MessageTooLarge, TransportError

__all__ = [
    "EVENT_KINDS",
    "Event",
    "KindCaps",
    "SSEParser",
    "encode_event",
    "json_values",
    "value_budget",
]

EVENT_KINDS = frozenset(
    {
        "start",
        "stdout",
        "stderr",
        "denial",
        "internal",
        "image",
        "result",
        "error",
        "notice",
        "done",
        "files",
    }
)

Event = tuple[str, Any]


def encode_event(kind: str, data: Any) -> bytes:
    """Encode one event; the JSON is compact and on a single line (json never emits newlines)."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    # A lone surrogate (print('\ud800')) has no UTF-8 form; backslashreplace writes it as
    # the JSON escape `\ud800`, so it round-trips instead of failing the whole event.
    body = payload.encode("utf-8", "backslashreplace")
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: The kinds whose data may be a large structure (the others are small and fixed-shape).
_STRUCTURED = frozenset({"result", "error"})


def value_budget(result_bytes: int) -> int:
    """How many JSON values one `result` or `error` event may hold, from `limits.result_bytes`.

    Decoding JSON costs more memory than its text (`[{},{}]` is 3 bytes per dict of 64):
    a budget of one value per 20 bytes keeps a decoded result near `result_bytes` plus a
    few megabytes, whatever its shape. Worker and host apply the same budget.
    """
    return max(result_bytes // 20, 1024)


def json_values(data: bytes, budget: int) -> int:
    """An upper bound on the number of values in the JSON text `data`, exact past `budget`.

    Counting separators and openers is enough when the count is within the budget (those
    inside strings only make it larger); past it, strings are removed and the count redone.
    """
    count = data.count(b",") + data.count(b"[") + data.count(b"{") + 1
    if count <= budget:
        return count
    bare = _JSON_STRING.sub(b"", data)
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{") + 1


#: A per-kind cap: (largest event block in bytes, the policy setting that raises it).
KindCaps = Mapping[str, tuple[int, str]]


class SSEParser:
    """Incremental SSE parser: `feed(bytes)` returns the complete events seen so far.

    `max_event_bytes` caps every event; `kind_caps` lowers the cap for some kinds (an
    event's cap is known as soon as its first line, `event: <kind>`, has arrived).
    """

    def __init__(
        self,
        max_event_bytes: int,
        kind_caps: KindCaps | None = None,
        max_values: int | None = None,
    ) -> None:
        self._buf = bytearray()
        self._max_values = max_values
        self._max = max_event_bytes
        self._setting = "limits.result_bytes"
        self._kind_caps = kind_caps or {}
        self._cap: tuple[int, str] | None = None  # the current event's cap, once known
        self._scanned = 0  # bytes of _buf already searched for a terminator

    def _current_cap(self) -> tuple[int, str]:
        if self._cap is None:
            head = self._buf.find(b"\n", 0, 64)
            if head < 0:
                return self._max, self._setting
            kind = bytes(self._buf[:head]).partition(b"event: ")[2].decode("ascii", "replace")
            cap, setting = self._kind_caps.get(kind, (self._max, self._setting))
            self._cap = (min(cap, self._max), setting)
        return self._cap

    def feed(self, data: bytes) -> list[Event]:
        self._buf += data
        events: list[Event] = []
        while True:
            # Resume the search where the last one stopped: a worker that trickles one
            # byte at a time must not make each feed rescan the whole buffer.
            end = self._buf.find(b"\n\n", max(0, self._scanned - 1))
            cap, setting = self._current_cap()
            if end < 0:
                self._scanned = len(self._buf)
                if len(self._buf) > cap:
                    raise MessageTooLarge("one event from the worker", len(self._buf), cap, setting)
                return events
            if end > cap:
                raise MessageTooLarge("one event from the worker", end, cap, setting)
            block = bytes(self._buf[:end])
            del self._buf[: end + 2]
            self._scanned = 0
            self._cap = None
            events.append(self._parse_block(block, self._max_values))

    def pending(self) -> int:
        """Bytes buffered that do not yet form a complete event."""
        return len(self._buf)

    @staticmethod
    def _parse_block(block: bytes, max_values: int | None = None) -> Event:
        kind: str | None = None
        data: bytes | None = None
        for line in block.split(b"\n"):
            name, sep, value = line.partition(b": ")
            if not sep:
                raise TransportError(f"malformed event line from the worker: {line[:80]!r}")
            if name == b"event":
                if kind is not None:
                    raise TransportError("an event from the worker names two kinds")
                try:
                    kind = value.decode("ascii")
                except UnicodeDecodeError:
                    raise TransportError("an event kind from the worker is not ASCII") from None
            elif name == b"data":
                if data is not None:
                    raise TransportError("an event from the worker carries two data lines")
                data = value
            else:
                raise TransportError(f"unknown field {name[:40]!r} in an event from the worker")
        if kind is None or data is None:
            raise TransportError("an event from the worker lacks its kind or its data")
        if kind not in EVENT_KINDS:
            raise TransportError(f"unknown event kind {kind[:40]!r} from the worker")
        if max_values is not None and kind in _STRUCTURED:
            values = json_values(data, max_values)
            if values > max_values:
                raise MessageTooLarge(
                    f"one {kind} from the worker (counted in JSON values)",
                    values,
                    max_values,
                    "limits.result_bytes",
                )
        try:
            # Strict UTF-8 first: json.loads(bytes) would guess UTF-16/32 from the bytes and
            # import the codec the worker's bytes chose (found by fuzzing).
            return kind, json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise TransportError(f"an event from the worker is not valid JSON: {exc}") from None
