"""The SSE wire format: encoding, incremental parsing, and malformed input."""

from __future__ import annotations

import pytest

from agent_sandbox import MessageTooLarge, TransportError
from agent_sandbox._host.intake.framing import SSEParser
from agent_sandbox._wire import encode_event


def test_round_trip_in_pieces() -> None:
    """It parses events split at every byte boundary."""
    data = encode_event("stdout", "a\nb") + encode_event("result", {"value": [1, "x"]})
    parser = SSEParser(1 << 20)
    events = []
    for i in range(len(data)):
        events.extend(parser.feed(data[i : i + 1]))
    assert events == [("stdout", "a\nb"), ("result", {"value": [1, "x"]})]
    assert parser.pending() == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"event: stdout\n\n",
        b"data: 1\n\n",
        b"event: bogus\ndata: 1\n\n",
        b"event: stdout\ndata: {not json\n\n",
        b"event: stdout\nevent: stderr\ndata: 1\n\n",
        b"garbage\n\n",
        b"event: stdout\nid: 3\ndata: 1\n\n",
    ],
)
def test_malformed_events_are_transport_errors(raw: bytes) -> None:
    """It turns malformed events into TransportError."""
    with pytest.raises(TransportError):
        SSEParser(1024).feed(raw)


def test_oversized_event_is_refused_before_it_completes() -> None:
    """It refuses an event larger than the cap even before its end arrives."""
    parser = SSEParser(100)
    with pytest.raises(MessageTooLarge):
        parser.feed(b'event: stdout\ndata: "' + b"x" * 200)
