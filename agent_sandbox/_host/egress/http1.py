"""HTTP/1.1 as the proxy serves it: h11 on both sides, each message rebuilt.

`Http1` serves the HTTP requests of one session (`CONNECT` and plain HTTP): each judged by
the session, forwarded, answered, or refused (`_refuse`, `_reply`). Under it, the messages:
`read_request` (h11, then `strict_head` and `request_framing` for the forms h11 reads
leniently), `upstream_request` and `client_response` (the messages passed on, rebuilt from
what was parsed; an upstream's reason phrase or header value never carries the proxy's
refusal marker, `_unmarked`), `_Peer` (one side of a session as h11 reads it) and
`_parse_target` (host, port and path of a proxy request). The fuzz targets and the
smuggling table call these.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import re
import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import h11

from agent_sandbox._denial import REFUSAL_START, refusal_line
from agent_sandbox._host.egress.addresses import normalise_host

if TYPE_CHECKING:
    from agent_sandbox._denial import Denial
    from agent_sandbox._host.egress.session import _Session

__all__ = [
    "Http1",
    "client_response",
    "interim_response",
    "read_request",
    "request_framing",
    "strict_head",
    "upstream_request",
]


MAX_HEAD_BYTES = 16 * 1024


_HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"proxy-connection",
    b"te",
    b"trailer",
    b"upgrade",
}


class _BadMessage(ValueError):
    """A request or response the proxy will not relay (malformed, ambiguous framing)."""


#: The framing headers: never copied from one side to the other, set from what was parsed.
_FRAMING_HEADERS = frozenset({b"content-length", b"transfer-encoding"})
#: Where h11 ends a message head (it takes a bare LF as a line end, as RFC 9112 lets a
#: recipient); the same search finds the head's bytes for `strict_head`.
_HEAD_END = re.compile(rb"\n\r?\n")
_TOO_LONG = f"more than {MAX_HEAD_BYTES} bytes before the end of a head or line"


def strict_head(raw: bytes) -> None:
    """Refuse what h11 reads leniently in a request head (whose bytes start `raw`): a bare
    LF as a line end and obsolete line folding (a line starting with a space or a tab),
    both ways of making two parsers frame one message differently. h11 refuses the rest
    (bare CR, NUL, a space before the colon, a malformed request line)."""
    end = _HEAD_END.search(raw)
    head = raw[: end.end()] if end is not None else raw
    lines = head.split(b"\n")
    if any(not line.endswith(b"\r") for line in lines[:-1]):
        raise _BadMessage("a bare LF in the message head")
    if any(line[:1] in (b" ", b"\t") for line in lines[1:-1]):
        raise _BadMessage("obsolete line folding in the message head")


def request_framing(request: Any) -> tuple[str, int]:
    """How a request's body is framed, from what h11 parsed: ("length", n), ("chunked", 0)
    or ("none", 0); _BadMessage for both Content-Length and Transfer-Encoding (h11 lets
    the latter win, RFC 9112 6.3; the proxy refuses the pair outright) or an HTTP version
    other than 1.0 and 1.1. h11 has already refused conflicting Content-Length values and
    any Transfer-Encoding but `chunked`."""
    if request.http_version not in (b"1.0", b"1.1"):
        raise _BadMessage(
            f"HTTP/{request.http_version.decode('ascii')} (the proxy speaks 1.0, 1.1)"
        )
    names = {name for name, _ in request.headers}
    if names >= _FRAMING_HEADERS:
        raise _BadMessage("both Content-Length and Transfer-Encoding")
    if b"transfer-encoding" in names:
        return "chunked", 0
    for name, value in request.headers:
        if name == b"content-length":
            return "length", int(value)
    return "none", 0


def read_request(data: bytes) -> tuple[Any, tuple[str, int]]:
    """A request head as the proxy reads it (h11, then `strict_head`, `request_framing`):
    (the h11 Request, its framing); _BadMessage when refused or incomplete (the fuzz
    targets and the smuggling table call this)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise _BadMessage(_h11_reason(exc)) from None
    if type(event) is not h11.Request:
        raise _BadMessage("an incomplete request head")
    strict_head(data)
    return event, request_framing(event)


def _h11_reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return _TOO_LONG if "buffer too long" in text else text


def _hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    named = {t.strip().lower() for k, v in headers if k == b"connection" for t in v.split(b",")}
    return _HOP_BY_HOP | named


