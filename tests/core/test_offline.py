"""The suite itself never reaches the internet: only loopback and Unix sockets are allowed."""

from __future__ import annotations

import socket

import pytest


def test_the_test_process_cannot_reach_a_public_address() -> None:
    """It refuses a connection to a public address from the test process (pytest-socket)."""
    with pytest.warns(UserWarning, match="192.0.2.1"), pytest.raises(Exception) as info:
        socket.create_connection(("192.0.2.1", 80), timeout=0.5)  # TEST-NET-1, never routed
    assert type(info.value).__name__ in ("SocketBlockedError", "SocketConnectBlockedError")
