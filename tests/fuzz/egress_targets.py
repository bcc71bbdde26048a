"""The egress proxy's parsers as fuzz targets (used by `egress_fuzz.py` and replayed by
`test_egress_parsers.py`). Each target takes bytes and may raise only the errors that
mean "refused" (the proxy answers 400 / a SOCKS5 error / a `net.resolve` denial)."""

from __future__ import annotations

import h11

from agent_sandbox._host.egress.addresses import normalise_host
from agent_sandbox._host.egress.http1 import (
    MAX_HEAD_BYTES,
    _BadMessage,
    _end_to_end,
    _parse_target,
    client_response,
    read_request,
    request_framing,
    strict_head,
    upstream_request,
)
from agent_sandbox._host.egress.socks import socks5_greeting, socks5_request

#: What a parser may raise for bad input: the proxy turns each into a refusal.
REFUSALS = (_BadMessage, ValueError, h11.LocalProtocolError)


def head(data: bytes) -> None:
    """A request head as the proxy reads it (h11 and the proxy's checks), then its target
    and host, and the request the proxy would send upstream, rebuilt by h11."""
    try:
        request, framing = read_request(data[: MAX_HEAD_BYTES + 4])
        assert framing[0] in ("length", "chunked", "none") and framing[1] >= 0
        method = request.method.decode("ascii")
        host, port, path = _parse_target(method.upper(), request.target.decode("ascii"))
        assert 0 <= port <= 65535
        normalise_host(host)
        out = h11.Connection(h11.CLIENT)
        out.send(
            h11.Request(
                method=request.method,
                target=path.encode("ascii"),
                headers=[("host", "example.test"), *_end_to_end(request.headers)],
            )
        )
    except REFUSALS:
        return


def socks(data: bytes) -> None:
    """A SOCKS5 greeting then request, as the proxy reads them."""
    greeting = socks5_greeting(data)
    if greeting is None:
        return
    answer, used = greeting
    assert answer in (b"\x05\x00", b"\x05\xff") and 2 <= used <= len(data)
    request = socks5_request(data[used:])
    if request is None:
        return
    code, host, port, taken = request
    assert (code in (0, 7, 8) and 0 <= port <= 65535 and taken <= len(data) - used) or code == 8
    if code == 0:
        try:
            normalise_host(host)
        except ValueError:
            return


def host(data: bytes) -> None:
    """A host as a client spells it: one spelling, stable when read again."""
    text = data.decode("latin-1")
    try:
        spelled = normalise_host(text)
    except ValueError:
        return
    again = normalise_host(spelled.text)
    assert again.text == spelled.text and again.judged == spelled.judged, (text, spelled, again)


def _send(conn: h11.Connection, event: object) -> bytes:
    """What `_Peer.send` does: h11 writes the event, or the message is refused."""
    try:
        return bytes(conn.send(event) or b"")
    except h11.LocalProtocolError as exc:
        raise _BadMessage(str(exc)) from None


def _events(conn: h11.Connection) -> list[object]:
    """Every event h11 gives from what it was fed, to the end of the data."""
    out = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return out
        out.append(event)
        if type(event) is h11.ConnectionClosed:
            return out


def _body(events: list[object]) -> bytes:
    return b"".join(bytes(e.data) for e in events if type(e) is h11.Data)


def _request_leg(client: h11.Connection) -> tuple[bytes, object, str, bytes] | None:
    """One pipelined request from the client as the proxy passes it on: (what goes
    upstream, the parsed request, the authority, the body); None at the end of the data."""
    raw = bytes(client.trailing_data[0])
    event = client.next_event()
    if event is h11.NEED_DATA or type(event) is h11.ConnectionClosed:
        return None
    assert type(event) is h11.Request, event
    strict_head(raw)
    framing = request_framing(event)
    method = event.method.decode("ascii").upper()
    host, port, path = _parse_target(method, event.target.decode("ascii"))
    if method == "CONNECT":
        return None
    try:
        host = normalise_host(host).text
    except ValueError:
        return None  # refused by the judgement
    rebuilt = upstream_request(event, path, framing, host, port)
    up = h11.Connection(h11.CLIENT)
    out = _send(up, rebuilt)
    body = b""
    while True:
        part = client.next_event()
        if part is h11.NEED_DATA:
            return None  # the client went away mid-body
        if type(part) is h11.Data:
            body += bytes(part.data)
            out += _send(up, h11.Data(data=part.data))
        else:
            assert type(part) is h11.EndOfMessage, part
            out += _send(up, h11.EndOfMessage())
            break
    authority = rebuilt.headers[0][1].decode("ascii")
    return out, event, authority, body