def _end_to_end(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers passed on: all but the hop-by-hop ones (and those `Connection` names)."""
    headers = list(headers)
    drop = _hop_by_hop(headers)
    return [(name, value) for name, value in headers if name not in drop]


def upstream_request(
    request: Any, path: str, framing: tuple[str, int], host: str, port: int
) -> Any:
    """The request sent upstream, rebuilt from what h11 parsed: the target's one Host (the
    request's absolute URI decides, RFC 9112 3.2.2: the client's Host lines, duplicates and
    all, are never passed on), the client's end-to-end headers, the framing the proxy read
    (h11 writes it: no chunk extension or trailer is passed on). _BadMessage when h11 will
    not write it."""
    spelled = f"[{host}]" if ":" in host else host
    authority = spelled if port == 80 else f"{spelled}:{port}"
    headers = [(b"host", authority.encode("ascii"))]
    headers += [
        (name, value)
        for name, value in _end_to_end(request.headers)
        if name != b"host" and name not in _FRAMING_HEADERS
    ]
    kind, length = framing
    if kind == "length":
        headers.append((b"content-length", b"%d" % length))
    elif kind == "chunked":
        headers.append((b"transfer-encoding", b"chunked"))
    try:
        return h11.Request(method=request.method, target=path.encode("ascii"), headers=headers)
    except h11.LocalProtocolError as exc:
        raise _BadMessage(f"the proxy cannot pass on this request ({exc})") from None


#: The words of the proxy's opening refusal marker (`_denial.REFUSAL_START`), lower case.
_MARKER_WORDS = REFUSAL_START.strip("| ").lower().encode("ascii")


def _unmarked(value: bytes) -> bytes:
    """An upstream's reason phrase or header value, made unable to pass for the proxy's
    refusal: when it holds the marker's words (`agent-sandbox refusal`, in any case), each
    `|` in it becomes `!`. The worker's guard finds a refusal only by the exact opening
    marker `|agent-sandbox refusal| ` (`_denial.refusal_first`), which needs the `|`
    before and after those words, so what the client quotes of such a value reads
    `!agent-sandbox refusal! ...` and is never put first. Any other value (a `|` in a
    link or a cookie included) is passed as it is."""
    if _MARKER_WORDS in value.lower():
        return value.replace(b"|", b"!")
    return value


def _answer_head(event: Any) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """An upstream answer's end-to-end headers and reason phrase as passed to the client,
    no refusal marker in them (`_unmarked`)."""
    headers = [(name, _unmarked(value)) for name, value in _end_to_end(event.headers)]
    return headers, _unmarked(bytes(event.reason))


def client_response(event: Any, method: bytes) -> Any:
    """The final response head passed to the client, rebuilt from the upstream's parsed
    one: its end-to-end headers and reason phrase (no refusal marker kept, `_unmarked`),
    and `Connection: close` when its body ends with the upstream's connection. _BadMessage
    for both Content-Length and Transfer-Encoding."""
    names = {name for name, _ in event.headers}
    if names >= _FRAMING_HEADERS:
        raise _BadMessage("both Content-Length and Transfer-Encoding in an answer")
    headers, reason = _answer_head(event)
    if not names & _FRAMING_HEADERS and not (method == b"HEAD" or event.status_code in (204, 304)):
        # Its body (if any) ends with the upstream's connection: so does the client's.
        headers.append((b"connection", b"close"))
    try:
        return h11.Response(status_code=event.status_code, headers=headers, reason=reason)
    except h11.LocalProtocolError as exc:
        raise _BadMessage(f"the proxy cannot pass on this answer ({exc})") from None


def interim_response(event: Any) -> Any:
    """An interim (1xx) head passed to the client, rebuilt like `client_response`."""
    headers, reason = _answer_head(event)
    return h11.InformationalResponse(status_code=event.status_code, headers=headers, reason=reason)


class _Peer:
    """One side of a session as h11 reads it: the client (h11's server role) or the
    upstream (its client role). Bytes are read only when h11 needs more to give the next
    event, so nothing is read from one side faster than the other side takes it."""

    __slots__ = ("conn", "eof", "reader", "session", "strict")

    def __init__(
        self, session: _Session, reader: asyncio.StreamReader, role: Any, strict: bool = False
    ) -> None:
        self.session = session
        self.reader = reader
        self.conn = h11.Connection(role, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.strict = strict
        self.eof = False

    def pending(self) -> bytes:
        """The bytes read and not yet parsed."""
        return bytes(self.conn.trailing_data[0])

    def feed(self, data: bytes) -> None:
        self.eof = not data
        self.conn.receive_data(data)

    async def event(self) -> Any:
        """The next h11 event; _BadMessage for a message h11 or `strict_head` refuses,
        ConnectionError for a peer that went away mid-message."""
        while True:
            head = self.strict and self.conn.their_state is h11.IDLE
            raw = self.pending() if head else b""
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                if self.eof:
                    raise ConnectionError("the peer closed the connection mid-message") from None
                raise _BadMessage(_h11_reason(exc)) from None
            if event is h11.NEED_DATA:
                self.feed(await self.session.read(self.reader))
                continue
            if head and type(event) is h11.Request:
                strict_head(raw)
            return event

    def send(self, event: Any) -> bytes:
        """The bytes h11 writes for `event` (framing from the headers given)."""
        try:
            return bytes(self.conn.send(event) or b"")
        except h11.LocalProtocolError as exc:
            raise _BadMessage(f"the proxy cannot pass on this message ({exc})") from None


def _send_all(writer: asyncio.StreamWriter, *parts: bytes) -> None:
    writer.write(b"".join(parts))


def _parse_target(method: str, target: str) -> tuple[str, int, str]:
    """(host, port, origin-form path) of a proxy request; ValueError when malformed."""
    if method == "CONNECT":
        parts = urllib.parse.urlsplit("//" + target)
        path = ""
    else:
        parts = urllib.parse.urlsplit(target)
        if parts.scheme.lower() != "http":
            raise ValueError(
                "the proxy takes absolute http:// URLs and CONNECT host:port (https goes "
                "through CONNECT)"
            )
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port in {target!r}") from exc
    host = parts.hostname or ""
    if not host:
        raise ValueError(f"no host in {target!r}")
    if port is None:
        if method == "CONNECT":
            raise ValueError(f"CONNECT needs host:port, got {target!r}")
        port = 80
    return host, port, path


class Http1:
    """The HTTP requests of one session, in order, each judged, forwarded and answered.

    Plain HTTP requests keep the client connection alive and reuse the upstream connection
    while the target stays the same; `CONNECT` turns the connection into a tunnel (the
    session's). Both sides are read by h11 (`_Peer`), with `strict_head` and
    `request_framing` on top for the forms h11 reads leniently; what goes out is rebuilt
    from what was parsed and written by h11 (one Host, the proxy's own framing, no chunk
    extension or trailer). The session keeps the deadlines, the byte bound, the upstream
    socket and the refusal records; this keeps the protocol.
    """

    def __init__(self, session: _Session) -> None:
        self.session = session
        self.writer = session.writer
        self.client = _Peer(session, session.reader, h11.SERVER, strict=True)
        session.unparsed = self.client.pending
        #: The upstream as h11 reads it, and its target: kept while the target stays.
        self.up: _Peer | None = None
        self.up_key: tuple[str, int] | None = None

    async def serve(self, first: bytes) -> None:
        """Serve requests until the connection ends (`first`: what the session read)."""
        session = self.session
        self.client.feed(first)
        while True:
            session.start_head()  # the next request on a kept-alive connection
            try:
                request = await self.client.event()
                if type(request) is h11.ConnectionClosed:
                    return
                framing = request_framing(request)
            except _BadMessage as exc:
                session.refused_head(str(exc))
                await _reply(session, 400, f"the proxy could not parse the request ({exc})")
                return
            session.head_in()
            target = request.target.decode("ascii", "backslashreplace")
            session.target = target[:200]
            if not await self._one(request, target, framing):
                return
            conn = self.client.conn
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return  # h11 says the connection must close (HTTP/1.0, `Connection: close`)
            conn.start_next_cycle()

    def _close_upstream(self) -> None:
        self.session.close_upstream()
        self.up_key = self.up = None

    async def _one(self, request: Any, target: str, framing: tuple[str, int]) -> bool:
        """Serve one request; False when the connection must end after it."""
        session = self.session
        method = request.method.decode("ascii")
        connect = method.upper() == "CONNECT"
        try:
            host, port, path = _parse_target(method.upper(), target)
        except ValueError as exc:
            await _reply(session, 400, str(exc))
            return False
        if connect and framing != ("none", 0):
            session.refused_head("a CONNECT request with a body")
            await _reply(
                session,
                400,
                "the proxy could not parse the request (a CONNECT request with a body)",
            )
            return False
        with contextlib.suppress(ValueError):  # a bad host is refused by the judgement
            host = normalise_host(host).text
        if connect or self.up_key != (host, port) or self.up is None:
            self._close_upstream()
            addresses, denial = await session.judge(host, port)  # a denial: recorded
            if denial is not None:
                await _refuse(session, denial, connect=connect)
                return False
            error = await session.connect(addresses, port)
            if error:
                why = f"the proxy could not reach {host}:{port} ({error})"
                await _reply(session, 502, why)
                return False
            assert session.up_reader is not None
            self.up = _Peer(session, session.up_reader, h11.CLIENT)
            self.up_key = (host, port)
        if connect:
            await self.client.event()  # its EndOfMessage: a CONNECT has no body
            leftover = self.client.pending()  # what the client sent after the head
            self.writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await session.tunnel(leftover)
            return False
        return await self._forward(request, path, framing, host, port)

    async def _forward(
        self, request: Any, path: str, framing: tuple[str, int], host: str, port: int
    ) -> bool:
        """One plain-HTTP exchange in origin form, rebuilt from what h11 parsed: the
        target's one Host, the client's end-to-end headers, the framing the proxy read
        (h11 writes it: no chunk extension or trailer is passed on), the bodies as data."""
        up, up_writer = self.up, self.session.up_writer
        assert up is not None and up_writer is not None
        kind, length = framing
        head = up.send(upstream_request(request, path, framing, host, port))
        if kind == "none" or (kind == "length" and length == 0):
            # No body (most requests): its end is already parsed; one write up, then the
            # response, in this task.
            await self.client.event()
            _send_all(up_writer, head, up.send(h11.EndOfMessage()))
            await self._relay_response(request.method.upper())
        else:
            up_writer.write(head)
            back = asyncio.ensure_future(self._relay_response(request.method.upper()))
            try:
                await self._relay_body()
                await up_writer.drain()
                await back
            finally:
                back.cancel()
        upc = up.conn
        if upc.our_state is h11.DONE and upc.their_state is h11.DONE and not up.pending():
            upc.start_next_cycle()  # the upstream connection is reused for the same target
        else:
            self._close_upstream()
        return True

    async def _relay_body(self) -> None:
        """The client's request body to the upstream, as data (back-pressure by drain);
        its trailers are read and dropped."""
        up, up_writer = self.up, self.session.up_writer
        assert up is not None and up_writer is not None
        while True:
            event = await self.client.event()
            if type(event) is h11.Data:
                up_writer.write(up.send(h11.Data(data=event.data)))
                await up_writer.drain()
            elif type(event) is h11.EndOfMessage:
                up_writer.write(up.send(h11.EndOfMessage()))
                return
            else:
                raise ConnectionError("the client went away mid-body")

    async def _relay_response(self, method: bytes) -> None:
        """Relay the upstream's answer (interim 1xx heads, then the final one and its
        body), rebuilt from what h11 parsed and written by the client's h11 connection."""
        up, client = self.up, self.client
        assert up is not None
        while True:
            event = await up.event()
            if type(event) is h11.InformationalResponse:
                if event.status_code == 101:
                    raise _BadMessage("the upstream switched protocols unasked")
                self.writer.write(client.send(interim_response(event)))
                # Back-pressure: no more is read from the upstream until the client has
                # taken this head (a flood of 1xx heads to a client that does not read
                # fills the socket's buffers, never the host's memory).
                await self.writer.drain()
                continue
            if type(event) is not h11.Response:
                raise ConnectionError("the upstream server closed the connection")
            break
        self.writer.write(client.send(client_response(event, method)))
        while True:
            event = await up.event()
            if type(event) is h11.Data:
                self.writer.write(client.send(h11.Data(data=event.data)))
                await self.writer.drain()
            elif type(event) is h11.EndOfMessage:
                self.writer.write(client.send(h11.EndOfMessage()))  # trailers dropped
                break
            else:
                raise ConnectionError("the upstream server closed the connection mid-body")
        await self.writer.drain()


async def _reply(session: _Session, status: int, text: str) -> None:
    """Answer the request just read (or that failed to parse) with a short text body; the
    connection ends after it."""
    body = (text + "\n").encode("utf-8", "replace")
    head = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n",
        "content-type: text/plain; charset=utf-8\r\n",
        f"content-length: {len(body)}\r\n",
        "connection: close\r\n",
        "\r\n",
    ]
    session.writer.write("".join(head).encode("latin-1", "replace") + body)
    await session.flush()


