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
   parsed, see `_Session`). It judges each target against the
   policy's rules by host name and port (`EgressRules`), resolves names itself on the host
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

This module is longer than 600 lines because it came whole from `providers/_egress.py`
(files move apart from behaviour changes); it is to be cut by concern within this package
(rules, proxy, HTTP, SOCKS, hand-off).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import ipaddress
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

import h11

from agent_sandbox._denial import Denial, refusal_line
from agent_sandbox._hints import grant_hint

__all__ = [
    "LAN_NETWORKS",
    "in_lan",
    "PROXY_HOST",
    "PROXY_PORT",
    "EgressError",
    "EgressProxy",
    "EgressRules",
    "Route",
    "egress_proxy",
    "proxy_env",
    "dns_resolver",
    "normalise_host",
    "set_resolver",
]


#: LAN ranges (RFC 1918 private, RFC 6598 shared, link-local, IPv6 unique-local and
#: link-local): an allow rule naming an address inside one is refused by the namespace
#: providers (`providers._netcheck.lan_network`), and the proxy's refusal of one says why.
LAN_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "fc00::/7",
        "fe80::/10",
    )
)


def in_lan(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """Whether `net` (an address as a /32 or /128, or a range) lies inside a LAN range."""
    return any(net.version == lan.version and net.subnet_of(lan) for lan in LAN_NETWORKS)  # type: ignore[arg-type]


#: Where the worker's listener sits inside its own network namespace.
PROXY_HOST = "127.0.0.1"
PROXY_PORT = 3128

#: Bounds (see the module docstring).
MAX_CONNECTIONS_PER_ROUTE = 64
MAX_BYTES_PER_CALL = 1 << 30
CONNECTION_SECONDS = 300.0
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


# -- one spelling for every host ---------------------------------------------------------

#: The longest host name DNS carries (RFC 1035: 253 characters in text form).
MAX_NAME = 253
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPAT = ipaddress.ip_network("::/96")
_LABEL = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclasses.dataclass(frozen=True)
class Host:
    """A target host in its one canonical spelling (see `normalise_host`).

    `name` is set for a host name (lower case, no trailing dot); `ip` for an address (the
    one the proxy connects to), and `judged` is the address the rules judge: the IPv4
    address embedded in an IPv4-mapped, IPv4-compatible, NAT64, 6to4 or Teredo address
    (the host such an address reaches), else `ip` itself. `form` names the spelling.
    """

    text: str
    name: str | None = None
    ip: Any = None
    judged: Any = None
    form: str = "name"


def _legacy_ipv4(text: str) -> Any:
    """`inet_aton`'s forms (1 to 4 parts, each decimal, 0-octal or 0x-hex, the last one
    filling the remaining bytes: `2130706433`, `0x7f.1`, `0177.0.0.01`, `127.1`); None when
    `text` is not one."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values: list[int] = []
    for part in parts:
        try:
            if part[:2] in ("0x", "0X"):
                values.append(int(part[2:] or "0", 16))
            elif part[:1] == "0" and len(part) > 1:
                values.append(int(part[1:], 8))
            elif part.isdigit() and part.isascii():
                values.append(int(part, 10))
            else:
                return None
        except ValueError:
            return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    number = last
    for i, v in enumerate(head):
        number |= v << (8 * (3 - i))
    return ipaddress.IPv4Address(number)


def _embedded_ipv4(ip: Any) -> tuple[Any, str]:
    """The IPv4 address an IPv6 address carries, and the form that carries it."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, "ipv4-mapped"
    if ip in _IPV4_COMPAT and int(ip) > 1:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "ipv4-compatible"
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "nat64"
    if ip.sixtofour is not None:
        return ip.sixtofour, "6to4"
    if ip.teredo is not None:
        return ip.teredo[1], "teredo"
    return None, "ipv6"


def normalise_host(text: str) -> Host:
    """The one canonical form of a host as a client spelled it; ValueError when it is
    neither an address nor a valid host name (the error says which part is wrong).

    Every judgement starts here: brackets, case, one trailing dot and an IPv6 zone
    (`%eth0`, `%25eth0`) are dropped; IPv4 is read in all of `inet_aton`'s spellings;
    an IPv4-mapped or IPv4-compatible address becomes its IPv4 address (connected to as
    IPv4); a NAT64, 6to4 or Teredo address is judged by the IPv4 address it reaches.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("an empty host")
    if len(text) > MAX_NAME + 2:
        raise ValueError(f"a host of {len(text)} characters (a name has at most {MAX_NAME})")
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host.lower()
    if host.endswith(".") and not host.endswith(".."):
        host = host[:-1]
    if ":" in host:
        address = host.split("%", 1)[0]
        try:
            ip6 = ipaddress.IPv6Address(address)
        except ValueError:
            raise ValueError(f"{text[:80]!r} is not an IPv6 address") from None
        embedded, form = _embedded_ipv4(ip6)
        if form in ("ipv4-mapped", "ipv4-compatible"):
            return Host(str(embedded), ip=embedded, judged=embedded, form=form)
        return Host(str(ip6), ip=ip6, judged=embedded or ip6, form=form)
    ip4 = _legacy_ipv4(host)
    if ip4 is not None:
        return Host(str(ip4), ip=ip4, judged=ip4, form="ipv4")
    if not host or len(host) > MAX_NAME:
        raise ValueError(f"a host name of {len(host)} characters (at most {MAX_NAME})")
    raw = host.encode("ascii", "replace")
    for label in raw.split(b"."):
        if not 1 <= len(label) <= 63 or not _LABEL.issuperset(label):
            raise ValueError(
                f"{text[:80]!r} is not a valid host name (labels of 1 to 63 letters, digits, "
                "'-' or '_')"
            )
    if raw.replace(b".", b"").isdigit():
        raise ValueError(f"{text[:80]!r} is neither an IPv4 address nor a host name")
    return Host(host, name=host)


# -- decisions (pure) --------------------------------------------------------------------


def _address(text: str) -> Any:
    """The address a client's spelling of an IP names (ValueError for a name)."""
    spelled = normalise_host(text)
    if spelled.ip is None:
        raise ValueError(f"{text!r} is a host name, not an address")
    return spelled.ip


def is_special(ip: Any) -> bool:
    """Whether a name rule must not reach `ip`: loopback, private, link-local, metadata..."""
    return not ip.is_global or ip.is_multicast or any(ip in net for net in _SPECIAL_NETS)


def _special_only(net: Any) -> bool:
    """Whether a rule's network names non-global addresses on purpose: it lies inside one
    of the special ranges, or it is one address (`0.0.0.0/0` is neither)."""
    return net.prefixlen == net.max_prefixlen or any(
        net.version == s.version and net.subnet_of(s) for s in _SPECIAL_NETS
    )


@dataclasses.dataclass(frozen=True)
class _Rule:
    action: str
    host: str
    name: str | None
    networks: tuple[Any, ...]
    ports: tuple[tuple[int, int], ...]
    #: `*` (or `any`): every host name and every global address.
    every_name: bool = False

    def has_port(self, port: int) -> bool:
        return any(lo <= port <= hi for lo, hi in self.ports)

    def holds(self, ip: Any) -> bool:
        return any(ip.version == net.version and ip in net for net in self.networks)

    def names(self, name: str) -> bool:
        return self.every_name or self.name == name


_EVERY_HOST = frozenset({"*", "any"})


class EgressRules:
    """A policy's TCP connect rules, as the proxy judges them (pure: no I/O here).

    Every target is first put in its one spelling (`normalise_host`), then:

    * A target given by name needs an allow rule naming that host on that port (names
      compare case-insensitively, without a trailing dot), or a `*` rule; only then is it
      resolved. An IP/CIDR rule never makes a name resolvable: a name no rule names is
      refused before any resolver sees it (`net.resolve`), so names carry no data out.
    * A deny rule naming a host beats any allow, for the name and for every address the
      name resolves to (`deny_addresses`, filled by the proxy from the same resolver), so
      the denied host is not reachable by its address either.
    * A name rule reaches only global addresses: a name that resolves to a loopback,
      private, link-local (the metadata address 169.254.169.254), shared or multicast
      address is refused unless an IP or CIDR rule lying inside such a range covers it
      (`0.0.0.0/0` does not count: it names no such address).
    * A target given as an address needs an IP/CIDR rule covering it (the address it
      reaches, for NAT64, 6to4 and Teredo), with the same rule for non-global addresses;
      `localhost` in a rule names the loopback addresses.
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
            every = host.lower() in _EVERY_HOST
            if every:
                networks = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
            elif host.lower() in _LOOPBACK_NAMES:
                networks = tuple(ipaddress.ip_network(n) for n in _LOOPBACK_NAMES[host.lower()])
            else:
                try:
                    networks = (ipaddress.ip_network(host, strict=False),)
                except ValueError:
                    try:
                        spelled = normalise_host(host)
                    except ValueError:
                        spelled = Host(host.lower(), name=host.lower())
                    if spelled.ip is not None:
                        networks = (ipaddress.ip_network(spelled.judged),)
                    else:
                        name = spelled.name
            self.rules.append(
                _Rule(rule.action, host, name, networks, tuple(rule.port_ranges()), every)
            )
        #: The names deny rules name, and the addresses they resolved to (by the proxy).
        self.deny_names = sorted(
            {r.name for r in self.rules if r.action == "deny" and r.name is not None}
        )
        self.deny_addresses: dict[str, list[Any]] = {}

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

    def bad_host(self, host: str, port: int, why: str) -> Denial:
        """The denial for a host that is neither an address nor a valid name."""
        return self._denial(
            "net.resolve",
            "resolve",
            host[:120] + ("..." if len(host) > 120 else ""),
            f"not a host the proxy connects to ({why}; port {port})",
            "name the host by a valid DNS name or an IP address",
        )

    def before_resolve(self, host: str, port: int) -> Denial | None:
        """Judge a host name before it is looked up: None only when an allow rule names it
        (or `*`) on this port and no deny rule names it; nothing else is ever resolved."""
        try:
            name = normalise_host(host).name or host.lower()
        except ValueError as exc:
            return self.bad_host(host, port, str(exc))
        named = [r for r in self.rules if r.names(name)]
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
        if any(r.action == "allow" for r in named):
            ports = ",".join(r.host + ":" + _ports_text(r.ports) for r in named)
            return self._denial(
                "net.connect",
                "connect",
                f"{host}:{port}",
                f"the [net] rules name this host for other ports only ({ports})",
                grant_hint({"net.rules": [{"host": name, "ports": str(port)}]}),
            )
        return self._denial(
            "net.resolve",
            "resolve",
            name,
            f"no [net] rule names this host, so it is not resolved (port {port})",
            grant_hint({"net.rules": [{"host": name, "ports": str(port)}]}),
        )

    def judge(
        self, host: str, port: int, addresses: Iterable[str], *, by_name: bool
    ) -> tuple[list[str], Denial | None]:
        """The addresses a connection may use, in order; else the denial for the first."""
        name = host.lower().rstrip(".")
        name_allows = by_name and any(
            r.action == "allow" and r.names(name) and r.has_port(port) for r in self.rules
        )
        usable: list[str] = []
        first: Denial | None = None
        for text in addresses:
            try:
                spelled = normalise_host(text)
            except ValueError:
                continue
            if spelled.ip is None:
                continue
            denial = self._judge_address(host, port, spelled, name_allows)
            if denial is None:
                usable.append(str(spelled.ip))
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

    def _judge_address(
        self, host: str, port: int, spelled: Host, name_allows: bool
    ) -> Denial | None:
        target = f"{host}:{port}"
        ip = spelled.judged
        both = (ip,) if spelled.ip == ip else (ip, spelled.ip)
        special = is_special(ip) or spelled.form == "teredo"
        shown = str(ip) if spelled.ip == ip else f"{spelled.ip} ({spelled.form} for {ip})"
        for rule in self.rules:
            if rule.action == "deny" and rule.has_port(port) and any(map(rule.holds, both)):
                return self._denial(
                    "net.connect",
                    "connect",
                    target,
                    f"{shown} is covered by a deny rule for {rule.host!r}, and deny beats allow",
                    f"remove the deny rule for {rule.host!r} from [net] rules",
                )
        for rule in self.rules:
            if rule.action != "deny" or rule.name is None or not rule.has_port(port):
                continue
            if any(a in self.deny_addresses.get(rule.name, ()) for a in both):
                return self._denial(
                    "net.connect",
                    "connect",
                    target,
                    f"{shown} is an address of {rule.host!r}, which a deny rule names, and "
                    "deny beats allow",
                    f"remove the deny rule for {rule.host!r} from [net] rules",
                )
        for rule in self.rules:
            if rule.action != "allow" or rule.name is not None or not rule.has_port(port):
                continue
            if any(
                a.version == net.version and a in net and (not special or _special_only(net))
                for net in rule.networks
                for a in both
            ):
                return None
        if name_allows and not special:
            return None
        hint = grant_hint({"net.rules": [{"host": str(ip), "ports": str(port)}]})
        if in_lan(ipaddress.ip_network(ip)):
            # A rule naming a LAN address refuses the policy (`_netcheck`): the way that works.
            hint = (
                f"{ip} is a LAN address, which a sandbox in a network namespace cannot reach "
                f"for every client: forward {ip}:{port} to a port on the host's loopback (ssh "
                'or socat) and allow host = "127.0.0.1" with that port'
            )
        if special and name_allows:
            return self._denial(
                "net.connect",
                "connect",
                target,
                f"{host} resolves to {shown}, a {_kind(ip)} address, which a host-name rule "
                "never reaches; a rule must name that address",
                hint,
            )
        if special:
            detail = f"{shown} is a {_kind(ip)} address and no [net] rule names it"
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


def _dns_query(qid: int, name: str, qtype: int) -> bytes:
    labels = b"".join(bytes([len(p)]) + p for p in name.encode("ascii").split(b"."))
    return (
        qid.to_bytes(2, "big")
        + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
        + labels
        + (b"\x00" + qtype.to_bytes(2, "big") + b"\x00\x01")
    )


def _dns_skip_name(data: bytes, i: int) -> int:
    for _ in range(128):
        n = data[i]
        if n == 0:
            return i + 1
        if n & 0xC0 == 0xC0:
            return i + 2
        i += 1 + n
    raise ValueError("a name with too many labels")


def _dns_answers(data: bytes, qid: int, qtype: int) -> list[str]:
    """The addresses of type `qtype` in a DNS answer; OSError for an error code."""
    if len(data) < 12 or int.from_bytes(data[:2], "big") != qid or not data[2] & 0x80:
        raise ValueError("not the answer to this query")
    rcode = data[3] & 0x0F
    if rcode:
        raise OSError(f"the DNS server answered rcode {rcode}")
    qdcount, ancount = int.from_bytes(data[4:6], "big"), int.from_bytes(data[6:8], "big")
    i = 12
    for _ in range(qdcount):
        i = _dns_skip_name(data, i) + 4
    out: list[str] = []
    for _ in range(ancount):
        i = _dns_skip_name(data, i)
        rtype, length = (
            int.from_bytes(data[i : i + 2], "big"),
            int.from_bytes(data[i + 8 : i + 10], "big"),
        )
        rdata = data[i + 10 : i + 10 + length]
        i += 10 + length
        if rtype == qtype == 1 and len(rdata) == 4:
            out.append(str(ipaddress.IPv4Address(rdata)))
        elif rtype == qtype == 28 and len(rdata) == 16:
            out.append(str(ipaddress.IPv6Address(rdata)))
    return out


def dns_resolver(server: tuple[str, int], timeout: float = RESOLVE_TIMEOUT) -> Resolver:
    """A resolver that asks one DNS server over UDP (A, then AAAA), and nothing else:
    no search list, no hosts file, no other server (the pinned resolver)."""
    import secrets

    def resolve(host: str) -> list[str]:
        name = normalise_host(host).name
        if name is None:
            raise OSError(f"{host!r} is not a host name")
        family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
        out: list[str] = []
        deadline = time.monotonic() + timeout
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(server)
            for qtype in (1, 28):
                qid = secrets.randbits(16)
                sock.send(_dns_query(qid, name, qtype))
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise OSError(f"the DNS server {server[0]}:{server[1]} did not answer")
                    sock.settimeout(left)
                    try:
                        data = sock.recv(4096)
                    except TimeoutError:
                        continue
                    try:
                        out.extend(_dns_answers(data, qid, qtype))
                    except (ValueError, IndexError):
                        continue  # not our answer, or malformed: wait for the real one
                    break
        if not out:
            raise OSError(f"[Errno -2] Name or service not known: {name!r}")
        return out

    return resolve


#: How long a lookup's answer (or failure) is kept, and how many names are kept.
RESOLVE_CACHE_SECONDS = 30.0
RESOLVE_CACHE_NAMES = 1024


class _CachedResolver:
    """The proxy's one resolver (pinned: set on the host, never by the worker), its
    answers kept for RESOLVE_CACHE_SECONDS; it is asked only for names a rule names."""

    def __init__(self, resolve: Resolver) -> None:
        self.resolve = resolve
        self._cache: dict[str, tuple[float, list[str] | None, str]] = {}
        self._lock = threading.Lock()

    def lookup(self, name: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(name)
        if hit is not None and now - hit[0] < RESOLVE_CACHE_SECONDS:
            if hit[1] is None:
                raise OSError(hit[2])
            return list(hit[1])
        try:
            answer: list[str] | None = list(self.resolve(name))
            error = ""
        except Exception as exc:
            answer, error = None, str(exc) or repr(exc)
        with self._lock:
            if len(self._cache) >= RESOLVE_CACHE_NAMES:
                self._cache.clear()
            self._cache[name] = (now, answer, error)
        if answer is None:
            raise OSError(error)
        return list(answer)


_resolver = _CachedResolver(system_resolve)


def set_resolver(resolver: Resolver | None) -> Resolver:
    """Replace the proxy's resolver (tests map names to loopback servers, or point it at
    a DNS server with `dns_resolver`); returns the old. `None` puts the system resolver
    back. The resolver runs on the host, in a thread, and raises OSError for a name that
    does not resolve; its answers are cached (`RESOLVE_CACHE_SECONDS`).
    """
    global _resolver
    old = _resolver.resolve
    _resolver = _CachedResolver(resolver or system_resolve)
    return old


# -- taking the worker's listener (the worker's side is `_inworker.open_egress_listener`) --


#: At most this many loopback address:port pairs are forwarded into a sandbox.
MAX_FORWARDS = 16


def loopback_forwards(policy: Any) -> list[tuple[str, int]]:
    """The allowed loopback services a namespace sandbox gets at the same address inside
    (`host = "127.0.0.1" ports = "8765"`): a listener there, served by the host, which
    judges and forwards each connection to that address:port on the host, so clients
    that do not read `HTTP_PROXY` (http.client, sockets, database drivers) reach it.
    Only single loopback addresses (`localhost` is 127.0.0.1), at most MAX_FORWARDS
    pairs in all (the first ones), never the proxy's own port."""
    out: list[tuple[str, int]] = []
    for rule in policy.net.rules:
        if rule.action != "allow" or rule.protocol not in ("tcp", "any"):
            continue
        if rule.direction not in ("connect", "any"):
            continue
        host = rule.host.strip().lower()
        if host in ("localhost", "localhost.localdomain"):
            host = "127.0.0.1"
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            continue
        if not ip.is_loopback:
            continue
        for lo, hi in rule.port_ranges():
            if hi - lo >= MAX_FORWARDS:
                continue  # a wide range: through the proxy only
            for port in range(max(lo, 1), hi + 1):
                pair = (str(ip), port)
                if port != PROXY_PORT and pair not in out:
                    out.append(pair)
    return out[:MAX_FORWARDS]


