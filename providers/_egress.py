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
   the contents) and plain HTTP proxying (absolute-form requests, forwarded one per
   connection with `Connection: close`). It judges each target against the policy's rules
   by host name and port (`EgressRules`), resolves names itself on the host (the worker
   never resolves), and refuses a name that resolves to a loopback, private, link-local,
   metadata or other non-global address unless a rule names that address. The host's
   own loopback services are reachable only through a rule naming them.
4. Each refusal becomes a `Denial` (`net.connect`, `net.resolve`) recorded on the host, on
   the worker's route, before the refusal is sent; the parent merges them into the call's
   `RunResult` (`Route.drain`). The worker cannot suppress or forge them.

Bounds: connections per worker and in all, the request head size, the relay buffers (with
back-pressure), and timeouts on the head, the name lookup, the upstream connect and idle
relays. The proxy runs as one event-loop thread of the agent's process, started with the
first route and stopped with the last (a pool or sandbox closing its workers stops it).

SOCKS5 (RFC 1928, no authentication, `CONNECT` only) is served on the same port: a
connection whose first byte is 5 is a SOCKS5 client (`socks5h://127.0.0.1:3128`, names
resolved and judged on the host like a `CONNECT`); a refusal is reply code 2 and the same
recorded denial.

What it does NOT do: UDP (a namespace provider refuses a UDP rule at build; seccomp denies
datagram sockets), SOCKS4 or SOCKS5 `BIND`/`UDP ASSOCIATE`, listening sockets reachable
from outside, or looking into TLS.
Code that connects directly (not through the proxy) reaches nothing: the namespace has no
route out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from agent_sandbox._denial import Denial
from agent_sandbox._hints import grant_hint

__all__ = [
    "PROXY_HOST",
    "PROXY_PORT",
    "EgressError",
    "EgressProxy",
    "EgressRules",
    "Route",
    "egress_proxy",
    "proxy_env",
    "set_resolver",
]

#: Where the worker's listener sits inside its own network namespace.
PROXY_HOST = "127.0.0.1"
PROXY_PORT = 3128

#: Bounds (see the module docstring).
MAX_CONNECTIONS_PER_ROUTE = 64
MAX_CONNECTIONS = 512
MAX_HEAD_BYTES = 16 * 1024
BUFFER_BYTES = 64 * 1024
HEAD_TIMEOUT = 10.0
RESOLVE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 300.0
MAX_DENIALS = 256

#: Address ranges a host-name rule never reaches: only a rule naming an address inside one
#: of them (an IP or a CIDR within it) does.
_SPECIAL_NETS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "224.0.0.0/3",
        "::/127",
        "::ffff:0:0/96",
        "64:ff9b:1::/48",
        "fc00::/7",
        "fe80::/10",
        "ff00::/8",
    )
)
_LOOPBACK_NAMES = {
    "localhost": ("127.0.0.0/8", "::1/128"),
    "localhost.localdomain": ("127.0.0.0/8", "::1/128"),
    "ip6-localhost": ("::1/128",),
}
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

Resolver = Callable[[str], list[str]]


class EgressError(RuntimeError):
    """The proxy could not start or could not take a worker's listener."""


def proxy_env(host: str = PROXY_HOST, port: int = PROXY_PORT) -> dict[str, str]:
    """The variables that point HTTP clients at the proxy (both cases; `NO_PROXY` empty)."""
    url = f"http://{host}:{port}"
    env: dict[str, str] = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = url
        env[name.lower()] = url
    env["NO_PROXY"] = ""
    env["no_proxy"] = ""
    return env


def _allow_rules(policy: Any) -> list[Any]:
    return [r for r in policy.net.rules if r.action == "allow"]


# -- decisions (pure) --------------------------------------------------------------------


