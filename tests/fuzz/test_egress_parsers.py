"""The egress proxy's parsers: the SOCKS5 part table-tested, and the committed fuzz corpus
(grown by `egress_fuzz.py`) replayed: through each pure parser, and as raw bytes into a
live proxy route, which must refuse or serve each input and go on serving."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from agent_sandbox import Policy
from agent_sandbox._host.egress import session
from agent_sandbox._host.egress.proxy import egress_proxy
from agent_sandbox._host.egress.socks import socks5_greeting, socks5_request

sys.path.insert(0, os.path.dirname(__file__))
import egress_targets

CORPUS = Path(__file__).parent / "corpus"


def _corpus(name: str) -> list[Path]:
    return sorted((CORPUS / name).iterdir())


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", None),
        (b"\x05", None),
        (b"\x05\x02\x00", None),
        (b"\x05\x01\x00", (b"\x05\x00", 3)),
        (b"\x05\x02\x02\x00rest", (b"\x05\x00", 4)),
        (b"\x05\x01\x02", (b"\x05\xff", 3)),  # user/password only: no acceptable method
        (b"\x05\x00", (b"\x05\xff", 2)),  # no method at all
        (b"\x04\x01\x00", (b"\x05\xff", 3)),  # not SOCKS5
    ],
)
def test_socks5_greeting(data: bytes, expected: object) -> None:
    """RFC 1928 section 3: "no authentication" or nothing."""
    assert socks5_greeting(data) == expected


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\x05\x01\x00\x01\x7f\x00\x00", None),
        (b"\x05\x01\x00\x01\x7f\x00\x00\x01\x00\x50", (0, "127.0.0.1", 80, 10)),
        (b"\x05\x01\x00\x03\x06a.test\x01\xbbxx", (0, "a.test", 443, 13)),
        (b"\x05\x01\x00\x04" + bytes(15) + b"\x01\x00\x16", (0, "::1", 22, 22)),
        (b"\x05\x02\x00\x01\x7f\x00\x00\x01\x00\x50", (7, "127.0.0.1", 80, 10)),  # BIND
        (b"\x05\x03\x00\x01\x7f\x00\x00\x01\x00\x50", (7, "127.0.0.1", 80, 10)),  # UDP
        (b"\x04\x01\x00\x01\x7f\x00\x00\x01\x00\x50", (7, "127.0.0.1", 80, 10)),  # version
        (b"\x05\x01\x00\x09\x00", (8, "", 0, 5)),  # unknown address type
        (b"\x05\x01\x00\x03\x00\x00\x50", (0, "", 80, 7)),  # empty name: refused by judgement
        (b"\x05\x01\x00\x03\x03a\xffb\x00\x50", (0, "a\\xffb", 80, 10)),  # not ASCII: escaped
    ],
)
def test_socks5_request(data: bytes, expected: object) -> None:
    """RFC 1928 section 4: CONNECT only; the host as sent (judged later), the port."""
    assert socks5_request(data) == expected


@pytest.mark.parametrize("name", list(egress_targets.TARGETS))
def test_the_corpus_replays_through_each_parser(name: str) -> None:
    """Every committed input is parsed or refused, nothing else raised."""
    files = _corpus(name)
    assert files  # the corpus is there
    for path in files:
        egress_targets.TARGETS[name](path.read_bytes())


def test_the_corpus_replays_into_a_live_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every committed input, sent raw to a proxy route and then closed, ends with an
    answer or a close (no hang), and the proxy serves a well-formed request after each."""
    monkeypatch.setattr(session, "HEAD_TIMEOUT", 2.0)
    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(1024)
    up_port = upstream.getsockname()[1]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    policy = Policy(name="fuzz", net={"rules": [{"host": "127.0.0.1", "ports": str(up_port)}]})
    route = egress_proxy().attach(policy, listener)
    try:
        for path in _corpus("egress_head") + _corpus("egress_socks"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                try:  # an answer then a close, or a reset: both end it
                    sock.sendall(path.read_bytes())
                    sock.shutdown(socket.SHUT_WR)
                    while sock.recv(65536):
                        pass
                except (ConnectionResetError, BrokenPipeError):
                    pass
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(f"CONNECT 127.0.0.1:{up_port} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
                assert sock.recv(4096).startswith(b"HTTP/1.1 200"), path
            route.drain()
            route.end_call()  # as a call's end does: its tunnels end (net.connections)
    finally:
        route.close()
        upstream.close()
