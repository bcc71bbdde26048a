"""The relay's own framing on `/run` (`_host/remote/serve_relay.py`): what it writes parses as h11
parses it, and what it reads from the worker is read strictly (the worker's user code can
write to that socket)."""

from __future__ import annotations

import h11
import pytest

from agent_sandbox._host.remote.serve_relay import (
    END,
    HEAD_MAX,
    SSE_HEAD,
    ResponseReader,
    UpstreamError,
    chunk,
    run_request,
)

EVENTS = [b"event: start\ndata: {}\n\n", b"event: result\ndata: 1\n\n", b"x" * 70000]


def _worker_response() -> bytes:
    """A response as the worker writes it (h11's head and EndOfMessage, its own chunks)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST /run HTTP/1.1\r\nhost: worker\r\ncontent-length: 0\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    head = conn.send(
        h11.Response(
            status_code=200,
            headers=[
                ("content-type", "text/event-stream"),
                ("cache-control", "no-store"),
                ("transfer-encoding", "chunked"),
            ],
        )
    )
    body = b"".join(chunk(e) for e in EVENTS)
    return (head or b"") + body + END


@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_a_worker_response_is_read_in_any_pieces(step: int) -> None:
    data = _worker_response()
    reader = ResponseReader()
    out = bytearray()
    for i in range(0, len(data), step):
        out += b"".join(reader.feed(data[i : i + step]))
    assert reader.status == 200 and reader.chunked and reader.done and not reader.close
    assert bytes(out) == b"".join(EVENTS)


def test_a_refused_call_stops_at_the_head() -> None:
    reader = ResponseReader()
    body = b'{"error": "x"}'
    head = b"HTTP/1.1 400 \r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    assert reader.feed(head + body) == []
    assert reader.status == 400 and not reader.chunked and reader.close


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 2x0 \r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 \r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 \r\nbad name: x\r\n\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n-1\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n11111111111111111\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n" + b"1" * 19,
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n5\r\nhelloXX",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n0\r\nx-trailer: 1\r\n\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nHTTP/1.1 200 \r\n",
        b"HTTP/1.1 200 \r\n" + b"x-pad: " + b"a" * HEAD_MAX,
    ],
    ids=range(16),
)
def test_broken_framing_from_the_worker_is_refused(data: bytes) -> None:
    reader = ResponseReader()
    with pytest.raises(UpstreamError):
        reader.feed(data)


def test_nothing_may_follow_the_end() -> None:
    reader = ResponseReader()
    reader.feed(b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n")
    assert reader.done
    assert reader.feed(b"") == []
    with pytest.raises(UpstreamError):
        reader.feed(b"x")


def test_what_the_relay_writes_parses_as_h11_parses_it() -> None:
    server = h11.Connection(h11.SERVER)
    server.receive_data(run_request("tok", b'{"code": "1"}'))
    request = server.next_event()
    assert isinstance(request, h11.Request) and request.target == b"/run"
    assert dict(request.headers)[b"authorization"] == b"Bearer tok"
    data = server.next_event()
    assert isinstance(data, h11.Data) and data.data == b'{"code": "1"}'
    assert isinstance(server.next_event(), h11.EndOfMessage)

    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/run", headers=[("host", "w")]))
    client.send(h11.EndOfMessage())
    client.receive_data(SSE_HEAD + b"".join(chunk(e) for e in EVENTS) + chunk(b"") + END)
    response = client.next_event()
    assert isinstance(response, h11.Response) and response.status_code == 200
    assert dict(response.headers)[b"content-type"] == b"text/event-stream"
    body = bytearray()
    while True:
        event = client.next_event()
        if isinstance(event, h11.EndOfMessage):
            break
        assert isinstance(event, h11.Data)
        body += event.data
    assert bytes(body) == b"".join(EVENTS)
    client.start_next_cycle()  # the connection stays usable


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 \ntransfer-encoding: chunked\n\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\n\n",
        b"HTTP/1.1 200 \r\nx-a: 1\n\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 \r\nx-a: 1\rx\r\ntransfer-encoding: chunked\r\n\r\n",
    ],
    ids=["all-bare-lf", "bare-lf-end", "lf-crlf-end", "bare-cr"],
)
@pytest.mark.parametrize("step", [1, 3, 1 << 16])
def test_refuses_a_head_with_bare_line_ends(head: bytes, step: int) -> None:
    """It denies a head with a bare LF or CR, which h11 frames differently (it ends a head
    at a bare LF): the relay and the host must read the same response, in any pieces."""
    data = head + b"5\r\nhello\r\n0\r\n\r\n"
    reader = ResponseReader()
    with pytest.raises(UpstreamError, match="bare"):
        for i in range(0, len(data), step):
            reader.feed(data[i : i + step])


def _h11_body(data: bytes) -> tuple[int, bytes] | None:
    """What h11 (the host's parser) reads from a worker response: (status, body) or None."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/run", headers=[("host", "w")]))
    client.send(h11.EndOfMessage())
    try:
        client.receive_data(data)
        client.receive_data(b"")
        response = client.next_event()
        if not isinstance(response, h11.Response):
            return None
        body = bytearray()
        while True:
            event = client.next_event()
            if isinstance(event, h11.EndOfMessage):
                return response.status_code, bytes(body)
            if not isinstance(event, h11.Data):
                return None
            body += event.data
    except h11.RemoteProtocolError:
        return None


_PIECES = [b"\r\n", b"\n", b"\r", b"HTTP/1.1 200 ", b"transfer-encoding: chunked", b"x-a: 1",
           b"5", b"hello", b"0", b"content-length: 5", b":", b" "]  # fmt: skip


def test_the_reader_never_frames_a_response_unlike_h11() -> None:
    """Differential against h11 over responses assembled from framing pieces: whenever
    ResponseReader completes a response, h11 reads the same status and body from it
    (ResponseReader may refuse more: it is only ever stricter)."""
    import random

    rng = random.Random(30)
    base = b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    done = 0
    for _ in range(4000):
        data = bytearray(base)
        for _edit in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data) + 1)
            piece = rng.choice(_PIECES)
            if rng.random() < 0.5:
                data[at:at] = piece
            else:
                del data[at : at + rng.randrange(1, 4)]
        reader = ResponseReader()
        body = bytearray()
        try:
            body += b"".join(reader.feed(bytes(data)))
        except UpstreamError:
            continue
        if not reader.done:
            continue
        done += 1
        assert _h11_body(bytes(data)) == (reader.status, bytes(body)), bytes(data)
    assert done > 20  # the corpus reaches complete responses
