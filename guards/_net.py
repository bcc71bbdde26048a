"""The socket guard: connects, binds, sends and name lookups are judged against `[net]`.

What it enforces, while armed:

1. `connect`, `connect_ex`, `bind`, `listen`, `sendto`, `sendmsg` of `socket.socket`, and the
   same methods of a `_socket.socket` made after install (the module attribute is replaced
   by a guarded subclass), are judged by address family:
   * IPv4/IPv6: the rules (host, IP or CIDR; port ranges; direction; protocol `tcp` for
     stream sockets, `udp` for datagram ones, `any` for both and for raw sockets). A DENY
     rule beats an ALLOW rule; no matching rule means refused.
   * Unix sockets: the path goes through the file rules as a write (the worker's own control
     socket is therefore never reachable); abstract names are refused.
   * Any other family is refused.
   * The host's egress proxy inside a namespace sandbox (`proxy`): a TCP connect to it is
     let through; the proxy judges the real target on the host and records the denial.
2. Host names in rules were resolved once in the parent when the policy was loaded; the
   wire form carries the addresses (the pin). The resolvers (`getaddrinfo`,
   `gethostbyname`, `gethostbyname_ex`, `gethostbyaddr`, `getnameinfo`, for `socket` and
   `_socket`) answer from that pin without asking DNS, and a name no rule names is refused
   (`net.resolve`). A connect to `(name, port)` is sent to the pinned address, so a name
   cannot be rebound between the decision and the connect.

3. Not a judgement, always on: the egress proxy's refusal reaches the code inside a client
   library's error (a status line, a tunnel's reason phrase, between the markers of
   `_denial.refusal_line`); `__str__` of requests', urllib's, http.client's, httpx's and
   aiohttp's error classes, and http.client's tunnel (a bare `OSError`, rewritten in
   place), put that refusal first, the library's words after (`_CLIENT_ERRORS`).

What it does NOT stop: sockets created before arming or inherited; a descriptor wrapped
by `socket.socket(fileno=...)` that is already connected; the C methods reached through
the class hierarchy (`_socket.socket` as a base class is immutable); native code. The OS
providers (network namespaces, seccomp) are the boundary.
"""

from __future__ import annotations

import _socket
import ipaddress
import socket
from _thread import get_ident

from agent_sandbox._denial import REFUSAL_START, Denial, refusal_first
from agent_sandbox._errors import NetworkDenied
from agent_sandbox._hints import grant_hint
from agent_sandbox.guards import _files, _patch
from agent_sandbox.guards._state import refuse, state

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["NetRules", "configure", "install"]

_st = state
_orig_getaddrinfo = _socket.getaddrinfo
_AF_INET, _AF_INET6 = int(socket.AF_INET), int(socket.AF_INET6)
_AF_UNIX = int(getattr(socket, "AF_UNIX", 1))
_SOCK_STREAM, _SOCK_DGRAM = int(socket.SOCK_STREAM), int(socket.SOCK_DGRAM)
_NI_NUMERICHOST = int(socket.NI_NUMERICHOST)
# The C socket's own `family` and `type` getters: plain ints, without the enum conversion of
# socket.socket's properties (and without any property a subclass puts in their place).
_C_FAMILY = vars(_socket.socket)["family"].__get__
_C_TYPE = vars(_socket.socket)["type"].__get__
_AI_NUMERICHOST = int(socket.AI_NUMERICHOST)


class _Rule:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.action = raw.get("action", "allow")
        self.protocol = raw.get("protocol", "tcp")
        self.direction = raw.get("direction", "connect")
        self.host = str(raw.get("host", ""))
        self.ports: list[tuple[int, int]] = []
        for part in str(raw.get("ports", "1-65535")).split(","):
            lo, _, hi = part.strip().partition("-")
            self.ports.append((int(lo), int(hi) if hi else int(lo)))
        self.networks: list[Any] = []
        self.name: str | None = None
        try:
            self.networks.append(ipaddress.ip_network(self.host, strict=False))
        except ValueError:
            self.name = self.host.lower().rstrip(".")
            for address in raw.get("addresses", ()):
                try:
                    self.networks.append(ipaddress.ip_network(address))
                except ValueError:
                    pass

    def matches(self, direction: str, protocol: str, ip: Any, port: int) -> bool:
        if self.direction != "any" and self.direction != direction:
            return False
        if self.protocol != "any" and self.protocol != protocol:
            return False
        if not any(lo <= port <= hi for lo, hi in self.ports):
            return False
        return any(ip in net for net in self.networks if net.version == ip.version)


