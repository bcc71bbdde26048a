"""The hand-off between a sandbox and the host's proxy: what the worker is given and sends.

The worker's environment names the proxy (`proxy_env`, at `PROXY_HOST:PROXY_PORT` inside its
own network namespace); the allowed loopback services get a listener at the same address
inside (`loopback_forwards`); the worker (or gVisor's and QEMU's relays) sends those listening
sockets to the host over an inherited Unix socket (`receive_listeners`), which checks each
before the proxy serves it. The worker's side is `_worker/_inworker.open_egress_listener`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from typing import Any

__all__ = [
    "PROXY_HOST",
    "PROXY_PORT",
    "EgressError",
    "forward_socket_name",
    "loopback_forwards",
    "proxy_env",
    "receive_listener",
    "receive_listeners",
]


#: Where the worker's listener sits inside its own network namespace.
PROXY_HOST = "127.0.0.1"
PROXY_PORT = 3128


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


#: A forwarded loopback service's Unix socket is named `fwd-<address>-<port>.sock`.
FORWARD_PREFIX, FORWARD_SUFFIX = "fwd-", ".sock"


def forward_socket_name(host: str, port: int) -> str:
    """The name of the host's Unix socket for the forwarded loopback service host:port
    (gVisor's in-sandbox relay and QEMU's host relay bind it; `_forward_pair` reads it back,
    and the parent matches the pair against its own list)."""
    return f"{FORWARD_PREFIX}{host}-{int(port)}{FORWARD_SUFFIX}"


def _forward_pair(bound: Any) -> tuple[str, int] | None:
    """The loopback service a forward listener stands for: the address it is bound to, or,
    for a Unix socket (gVisor's and QEMU's relays), the address its name says
    (`forward_socket_name`); None for anything else. The caller checks the pair against
    the host's own list."""
    try:
        if isinstance(bound, str):
            name = os.path.basename(bound)
            if not (name.startswith(FORWARD_PREFIX) and name.endswith(FORWARD_SUFFIX)):
                return None
            host, _, port = name[len(FORWARD_PREFIX) : -len(FORWARD_SUFFIX)].rpartition("-")
            return (str(ipaddress.ip_address(host)), int(port))
        return (str(ipaddress.ip_address(bound[0])), int(bound[1]))
    except (ValueError, TypeError, IndexError):
        return None
