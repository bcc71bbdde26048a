"""The worker's HTTP/1.1 server (h11) on the inherited listening socket.

Routes, each requiring `Authorization: Bearer <token>` (compared in constant time):

* `GET /hello`    the handshake: interpreter, prefix, pid, and the provider's checks
* `POST /run`     body `{"code": ...}`; answered by an SSE stream of events ending in `done`
* `POST /shutdown` the worker exits after answering

Anything else gets a 4xx and the connection is closed. One request runs at a time; idle
connections are multiplexed with `selectors`.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import threading
import time

# NOTE: allowed because it is exactly what hmac.compare_digest is, without importing OpenSSL
# (2 ms of the worker's start-up).
from _operator import _compare_digest as compare_digest
from typing import Any

import h11

from agent_sandbox._denial import Denial
from agent_sandbox._wire import encode_event
from agent_sandbox._worker import audit
from agent_sandbox._worker.run import Runner, on_interrupt

__all__ = ["serve"]

_MAX_BODY = 16 * 1024 * 1024
_READ_TIMEOUT = 30.0


class _Stop(Exception):
    """Raised to leave the serve loop after a shutdown request."""


class _Server:
    def __init__(self, boot: dict[str, Any], runner: Runner, checks: dict[str, Any]) -> None:
        self.token = ("Bearer " + boot["token"]).encode()
        self.runner = runner
        self.checks = checks
        self.boot = boot
        self.tamper_check: Any = None
        #: This worker's pid (the server is made in the worker's own process).
        self.pid = os.getpid()
        #: The head of every `/run` answer, made once (h11 validates an event's headers when
        #: it is made; it frames them again for each response).
        self._stream_head = h11.Response(
            status_code=200,
            headers=[
                ("content-type", "text/event-stream"),
                ("cache-control", "no-store"),
                ("transfer-encoding", "chunked"),
            ],
        )

    # -- connection handling -------------------------------------------------------------

    def handle(self, sock: socket.socket, conn: h11.Connection) -> bool:
        """Serve one request on `sock`; return False when the connection should be closed."""
        request, body = self._read_request(sock, conn)
        if request is None:
            return False
        headers = dict(request.headers)
        auth = headers.get(b"authorization", b"")
        if not compare_digest(auth, self.token):
            self._send_simple(sock, conn, 403, {"error": "missing or wrong token"}, close=True)
            return False
        target = request.target
        if request.method == b"GET" and target == b"/hello":
            self._send_simple(sock, conn, 200, self._hello())
        elif request.method == b"POST" and target == b"/run":
            self._run(sock, conn, body)
        elif request.method == b"POST" and target == b"/shutdown":
            self._send_simple(sock, conn, 200, {"ok": True})
            raise _Stop
        else:
            self._send_simple(sock, conn, 404, {"error": "no such route"}, close=True)
            return False
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
            return False
        conn.start_next_cycle()
        return True

    def _read_request(
        self, sock: socket.socket, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request = None
        body = bytearray()
        # The request is normally whole when the selector wakes: read it without waiting,
        # and set the read timeout only for a request that comes in pieces.
        timed = False
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    if not timed:
                        try:
                            conn.receive_data(sock.recv(65536, socket.MSG_DONTWAIT))
                            continue
                        except (BlockingIOError, InterruptedError):
                            pass
                        sock.settimeout(_READ_TIMEOUT)
                        timed = True
                    data = sock.recv(65536)
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > _MAX_BODY:
                        self._send_simple(sock, conn, 413, {"error": "request too large"}, True)
                        return None, b""
                elif isinstance(event, h11.EndOfMessage):
                    return request, bytes(body)
                elif isinstance(event, h11.ConnectionClosed):
                    return None, b""
        except (h11.RemoteProtocolError, OSError):
            return None, b""
        finally:
            if timed:
                sock.settimeout(None)

    def _send_simple(
        self,
        sock: socket.socket,
        conn: h11.Connection,
        status: int,
        payload: dict[str, Any],
        close: bool = False,
    ) -> None:
        body = json.dumps(payload).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        if close:
            headers.append(("connection", "close"))
        try:
            sock.sendall(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
            sock.sendall(conn.send(h11.Data(data=body)) or b"")
            sock.sendall(conn.send(h11.EndOfMessage()) or b"")
        except (h11.LocalProtocolError, OSError):
            pass

    # -- routes --------------------------------------------------------------------------

    def _hello(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "version": list(sys.version_info[:3]),
            "prefix": sys.prefix,
            "base_prefix": sys.base_prefix,
            "executable": sys.executable,
            "worker_id": self.boot.get("worker_id", ""),
            "checks": self.checks,
        }

    def _run(self, sock: socket.socket, conn: h11.Connection, body: bytes) -> None:
        try:
            request = json.loads(body)
            code = request["code"]
            if not isinstance(code, str):
                raise TypeError("code must be a string")
        except (ValueError, KeyError, TypeError) as exc:
            self._send_simple(sock, conn, 400, {"error": f"bad run request: {exc}"}, close=True)
            return
        lock = threading.Lock()
        broken = False
        # Writes to the host are few: each one wakes the host. When the request allows it
        # (`hold_head`: the local client does; a relay that keeps an idle stream alive
        # does not), the response's head and `start` wait for the first event the cell
        # emits while it runs (its output, a denial), which goes out with them in one
        # write; each later one is written at once, in order. The events after the cell
        # (its result, the counts, `done`) and the end of the response go out in the last
        # write. So a call that prints nothing is one write, and live output is unchanged.
        # (Under qemu each write also crosses the guest agent and both relays.)
        held: list[bytes] = []
        holding = request.get("hold_head") is True  # until the first event of the cell
        final = False  # from the result on: everything waits for the last write

        owner = self.pid

        def write(data: bytes) -> None:
            nonlocal broken
            if broken:
                return
            try:
                sock.sendall(data)
            except OSError:
                broken = True

        def emit(kind: str, data: Any) -> None:
            """What the cell's run emits with: a forked child never writes on its parent's
            connection."""
            if os.getpid() == owner:
                put(kind, data)

        def put(kind: str, data: Any) -> None:
            nonlocal holding
            framed = _chunk(encode_event(kind, data))
            with lock:
                if broken:
                    return
                if final:
                    held.append(framed)
                elif holding:
                    held.append(framed)
                    holding = False
                    write(b"".join(held))
                    held.clear()
                else:
                    write(framed)

        def hold(kind: str, data: Any) -> None:
            nonlocal final
            with lock:
                final = True  # from here on, emit() keeps its events for the last write
            emit(kind, data)

        try:
            head = conn.send(self._stream_head) or b""
        except h11.LocalProtocolError:
            return
        filename = request.get("filename")
        # `encode_event("start", {"call": n})`, written out: the same bytes.
        head += _chunk(b'event: start\ndata: {"call":%d}\n\n' % (self.runner.calls + 1))
        held.append(head)
        if holding:
            if _caller_left(sock):
                return  # a cancelled call: nobody waits for this code's result
        else:
            try:
                sock.sendall(head)
            except OSError:
                return  # the caller left (a cancelled call): nobody waits for this code's result
            held.clear()
        audit.begin_call(lambda d: emit("denial", d.to_dict()))
        started = time.perf_counter()
        try:
            self.runner.run(code, emit, filename if isinstance(filename, str) else None, last=hold)
        finally:
            if os.getpid() != owner:
                os._exit(1)  # a child the cell forked never goes on with the server's work
            counted = audit.end_call()
            with lock:
                final = True
        # From here on in the worker itself (checked above): `put`, without a check per event.
        # First occurrences streamed as they were classified; counts and last ones now.
        counts = [
            [i, d.count, d.last.to_dict()] for i, d in enumerate(counted) if d.last is not None
        ]
        if counts:
            put("counts", counts)
        tampered = self.tamper_check() if self.tamper_check is not None else []
        for reason in tampered:
            put(
                "denial",
                Denial(
                    rule="guard.tampered",
                    action="tamper",
                    target=reason,
                    policy=self.runner.policy_name,
                    detail="a guard was disarmed or displaced; this worker will be discarded",
                ).to_dict(),
            )
        put(
            "done",
            {
                "duration": time.perf_counter() - started,
                "discard": bool(tampered),
                "denials": sum(d.count for d in counted),
            },
        )
        with lock:
            if not broken:
                try:
                    held.append(conn.send(h11.EndOfMessage()) or b"")
                except h11.LocalProtocolError:
                    pass
            write(b"".join(held))
            held.clear()
        if tampered:
            raise _Stop


def _chunk(data: bytes) -> bytes:
    """One chunk of the chunked response body, as h11 frames `Data` (never empty: an empty
    chunk ends the body). Framed here, not by `conn.send`: h11's chunked writer keeps no
    state between chunks, and its state machine is in the body until `EndOfMessage`,
    which still goes through it; the host parses every byte with h11 all the same."""
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


def _caller_left(sock: socket.socket) -> bool:
    """Whether the host closed the connection (a cancelled call), asked without waiting
    and without writing: the head of the response is not written before the cell runs."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing to read: the host waits for the answer
    except OSError:
        return True


def serve(boot: dict[str, Any]) -> None:
    """Set up the worker from its boot configuration, then serve until shutdown."""
    from agent_sandbox._worker.setup import prepare

    runner, checks, hooks = prepare(boot)
    # The host's interrupt: KeyboardInterrupt in the running cell only (see `on_interrupt`).
    signal.signal(signal.SIGINT, on_interrupt)
    server = _Server(boot, runner, checks)
    server.tamper_check = hooks.get("tamper_check")
    listener = socket.socket(fileno=int(boot["listen_fd"]))
    listener.setblocking(True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    try:
        while True:
            for key, _ in selector.select():
                if key.data is None:
                    client, _addr = listener.accept()
                    selector.register(
                        client,
                        selectors.EVENT_READ,
                        h11.Connection(h11.SERVER, max_incomplete_event_size=65536),
                    )
                    continue
                client = key.fileobj  # type: ignore[assignment]
                try:
                    keep = server.handle(client, key.data)
                except (OSError, h11.LocalProtocolError):
                    keep = False  # this connection broke; the worker serves the next one
                if not keep:
                    selector.unregister(client)
                    client.close()
    except _Stop:
        pass
    finally:
        sys.stdout.flush()
        os._exit(0)