class NetRules:
    """The `[net]` rules with their pinned addresses, compiled for fast decisions."""

    def __init__(
        self, net: dict[str, Any], policy_name: str = "", proxy: tuple[str, int] | None = None
    ) -> None:
        self.policy_name = policy_name
        #: The host's egress proxy inside the sandbox (namespace providers): a TCP connect
        #: to it is left to the proxy, which judges the real target and records the denial.
        self.proxy = proxy
        self.rules = [_Rule(r) for r in net.get("rules", ())]
        self.pins: dict[str, list[str]] = {}
        self.reverse: dict[str, str] = {}
        for rule in self.rules:
            if rule.name is not None:
                addresses = [str(n.network_address) for n in rule.networks]
                self.pins.setdefault(rule.name, [])
                for address in addresses:
                    if address not in self.pins[rule.name]:
                        self.pins[rule.name].append(address)
                    self.reverse.setdefault(address, rule.name)
        self._cache: dict[tuple[str, str, str, int], Denial | None] = {}

    def decide(self, direction: str, protocol: str, host: str, port: int) -> Denial | None:
        key = (direction, protocol, host, port)
        if key in self._cache:
            return self._cache[key]
        result = self._decide(direction, protocol, host, port)
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = result
        return result

    def _decide(self, direction: str, protocol: str, host: str, port: int) -> Denial | None:
        rule_name = "net.bind" if direction == "bind" else "net.connect"
        try:
            ip = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            return Denial(
                rule_name, direction, f"{host}:{port}", self.policy_name, detail="not an IP address"
            )
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if (
            self.proxy is not None
            and direction == "connect"
            and protocol == "tcp"
            and (str(ip), port) == self.proxy
        ):
            return None
        allowed = False
        for rule in self.rules:
            if rule.matches(direction, protocol, ip, port):
                if rule.action == "deny":
                    return Denial(
                        rule_name,
                        direction,
                        f"{host}:{port}",
                        self.policy_name,
                        detail=f"a deny rule for {rule.host!r} matches, and deny beats allow",
                        hint=f"remove the deny rule for {rule.host!r} from [net] rules",
                    )
                allowed = True
        if allowed:
            return None
        entry = {"host": str(ip), "ports": str(port)}
        if protocol != "tcp":
            entry["protocol"] = protocol
        if direction != "connect":
            entry["direction"] = direction
        return Denial(
            rule_name,
            direction,
            f"{host}:{port}",
            self.policy_name,
            detail=f"no [net] rule allows {protocol} {direction} to this address",
            hint=grant_hint({"net.rules": [entry]}),
        )

    def resolve_denial(self, name: str, port: Any = None) -> Denial:
        ports = str(port) if isinstance(port, int | str) and str(port).isdigit() else "443"
        if self.proxy is not None:
            host, proxy_port = self.proxy
            return Denial(
                "net.resolve",
                "resolve",
                name,
                self.policy_name,
                detail="this sandbox resolves no names itself: its network goes through the "
                f"host's egress proxy at http://{host}:{proxy_port} (HTTP_PROXY), which "
                "resolves and judges each host; requests, urllib, httpx, pip and curl use it",
                hint=grant_hint({"net.rules": [{"host": name, "ports": ports}]}),
            )
        if self.pins.get(name.lower().rstrip(".")) == []:
            # A rule names it, but it resolved to nothing when the policy loaded (the pin).
            return Denial(
                "net.resolve",
                "resolve",
                name,
                self.policy_name,
                detail="a [net] rule names this host but it did not resolve when the policy "
                "loaded, so it reaches nothing",
                hint="check the host name in the policy's [net] rules (or its DNS on the host)",
            )
        return Denial(
            "net.resolve",
            "resolve",
            name,
            self.policy_name,
            detail="no [net] rule names this host, so it is not resolved (names are pinned "
            "when the policy loads)",
            hint=grant_hint({"net.rules": [{"host": name, "ports": ports}]}),
        )