def exchange(data: bytes) -> None:
    """A pipelined client stream and an upstream's answers (split where the first two bytes
    say), each leg parsed by h11 and rebuilt as the proxy rebuilds it. The oracle: what the
    proxy writes parses back, by a fresh h11 and the proxy's own strict check, to exactly
    the parsed message (one Host, the target's; the same method, path and body; the same
    status and body back): nothing the proxy did not parse is passed on."""
    if len(data) < 2:
        return
    cut = 2 + int.from_bytes(data[:2], "big") % max(1, len(data) - 1)
    to_proxy, answers = data[2:cut], data[cut:]
    client = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    client.receive_data(to_proxy)
    client.receive_data(b"")
    upstream = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    upstream.receive_data(answers)
    upstream.receive_data(b"")
    try:
        for _ in range(8):
            leg = _request_leg(client)
            if leg is None:
                return
            out, request, authority, body = leg
            # Upstream sees exactly the parsed request.
            strict_head(out)
            seen = h11.Connection(h11.SERVER)
            seen.receive_data(out)
            events = _events(seen)
            assert type(events[0]) is h11.Request and type(events[-1]) is h11.EndOfMessage
            again = events[0]
            hosts = [v for k, v in again.headers if k == b"host"]
            assert hosts == [authority.encode("ascii")], (hosts, authority)
            assert again.method == request.method
            assert _body(events) == body
            assert not events[-1].headers  # no trailer passed on
            # The answer, relayed.
            method = request.method.upper()
            upstream.send(h11.Request(method=request.method, target=b"/", headers=[("host", "a")]))
            upstream.send(h11.EndOfMessage())
            back = h11.Connection(h11.SERVER)
            back.receive_data(out)
            _events(back)
            written = b""
            body_in = b""
            status = None
            while True:
                event = upstream.next_event()
                if event is h11.NEED_DATA or type(event) is h11.ConnectionClosed:
                    return  # the upstream went away
                if type(event) is h11.InformationalResponse:
                    if event.status_code == 101:
                        return
                    written += _send(
                        back,
                        h11.InformationalResponse(
                            status_code=event.status_code,
                            headers=_end_to_end(event.headers),
                            reason=event.reason,
                        ),
                    )
                elif type(event) is h11.Response:
                    status = event.status_code
                    written += _send(back, client_response(event, method))
                elif type(event) is h11.Data:
                    body_in += bytes(event.data)
                    written += _send(back, h11.Data(data=event.data))
                else:
                    assert type(event) is h11.EndOfMessage, event
                    written += _send(back, h11.EndOfMessage())
                    break
            reader = h11.Connection(h11.CLIENT)
            reader.send(h11.Request(method=request.method, target=b"/", headers=[("host", "a")]))
            reader.send(h11.EndOfMessage())
            reader.receive_data(written)
            if back.our_state is h11.MUST_CLOSE:
                reader.receive_data(b"")
            interim = (h11.InformationalResponse, h11.ConnectionClosed)
            got = [e for e in _events(reader) if type(e) not in interim]
            assert type(got[0]) is h11.Response and got[0].status_code == status, got
            assert type(got[-1]) is h11.EndOfMessage and not got[-1].headers, got
            assert _body(got) == body_in
            if not (
                upstream.our_state is upstream.their_state is h11.DONE
                and client.our_state is h11.SEND_RESPONSE
            ):
                return
            upstream.start_next_cycle()
            # The proxy's own answer to the client ends the client's cycle.
            client.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            client.send(h11.EndOfMessage())
            if client.our_state is not h11.DONE or client.their_state is not h11.DONE:
                return
            client.start_next_cycle()
    except (*REFUSALS, h11.RemoteProtocolError):
        return


def everything(data: bytes) -> None:
    """All four in one process (one libFuzzer run): the first byte picks the target."""
    if data:
        _ALL[data[0] % len(_ALL)](data[1:])


_ALL = (head, socks, host, exchange)

TARGETS = {
    "egress_head": head,
    "egress_socks": socks,
    "egress_host": host,
    "egress_exchange": exchange,
}

#: The one-process driver for long runs (`egress_fuzz.py egress_all`); its inputs are
#: split back into the four corpora by their first byte (`_ALL`'s order).
COMBINED = {"egress_all": everything}
