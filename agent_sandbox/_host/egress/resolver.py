"""The proxy's one resolver: pinned on the host, asked only for names a rule names.

`system_resolve` (the host's resolver, the default), `dns_resolver` (one DNS server over UDP,
nothing else), the cache in front of either (`RESOLVE_CACHE_SECONDS`), `set_resolver` to
replace it (tests; a deployment pinning its DNS server), and `_lookup`, the event loop's way
of asking it (bounded by `RESOLVE_TIMEOUT`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from collections.abc import Callable

from agent_sandbox._host.egress.addresses import normalise_host

__all__ = ["Resolver", "dns_resolver", "set_resolver", "system_resolve"]


RESOLVE_TIMEOUT = 5.0


Resolver = Callable[[str], list[str]]


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


async def _lookup(name: str) -> list[str]:
    """The pinned resolver's answer for a name a rule names (bounded by RESOLVE_TIMEOUT)."""
    loop = asyncio.get_running_loop()
    resolver = _resolver
    return await asyncio.wait_for(
        loop.run_in_executor(None, resolver.lookup, name), RESOLVE_TIMEOUT
    )