_rules = NetRules({})


def configure(rules: NetRules) -> None:
    global _rules
    _rules = rules


def _active() -> bool:
    return _st.armed or (bool(_st.user_threads) and get_ident() in _st.user_threads)


def _is_ip(host: str) -> bool:
    known = _IS_IP.get(host)
    if known is not None:
        return known
    try:
        ipaddress.ip_address(host.split("%")[0])
        answer = True
    except ValueError:
        answer = False
    if len(_IS_IP) >= 4096:
        _IS_IP.clear()
    _IS_IP[host] = answer
    return answer


#: host string -> whether it is an IP address (a connect loop asks about the same few).
_IS_IP: dict[str, bool] = {}


def _pinned(name: str) -> list[str] | None:
    return _rules.pins.get(name.lower().rstrip("."))


def _protocol(sock: Any) -> str:
    kind = _C_TYPE(sock) & 0xF
    return "tcp" if kind == _SOCK_STREAM else "udp" if kind == _SOCK_DGRAM else "raw"


def _judge_address(sock: Any, address: Any, direction: str) -> Any:
    """Judge one address for `sock`; returns the address to hand to the call."""
    family = _C_FAMILY(sock)
    if family == _AF_UNIX:
        if isinstance(address, bytes | bytearray | str) and address[:1] in ("\0", b"\0"):
            refuse(
                NetworkDenied,
                Denial(
                    "net.bind" if direction == "bind" else "net.connect",
                    direction,
                    f"unix:@{address[1:]!r}",
                    _rules.policy_name,
                    detail="abstract Unix sockets are never allowed",
                ),
            )
            return address
        return _files.check(_files.WRITE, address)
    if family not in (_AF_INET, _AF_INET6):
        refuse(
            NetworkDenied,
            Denial(
                "net.bind" if direction == "bind" else "net.connect",
                direction,
                f"address family {family}",
                _rules.policy_name,
                detail="only IPv4, IPv6 and Unix sockets are judged; other families are refused",
            ),
        )
        return address
    if not isinstance(address, tuple) or len(address) < 2:
        return address  # the call raises its own TypeError
    host, port = address[0], address[1]
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str) or not isinstance(port, int):
        return address
    if host == "":
        host = "0.0.0.0" if family == _AF_INET else "::"
    elif host == "<broadcast>":
        host = "255.255.255.255"
    protocol = _protocol(sock)
    if not _is_ip(host):
        pins = _pinned(host)
        if not pins:
            refuse(NetworkDenied, _rules.resolve_denial(host, port))
            return address
        want = 4 if family == _AF_INET else 6
        usable = [ip for ip in pins if ipaddress.ip_address(ip).version == want] or pins
        chosen = None
        last: Denial | None = None
        for ip in usable:
            last = _rules.decide(direction, protocol, ip, port)
            if last is None:
                chosen = ip
                break
        if chosen is None:
            if last is not None:
                refuse(NetworkDenied, last)
            return address
        return (chosen, port, *address[2:])
    denial = _rules.decide(direction, protocol, host, port)
    if denial is not None:
        refuse(NetworkDenied, denial)
    return address


def _first_arg(direction: str) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if (_st.armed or (_st.user_threads and get_ident() in _st.user_threads)) and args:
            args = (_judge_address(instance, args[0], direction), *args[1:])
        return wrapped(*args, **kwargs)

    return wrapper


def _listen_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _active() and int(instance.family) in (_AF_INET, _AF_INET6):
        _judge_address(instance, instance.getsockname(), "bind")
    return wrapped(*args, **kwargs)


def _sendto_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _active() and len(args) >= 2:
        args = (*args[:-1], _judge_address(instance, args[-1], "connect"))
    return wrapped(*args, **kwargs)