def _address(text: str) -> Any:
    ip = ipaddress.ip_address(text.split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_special(ip: Any) -> bool:
    """Whether a name rule must not reach `ip`: loopback, private, link-local, metadata..."""
    return not ip.is_global or ip.is_multicast or any(ip in net for net in _SPECIAL_NETS)


def _special_only(net: Any) -> bool:
    return any(net.version == s.version and net.subnet_of(s) for s in _SPECIAL_NETS)


@dataclasses.dataclass(frozen=True)
class _Rule:
    action: str
    host: str
    name: str | None
    networks: tuple[Any, ...]
    ports: tuple[tuple[int, int], ...]

    def has_port(self, port: int) -> bool:
        return any(lo <= port <= hi for lo, hi in self.ports)

    def holds(self, ip: Any) -> bool:
        return any(ip.version == net.version and ip in net for net in self.networks)


class EgressRules:
    """A policy's TCP connect rules, as the proxy judges them (pure: no I/O here).

    * A target given by name needs a rule naming that host on that port (names compare
      case-insensitively, without a trailing dot), or an IP/CIDR rule on that port; a
      deny rule naming it, or covering an address it resolves to, beats any allow.
    * A name rule reaches only global addresses: a name that resolves to a loopback,
      private, link-local (the metadata address 169.254.169.254), shared or multicast
      address is refused unless an IP or CIDR rule lying inside such a range covers it
      (`0.0.0.0/0` does not count: it names no such address).
    * A target given as an address needs an IP/CIDR rule covering it, with the same rule
      for non-global addresses; `localhost` in a rule names the loopback addresses.
    """

    def __init__(self, policy: Any) -> None:
        self.policy_name = str(policy.name)
        # In learning mode a refusal still refuses (the envelope never widens the network)
        # and is marked learned, so `agent-sandbox learn` proposes a rule for the host.
        self.learn = str(getattr(policy, "mode", "enforce")) == "learn"
        self.rules: list[_Rule] = []
        for rule in policy.net.rules:
            if rule.protocol not in ("tcp", "any") or rule.direction not in ("connect", "any"):
                continue
            host = rule.host.strip()
            name: str | None = None
            networks: tuple[Any, ...] = ()
            if host.lower() in _LOOPBACK_NAMES:
                networks = tuple(ipaddress.ip_network(n) for n in _LOOPBACK_NAMES[host.lower()])
            else:
                try:
                    networks = (ipaddress.ip_network(host, strict=False),)
                except ValueError:
                    name = host.lower().rstrip(".")
            self.rules.append(_Rule(rule.action, host, name, networks, tuple(rule.port_ranges())))

    def _denial(self, rule: str, action: str, target: str, detail: str, hint: str) -> Denial:
        return Denial(
            rule,
            action,
            target,
            self.policy_name,
            hint=hint,
            detail=detail + " (refused by the host's egress proxy)",
            learned=self.learn,
        )

    def before_resolve(self, host: str, port: int) -> Denial | None:
        """Judge a host name before it is looked up (so a refused name is never resolved)."""
        name = host.lower().rstrip(".")
        named = [r for r in self.rules if r.name == name]
        for rule in named:
            if rule.action == "deny" and rule.has_port(port):
                return self._denial(
                    "net.connect",
                    "connect",
                    f"{host}:{port}",
                    f"a deny rule for {rule.host!r} matches, and deny beats allow",
                    f"remove the deny rule for {rule.host!r} from [net] rules",
                )
        if any(r.action == "allow" and r.has_port(port) for r in named):
            return None
        if any(
            r.action == "allow"
            and r.name is None
            and r.has_port(port)
            and not all(_special_only(net) for net in r.networks)
            for r in self.rules
        ):
            return None  # a rule for global addresses may cover what the name resolves to
        if any(r.action == "allow" for r in named):
            ports = ",".join(r.host + ":" + _ports_text(r.ports) for r in named)
            return self._denial(
                "net.connect",
                "connect",
                f"{host}:{port}",
                f"the [net] rules name this host for other ports only ({ports})",
                grant_hint({"net.rules": [{"host": host, "ports": str(port)}]}),
            )
        return self._denial(
            "net.resolve",
            "resolve",
            host,
            f"no [net] rule names this host, so it is not resolved (port {port})",
            grant_hint({"net.rules": [{"host": host, "ports": str(port)}]}),
        )

    def judge(
        self, host: str, port: int, addresses: Iterable[str], *, by_name: bool
    ) -> tuple[list[str], Denial | None]:
        """The addresses a connection may use, in order; else the denial for the first."""
        name = host.lower().rstrip(".")
        name_allows = by_name and any(
            r.action == "allow" and r.name == name and r.has_port(port) for r in self.rules
        )
        usable: list[str] = []
        first: Denial | None = None
        for text in addresses:
            try:
                ip = _address(text)
            except ValueError:
                continue
            denial = self._judge_address(host, port, ip, name_allows)
            if denial is None:
                usable.append(str(ip))
            elif first is None:
                first = denial
        if usable:
            return usable, None
        if first is None:
            first = self._denial(
                "net.resolve",
                "resolve",
                host,
                "the host name resolves to no usable address",
                "",
            )
        return [], first

    def _judge_address(self, host: str, port: int, ip: Any, name_allows: bool) -> Denial | None:
        target = f"{host}:{port}"
        special = is_special(ip)
        for rule in self.rules:
            if rule.action == "deny" and rule.has_port(port) and rule.holds(ip):
                return self._denial(
                    "net.connect",
                    "connect",
                    target,
                    f"{ip} is covered by a deny rule for {rule.host!r}, and deny beats allow",
                    f"remove the deny rule for {rule.host!r} from [net] rules",
                )
        for rule in self.rules:
            if rule.action != "allow" or rule.name is not None or not rule.has_port(port):
                continue
            if any(
                ip.version == net.version and ip in net and (not special or _special_only(net))
                for net in rule.networks
            ):
                return None
        if name_allows and not special:
            return None
        hint = grant_hint({"net.rules": [{"host": str(ip), "ports": str(port)}]})
        if special and name_allows:
            return self._denial(
                "net.connect",
                "connect",
                target,
                f"{host} resolves to {ip}, a {_kind(ip)} address, which a host-name rule "
                "never reaches; a rule must name that address",
                hint,
            )
        if special:
            detail = f"{ip} is a {_kind(ip)} address and no [net] rule names it"
        else:
            detail = "no [net] rule allows tcp connect to this address"
        return self._denial("net.connect", "connect", target, detail, hint)


def _kind(ip: Any) -> str:
    if ip.is_loopback:
        return "loopback"
    if str(ip) == "169.254.169.254":
        return "cloud metadata (link-local)"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_private:
        return "private"
    return "non-global"


def _ports_text(ports: Iterable[tuple[int, int]]) -> str:
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ports)