def receive_listener(channel: socket.socket, timeout: float) -> socket.socket:
    """In the host: the listening socket the worker sent, checked (raises EgressError)."""
    listener, extra = receive_listeners(channel, timeout, [])
    for sock in extra.values():
        sock.close()
    return listener


def receive_listeners(
    channel: socket.socket, timeout: float, forwards: list[tuple[str, int]]
) -> tuple[socket.socket, dict[tuple[str, int], socket.socket]]:
    """In the host: the proxy's listening socket the worker sent, and its listeners for
    `forwards` (the host's own list; each matched by the address the kernel says it is
    bound to, anything else refused), checked (raises EgressError)."""
    channel.settimeout(max(timeout, 0.05))
    try:
        _msg, fds, _flags, _addr = socket.recv_fds(channel, 16, 1 + MAX_FORWARDS)
    except (OSError, TimeoutError) as exc:
        raise EgressError(f"the worker sent no proxy listener ({exc})") from None
    if not 1 <= len(fds) <= 1 + len(forwards):
        for fd in fds:
            with contextlib.suppress(OSError):
                socket.close(fd)
        raise EgressError(f"the worker sent {len(fds)} descriptors for the proxy, not one")
    socks: list[socket.socket] = []
    try:
        for fd in fds:
            try:
                socks.append(socket.socket(fileno=fd))
            except OSError as exc:
                with contextlib.suppress(OSError):
                    socket.close(fd)
                raise EgressError(
                    f"the worker's proxy descriptor is not a socket ({exc})"
                ) from None
        for sock in socks:
            ok = (
                sock.family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)
                and sock.type == socket.SOCK_STREAM
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            )
            if not ok:
                raise EgressError("the worker's proxy descriptor is not a listening stream socket")
        extra: dict[tuple[str, int], socket.socket] = {}
        for sock in socks[1:]:
            bound = sock.getsockname()
            pair = _forward_pair(bound)
            if pair not in forwards or pair in extra:
                raise EgressError(f"the worker sent a listener on {pair}, which is not forwarded")
            extra[pair] = sock
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks[0], extra


