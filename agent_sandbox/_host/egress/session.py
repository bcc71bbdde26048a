"""One client connection to the proxy: its requests judged, forwarded and answered.

`_Session` serves a connection (HTTP `CONNECT`, plain HTTP, SOCKS5, or a forwarded loopback
service), enforces its absolute deadlines and the worker's byte bound, and records each
refusal on the worker's route before the refusal reaches the worker (`_reply`, `_refuse`).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import h11

from agent_sandbox._denial import Denial, refusal_line
from agent_sandbox._hints import grant_hint
from agent_sandbox._host.egress.addresses import normalise_host
from agent_sandbox._host.egress.http1 import (
    MAX_HEAD_BYTES,
    _BadMessage,
    _end_to_end,
    _parse_target,
    _Peer,
    _send_all,
    client_response,
    request_framing,
    upstream_request,
)
from agent_sandbox._host.egress.rules import _decide
from agent_sandbox._host.egress.socks import socks5_greeting, socks5_request

if TYPE_CHECKING:
    from agent_sandbox._host.egress.proxy import Route

__all__: list[str] = []


BUFFER_BYTES = 64 * 1024
HEAD_TIMEOUT = 10.0


CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 300.0


class _Session:
    """One client connection: requests in order, each judged, forwarded and answered.

    Plain HTTP requests keep the client connection alive and reuse the upstream connection
    while the target stays the same; `CONNECT` turns the connection into a tunnel. One
    timer per connection enforces the deadlines, all absolute: each request head must
    arrive within HEAD_TIMEOUT of its start (a head trickled byte by byte does not extend
    it), the connection ends `net.connection_seconds` after its accept, and silence longer
    than IDLE_TIMEOUT ends it too. Every byte read counts against the worker's
    `net.bytes_per_call`. A deadline or bound that ends a connection is recorded as a
    `limits.net` refusal (silence and an idle kept-alive connection are not refusals).

    Both sides are read by h11 (`_Peer`), with `strict_head` and `request_framing` on
    top for the forms h11 reads leniently; what goes out is rebuilt from what was parsed
    and written by h11 (one Host, the proxy's own framing, no chunk extension or trailer).
    """

    def __init__(
        self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.route = route
        self.reader = reader
        self.writer = writer
        self.client = _Peer(self, reader, h11.SERVER, strict=True)
        self.up_key: tuple[str, int] | None = None
        self.up: _Peer | None = None
        self.up_writer: asyncio.StreamWriter | None = None
        self.loop = asyncio.get_running_loop()
        self.limit = IDLE_TIMEOUT
        now = self.last = self.loop.time()
        #: Absolute deadlines: the connection's life, and the request head being read.
        self.end = now + route.lifetime
        self.head_end: float | None = now + HEAD_TIMEOUT
        self.target = "the proxy"
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(HEAD_TIMEOUT, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        why = ""
        if now >= self.end:
            why = (
                f"the connection reached its deadline (net.connection_seconds = "
                f"{self.route.lifetime:g})"
            )
        elif self.head_end is not None and now >= self.head_end:
            if not self.client.pending():
                self._abort()  # a connection left idle before a head: closed, not refused
                return
            why = f"the request head did not arrive within {HEAD_TIMEOUT:g} s"
        elif now - self.last >= self.limit:
            why = ""  # silence: the peers went quiet, nothing was refused
            self._abort()
            return
        if why:
            self.route.record(
                self.route.limit_denial(
                    self.target,
                    why,
                    grant_hint({"net.connection_seconds": self.route.lifetime * 2})
                    if "deadline" in why
                    else "send the whole request head at once",
                )
            )
            self._abort()
            return
        wake = min(self.end, self.last + self.limit)
        if self.head_end is not None:
            wake = min(wake, self.head_end)
        self.timer = self.loop.call_later(max(wake - now, 0.01), self._check)

    def _abort(self) -> None:
        self.timer = None
        for w in (self.writer, self.up_writer):
            if w is not None:
                w.transport.abort()  # pending reads end; the session closes

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        data = await reader.read(BUFFER_BYTES)
        self.last = self.loop.time()
        route = self.route
        route.relayed += len(data)
        if route.relayed > route.max_bytes:
            route.record(
                route.limit_denial(
                    self.target,
                    f"the proxy relayed more than {route.max_bytes} bytes for this worker in "
                    f"this call (net.bytes_per_call)",
                    grant_hint({"net.bytes_per_call": route.max_bytes * 2}),
                )
            )
            self._abort()
            raise ConnectionError("net.bytes_per_call reached")
        return data

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for w in (self.writer, self.up_writer):
            if w is not None:
                w.close()

    def _close_upstream(self) -> None:
        if self.up_writer is not None:
            self.up_writer.close()
        self.up_key = self.up = self.up_writer = None

    async def serve(self) -> None:
        first = await self.read(self.reader)
        if first[:1] == b"\x05":
            await self._socks(first)
            return
        self.client.feed(first)
        while True:
            if self.head_end is None:  # the next request on a kept-alive connection
                self.head_end = self.loop.time() + HEAD_TIMEOUT
            try:
                request = await self.client.event()
                if type(request) is h11.ConnectionClosed:
                    return
                framing = request_framing(request)
            except _BadMessage as exc:
                self._refused_head(str(exc))
                await _reply(self.writer, 400, f"the proxy could not parse the request ({exc})")
                return
            self.head_end = None  # the head is in; from here on, silence is what counts
            target = request.target.decode("ascii", "backslashreplace")
            self.target = target[:200]
            if not await self._one(request, target, framing):
                return
            conn = self.client.conn
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return  # h11 says the connection must close (HTTP/1.0, `Connection: close`)
            conn.start_next_cycle()

    def _refused_head(self, why: str) -> None:
        """Record a request the proxy would not read (host-side, with its rule)."""
        too_long = why.startswith("more than")
        self.route.record(
            self.route.limit_denial(
                "the proxy", f"a request head too long ({why})", "send a shorter request head"
            )
            if too_long
            else self.route.rules._denial(
                "net.connect",
                "connect",
                "the proxy",
                f"a malformed request head ({why})",
                "send a well-formed HTTP/1.1 request (or SOCKS5)",
            )
        )

    async def forward(self, host: str, port: int) -> None:
        """A connection to a forwarded loopback service (`loopback_forwards`): judged like
        a `CONNECT` to host:port, then relayed as bytes; a refusal closes it, recorded."""
        self.head_end = None
        self.target = f"{host}:{port}"
        addresses, denial = await _decide(self.route, host, port)
        if denial is not None:
            self.route.record(denial)
            self.writer.transport.abort()
            return
        if await self._connect(addresses, port):
            self.writer.transport.abort()  # the service is not there: like a closed port
            return
        assert self.up is not None and self.up_writer is not None
        await asyncio.gather(
            self._pump(self.reader, self.up_writer),
            self._pump(self.up.reader, self.writer),
            return_exceptions=True,
        )

    async def _socks(self, data: bytes) -> None:
        """A SOCKS5 client (RFC 1928): no authentication, `CONNECT` only, judged like a
        `CONNECT` request (a name is resolved and judged on the host: `socks5h://`)."""

        async def need(parse: Callable[[bytes], Any]) -> Any:
            nonlocal data
            while (out := parse(data)) is None:
                if len(data) > MAX_HEAD_BYTES:
                    raise ConnectionError("SOCKS5 head too long")
                more = await self.read(self.reader)
                if not more:
                    raise ConnectionError("SOCKS5 client went away")
                data += more
            return out

        def reply(code: int) -> None:
            self.writer.write(bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0]))

        answer, used = await need(socks5_greeting)
        self.writer.write(answer)
        data = data[used:]
        if answer != b"\x05\x00":
            self._refused_head("a SOCKS5 greeting offering no method without authentication")
            return
        code, host, port, used = await need(socks5_request)
        leftover = data[used:]
        if code:
            self._refused_head(f"a SOCKS5 request the proxy does not serve (reply {code})")
            reply(code)
            return
        self.head_end = None
        self.target = f"{host[:200]}:{port}"
        addresses, denial = await _decide(self.route, host, port)
        if denial is not None:
            self.route.record(denial)  # recorded before the refusal reaches the worker
            reply(2)  # connection not allowed by ruleset
            return
        error = await self._connect(addresses, port)
        if error:
            reply(5)  # connection refused
            return
        assert self.up is not None and self.up_writer is not None
        reply(0)
        if leftover:
            self.up_writer.write(leftover)
        await asyncio.gather(
            self._pump(self.reader, self.up_writer),
            self._pump(self.up.reader, self.writer),
            return_exceptions=True,
        )

    async def _connect(self, addresses: list[str], port: int) -> str:
        """Open the upstream connection to the first address that answers; "" or the error."""
        error = ""
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await asyncio.wait_for(
                    self.loop.sock_connect(sock, (address, port)), CONNECT_TIMEOUT
                )
                up_reader, self.up_writer = await asyncio.open_connection(
                    sock=sock, limit=BUFFER_BYTES
                )
                self.up = _Peer(self, up_reader, h11.CLIENT)
                return ""
            except (TimeoutError, OSError) as exc:
                sock.close()
                error = f"{address}:{port}: {exc or type(exc).__name__}"
        return error or "no address"

    async def _one(self, request: Any, target: str, framing: tuple[str, int]) -> bool:
        """Serve one request; False when the connection must end after it."""
        method = request.method.decode("ascii")
        connect = method.upper() == "CONNECT"
        try:
            host, port, path = _parse_target(method.upper(), target)
        except ValueError as exc:
            await _reply(self.writer, 400, str(exc))
            return False
        if connect and framing != ("none", 0):
            self._refused_head("a CONNECT request with a body")
            await _reply(
                self.writer,
                400,
                "the proxy could not parse the request (a CONNECT request with a body)",
            )
            return False
        with contextlib.suppress(ValueError):  # a bad host is refused by `_decide`
            host = normalise_host(host).text
        if connect or self.up_key != (host, port) or self.up is None:
            self._close_upstream()
            addresses, denial = await _decide(self.route, host, port)
            if denial is not None:
                self.route.record(denial)  # recorded before the refusal reaches the worker
                await _refuse(self.writer, denial, connect=connect)
                return False
            error = await self._connect(addresses, port)
            if error:
                why = f"the proxy could not reach {host}:{port} ({error})"
                await _reply(self.writer, 502, why)
                return False
            self.up_key = (host, port)
        assert self.up is not None and self.up_writer is not None
        if connect:
            await self.client.event()  # its EndOfMessage: a CONNECT has no body
            leftover = self.client.pending()  # what the client sent after the head
            self.writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if leftover:
                self.up_writer.write(leftover)
            await asyncio.gather(
                self._pump(self.reader, self.up_writer),
                self._pump(self.up.reader, self.writer),
                return_exceptions=True,
            )
            return False
        return await self._forward(request, path, framing, host, port)

    async def _forward(
        self, request: Any, path: str, framing: tuple[str, int], host: str, port: int
    ) -> bool:
        """One plain-HTTP exchange in origin form, rebuilt from what h11 parsed: the
        target's one Host, the client's end-to-end headers, the framing the proxy read
        (h11 writes it: no chunk extension or trailer is passed on), the bodies as data."""
        up, up_writer = self.up, self.up_writer
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
        up, up_writer = self.up, self.up_writer
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
                self.writer.write(
                    client.send(
                        h11.InformationalResponse(
                            status_code=event.status_code,
                            headers=_end_to_end(event.headers),
                            reason=event.reason,
                        )
                    )
                )
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

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Copy until EOF, then half-close `dst` (back-pressure by drain)."""
        try:
            while data := await self.read(src):
                dst.write(data)
                await dst.drain()
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                if dst.can_write_eof() and not dst.is_closing():
                    dst.write_eof()


async def _reply(
    writer: asyncio.StreamWriter, status: int, text: str, rule: str | None = None
) -> None:
    """Answer the request just read (or that failed to parse) with a short text body, and
    end the connection."""
    body = (text + "\n").encode("utf-8", "replace")
    head = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n",
        "content-type: text/plain; charset=utf-8\r\n",
        f"content-length: {len(body)}\r\n",
        "connection: close\r\n",
    ]
    if rule:
        head.append(f"x-agent-sandbox-denial: {rule}\r\n")
    head.append("\r\n")
    writer.write("".join(head).encode("latin-1", "replace") + body)
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT)


def _one_line(denial: Denial) -> bytes:
    """The refusal as one line of printable ASCII: the rule, the target, the reason, the
    hint (what the client's error message shows), between the markers the worker's
    guards find it by to put it first in the client's error (`_denial.refusal_line`)."""
    return refusal_line(denial.message(), MAX_HEAD_BYTES // 2).encode("ascii")


async def _refuse(writer: asyncio.StreamWriter, denial: Denial, *, connect: bool) -> None:
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
        writer.write(
            b"HTTP/1.1 403 " + line + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\nx-agent-sandbox-denial: %s\r\n\r\n"
            % (len(body), denial.rule.encode("ascii", "replace"))
            + body
        )
    else:
        writer.write(line + b"\r\n\r\n")
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT)