# -- resolution --------------------------------------------------------------------------


def system_resolve(host: str) -> list[str]:
    """The host's own resolver: every TCP address of `host`, in the resolver's order."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


_resolver: Resolver = system_resolve


def set_resolver(resolver: Resolver | None) -> Resolver:
    """Replace the proxy's resolver (tests map names to loopback servers); returns the old.

    `None` puts the system resolver back. The resolver runs on the host, in a thread, and
    raises OSError for a name that does not resolve.
    """
    global _resolver
    old = _resolver
    _resolver = resolver or system_resolve
    return old


# -- taking the worker's listener (the worker's side is `_inworker.open_egress_listener`) --


def receive_listener(channel: socket.socket, timeout: float) -> socket.socket:
    """In the host: the listening socket the worker sent, checked (raises EgressError)."""
    channel.settimeout(max(timeout, 0.05))
    try:
        _msg, fds, _flags, _addr = socket.recv_fds(channel, 16, 4)
    except (OSError, TimeoutError) as exc:
        raise EgressError(f"the worker sent no proxy listener ({exc})") from None
    if len(fds) != 1:
        for fd in fds:
            with contextlib.suppress(OSError):
                socket.close(fd)
        raise EgressError(f"the worker sent {len(fds)} descriptors for the proxy, not one")
    try:
        sock = socket.socket(fileno=fds[0])
    except OSError as exc:
        with contextlib.suppress(OSError):
            socket.close(fds[0])
        raise EgressError(f"the worker's proxy descriptor is not a socket ({exc})") from None
    ok = (
        sock.family == socket.AF_INET
        and sock.type == socket.SOCK_STREAM
        and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    )
    if not ok:
        sock.close()
        raise EgressError("the worker's proxy descriptor is not a listening TCP socket")
    return sock


# -- the host's proxy --------------------------------------------------------------------


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
        self._routes: set[Route] = set()
        self._connections = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start_locked(self) -> asyncio.AbstractEventLoop:
        if self._loop is not None and self.running:
            return self._loop
        ready = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                loop = asyncio.new_event_loop()
            except Exception as exc:  # reported to the starter below
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
        if not ready.wait(5.0) or "loop" not in box:
            raise EgressError(f"the proxy's event loop did not start ({box.get('error')})")
        self._thread = thread
        self._loop = box["loop"]
        return self._loop

    def start(self) -> None:
        """Make sure the proxy runs (raises EgressError with the reason when it cannot)."""
        with self._lock:
            self._start_locked()

    def attach(self, policy: Any, listener: socket.socket, timeout: float = 5.0) -> Route:
        """Serve a worker's listener under `policy`'s rules; returns its route."""
        rules = EgressRules(policy)
        with self._lock:
            loop = self._start_locked()
            route = Route(self, rules, listener)
            self._routes.add(route)
        future = asyncio.run_coroutine_threadsafe(self._serve(route), loop)
        try:
            future.result(timeout)
        except BaseException as exc:
            route.close()
            listener.close()
            raise EgressError(f"the proxy cannot serve the worker's listener ({exc})") from None
        return route

    async def _serve(self, route: Route) -> None:
        def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.ensure_future(self._connection(route, reader, writer))
            route.tasks.add(task)
            task.add_done_callback(route.tasks.discard)

        route.listener.setblocking(False)
        route.server = await asyncio.start_server(
            handler, sock=route.listener, limit=BUFFER_BYTES, backlog=128
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
        if route.server is not None:
            route.server.close()
        else:
            route.listener.close()
        for task in list(route.tasks):
            task.cancel()
        if route.tasks:
            await asyncio.wait(list(route.tasks), timeout=2.0)

    def _stop_if_idle(self) -> None:
        with self._lock:
            if self._routes or self._loop is None:
                return
            loop, thread = self._loop, self._thread
            self._loop = None
            self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def stop(self) -> None:
        """End every route and the thread (the pool's and the tests' last word)."""
        for route in list(self._routes):
            route.close()
        self._stop_if_idle()

    # -- one connection ------------------------------------------------------------------

    async def _connection(
        self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if len(route.tasks) > MAX_CONNECTIONS_PER_ROUTE or self._connections >= MAX_CONNECTIONS:
            writer.close()
            return
        self._connections += 1
        sock = writer.get_extra_info("socket")
        if sock is not None:  # asyncio sets it only when the listener's proto says TCP
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = _Session(route, reader, writer)
        try:
            await session.serve()
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass  # the peer went away or stalled: the connection just ends
        except Exception:  # a bug must end one connection, never the proxy
            import logging

            logging.getLogger("agent_sandbox.egress").exception("egress proxy connection failed")
        finally:
            self._connections -= 1
            session.close()


class _Session:
    """One client connection: requests in order, each judged, forwarded and answered.

    Plain HTTP requests keep the client connection alive and reuse the upstream connection
    while the target stays the same; `CONNECT` turns the connection into a tunnel. One
    timer per connection enforces the timeouts: the request head must arrive within
    HEAD_TIMEOUT, and any later silence longer than IDLE_TIMEOUT ends the connection.
    """

    def __init__(
        self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        import h11

        self.route = route
        self.reader = reader
        self.writer = writer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.up_key: tuple[str, int] | None = None
        self.up_reader: asyncio.StreamReader | None = None
        self.up_writer: asyncio.StreamWriter | None = None
        self.up_conn: Any = None
        self.loop = asyncio.get_running_loop()
        self.limit = HEAD_TIMEOUT
        self.last = self.loop.time()
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(self.limit, self._check)

    def _check(self) -> None:
        idle = self.loop.time() - self.last
        if idle >= self.limit:
            self.timer = None
            for w in (self.writer, self.up_writer):
                if w is not None:
                    w.transport.abort()  # pending reads end; the session closes
            return
        self.timer = self.loop.call_later(self.limit - idle, self._check)

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        data = await reader.read(BUFFER_BYTES)
        self.last = self.loop.time()
        return data

    async def next_event(self, conn: Any, reader: asyncio.StreamReader) -> Any:
        import h11

        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await self.read(reader))

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for w in (self.writer, self.up_writer):
            if w is not None:
                w.close()

    def _close_upstream(self) -> None:
        if self.up_writer is not None:
            self.up_writer.close()
        self.up_key = self.up_reader = self.up_writer = self.up_conn = None

    async def serve(self) -> None:
        import h11

        first = await self.read(self.reader)
        if first[:1] == b"\x05":
            await self._socks(first)
            return
        self.conn.receive_data(first)
        while True:
            try:
                event = await self.next_event(self.conn, self.reader)
            except h11.RemoteProtocolError:
                await _reply(self.writer, self.conn, 400, "the proxy could not parse the request")
                return
            if not isinstance(event, h11.Request):
                return
            self.limit = IDLE_TIMEOUT  # the head is in; from here on, silence is what counts
            if not await self._one(event):
                return
            if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
                return
            self.conn.start_next_cycle()

    async def _socks(self, data: bytes) -> None:
        """A SOCKS5 client (RFC 1928): no authentication, `CONNECT` only, judged like a
        `CONNECT` request (a name is resolved and judged on the host: `socks5h://`)."""

        async def need(n: int) -> bytes:
            nonlocal data
            while len(data) < n:
                if len(data) > MAX_HEAD_BYTES:
                    raise ConnectionError("SOCKS5 head too long")
                more = await self.read(self.reader)
                if not more:
                    raise ConnectionError("SOCKS5 client went away")
                data += more
            return data

        def reply(code: int) -> None:
            self.writer.write(bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0]))

        await need(2)
        count = data[1]
        await need(2 + count)
        if 0 not in data[2 : 2 + count]:
            self.writer.write(b"\x05\xff")  # no acceptable method
            return
        self.writer.write(b"\x05\x00")
        data = data[2 + count :]
        await need(5)
        version, command, _reserved, kind = data[0], data[1], data[2], data[3]
        if kind == 1:
            end = 4 + 4
            await need(end + 2)
            host = str(ipaddress.IPv4Address(data[4:end]))
        elif kind == 4:
            end = 4 + 16
            await need(end + 2)
            host = str(ipaddress.IPv6Address(data[4:end]))
        elif kind == 3:
            end = 5 + data[4]
            await need(end + 2)
            host = data[5:end].decode("ascii", "replace")
        else:
            reply(8)  # address type not supported
            return
        port = int.from_bytes(data[end : end + 2], "big")
        leftover = data[end + 2 :]
        if version != 5 or command != 1:
            reply(7)  # command not supported: CONNECT only
            return
        self.limit = IDLE_TIMEOUT
        addresses, denial = await _decide(self.route, host, port)
        if denial is not None:
            self.route.record(denial)  # recorded before the refusal reaches the worker
            reply(2)  # connection not allowed by ruleset
            return
        error = await self._connect(addresses, port)
        if error:
            reply(5)  # connection refused
            return
        assert self.up_reader is not None and self.up_writer is not None
        reply(0)
        if leftover:
            self.up_writer.write(leftover)
        await asyncio.gather(
            self._pump(self.reader, self.up_writer),
            self._pump(self.up_reader, self.writer),
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
                self.up_reader, self.up_writer = await asyncio.open_connection(
                    sock=sock, limit=BUFFER_BYTES
                )
                return ""
            except (TimeoutError, OSError) as exc:
                sock.close()
                error = f"{address}:{port}: {exc or type(exc).__name__}"
        return error or "no address"

    async def _one(self, request: Any) -> bool:
        """Serve one request; False when the connection must end after it."""
        import h11

        method = request.method.decode("ascii", "replace").upper()
        target = request.target.decode("ascii", "replace")
        try:
            host, port, path = _parse_target(method, target)
        except ValueError as exc:
            await _reply(self.writer, self.conn, 400, str(exc))
            return False
        if (
            self.up_key != (host, port)
            or self.up_conn is None
            or self.up_conn.our_state is not h11.IDLE
        ):
            self._close_upstream()
            addresses, denial = await _decide(self.route, host, port)
            if denial is not None:
                self.route.record(denial)  # recorded before the refusal reaches the worker
                await _reply(self.writer, self.conn, 403, denial.message(), rule=denial.rule)
                return False
            error = await self._connect(addresses, port)
            if error:
                why = f"the proxy could not reach {host}:{port} ({error})"
                await _reply(self.writer, self.conn, 502, why)
                return False
            self.up_key = (host, port)
            self.up_conn = h11.Connection(h11.CLIENT)
        assert self.up_reader is not None and self.up_writer is not None
        if method == "CONNECT":
            self.writer.write(self.conn.send(h11.Response(status_code=200, headers=[])) or b"")
            leftover = self.conn.trailing_data[0]
            if leftover:
                self.up_writer.write(leftover)
            await asyncio.gather(
                self._pump(self.reader, self.up_writer),
                self._pump(self.up_reader, self.writer),
                return_exceptions=True,
            )
            return False
        return await self._forward(request, path)

    async def _forward(self, request: Any, path: str) -> bool:
        """One plain-HTTP exchange in origin form, both sides framed by h11."""
        import h11

        up, up_writer = self.up_conn, self.up_writer
        assert up is not None and up_writer is not None
        headers = [(k, v) for k, v in request.headers if k.lower() not in _HOP_BY_HOP]
        head = up.send(h11.Request(method=request.method, target=path, headers=headers)) or b""
        event = self.conn.next_event()
        if isinstance(event, h11.EndOfMessage):
            # No body (most requests): one write up, then the response, in this task.
            up_writer.write(head + (up.send(h11.EndOfMessage()) or b""))
            await self._relay_response()
        else:
            up_writer.write(head)
            back = asyncio.ensure_future(self._relay_response())
            try:
                while True:
                    if event is h11.NEED_DATA:
                        self.conn.receive_data(await self.read(self.reader))
                    elif isinstance(event, h11.Data):
                        up_writer.write(up.send(h11.Data(data=event.data)) or b"")
                        await up_writer.drain()
                    elif isinstance(event, h11.EndOfMessage):
                        up_writer.write(up.send(h11.EndOfMessage()) or b"")
                        break
                    else:
                        return False
                    event = self.conn.next_event()
                await back
            finally:
                back.cancel()
        if up.our_state is h11.DONE and up.their_state is h11.DONE:
            up.start_next_cycle()
        else:
            self._close_upstream()
        return True

    async def _relay_response(self) -> None:
        """Relay the upstream's answer, re-framed by h11, one client write per chunk read."""
        import h11

        up, up_reader = self.up_conn, self.up_reader
        assert up is not None and up_reader is not None
        out: list[bytes] = []
        while True:
            event = up.next_event()
            if event is h11.NEED_DATA:
                if out:
                    self.writer.write(b"".join(out))
                    out.clear()
                    await self.writer.drain()
                up.receive_data(await self.read(up_reader))
                continue
            if isinstance(event, h11.InformationalResponse | h11.Response):
                headers = [(k, v) for k, v in event.headers if k.lower() not in _HOP_BY_HOP]
                kind = type(event)
                out.append(
                    self.conn.send(
                        kind(status_code=event.status_code, headers=headers, reason=event.reason)
                    )
                    or b""
                )
            elif isinstance(event, h11.Data):
                out.append(self.conn.send(h11.Data(data=event.data)) or b"")
            elif isinstance(event, h11.EndOfMessage):
                out.append(self.conn.send(h11.EndOfMessage()) or b"")
                self.writer.write(b"".join(out))
                await self.writer.drain()
                return
            else:
                raise ConnectionError("the upstream server closed the connection mid-response")

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