def _one_line(denial: Denial) -> bytes:
    """The refusal as one line of printable ASCII: the rule, the target, the reason, the
    hint (what the client's error message shows), between the markers the worker's
    guards find it by to put it first in the client's error (`_denial.refusal_line`)."""
    return refusal_line(denial.message(), MAX_HEAD_BYTES // 2).encode("ascii")


async def _refuse(session: _Session, denial: Denial, *, connect: bool) -> None:
    """Refuse a request so that every client raises its own connection error naming the
    rule and the hint, and none reads a refusal as a response (then end the connection).

    `CONNECT`: a 403 whose reason phrase is the refusal (clients raise on a failed tunnel
    and quote the phrase: `Tunnel connection failed: 403 |agent-sandbox refusal|
    [net.resolve] ...`). Plain HTTP: the refusal in place of the status line, which no HTTP
    client takes for a response (http.client's `BadStatusLine`, h11's and aiohttp's protocol
    errors), so the code's request fails as a connection does instead of returning a body
    to parse. The worker's network guard puts the marked refusal first in the text of the
    error the code catches (`guards/_net.py`).
    """
    line = _one_line(denial)
    if connect:
        body = line + b"\n"
        session.writer.write(
            b"HTTP/1.1 403 " + line + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\nx-agent-sandbox-denial: %s\r\n\r\n"
            % (len(body), denial.rule.encode("ascii", "replace"))
            + body
        )
    else:
        session.writer.write(line + b"\r\n\r\n")
    await session.flush()