def _sendmsg_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _active():
        if len(args) >= 4 and args[3] is not None:
            args = (*args[:3], _judge_address(instance, args[3], "connect"), *args[4:])
        elif kwargs.get("address") is not None:
            kwargs = dict(kwargs, address=_judge_address(instance, kwargs["address"], "connect"))
    return wrapped(*args, **kwargs)


def _getaddrinfo_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if not _active():
        return wrapped(*args, **kwargs)
    names = ("host", "port", "family", "type", "proto", "flags")
    call = dict(zip(names, args, strict=False))
    call.update(kwargs)
    host = call.get("host")
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if isinstance(host, str) and _is_ip(host) and not _rules.rules and _rules.proxy is None:
        # No [net] rule at all: the kernel refuses every internet socket (seccomp), so the
        # code would get a bare EPERM from `socket()` with no target. The lookup that comes
        # first names the target: refused here with the rule, the hint and the target.
        port = call.get("port")
        if isinstance(port, int | str) and str(port).isdigit():
            kind = call.get("type", 0)
            protocol = "udp" if kind == _SOCK_DGRAM else "tcp"
            denial = _rules.decide("connect", protocol, host, int(port))
            if denial is not None:
                refuse(NetworkDenied, denial)
    if host is None or (isinstance(host, str) and _is_ip(host)):
        return wrapped(*args, **kwargs)
    if not isinstance(host, str):
        return wrapped(*args, **kwargs)
    pins = _pinned(host)
    if not pins:
        refuse(NetworkDenied, _rules.resolve_denial(host, call.get("port")))
        return wrapped(*args, **kwargs)
    out: list[Any] = []
    error: Exception | None = None
    for ip in pins:
        try:
            out.extend(
                _orig_getaddrinfo(
                    ip,
                    call.get("port"),
                    call.get("family", 0),
                    call.get("type", 0),
                    call.get("proto", 0),
                    int(call.get("flags", 0)) | _AI_NUMERICHOST,
                )
            )
        except OSError as exc:
            error = exc
    if not out and error is not None:
        raise error
    return out


def _byname_wrapper(ex: bool) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not _active() or not args or not isinstance(args[0], str) or _is_ip(args[0]):
            return wrapped(*args, **kwargs)
        name = args[0]
        pins = [ip for ip in (_pinned(name) or []) if ":" not in ip]
        if not pins:
            refuse(NetworkDenied, _rules.resolve_denial(name))
            return wrapped(*args, **kwargs)
        return (name, [], pins) if ex else pins[0]

    return wrapper


def _byaddr_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if not _active() or not args or not isinstance(args[0], str):
        return wrapped(*args, **kwargs)
    target = args[0]
    if _is_ip(target):
        name = _rules.reverse.get(target)
        if name is None:
            refuse(NetworkDenied, _rules.resolve_denial(target))
            return wrapped(*args, **kwargs)
        return (name, [], [target])
    pins = _pinned(target)
    if not pins:
        refuse(NetworkDenied, _rules.resolve_denial(target))
        return wrapped(*args, **kwargs)
    return (target, [], list(pins))


def _nameinfo_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if not _active() or len(args) < 2:
        return wrapped(*args, **kwargs)
    sockaddr, flags = args[0], args[1]
    if isinstance(flags, int) and flags & _NI_NUMERICHOST:
        return wrapped(*args, **kwargs)
    host = sockaddr[0] if isinstance(sockaddr, tuple) and sockaddr else None
    name = _rules.reverse.get(str(host))
    if name is None:
        refuse(NetworkDenied, _rules.resolve_denial(str(host)))
        return wrapped(*args, **kwargs)
    return (name, str(sockaddr[1]))


_METHODS: dict[str, Any] = {
    "connect": _first_arg("connect"),
    "connect_ex": _first_arg("connect"),
    "bind": _first_arg("bind"),
    "listen": _listen_wrapper,
    "sendto": _sendto_wrapper,
    "sendmsg": _sendmsg_wrapper,
}


class _GuardedCSocket(_socket.socket):  # type: ignore[misc]
    """What `_socket.socket` names after install: the C socket with judged methods."""


