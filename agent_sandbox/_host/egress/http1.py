"""HTTP/1.1 as the proxy reads and writes it: h11 on both sides, each message rebuilt.

`read_request` (h11, then `strict_head` and `request_framing` for the forms h11 reads
leniently), `upstream_request` and `client_response` (the messages passed on, rebuilt from
what was parsed), `_Peer` (one side of a session as h11 reads it) and `_parse_target` (host,
port and path of a proxy request). The fuzz targets and the smuggling table call these.
"""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import h11

if TYPE_CHECKING:
    from agent_sandbox._host.egress.session import _Session

__all__ = ["client_response", "read_request", "request_framing", "strict_head", "upstream_request"]


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


def client_response(event: Any, method: bytes) -> Any:
    """The final response head passed to the client, rebuilt from the upstream's parsed
    one: its end-to-end headers, and `Connection: close` when its body ends with the
    upstream's connection. _BadMessage for both Content-Length and Transfer-Encoding."""
    names = {name for name, _ in event.headers}
    if names >= _FRAMING_HEADERS:
        raise _BadMessage("both Content-Length and Transfer-Encoding in an answer")
    headers = _end_to_end(event.headers)
    if not names & _FRAMING_HEADERS and not (method == b"HEAD" or event.status_code in (204, 304)):
        # Its body (if any) ends with the upstream's connection: so does the client's.
        headers.append((b"connection", b"close"))
    try:
        return h11.Response(status_code=event.status_code, headers=headers, reason=event.reason)
    except h11.LocalProtocolError as exc:
        raise _BadMessage(f"the proxy cannot pass on this answer ({exc})") from None


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
