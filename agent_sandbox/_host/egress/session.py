"""One client connection to the proxy, from its accept to its close.

`_Session` holds what every protocol spoken on a connection shares: the absolute deadlines
(one timer), the worker's byte bound (`read`), the judgement of a target with its refusal
recorded on the worker's route before the refusal reaches the worker (`judge`,
`refused_head`), the upstream connection (`connect`), a tunnel's byte relay (`tunnel`) and
the close. `serve` hands the connection to its protocol by its first byte: SOCKS5
(`socks.serve`) or HTTP/1.1 (`http1.Http1`); a forwarded loopback service is judged like a
`CONNECT` and relayed as bytes (`forward`). How a refusal is worded to the client is the
protocol's (a 403 or a status line, a SOCKS5 reply code); that it is recorded first is
the session's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent_sandbox._hints import grant_hint
from agent_sandbox._host.egress import http1, socks
from agent_sandbox._host.egress.rules import _decide

if TYPE_CHECKING:
    from agent_sandbox._denial import Denial
    from agent_sandbox._host.egress.proxy import Route

__all__: list[str] = []


BUFFER_BYTES = 64 * 1024
HEAD_TIMEOUT = 10.0


CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 300.0


class _Session:
    """One client connection: its deadlines, its byte bound, its upstream, its refusals.

    One timer per connection enforces the deadlines, all absolute: each request head must
    arrive within HEAD_TIMEOUT of its start (`start_head`; a head trickled byte by byte
    does not extend it), the connection ends `net.connection_seconds` after its accept, and
    silence longer than IDLE_TIMEOUT ends it too. Every byte read counts against the
    worker's `net.bytes_per_call`. A deadline or bound that ends a connection is recorded
    as a `limits.net` refusal (silence and an idle kept-alive connection are not refusals).
    """

    def __init__(
        self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.route = route
        self.reader = reader
        self.writer = writer
        self.up_reader: asyncio.StreamReader | None = None
        self.up_writer: asyncio.StreamWriter | None = None
        #: The client's bytes read and not yet parsed, as the protocol parsing them says: a
        #: head deadline passed with none is an idle connection (closed, not refused).
        self.unparsed: Callable[[], bytes] = bytes
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
            if not self.unparsed():
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

    def start_head(self) -> None:
        """The next request head's deadline starts now (the first one's started at the
        accept); kept when already running."""
        if self.head_end is None:
            self.head_end = self.loop.time() + HEAD_TIMEOUT

    def head_in(self) -> None:
        """The head is in: from here on, silence is what counts."""
        self.head_end = None

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

    async def flush(self) -> None:
        """Wait, at most HEAD_TIMEOUT, for the client to take what was written (a refusal's
        or an error's last step before the connection ends)."""
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self.writer.drain(), HEAD_TIMEOUT)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for w in (self.writer, self.up_writer):
            if w is not None:
                w.close()

    def close_upstream(self) -> None:
        if self.up_writer is not None:
            self.up_writer.close()
        self.up_reader = self.up_writer = None

    async def serve(self) -> None:
        """Serve the connection in the protocol its first byte names (5: SOCKS5)."""
        first = await self.read(self.reader)
        if first[:1] == b"\x05":
            await socks.serve(self, first)
        else:
            await http1.Http1(self).serve(first)

    def refused_head(self, why: str) -> None:
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

    async def judge(self, host: str, port: int) -> tuple[list[str], Denial | None]:
        """The rules' decision for host:port: (the addresses to connect to, None), or
        ([], the denial), recorded on the route before the caller refuses the client."""
        addresses, denial = await _decide(self.route, host, port)
        if denial is not None:
            self.route.record(denial)
        return addresses, denial

    async def forward(self, host: str, port: int) -> None:
        """A connection to a forwarded loopback service (`loopback_forwards`): judged like
        a `CONNECT` to host:port, then relayed as bytes; a refusal closes it, recorded."""
        self.head_in()
        self.target = f"{host}:{port}"
        addresses, denial = await self.judge(host, port)
        if denial is not None:
            self.writer.transport.abort()
            return
        if await self.connect(addresses, port):
            self.writer.transport.abort()  # the service is not there: like a closed port
            return
        await self.tunnel()

    async def connect(self, addresses: list[str], port: int) -> str:
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
                self.up_reader, self.up_writer = await asyncio.open_connection(
                    sock=sock, limit=BUFFER_BYTES
                )
                return ""
            except (TimeoutError, OSError) as exc:
                sock.close()
                error = f"{address}:{port}: {exc or type(exc).__name__}"
        return error or "no address"

    async def tunnel(self, leftover: bytes = b"") -> None:
        """Relay bytes both ways between the client and the upstream until both end
        (`leftover`, what the client sent after its head, goes first)."""
        assert self.up_reader is not None and self.up_writer is not None
        if leftover:
            self.up_writer.write(leftover)
        await asyncio.gather(
            self._pump(self.reader, self.up_writer),
            self._pump(self.up_reader, self.writer),
            return_exceptions=True,
        )

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
