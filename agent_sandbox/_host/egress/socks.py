"""SOCKS5 as the proxy reads it (RFC 1928: no authentication, `CONNECT` only).

A connection whose first byte is 5 is a SOCKS5 client (`socks5h://127.0.0.1:3128`); the
session (`session._Session._socks`) answers with what these parsers return, and judges the
target like a `CONNECT`. A refusal is reply code 2 and the same recorded denial.
"""

from __future__ import annotations

import ipaddress

__all__ = ["socks5_greeting", "socks5_request"]


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
