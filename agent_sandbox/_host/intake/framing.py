"""The host's reading of the wire format: an incremental Server-Sent Events parser.

The format is `agent_sandbox._wire`. The parser caps the size of one event (per kind, once
the kind line has arrived, so no event is buffered past its own cap), counts the JSON values
of an outcome before decoding it, and turns anything malformed into a `TransportError`; it
never evaluates what it reads. What an event may contain, in which order, and how much of it
the host keeps is judged by `agent_sandbox._host.intake.events`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agent_sandbox._errors import MessageTooLarge, TransportError
from agent_sandbox._wire import EVENT_KINDS, json_values

if TYPE_CHECKING:
    from agent_sandbox._wire import Event

__all__ = ["KindCaps", "SSEParser", "valid_text"]
#: The kinds whose data may be a large structure (the others are small and fixed-shape).
_STRUCTURED = frozenset({"result", "error"})


#: A per-kind cap: (largest event block in bytes, the policy setting that raises it).
KindCaps = Mapping[str, tuple[int, str]]

#: The head of a well-formed event: its kind line, then the start of its data line.
_HEAD = re.compile(rb"event: ([a-z]{1,16})\ndata: ")
_KINDS = {kind.encode("ascii"): kind for kind in EVENT_KINDS}
_DECODE = json.JSONDecoder().decode  # what json.loads(text) calls


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
        #: Each known kind's cap, as `_current_cap` finds it from the kind line.
        self._caps = {
            kind: (min(cap, max_event_bytes), setting)
            for kind, (cap, setting) in self._kind_caps.items()
        }

    def reset(self) -> None:
        """Forget everything buffered: ready for the next response's stream."""
        self._buf = bytearray()
        self._cap = None
        self._scanned = 0

    def _current_cap(self, start: int) -> tuple[int, str]:
        if self._cap is None:
            head = self._buf.find(b"\n", start, start + 64)
            if head < 0:
                return self._max, self._setting
            kind = bytes(self._buf[start:head]).partition(b"event: ")[2].decode("ascii", "replace")
            cap, setting = self._kind_caps.get(kind, (self._max, self._setting))
            self._cap = (min(cap, self._max), setting)
        return self._cap

    def feed(self, data: bytes) -> list[Event]:
        self._buf += data
        events: list[Event] = []
        start = 0  # where the current event begins in _buf
        try:
            while True:
                # Resume the search where the last one stopped: a worker that trickles one
                # byte at a time must not make each feed rescan the whole buffer.
                end = self._buf.find(b"\n\n", max(start, self._scanned - 1))
                if end >= 0:
                    head = _HEAD.match(self._buf, start, end)
                    kind = _KINDS.get(head[1]) if head is not None else None
                    first = head.end() if head is not None else end
                    if kind is not None and self._buf.find(b"\n", first, end) < 0:
                        # The usual event, whole and well-formed: its kind line and one
                        # data line, checked in one match (the slow path below names
                        # what is wrong with any other).
                        cap, setting = self._caps.get(kind) or (self._max, self._setting)
                        if end - start > cap:
                            raise MessageTooLarge(
                                "one event from the worker", end - start, cap, setting
                            )
                        events.append(self._decode(kind, first, end))
                        start = self._scanned = end + 2
                        self._cap = None
                        continue
                cap, setting = self._current_cap(start)
                if end < 0:
                    self._scanned = len(self._buf)
                    if len(self._buf) - start > cap:
                        raise MessageTooLarge(
                            "one event from the worker", len(self._buf) - start, cap, setting
                        )
                    return events
                if end - start > cap:
                    raise MessageTooLarge("one event from the worker", end - start, cap, setting)
                if self._buf.startswith(b":", start):
                    self._skip_comment(start, end)
                else:
                    events.append(self._parse(start, end))
                start = self._scanned = end + 2
                self._cap = None
        finally:
            if start:
                # A fresh buffer for the rest: the consumed events' memory is released.
                self._buf = self._buf[start:]
                self._scanned = max(0, self._scanned - start)

    def pending(self) -> int:
        """Bytes buffered that do not yet form a complete event."""
        return len(self._buf)

    def _skip_comment(self, start: int, end: int) -> None:
        """A keep-alive block: every line must be a comment (no event hides behind one)."""
        if any(not line.startswith(b":") for line in bytes(self._buf[start:end]).split(b"\n")):
            raise TransportError("an event from the worker mixes comment and field lines")

    def _parse(self, start: int, end: int) -> Event:
        """The event in `_buf[start:end]`: exactly `event: <kind>` then `data: <json>`.

        Read in place: the data is never copied before it is decoded, and a structured
        event is refused on its value count before it is decoded at all.
        """
        buf = self._buf
        head = buf.find(b"\n", start, min(end, start + 64))
        if head < 0 or not buf.startswith(b"event: ", start):
            line = bytes(buf[start : min(end, start + 80)])
            raise TransportError(f"malformed event line from the worker: {line!r}")
        try:
            kind = bytes(buf[start + 7 : head]).decode("ascii")
        except UnicodeDecodeError:
            raise TransportError("an event kind from the worker is not ASCII") from None
        if not buf.startswith(b"data: ", head + 1):
            line = bytes(buf[head + 1 : min(end, head + 81)])
            name = line.partition(b": ")[0]
            if name == b"event":
                raise TransportError("an event from the worker names two kinds")
            if name == b"data" or not line:
                raise TransportError("an event from the worker lacks its kind or its data")
            raise TransportError(f"unknown field {name[:40]!r} in an event from the worker")
        if buf.find(b"\n", head + 1, end) >= 0:
            raise TransportError("an event from the worker has lines after its data")
        if kind not in EVENT_KINDS:
            raise TransportError(f"unknown event kind {kind[:40]!r} from the worker")
        return self._decode(kind, head + 7, end)

    def _decode(self, kind: str, first: int, end: int) -> Event:
        """The event's data, `_buf[first:end]`: counted (a structured kind), then decoded."""
        buf = self._buf
        if self._max_values is not None and kind in _STRUCTURED:
            values = json_values(buf, self._max_values, first, end)
            if values > self._max_values:
                raise MessageTooLarge(
                    f"one {kind} from the worker (counted in JSON values)",
                    values,
                    self._max_values,
                    "limits.result_bytes",
                )
        try:
            # Strict UTF-8 first: json.loads(bytes) would guess UTF-16/32 from the bytes and
            # import the codec the worker's bytes chose (found by fuzzing).
            with memoryview(buf) as view:
                text = str(view[first:end], "utf-8")
            data = _DECODE(text)
        except (ValueError, RecursionError) as exc:
            raise TransportError(f"an event from the worker is not valid JSON: {exc}") from None
        # Strict UTF-8 leaves one way to a string that is not text: a JSON escape of a lone
        # surrogate (`"\\ud800"`, what `print('\\ud800')` sends). Only then is the value walked.
        if buf.find(b"\\ud", first, end) >= 0 or buf.find(b"\\uD", first, end) >= 0:
            data = valid_text(data)
        return kind, data


#: A surrogate code point: in a decoded JSON string always a lone one (json joins pairs).
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(data: Any) -> Any:
    """`data` with every lone surrogate in its strings (keys too) replaced by U+FFFD.

    The one rule for text from a worker: what is not a Unicode scalar value becomes the
    replacement character, as an invalid byte does in `bytes.decode("utf-8", "replace")`.
    Every string the host keeps can then be encoded as UTF-8 (printed, written as JSON,
    given to a model). Iterative, so a deep value costs no recursion.
    """
    if isinstance(data, str):
        return _SURROGATE.sub("\ufffd", data)
    if not isinstance(data, (list, dict)):
        return data
    root: list[Any] = [data]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, slot = stack.pop()
        value = parent[slot]
        if isinstance(value, str):
            parent[slot] = _SURROGATE.sub("\ufffd", value)
        elif isinstance(value, list):
            stack.extend((value, i) for i in range(len(value)))
        elif isinstance(value, dict):
            if any(isinstance(k, str) and _SURROGATE.search(k) for k in value):
                fixed = {_SURROGATE.sub("\ufffd", k): v for k, v in value.items()}
                value.clear()
                value.update(fixed)
            stack.extend((value, k) for k in value)
    return root[0]
