"""The host's egress proxy: the only way out of a namespace sandbox's network.

How it is wired (`bwrap` and `unshare`, for a policy with `[net]` allow rules):

1. The worker's network namespace has only its own loopback. Before it restricts itself,
   the worker listens on `127.0.0.1:3128` there and hands that listening socket to the
   host through an inherited Unix socket pair (`SCM_RIGHTS`), then closes its own copy
   (`open_listener`). The host accepts on it: every connection the sandbox makes to the
   proxy address is read and written by the host directly, so nothing of the proxy runs,
   or can be stopped or spoofed, inside the sandbox.
2. The worker's environment names the proxy (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY` and
   the lower-case forms, `NO_PROXY` empty), so `requests`, `urllib`, `httpx`, `pip` and
   `curl` use it unchanged.
3. The proxy speaks HTTP `CONNECT` (a TLS tunnel: it sees the host name and the port, never
   the contents) and plain HTTP proxying (absolute-form requests; the client and upstream
   connections kept alive; both sides read by h11 and each message rebuilt from what was
   parsed, see `http1.Http1`). It judges each target against the
   policy's rules by host name and port (`rules.EgressRules`), resolves names itself on the host
   (the worker never resolves), and refuses a name that resolves to a loopback, private, link-local,
   metadata or other non-global address unless a rule names that address. The host's
   own loopback services are reachable only through a rule naming them.
4. Each refusal becomes a `Denial` (`net.connect`, `net.resolve`) recorded on the host, on
   the worker's route, before the refusal is sent; the parent merges them into the call's
   `RunResult` (`Route.drain`). The worker cannot suppress or forge them.

Bounds, per worker (its policy's `[net]` bounds, with defaults): open connections
(`net.connections`), bytes relayed per call (`net.bytes_per_call`), the life of one
connection (`net.connection_seconds`, an absolute deadline); connections end with the call
unless `net.keep_connections`. No bound is shared between workers, so what one holds never
refuses or delays another's connection. Also the request head size and its absolute
deadline, the relay buffers (back-pressure: nothing is read from one side faster than the
other side takes it, 1xx heads included), and timeouts on the name lookup and the upstream
connect. Each refusal at a bound is recorded as `limits.net`. The proxy runs as one
event-loop thread of the agent's process, started with the first route and stopped with
the last (a pool or sandbox closing its workers stops it).

SOCKS5 (RFC 1928, no authentication, `CONNECT` only) is served on the same port: a
connection whose first byte is 5 is a SOCKS5 client (`socks5h://127.0.0.1:3128`, names
resolved and judged on the host like a `CONNECT`); a refusal is reply code 2 and the same
recorded denial.

What it does NOT do: UDP (a namespace provider refuses a UDP rule at build; seccomp denies
datagram sockets), SOCKS4 or SOCKS5 `BIND`/`UDP ASSOCIATE`, listening sockets reachable
from outside, or looking into TLS.
Code that connects directly (not through the proxy) reaches nothing: the namespace has no
route out.

This module is the server: one event-loop thread (`EgressProxy`, `egress_proxy()`) and one
route per worker (`Route`: its rules, bounds, connections and recorded refusals). The rest of
the proxy, by concern: `addresses` (a target's one spelling, LAN and special ranges), `rules`
(the judgement and the decision for one target), `resolver` (the pinned resolver), `session`
(one connection's life: deadlines, byte bound, upstream, tunnel, refusals recorded), `http1`
(HTTP/1.1 served on a session: h11 parsing, rebuilt messages, the HTTP refusals), `socks`
(SOCKS5 served on a session), `handoff` (the proxy's address and environment, the listeners
a sandbox sends, loopback forwards).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any

from agent_sandbox._denial import Denial
from agent_sandbox._hints import grant_hint
from agent_sandbox._host.egress.handoff import EgressError
from agent_sandbox._host.egress.http1 import _BadMessage
from agent_sandbox._host.egress.rules import EgressRules
from agent_sandbox._host.egress.session import BUFFER_BYTES, _Session

__all__ = ["EgressProxy", "Route", "egress_proxy"]


#: Bounds (see the module docstring).
MAX_CONNECTIONS_PER_ROUTE = 64
MAX_BYTES_PER_CALL = 1 << 30
CONNECTION_SECONDS = 300.0
MAX_DENIALS = 256


class Route:
    """One worker's listener on the proxy: its rules, its connections, its denials."""

    def __init__(self, proxy: EgressProxy, rules: EgressRules, listener: socket.socket) -> None:
        self.proxy = proxy
        self.rules = rules
        self.listener = listener
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self._denials: list[Denial] = []
        self._dropped = 0
        self._lock = threading.Lock()
        self.closed = False
        #: The loop's task serving the listener, and why it could not (see `attach`).
        self.serve_task: asyncio.Task[None] | None = None
        self.failure: str | None = None
        #: This worker's own bounds (the policy's `[net]` bounds, else the defaults).
        self.max_connections = MAX_CONNECTIONS_PER_ROUTE
        self.max_bytes = MAX_BYTES_PER_CALL
        self.lifetime = CONNECTION_SECONDS
        self.keep = False
        #: Bytes relayed for this worker since the last drain (the call's).
        self.relayed = 0
        self.open = 0
        #: Listeners at allowed loopback addresses inside the sandbox (`loopback_forwards`).
        self.forwards: dict[tuple[str, int], socket.socket] = {}
        self.forward_servers: list[asyncio.AbstractServer] = []

    def bound(self, policy: Any) -> None:
        """Take the policy's `[net]` bounds (a policy without them keeps the defaults)."""
        net = getattr(policy, "net", None)
        self.max_connections = int(getattr(net, "connections", self.max_connections))
        self.max_bytes = int(getattr(net, "bytes_per_call", self.max_bytes))
        self.lifetime = float(getattr(net, "connection_seconds", self.lifetime))
        self.keep = bool(getattr(net, "keep_connections", self.keep))

    def limit_denial(self, target: str, detail: str, hint: str) -> Denial:
        return Denial(
            "limits.net",
            "connect",
            target,
            self.rules.policy_name,
            detail=detail + " (refused by the host's egress proxy)",
            hint=hint,
        )

    def record(self, denial: Denial) -> None:
        with self._lock:
            if len(self._denials) < MAX_DENIALS:
                self._denials.append(denial)
            else:
                self._dropped += 1

    def drain(self) -> list[Denial]:
        """The denials recorded since the last drain (the parent merges them into a result)."""
        with self._lock:
            out, self._denials = self._denials, []
            dropped, self._dropped = self._dropped, 0
            self.relayed = 0
        if dropped:
            out.append(
                Denial(
                    "net.connect",
                    "connect",
                    f"{dropped} more connections",
                    self.rules.policy_name,
                    detail=f"the egress proxy refused {dropped} more connections than it "
                    f"records per call ({MAX_DENIALS})",
                )
            )
        return out

    def end_call(self) -> None:
        """The call ended: end this worker's connections unless the policy keeps them
        (`net.keep_connections`), so no tunnel opened by a call outlives it."""
        if self.keep or self.closed or not self.tasks:
            return
        self.proxy._end_connections(self)

    def close(self) -> None:
        """Stop accepting, end every connection of this worker (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.proxy._remove(self)


class EgressProxy:
    """The event-loop thread serving every route of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._box: dict[str, Any] = {}
        self._routes: set[Route] = set()
        self._connections = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _spawn_locked(self) -> None:
        """Start the loop thread when none runs, without waiting for it (see `start`)."""
        if self._thread is not None and self._thread.is_alive():
            return
        ready = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                loop = asyncio.new_event_loop()
            except Exception as exc:  # reported by `_loop_locked`
                box["error"] = exc
                ready.set()
                return
            box["loop"] = loop
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        thread = threading.Thread(target=run, name="agent-sandbox-egress", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            raise EgressError(f"cannot start the proxy thread ({exc})") from None
        self._thread, self._ready, self._box, self._loop = thread, ready, box, None

    def _loop_locked(self) -> asyncio.AbstractEventLoop:
        """The running loop (started when needed), waiting for its thread to be up."""
        self._spawn_locked()
        if self._loop is not None:
            return self._loop
        if not self._ready.wait(5.0) or "loop" not in self._box:
            self._thread = None
            raise EgressError(f"the proxy's event loop did not start ({self._box.get('error')})")
        self._loop = self._box["loop"]
        return self._loop

    def start(self) -> None:
        """Make sure the proxy's thread runs (raises EgressError when it cannot start).

        It does not wait for the thread's loop: a worker's start goes on meanwhile, and
        `attach` (after the worker's handshake) finds it up. Two waits on another thread
        per start cost several milliseconds on a loaded machine (benchmarks/bench_egress.py).
        """
        with self._lock:
            self._spawn_locked()

    def attach(
        self,
        policy: Any,
        listener: socket.socket,
        timeout: float = 5.0,
        forwards: dict[tuple[str, int], socket.socket] | None = None,
    ) -> Route:
        """Serve a worker's listener under `policy`'s rules; returns its route.

        The listener already listens (the worker made it), so connections wait in its
        backlog until the loop serves it; attach does not wait for the loop: a failure to
        serve is kept on the route (`Route.failure`) and the parent discards the worker
        with the reason after its call. Raises EgressError when the loop cannot start.
        """
        rules = EgressRules(policy)
        with self._lock:
            try:
                loop = self._loop_locked()
            except EgressError:
                listener.close()
                raise
            route = Route(self, rules, listener)
            route.bound(policy)
            route.forwards = dict(forwards or {})
            self._routes.add(route)
        try:
            loop.call_soon_threadsafe(self._spawn_serve, route)
        except RuntimeError as exc:  # the loop closed under us
            route.close()
            listener.close()
            raise EgressError(f"the proxy cannot serve the worker's listener ({exc})") from None
        return route

    def _spawn_serve(self, route: Route) -> None:
        if route.closed:
            route.listener.close()
            return
        task = asyncio.ensure_future(self._serve(route))
        route.serve_task = task

        def done(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                route.failure = f"the proxy cannot serve the worker's listener ({t.exception()})"

        task.add_done_callback(done)

    async def _serve(self, route: Route) -> None:
        def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.ensure_future(self._connection(route, reader, writer))
            route.tasks.add(task)
            task.add_done_callback(route.tasks.discard)

        route.listener.setblocking(False)
        route.server = await asyncio.start_server(
            handler, sock=route.listener, limit=BUFFER_BYTES, backlog=128
        )
        for (host, port), sock in route.forwards.items():

            def forwarder(
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                target: tuple[str, int] = (host, port),
            ) -> None:
                task = asyncio.ensure_future(self._connection(route, reader, writer, target))
                route.tasks.add(task)
                task.add_done_callback(route.tasks.discard)

            sock.setblocking(False)
            route.forward_servers.append(
                await asyncio.start_server(forwarder, sock=sock, limit=BUFFER_BYTES, backlog=128)
            )

    def _remove(self, route: Route) -> None:
        with self._lock:
            self._routes.discard(route)
            loop = self._loop
            last = not self._routes
        if loop is None or not self.running:
            route.listener.close()
            return
        future = asyncio.run_coroutine_threadsafe(self._close(route), loop)
        with contextlib.suppress(Exception):
            future.result(5.0)
        if last:
            self._stop_if_idle()

    async def _close(self, route: Route) -> None:
        if route.serve_task is not None and not route.serve_task.done():
            await asyncio.wait([route.serve_task], timeout=2.0)
        if route.server is not None:
            route.server.close()
        else:
            route.listener.close()
        for server in route.forward_servers:
            server.close()
        for sock in route.forwards.values():
            sock.close()
        for task in list(route.tasks):
            task.cancel()
        if route.tasks:
            await asyncio.wait(list(route.tasks), timeout=2.0)

    def _end_connections(self, route: Route) -> None:
        loop = self._loop
        if loop is None or not self.running:
            return

        async def end() -> None:
            tasks = list(route.tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2.0)

        future = asyncio.run_coroutine_threadsafe(end(), loop)
        with contextlib.suppress(Exception):
            future.result(5.0)

    def _stop_if_idle(self) -> None:
        with self._lock:
            if self._routes or self._thread is None:
                return
            thread, ready, box = self._thread, self._ready, self._box
            self._loop = None
            self._thread = None
        # A thread started by `start` may not have its loop yet (a start that failed
        # before its attach): wait for it, then stop it all the same.
        ready.wait(5.0)
        loop = box.get("loop")
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(5.0)

    def stop(self) -> None:
        """End every route and the thread (the pool's and the tests' last word)."""
        for route in list(self._routes):
            route.close()
        self._stop_if_idle()

    # -- one connection ------------------------------------------------------------------

    async def _connection(
        self,
        route: Route,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        forward: tuple[str, int] | None = None,
    ) -> None:
        # Each worker's own bound: what one holds never refuses or delays another's.
        if route.open >= route.max_connections:
            route.record(
                route.limit_denial(
                    f"connection {route.open + 1}",
                    f"this worker already holds {route.open} proxy connections, its "
                    f"bound (net.connections = {route.max_connections})",
                    grant_hint({"net.connections": route.max_connections * 2}),
                )
            )
            writer.transport.abort()
            return
        route.open += 1
        self._connections += 1
        sock = writer.get_extra_info("socket")
        if sock is not None:  # asyncio sets it only when the listener's proto says TCP
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = _Session(route, reader, writer)
        try:
            if forward is None:
                await session.serve()
            else:
                await session.forward(*forward)
        except _BadMessage as exc:  # a body or an answer the proxy would not relay
            route.record(
                route.rules._denial(
                    "net.connect",
                    "connect",
                    session.target,
                    f"a malformed message, not relayed ({exc}); the connection ended",
                    "send well-formed HTTP/1.1 (the server's answer may be at fault)",
                )
            )
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass  # the peer went away or stalled: the connection ends
        except Exception:  # a bug must end one connection, never the proxy
            import logging

            logging.getLogger("agent_sandbox.egress").exception("egress proxy connection failed")
        finally:
            self._connections -= 1
            route.open -= 1
            session.close()


_proxy: EgressProxy | None = None
_proxy_lock = threading.Lock()


def egress_proxy() -> EgressProxy:
    """The process's proxy (one event-loop thread serves every worker's route)."""
    global _proxy
    with _proxy_lock:
        if _proxy is None:
            _proxy = EgressProxy()
        return _proxy