def _forward_pair(bound: Any) -> tuple[str, int] | None:
    """The loopback service a forward listener stands for: the address it is bound to, or,
    for a Unix socket (gVisor's: the sandbox's relay connects to it), the address its name
    says (`_gvisor.forward_socket_name`); None for anything else. The caller checks the
    pair against the host's own list."""
    try:
        if isinstance(bound, str):
            name = os.path.basename(bound)
            if not (name.startswith("fwd-") and name.endswith(".sock")):
                return None
            host, _, port = name[4 : -len(".sock")].rpartition("-")
            return (str(ipaddress.ip_address(host)), int(port))
        return (str(ipaddress.ip_address(bound[0])), int(bound[1]))
    except (ValueError, TypeError, IndexError):
        return None


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


async def _lookup(name: str) -> list[str]:
    """The pinned resolver's answer for a name a rule names (bounded by RESOLVE_TIMEOUT)."""
    loop = asyncio.get_running_loop()
    resolver = _resolver
    return await asyncio.wait_for(
        loop.run_in_executor(None, resolver.lookup, name), RESOLVE_TIMEOUT
    )


async def _decide(route: Route, host: str, port: int) -> tuple[list[str], Denial | None]:
    """Judge a target: its one spelling first (`normalise_host`); an address is judged as
    it is; a name is judged, then (only when a rule names it) resolved on the host by the
    pinned resolver, then judged by address. A deny rule's names are resolved too, so
    their addresses are refused whatever the spelling."""
    rules = route.rules
    try:
        spelled = normalise_host(host)
    except ValueError as exc:
        return [], rules.bad_host(host, port, str(exc))
    for name in rules.deny_names:
        with contextlib.suppress(Exception):
            found = await _lookup(name)
            rules.deny_addresses[name] = [
                a for a in (_address_or_none(t) for t in found) if a is not None
            ]
    if spelled.ip is not None:
        return rules.judge(spelled.text, port, [spelled.text], by_name=False)
    assert spelled.name is not None
    denial = rules.before_resolve(spelled.name, port)
    if denial is not None:
        return [], denial
    try:
        addresses = await _lookup(spelled.name)
    except Exception as exc:  # whatever the resolver raises, the name did not resolve
        why = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc) or repr(exc)
        return [], rules._denial(
            "net.resolve",
            "resolve",
            spelled.name,
            f"the host does not resolve ({why})",
            "check the host name in the policy's [net] rules",
        )
    return rules.judge(spelled.name, port, addresses, by_name=True)


