"""The wire format shared by parent and worker: Server-Sent Events carrying JSON.

One event is `event: <kind>\\ndata: <json>\\n\\n`. Kinds: `stdout`, `stderr`, `denial`, `counts`,
`image`, `result`, `error`, `notice`, `done`. The parser is incremental, caps the size of
one event, and turns anything malformed into a `TransportError`; it never evaluates what
it reads.

Standard library only: the worker imports it before arming.
"""

from __future__ import annotations

import json
from typing import Any

from agent_sandbox._errors import MessageTooLarge, TransportError

__all__ = ["EVENT_KINDS", "Event", "SSEParser", "encode_event"]

EVENT_KINDS = frozenset(
    {
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


class SSEParser:
    """Incremental SSE parser: `feed(bytes)` returns the complete events seen so far."""

    def __init__(self, max_event_bytes: int) -> None:
        self._buf = bytearray()
        self._max = max_event_bytes
        self._scanned = 0  # bytes of _buf already searched for a terminator

    def feed(self, data: bytes) -> list[Event]:
        self._buf += data
        events: list[Event] = []
        while True:
            # Resume the search where the last one stopped: a worker that trickles one
            # byte at a time must not make each feed rescan the whole buffer.
            end = self._buf.find(b"\n\n", max(0, self._scanned - 1))
            if end < 0:
                self._scanned = len(self._buf)
                if len(self._buf) > self._max:
                    raise MessageTooLarge(
                        "one event from the worker",
                        len(self._buf),
                        self._max,
                        "limits.result_bytes",
                    )
                return events
            if end > self._max:
                raise MessageTooLarge(
                    "one event from the worker", end, self._max, "limits.result_bytes"
                )
            block = bytes(self._buf[:end])
            del self._buf[: end + 2]
            self._scanned = 0
            events.append(self._parse_block(block))

    def pending(self) -> int:
        """Bytes buffered that do not yet form a complete event."""
        return len(self._buf)

    @staticmethod
    def _parse_block(block: bytes) -> Event:
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
        try:
            # Strict UTF-8 first: json.loads(bytes) would guess UTF-16/32 from the bytes and
            # import the codec the worker's bytes chose (found by fuzzing).
            return kind, json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise TransportError(f"an event from the worker is not valid JSON: {exc}") from None
