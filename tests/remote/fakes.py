"""Test doubles for the remote transport: an in-process `worker serve`, and a hostile pod.

`serving(config)` runs a real `WorkerServer` in a thread (so tests can read its logs and stop
it). `HostilePod` is a TLS server that speaks just enough of the protocol to be bound and then
answers `/run` with whatever bytes the test gives it: what a compromised pod could send.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any

import h11

from agent_sandbox._host.remote.serve import ServeConfig, WorkerServer

#: A worker's handshake as a pod relays it (`_wire.Hello`), its `remote` section aside.
HELLO = {
    "pid": 1,
    "version": [3, 11, 0],
    "prefix": "/usr",
    "base_prefix": "/usr",
    "executable": "/usr/bin/python3",
    "worker_id": "w-fake",
    "checks": {},
}


@contextlib.contextmanager
def serving(config: ServeConfig) -> Iterator[WorkerServer]:
    server = WorkerServer(config)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop("test over")
        thread.join(15)


RunBody = Callable[[socket.socket, h11.Connection], None]


class HostilePod:
    """Binds anyone, says hello with `remote`, and runs `on_run` to answer `/run`."""

    def __init__(self, cert: str, remote: dict[str, Any], on_run: RunBody) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert)
        self.remote = remote
        self.on_run = on_run
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"https://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> HostilePod:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for t in self._threads:
            t.join(5)
        self.listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._conn, args=(raw,), daemon=True)
            self._threads.append(t)
            t.start()

    def _conn(self, raw: socket.socket) -> None:
        raw.settimeout(10)
        try:
            sock = self.ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            return
        conn = h11.Connection(h11.SERVER)
        try:
            while not self._stop.is_set():
                request = None
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(sock.recv(65536))
                        continue
                    if isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        return
                assert request is not None
                if request.target == b"/run":
                    self.on_run(sock, conn)
                    return
                body = {"bound": True} if request.target == b"/v1/bind" else {}
                if request.target == b"/hello":
                    body = {**HELLO, "remote": self.remote}
                data = json.dumps(body).encode()
                sock.sendall(
                    conn.send(
                        h11.Response(
                            status_code=200,
                            headers=[
                                ("content-type", "application/json"),
                                ("content-length", str(len(data))),
                            ],
                        )
                    )
                    or b""
                )
                sock.sendall(conn.send(h11.Data(data=data)) or b"")
                sock.sendall(conn.send(h11.EndOfMessage()) or b"")
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError, ssl.SSLError):
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()


def stream(chunks: list[bytes], end: bool = True, delay: float = 0.0) -> RunBody:
    """An `/run` answer: a 200 event stream made of `chunks` (and its end, if `end`)."""
    import time

    def run(sock: socket.socket, conn: h11.Connection) -> None:
        sock.sendall(
            conn.send(
                h11.Response(
                    status_code=200,
                    headers=[
                        ("content-type", "text/event-stream"),
                        ("transfer-encoding", "chunked"),
                    ],
                )
            )
            or b""
        )
        for chunk in chunks:
            sock.sendall(conn.send(h11.Data(data=chunk)) or b"")
            if delay:
                time.sleep(delay)
        if end:
            sock.sendall(conn.send(h11.EndOfMessage()) or b"")

    return run
