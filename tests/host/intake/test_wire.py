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


def test_whole_events_in_one_feed_keep_every_check() -> None:
    """Whole events arriving together (a quiet call's one body chunk: `start`, the outcome
    and `done`) take the one-match path; its per-kind cap, value budget and JSON check are
    the slow path's, and a malformed event among them still fails."""
    caps = {"result": (64, "limits.result_bytes"), "done": (64, "limits.output_bytes")}
    quiet = encode_event("start", {"call": 1}) + encode_event("result", {"value": 2})
    quiet += encode_event("done", {"duration": 0.1, "discard": False, "denials": 0})
    assert [kind for kind, _ in SSEParser(1024, caps, 16).feed(quiet)] == [
        "start",
        "result",
        "done",
    ]
    big = encode_event("result", {"value": "x" * 100})
    with pytest.raises(MessageTooLarge) as info:
        SSEParser(1024, caps, 16).feed(encode_event("start", {"call": 1}) + big)
    assert info.value.setting == "limits.result_bytes"
    many = encode_event("result", {"value": list(range(20))})
    with pytest.raises(MessageTooLarge):
        SSEParser(1024, None, 16).feed(many)
    with pytest.raises(TransportError):
        SSEParser(1024).feed(quiet + b"event: done\ndata: {not json\n\n")
    parser = SSEParser(1024)
    assert parser.feed(quiet[:10]) == []
    parser.reset()  # a new response: nothing of the last one's stream is kept
    assert parser.pending() == 0
    assert [kind for kind, _ in parser.feed(quiet)] == ["start", "result", "done"]
