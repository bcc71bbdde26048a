"""SOCKS5 as the proxy serves it (RFC 1928: no authentication, `CONNECT` only).

A connection whose first byte is 5 is a SOCKS5 client (`socks5h://127.0.0.1:3128`).
`serve` answers it with what the parsers (`socks5_greeting`, `socks5_request`) return and
has the session judge the target like a `CONNECT`; a refusal is reply code 2 and the same
denial, recorded by the session before the reply. The session keeps the deadlines, the
byte bound and the tunnel.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_sandbox._host.egress.session import _Session

__all__ = ["serve", "socks5_greeting", "socks5_request"]

#: The longest head: a greeting is at most 257 bytes and a request 262, and the parsers
#: answer as soon as they hold one; a client still short of an answer past this is refused.
LONGEST_HEAD = 2 + 255 + 4 + 1 + 255 + 2


async def serve(session: _Session, data: bytes) -> None:
    """A SOCKS5 client (RFC 1928): no authentication, `CONNECT` only, judged like a
    `CONNECT` request (a name is resolved and judged on the host: `socks5h://`); `data` is
    what the session read first."""

    async def need(parse: Callable[[bytes], Any]) -> Any:
        nonlocal data
        while (out := parse(data)) is None:
            if len(data) > LONGEST_HEAD:
                raise ConnectionError("SOCKS5 head too long")
            more = await session.read(session.reader)
            if not more:
                raise ConnectionError("SOCKS5 client went away")
            data += more
        return out

    def reply(code: int) -> None:
        session.writer.write(bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0]))

    answer, used = await need(socks5_greeting)
    session.writer.write(answer)
    data = data[used:]
    if answer != b"\x05\x00":
        session.refused_head("a SOCKS5 greeting offering no method without authentication")
        return
    code, host, port, used = await need(socks5_request)
    leftover = data[used:]
    if code:
        session.refused_head(f"a SOCKS5 request the proxy does not serve (reply {code})")
        reply(code)
        return
    session.head_in()
    session.target = f"{host[:200]}:{port}"
    addresses, denial = await session.judge(host, port)  # a denial: recorded by the session
    if denial is not None:
        reply(2)  # connection not allowed by ruleset
        return
    if await session.connect(addresses, port):
        reply(5)  # connection refused
        return
    reply(0)
    await session.tunnel(leftover)


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
