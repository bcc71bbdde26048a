"""The egress proxy is fair and bounded: each worker's bounds are its own, every deadline is
absolute, and every refusal at a bound or of bad input is recorded with its rule while the
proxy goes on serving every other worker.

The proxy runs in this process with listeners standing in for the workers'; upstreams are
listening sockets on loopback (a connect completes from the kernel's backlog).
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._host.egress import session
from agent_sandbox._host.egress.proxy import egress_proxy


@pytest.fixture
def upstream() -> Iterator[int]:
    """A loopback port that accepts connections (from its backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _route(port: int, **net: Any) -> tuple[Any, int]:
    policy = Policy(
        name="bounds",
        net={"rules": [{"host": "127.0.0.1", "ports": str(port)}], **net},
        limits={"wall_seconds": 30},
    )
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    address = listener.getsockname()[1]
    return egress_proxy().attach(policy, listener), address


def _tunnel(proxy: int, target: str, timeout: float = 30.0) -> tuple[socket.socket, bytes]:
    """Open a CONNECT tunnel; the socket and the proxy's answer head."""
    sock = socket.create_connection(("127.0.0.1", proxy), timeout=timeout)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nhost: {target}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            break
        if not chunk:
            break
        answer += chunk
    return sock, answer


def _ended(sock: socket.socket, timeout: float = 30.0) -> bool:
    """Whether the proxy ended the connection (EOF or reset) before `timeout`."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def test_one_worker_at_its_bound_never_refuses_or_delays_another(upstream: int) -> None:
    """It denies a starvation attack: worker A holds its maximum of open tunnels (and is
    refused one more, recorded as `limits.net`); worker B's tunnel still opens at once.
    Prints B's tunnel-open times with A idle and with A at its bound (medians, ranges)."""
    a, a_port = _route(upstream)
    b, b_port = _route(upstream)
    held: list[socket.socket] = []
    try:
        target = f"127.0.0.1:{upstream}"

        def b_opens() -> float:
            t0 = time.perf_counter()
            sock, answer = _tunnel(b_port, target)
            took = time.perf_counter() - t0
            sock.close()
            assert answer.startswith(b"HTTP/1.1 200"), answer
            return took

        before = [b_opens() for _ in range(21)]
        for _ in range(a.max_connections):
            sock, answer = _tunnel(a_port, target)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            held.append(sock)
        assert a.open == a.max_connections == 64  # the attack ran: A holds its bound
        extra, answer = _tunnel(a_port, target)
        assert answer == b""  # refused: ended without an answer
        extra.close()
        during = [b_opens() for _ in range(21)]
        assert b.drain() == []  # B was refused nothing
        [denial] = a.drain()
        assert denial.rule == "limits.net" and "net.connections = 64" in denial.detail
        assert "net.connections = 128" in denial.hint
        print(
            f"\nFAIRNESS B's tunnel open (ms): A idle median {statistics.median(before) * 1e3:.2f} range {min(before) * 1e3:.2f}-{max(before) * 1e3:.2f}; "
            f"A holding 64 median {statistics.median(during) * 1e3:.2f} range {min(during) * 1e3:.2f}-{max(during) * 1e3:.2f}"
        )
    finally:
        for sock in held:
            sock.close()
        a.close()
        b.close()


def test_a_calls_tunnels_end_with_the_call_unless_the_policy_keeps_them(upstream: int) -> None:
    """A tunnel opened during a call ends when the call ends (`Route.end_call`); with
    `net.keep_connections = true` it stays."""
    for keep in (False, True):
        route, port = _route(upstream, keep_connections=keep)
        try:
            sock, answer = _tunnel(port, f"127.0.0.1:{upstream}")
            assert answer.startswith(b"HTTP/1.1 200")
            route.end_call()
            assert _ended(sock, timeout=30.0 if not keep else 0.5) is (not keep)
            sock.close()
        finally:
            route.close()


def test_a_half_open_tunnel_ends_at_its_absolute_deadline(upstream: int) -> None:
    """It denies holding a tunnel past `net.connection_seconds`: a client that half-closes
    a tunnel whose upstream never answers is ended at the deadline, recorded as
    `limits.net`."""
    route, port = _route(upstream, connection_seconds=1.0)
    try:
        sock, answer = _tunnel(port, f"127.0.0.1:{upstream}")
        assert answer.startswith(b"HTTP/1.1 200")
        sock.shutdown(socket.SHUT_WR)  # half-open: the client says no more
        assert _ended(sock)
        sock.close()
        [denial] = route.drain()
        assert denial.rule == "limits.net" and "net.connection_seconds = 1" in denial.detail
    finally:
        route.close()


def test_a_head_trickled_byte_by_byte_meets_an_absolute_deadline(
    upstream: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It denies a slow-loris head: bytes that keep coming do not extend the head's
    deadline; the connection ends, recorded as `limits.net`."""
    monkeypatch.setattr(session, "HEAD_TIMEOUT", 1.0)
    route, port = _route(upstream)
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(b"GET http://127.0.0.1/ HTTP/1.1\r\n")
        ended = False
        for _ in range(600):  # one header byte every 0.1 s, far past the 1 s deadline
            try:
                sock.sendall(b"x")
            except OSError:
                ended = True
                break
            time.sleep(0.1)
        assert ended or _ended(sock, timeout=1.0)
        sock.close()
        [denial] = route.drain()
        assert denial.rule == "limits.net" and "did not arrive" in denial.detail
    finally:
        route.close()


@pytest.mark.parametrize(
    ("name", "request_bytes", "rule", "answer"),
    [
        (
            "a never-ending header",
            b"GET http://127.0.0.1/ HTTP/1.1\r\nx-long: " + b"a" * 20_000,
            "limits.net",
            b"HTTP/1.1 400",
        ),
        (
            "a hostile head (two framings)",
            b"POST http://127.0.0.1/ HTTP/1.1\r\ncontent-length: 5\r\n"
            b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            "net.connect",
            b"HTTP/1.1 400",
        ),
        (
            "a bare LF in the head",
            b"GET http://127.0.0.1/ HTTP/1.1\nhost: x\r\n\r\n",
            "net.connect",
            b"HTTP/1.1 400",
        ),
        (
            "a CONNECT to a port no rule lists",
            b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nhost: 127.0.0.1:22\r\n\r\n",
            "net.connect",
            b"HTTP/1.1 403 |agent-sandbox refusal| [net.connect]",
        ),
        (
            "a name of 10,000 characters",
            b"CONNECT " + b"a" * 10_000 + b".test:443 HTTP/1.1\r\nhost: x\r\n\r\n",
            "net.resolve",
            b"HTTP/1.1 403 |agent-sandbox refusal| [net.resolve]",
        ),
    ],
)
def test_bad_input_is_refused_with_its_rule_and_others_are_served(
    upstream: int, name: str, request_bytes: bytes, rule: str, answer: bytes
) -> None:
    """It denies bad input: each is refused with its rule, recorded by the host, and
    another worker's tunnel opens meanwhile."""
    route, port = _route(upstream)
    other, other_port = _route(upstream)
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(request_bytes)
        got = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        sock.close()
        assert got.startswith(answer), (name, got[:200])
        denials = route.drain()
        assert [d.rule for d in denials] == [rule], (name, denials)
        tunnel, head = _tunnel(other_port, f"127.0.0.1:{upstream}")
        tunnel.close()
        assert head.startswith(b"HTTP/1.1 200")
    finally:
        route.close()
        other.close()