async def _decide(route: Route, host: str, port: int) -> tuple[list[str], Denial | None]:
    """Judge a target; a name is judged, then resolved on the host, then judged by address."""
    rules = route.rules
    try:
        _address(host)
        return rules.judge(host, port, [host], by_name=False)
    except ValueError:
        pass
    denial = rules.before_resolve(host, port)
    if denial is not None:
        return [], denial
    loop = asyncio.get_running_loop()
    resolver = _resolver
    try:
        addresses = await asyncio.wait_for(
            loop.run_in_executor(None, resolver, host), RESOLVE_TIMEOUT
        )
    except Exception as exc:  # whatever the resolver raises, the name did not resolve
        why = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc) or repr(exc)
        return [], rules._denial(
            "net.resolve",
            "resolve",
            host,
            f"the host does not resolve ({why})",
            "check the host name in the policy's [net] rules",
        )
    return rules.judge(host, port, addresses, by_name=True)


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


async def _reply(
    writer: asyncio.StreamWriter, conn: Any, status: int, text: str, rule: str | None = None
) -> None:
    """Answer the request `conn` has read (or failed to read) with a short text body."""
    import h11

    body = (text + "\n").encode("utf-8", "replace")
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if rule:
        headers.append((b"x-agent-sandbox-denial", rule.encode()))
    try:
        data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
        data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
    except h11.LocalProtocolError:
        return  # nothing sensible can be answered; the connection is closed
    writer.write(data)
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT)


_proxy: EgressProxy | None = None
_proxy_lock = threading.Lock()


def egress_proxy() -> EgressProxy:
    """The process's proxy (one event-loop thread serves every worker's route)."""
    global _proxy
    with _proxy_lock:
        if _proxy is None:
            _proxy = EgressProxy()
        return _proxy
