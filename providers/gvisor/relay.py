"""The host's side of a gVisor worker's egress relay.

Inside, a relay process the worker forks listens on the proxy address (and each allowed
loopback service's) on the Sentry's loopback and carries each connection to a Unix socket in
the shared socket directory (`_worker/_inworker.start_egress_relay`); `send_egress_listener`
binds those sockets on the host and sends them over the egress channel, where the parent
takes them onto its egress proxy (`_host/egress/handoff.receive_listeners`, which matches each
forward socket by its name, `handoff.forward_socket_name`).
"""

from __future__ import annotations

import os

from agent_sandbox.providers.gvisor.bundle import GvisorPlan

__all__ = ["send_egress_listener"]


def send_egress_listener(plan: GvisorPlan) -> None:
    """Bind the host's end of the proxy route in the socket directory, and one socket for
    each allowed loopback service, and send them over the egress channel, where the parent
    takes them onto its egress proxy (as it takes a worker's listeners under bwrap, or the
    QEMU relay's)."""
    import socket

    relay = plan.worker_setup.get("egress_relay") or {}
    paths = [str(relay["socket"]), *(str(path) for _h, _p, path in relay.get("forwards", ()))]
    listeners: list[socket.socket] = []
    try:
        for path in paths:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listeners.append(listener)
            listener.bind(path)
            listener.listen(128)
        channel = socket.socket(fileno=os.dup(plan.egress_fd))
        try:
            socket.send_fds(channel, [b"egress"], [sock.fileno() for sock in listeners])
        finally:
            channel.close()
    finally:
        for sock in listeners:
            sock.close()