def _socket_init_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """An internet socket the kernel refuses (seccomp, under a policy with no `[net]`
    rule) is a `net.connect` refusal with its rule and hint, not a bare EPERM."""
    try:
        return wrapped(*args, **kwargs)
    except PermissionError:
        family = args[0] if args else kwargs.get("family", _AF_INET)
        if not _active() or int(family if family is not None else -1) not in (
            _AF_INET,
            _AF_INET6,
        ):
            raise
        kind = args[1] if len(args) > 1 else kwargs.get("type", _SOCK_STREAM)
        protocol = "udp" if int(kind if kind is not None else 0) & 0xF == _SOCK_DGRAM else "tcp"
        refuse(
            NetworkDenied,
            Denial(
                "net.connect",
                "socket",
                f"a {protocol} socket",
                _rules.policy_name,
                detail="the policy has no [net] rule, so the kernel refuses every internet socket",
                hint=grant_hint(
                    {"net.rules": [{"host": "<the host it connects to>", "ports": "<port>"}]}
                ),
            ),
        )
        raise


#: The clients' error classes whose text can carry the egress proxy's refusal (each class
#: that words its own `__str__`, or the base of those that inherit it): their `__str__` puts
#: the refusal first (`_refusal_first_str`). Missing ones (a client not installed, another
#: version's names) are skipped.
_CLIENT_ERRORS = (
    ("requests.exceptions", "RequestException.__str__"),
    ("urllib.error", "URLError.__str__"),
    ("http.client", "HTTPException.__str__"),
    ("httpx._exceptions", "HTTPError.__str__"),
    ("aiohttp.client_exceptions", "ClientError.__str__"),
    ("aiohttp.client_exceptions", "ClientResponseError.__str__"),
    ("aiohttp.client_exceptions", "ClientConnectorError.__str__"),
)


def _refusal_first_str(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A client's error whose text carries the proxy's marked refusal (`REFUSAL_START`)
    says the refusal first (rule, target, hint), then its own words; any other text, and
    the exception's type, stay as they are."""
    text = wrapped(*args, **kwargs)
    if isinstance(text, str) and REFUSAL_START in text:
        return refusal_first(text) or text
    return text


def _tunnel_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """http.client's refused `CONNECT` raises a bare `OSError("Tunnel connection failed:
    403 <refusal>")`, whose class cannot be patched: its message is put refusal-first in
    place (the same exception, type and traceback), the marked refusal kept in the words
    that follow, for a library that quotes this error in its own (urllib, urllib3)."""
    try:
        return wrapped(*args, **kwargs)
    except OSError as exc:
        if len(exc.args) == 1 and isinstance(exc.args[0], str):
            first = refusal_first(exc.args[0], keep_marked=True)
            if first is not None:
                exc.args = (first,)
        raise


def install() -> None:
    for home, dotted in _CLIENT_ERRORS:
        _patch.wrap_later(home, dotted, _refusal_first_str)
    _patch.wrap_later("http.client", "HTTPConnection._tunnel", _tunnel_wrapper)
    for name, wrapper in _METHODS.items():
        _patch.wrap(socket.socket, name, wrapper, label=f"socket.socket.{name}")
        _patch.wrap(_GuardedCSocket, name, wrapper, label=f"_socket.socket.{name}")
    _patch.wrap(socket.socket, "__init__", _socket_init_wrapper, label="socket.socket.__init__")
    _patch.set_attr(_socket, "socket", _GuardedCSocket, label="_socket.socket")
    _patch.set_attr(_socket, "SocketType", _GuardedCSocket, label="_socket.SocketType")
    _patch.wrap(_socket, "getaddrinfo", _getaddrinfo_wrapper)
    for module in (socket, _socket):
        _patch.wrap(module, "gethostbyname", _byname_wrapper(False))
        _patch.wrap(module, "gethostbyname_ex", _byname_wrapper(True))
        _patch.wrap(module, "gethostbyaddr", _byaddr_wrapper)
        _patch.wrap(module, "getnameinfo", _nameinfo_wrapper)