def _address_or_none(text: str) -> Any:
    try:
        spelled = normalise_host(text)
    except ValueError:
        return None
    return spelled.judged if spelled.ip is not None else None


def socks5_greeting(data: bytes) -> tuple[bytes, int] | None:
    """A SOCKS5 greeting (RFC 1928 section 3): (the answer, bytes used); None when more
    bytes are needed. Only "no authentication" (0) is accepted; else 0xFF."""
    if len(data) < 2:
        return None
    used = 2 + data[1]
    if len(data) < used:
        return None
    if data[0] != 5 or 0 not in data[2:used]:
        return b"\x05\xff", used
    return b"\x05\x00", used


def socks5_request(data: bytes) -> tuple[int, str, int, int] | None:
    """A SOCKS5 request (RFC 1928 section 4): (reply code, host, port, bytes used), the
    code 0 for a `CONNECT` the proxy serves, 7 for another command or version, 8 for an
    unknown address type; None when more bytes are needed."""
    if len(data) < 5:
        return None
    version, command, kind = data[0], data[1], data[3]
    if kind == 1:
        end = 8
    elif kind == 4:
        end = 20
    elif kind == 3:
        end = 5 + data[4]
    else:
        return 8, "", 0, len(data)
    if len(data) < end + 2:
        return None
    if kind == 1:
        host = str(ipaddress.IPv4Address(data[4:end]))
    elif kind == 4:
        host = str(ipaddress.IPv6Address(data[4:end]))
    else:
        host = data[5:end].decode("ascii", "backslashreplace")
    port = int.from_bytes(data[end : end + 2], "big")
    if version != 5 or command != 1:
        return 7, host, port, end + 2
    return 0, host, port, end + 2


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


_proxy: EgressProxy | None = None
_proxy_lock = threading.Lock()


def egress_proxy() -> EgressProxy:
    """The process's proxy (one event-loop thread serves every worker's route)."""
    global _proxy
    with _proxy_lock:
        if _proxy is None:
            _proxy = EgressProxy()
        return _proxy
