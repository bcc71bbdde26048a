"""The socket guard, in-process, judged by what loopback listeners receive."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._errors import NetworkDenied
from agent_sandbox.policies import _model


@pytest.fixture
def tcp() -> Iterator[socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    try:
        yield listener
    finally:
        listener.close()


@pytest.fixture
def udp() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def nothing_arrived(listener: socket.socket) -> bool:
    """True when no connection is waiting (the denied connect never reached the kernel)."""
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def received(listener: socket.socket) -> bytes:
    listener.settimeout(10)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(10)
        return conn.recv(100)


def attempt(guard: Any, body: str) -> Any:
    guard.run(
        "import socket\n"
        "try:\n"
        f"    result = {body}\n"
        "except Exception as exc:\n"
        "    result = type(exc).__name__\n"
    )
    return guard.namespace["result"]


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def test_blocks_connect_to_a_port_no_rule_allows(
    armed: Callable[..., Any], tcp: socket.socket
) -> None:
    """It denies a connect outside the rules; the listener receives nothing."""
    port = port_of(tcp)
    guard = armed(
        imports={"allow": ["socket"]}, net={"rules": [{"host": "127.0.0.1", "ports": port + 1}]}
    )
    body = f"socket.create_connection(('127.0.0.1', {port})).sendall(b'canary')"
    assert attempt(guard, body) == "NetworkDenied"
    assert attempt(guard, f"socket.socket().connect_ex(('127.0.0.1', {port}))") == "NetworkDenied"
    assert nothing_arrived(tcp)
    denial = guard.denials()[-1]
    assert denial.rule == "net.connect" and denial.target == f"127.0.0.1:{port}"
    assert denial.hint == f'[[grant]]\nnet.rules = [{{ host = "127.0.0.1", ports = "{port}" }}]'


def test_allows_connect_to_an_allowed_loopback_port(
    armed: Callable[..., Any], tcp: socket.socket
) -> None:
    """It lets an allowed connect through untouched."""
    port = port_of(tcp)
    guard = armed(
        imports={"allow": ["socket"]}, net={"rules": [{"host": "127.0.0.0/8", "ports": port}]}
    )
    guard.run(
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}))\ns.sendall(b'hello')"
    )
    assert received(tcp) == b"hello"
    guard.namespace["s"].close()


def test_blocks_udp_sendto_and_sendmsg(armed: Callable[..., Any], udp: socket.socket) -> None:
    """It denies datagrams to an address no UDP rule allows; nothing is received."""
    port = port_of(udp)
    guard = armed(
        imports={"allow": ["socket"]}, net={"rules": [{"host": "127.0.0.1", "ports": port}]}
    )
    guard.run("import socket\nu = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)")
    assert attempt(guard, f"u.sendto(b'canary', ('127.0.0.1', {port}))") == "NetworkDenied"
    assert (
        attempt(guard, f"u.sendmsg([b'canary'], [], 0, ('127.0.0.1', {port}))") == "NetworkDenied"
    )
    with pytest.raises(BlockingIOError):
        udp.recvfrom(100)
    guard.namespace["u"].close()


def test_blocks_bind_and_listen_without_a_bind_rule(armed: Callable[..., Any]) -> None:
    """It denies binding a port unless a rule with direction bind allows it."""
    guard = armed(imports={"allow": ["socket"]}, net={"rules": [{"host": "127.0.0.1"}]})
    assert attempt(guard, "socket.socket().bind(('127.0.0.1', 0))") == "NetworkDenied"
    # create_server re-raises the refusal as a new OSError (errno ECONNREFUSED); the
    # denial is still recorded.
    assert attempt(guard, "socket.create_server(('127.0.0.1', 0))") in (
        "NetworkDenied",
        "ConnectionRefusedError",
    )
    assert guard.denials()[-1].rule == "net.bind"
    allowed = armed(
        imports={"allow": ["socket"]},
        net={"rules": [{"host": "127.0.0.1", "ports": "0-65535", "direction": "bind"}]},
    )
    assert attempt(allowed, "socket.create_server(('127.0.0.1', 0)).close()") is None


def test_deny_rule_beats_allow_rule(armed: Callable[..., Any], tcp: socket.socket) -> None:
    """It lets a deny rule win over a broader allow rule."""
    port = port_of(tcp)
    rules = [
        {"host": "127.0.0.0/8", "ports": "1-65535"},
        {"action": "deny", "host": "127.0.0.1", "ports": port},
    ]
    guard = armed(imports={"allow": ["socket"]}, net={"rules": rules})
    assert attempt(guard, f"socket.create_connection(('127.0.0.1', {port}))") == "NetworkDenied"
    assert nothing_arrived(tcp)


def test_blocks_the_c_twin_socket(armed: Callable[..., Any], tcp: socket.socket) -> None:
    """It denies a connect through `_socket.socket`, the C twin."""
    port = port_of(tcp)
    guard = armed(imports={"allow": ["socket", "_socket"]})
    assert attempt(guard, f"__import__('_socket').socket().connect(('127.0.0.1', {port}))") == (
        "NetworkDenied"
    )
    assert nothing_arrived(tcp)


def test_escape_by_a_socket_subclass_lying_about_its_family(
    armed: Callable[..., Any], tcp: socket.socket
) -> None:
    """A subclass whose `family` and `type` properties claim a Unix datagram socket is still
    judged as what the kernel holds (the guard reads the C socket's own fields)."""
    port = port_of(tcp)
    guard = armed(imports={"allow": ["socket"]}, files={"write": ["/"]})
    guard.run(
        "import socket\n"
        "class Liar(socket.socket):\n"
        "    family = property(lambda self: socket.AF_UNIX)\n"
        "    type = property(lambda self: socket.SOCK_DGRAM)\n"
        "s = Liar()\n"
        "try:\n"
        f"    s.connect(('127.0.0.1', {port}))\n"
        "    result = 'connected'\n"
        "except Exception as exc:\n"
        "    result = type(exc).__name__\n"
        "s.close()\n"
    )
    assert guard.namespace["result"] == "NetworkDenied"
    assert nothing_arrived(tcp)
    assert guard.denials()[-1].target == f"127.0.0.1:{port}"


def test_names_are_answered_from_the_pin(
    armed: Callable[..., Any], tcp: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It resolves a rule's host name once at load and answers lookups from that pin."""
    port = port_of(tcp)
    monkeypatch.setattr(_model, "_resolve_host", lambda host: ("127.0.0.1",))
    policy = Policy(
        name="pinned", imports={"allow": ["socket"]},
        net={"rules": [{"host": "service.invalid", "ports": port}]},
    )  # fmt: skip
    assert policy.to_wire()["net"]["rules"][0]["addresses"] == ["127.0.0.1"]
    monkeypatch.undo()  # from here on, the name no longer resolves anywhere but in the pin
    guard = armed(policy=policy)
    infos = attempt(guard, f"[i[4] for i in socket.getaddrinfo('service.invalid', {port})]")
    assert infos and all(addr == ("127.0.0.1", port) for addr in infos)
    assert attempt(guard, "socket.gethostbyname('service.invalid')") == "127.0.0.1"
    guard.run(f"s = socket.create_connection(('service.invalid', {port}))\ns.sendall(b'pin')")
    assert received(tcp) == b"pin"
    guard.namespace["s"].close()
    assert attempt(guard, "socket.getaddrinfo('example.com', 443)") == "NetworkDenied"
    assert attempt(guard, "socket.gethostbyname('example.com')") == "NetworkDenied"
    assert guard.denials()[-1].rule == "net.resolve"


def test_blocks_the_workers_control_socket(armed: Callable[..., Any]) -> None:
    """It judges Unix socket paths by the file rules: the control socket is unreachable."""
    guard = armed(imports={"allow": ["socket"]})
    path = os.path.join(os.path.dirname(guard.scratch), "ctl.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    listener.setblocking(False)
    try:
        body = f"socket.socket(socket.AF_UNIX).connect({path!r})"
        assert attempt(guard, body) == "FileAccessDenied"
        assert attempt(guard, "socket.socket(socket.AF_UNIX).connect('\\0abstract')") == (
            "NetworkDenied"
        )
        assert nothing_arrived(listener)
    finally:
        listener.close()


def test_bad_ports_and_hosts_fail_cleanly(armed: Callable[..., Any]) -> None:
    """It refuses an invalid port and a host no rule names without crashing."""
    guard = armed(imports={"allow": ["socket"]}, net={"rules": [{"host": "127.0.0.1"}]})
    assert attempt(guard, "socket.socket().connect(('127.0.0.1', 70000))") in (
        "NetworkDenied",
        "OverflowError",
    )
    assert attempt(guard, "socket.socket().connect(('no-such-host.invalid', 80))") == (
        "NetworkDenied"
    )


def test_an_unresolvable_host_pins_nothing_and_prints_no_warning() -> None:
    """A rule's host that does not resolve pins no address, and the host prints no warning
    (the worker turns a lookup of it into a `net.resolve` denial naming the host)."""
    policy = Policy(name="bad-host", net={"rules": [{"host": "no-such-host.invalid"}]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wire = policy.to_wire()
    assert wire["net"]["rules"][0]["addresses"] == []
    assert not [w for w in caught if "resolve" in str(w.message)]


def test_network_denied_is_a_connection_refused_error() -> None:
    """It raises the builtin class ordinary network code catches."""
    assert issubclass(NetworkDenied, ConnectionRefusedError)
