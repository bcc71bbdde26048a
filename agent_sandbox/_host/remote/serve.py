"""`agent-sandbox worker serve`: a remote worker's entry point (a pod's main process).

It serves the worker protocol on TCP with TLS (optionally mTLS) and starts the actual worker
(the same code as a local worker, under a local kernel provider) only once a session is bound:

* `GET /healthz`  readiness (no token; says nothing about the session)
* `POST /v1/bind` once: the session's token hash, policy and limits, authenticated by the
  template-wide bootstrap secret (`X-Agent-Sandbox-Bind`); a second bind is refused (409),
  whoever sends it. The worker is started here, under `--provider` (`auto`: the strongest
  kernel provider that works; `subprocess` only under a runtime that is one: `placement`).
* `GET /hello`, `POST /run`, `POST /shutdown`: the worker's own routes, and `POST /interrupt`
  (SIGINT to the running cell, replaced after `grace` seconds, as locally), authenticated by the
  session token (`X-Agent-Sandbox-Token`, compared by SHA-256 in constant time; the token
  itself is never stored, logged or echoed). `/run` is streamed through from the worker's
  Unix socket; an idle stream gets an SSE comment (`: keep-alive`) every `keepalive`
  seconds, at an event boundary, so proxies (the agent-sandbox router) keep it open.

One call at a time (a second one is answered 409, not queued). A call that passes its wall
time (plus a grace) has its worker killed here too, whatever the host does. When the worker
dies, the session is over and the server exits; it also exits after `idle_exit` seconds
without a request once bound (the pod ends, and the claim's TTL reaps it), and with
`exit_with_parent` when the process that started it is gone (the local claim backend).

This module is longer than 600 lines because `WorkerServer` is one state machine: its bounds
before authentication, the bind and the relay of `/run` read and change the same
per-connection and per-session state under one lock; its pure parts are apart already
(`serve_relay`: the `/run` framing, `serve_guard`: the guard check, `serve_limits`: the
checks before it listens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import socket
import ssl
import sys
import threading
import time
from typing import Any

import h11

from agent_sandbox._host.placement import check_runtime, serve_provider, serve_runtime
from agent_sandbox._host.remote.serve_limits import check_cert_dates, default_pending
from agent_sandbox._host.remote.serve_relay import (
    END,
    SSE_HEAD,
    ResponseReader,
    UpstreamError,
    chunk,
    connect_unix,
    next_request_parser,
    run_request,
)

__all__ = ["ServeConfig", "WorkerServer", "parse_listen"]

_log = logging.getLogger("agent_sandbox.serve")

_MAX_BIND_BODY = 1024 * 1024
_MAX_RUN_BODY = 16 * 1024 * 1024
#: The body of every other authenticated route (`/hello`, `/interrupt`, `/shutdown`).
_MAX_SMALL_BODY = 65536
#: The most body an unauthenticated `GET /healthz` may carry (a router's empty chunked body).
_MAX_PROBE_BODY = 1024
#: The most a request's head may take (h11 refuses a longer one: 400).
_MAX_HEAD = 65536
_READ_TIMEOUT = 30.0
#: Connections past their authentication at once (the session's host uses two or three).
_MAX_AUTHED = 16
#: The default bound on connections not yet authenticated, when the pod has no memory
#: limit; with one, a sixteenth of it at `_CONN_BUDGET` bytes each, in [8, 256].
_DEFAULT_PENDING = 128
_CONN_BUDGET = 256 * 1024
_ROUTES = {
    b"/healthz": b"GET",
    b"/v1/bind": b"POST",
    b"/hello": b"GET",
    b"/run": b"POST",
    b"/interrupt": b"POST",
    b"/shutdown": b"POST",
}
_WALL_GRACE = 2.0
#: The most the relay holds back to send what the worker wrote in one write.
_COALESCE_MAX = 65536
#: How long the relay waits for more before a call's first write to the host (a short
#: call then costs the host one wake-up; a long one gets its response head this late).
_FIRST_WRITE_HOLD = 0.05
KEEPALIVE_COMMENT = b": keep-alive\n\n"


def _has_body(request: h11.Request) -> bool:
    for name, value in request.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


def _bind_request(body: bytes) -> dict[str, Any]:
    """The bind body's fields, checked; ValueError with one line naming what is wrong."""
    if not body:
        raise ValueError(
            "empty body; expected a JSON object with token_sha256, policy, fingerprint"
        )
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the body is not JSON") from None
    if not isinstance(request, dict):
        raise ValueError("the body is not a JSON object")
    missing = [k for k in ("token_sha256", "policy", "fingerprint") if k not in request]
    if missing:
        raise ValueError("missing " + ", ".join(missing))
    token = request["token_sha256"]
    if not isinstance(token, str) or len(token) != 64:
        raise ValueError("token_sha256 must be 64 hex digits")
    try:
        bytes.fromhex(token)
    except ValueError:
        raise ValueError("token_sha256 must be 64 hex digits") from None
    if not isinstance(request["policy"], dict):
        raise ValueError("policy must be a JSON object")
    if not isinstance(request["fingerprint"], str):
        raise ValueError("fingerprint must be a string")
    return request


def parse_listen(text: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (host, port); anything else is a ValueError naming the form."""
    if not text.startswith("tcp://"):
        raise ValueError(f"--listen {text!r}: expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:8888")
    host, sep, port = text[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen {text!r}: expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:8888")
    return host.strip("[]"), int(port)


@dataclasses.dataclass
class ServeConfig:
    """What `worker serve` was started with (see `_tools/cli_worker.py` for the flags)."""

    host: str = "0.0.0.0"
    port: int = 8888
    tls_cert: str | None = None
    tls_key: str | None = None
    client_ca: str | None = None
    plaintext: str = ""
    bind_secret: str | None = None
    provider: str = "auto"
    runtime_boundary: str = ""
    idle_exit: float = 900.0
    keepalive: float = 15.0
    exit_with_parent: bool = False
    start_timeout: float = 15.0
    #: Connections not yet authenticated, at once (0: from the pod's memory limit).
    max_pending: int = 0
    #: The most seconds a connection may take, from accept, to authenticate (TLS handshake
    #: and request head included); past it the connection is cut.
    head_timeout: float = 10.0

    def check(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_cert is None and self.plaintext != "accepted":
            raise ValueError(
                "no --tls-cert/--tls-key: the worker would serve the session token and the "
                "code in plain text; give a certificate, or, behind a TLS-terminating router "
                "on a NetworkPolicy-restricted pod network, opt out with --plaintext accepted"
            )
        if self.client_ca is not None and self.tls_cert is None:
            raise ValueError("--client-ca (mTLS) needs --tls-cert and --tls-key")
        if not self.bind_secret:
            raise ValueError(
                "no bind secret: anyone who reaches the port could bind the worker; give "
                "--bind-secret-file (or AGENT_SANDBOX_BIND_SECRET), the template-wide secret "
                "the host also holds"
            )
        if self.keepalive <= 0 or self.idle_exit <= 0:
            raise ValueError("--keepalive and --idle-exit must be positive")
        if self.max_pending < 0 or self.head_timeout <= 0:
            raise ValueError("--max-connections must be >= 0 and --head-timeout positive")
        if self.tls_cert is not None:
            check_cert_dates(self.tls_cert)
        check_runtime(self.runtime_boundary)  # a declared gVisor the kernel contradicts

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls_cert is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        if self.client_ca is not None:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


class _Stop(Exception):
    pass


class WorkerServer:
    """The server; `serve_forever()` returns when the session ends (shutdown, death, idle)."""

    def __init__(self, config: ServeConfig) -> None:
        config.check()
        self.config = config
        self._ssl = config.ssl_context()
        self._bind_secret = (config.bind_secret or "").encode()
        self.listener = socket.create_server(
            (config.host, config.port),
            family=socket.AF_INET6 if ":" in config.host else socket.AF_INET,
            backlog=64,
        )
        self.listener.settimeout(0.25)
        self.port = int(self.listener.getsockname()[1])
        self._lock = threading.Lock()
        self._call = threading.Lock()
        self._token_hash: bytes | None = None
        self._bound = False
        self._binding = False
        self._pending_hash = b""
        self._upstream: socket.socket | None = None  # the worker's connection, between calls
        self.worker: Any = None  # a WorkerProcess once bound
        self.remote_info: dict[str, Any] = {}
        self._stop = threading.Event()
        self.exit_reason = ""
        self._last_activity = time.monotonic()
        self._parent = os.getppid()
        self.max_pending = config.max_pending or default_pending(_CONN_BUDGET, _DEFAULT_PENDING)
        self._pending_slots = threading.BoundedSemaphore(self.max_pending)
        self._authed_slots = threading.BoundedSemaphore(_MAX_AUTHED)
        #: Accepted connections not yet authenticated, and when each must have.
        self._pending: dict[socket.socket, float] = {}
        #: Connections closed at accept because `max_pending` were waiting already.
        self.refused = 0
        self.runtime, self.runtime_source = serve_runtime(config.runtime_boundary)

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.exit_reason = reason
            self._stop.set()

    def serve_forever(self) -> str:
        watchdog = threading.Thread(target=self._watchdog, name="serve-watchdog", daemon=True)
        watchdog.start()
        try:
            while not self._stop.is_set():
                try:
                    conn, _addr = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._stop.is_set():
                        break
                    raise
                if not self._pending_slots.acquire(blocking=False):
                    # Full of connections that have not authenticated: this one is closed
                    # at once (no thread, nothing read); an authenticated one is unaffected.
                    self.refused += 1
                    with contextlib.suppress(OSError):
                        conn.close()
                    continue
                with self._lock:
                    self._pending[conn] = time.monotonic() + self.config.head_timeout
                threading.Thread(
                    target=self._connection, args=(conn,), name="serve-conn", daemon=True
                ).start()
        finally:
            self.listener.close()
            worker = self.worker
            if worker is not None:
                worker.close()
        return self.exit_reason

    def _watchdog(self) -> None:
        while not self._stop.wait(0.2):
            if self.config.exit_with_parent and os.getppid() != self._parent:
                self.stop("the process that started it is gone")
            self._cut_late()
            worker = self.worker
            if self._bound and not self._call.locked():
                if worker is not None and not worker.alive():
                    self.stop("its worker ended")
                elif time.monotonic() - self._last_activity > self.config.idle_exit:
                    self.stop(f"idle for {self.config.idle_exit:g} s")

    def _cut_late(self) -> None:
        """Cut the connections that did not authenticate within `head_timeout` of their
        accept (a slow TLS handshake or head, a body never sent): their threads end."""
        now = time.monotonic()
        with self._lock:
            late = [conn for conn, deadline in self._pending.items() if now > deadline]
        for conn in late:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # -- connections -----------------------------------------------------------------------

    def _promote(self, raw: socket.socket) -> bool:
        """The connection authenticated: from the pending bound to the authenticated one.
        False when that one is full (the caller answers 503 and closes)."""
        with self._lock:
            if raw not in self._pending:
                return True  # promoted already
            if not self._authed_slots.acquire(blocking=False):
                return False
            del self._pending[raw]
        self._pending_slots.release()
        return True

    def _connection(self, raw: socket.socket) -> None:
        # Small SSE chunks must not wait for Nagle + the peer's delayed ACK (40 ms a call).
        with contextlib.suppress(OSError):
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket = raw
        try:
            raw.settimeout(self.config.head_timeout)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(raw, server_side=True)
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
            while not self._stop.is_set():
                if not self._handle(raw, sock, conn):
                    break
                if conn.our_state is h11.SEND_RESPONSE and conn.their_state is h11.DONE:
                    # `/run` was answered outside h11 (`serve_relay`): a fresh parser for
                    # the next request, with whatever the host already sent of it.
                    conn = next_request_parser(conn)
                    continue
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    break
        except (OSError, ssl.SSLError, h11.LocalProtocolError):
            pass  # a failed handshake (wrong certificate) or a broken connection: drop it
        except _Stop:
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            with self._lock:
                pending = self._pending.pop(raw, None) is not None
            (self._pending_slots if pending else self._authed_slots).release()

    def _head(
        self, raw: socket.socket, sock: socket.socket, conn: h11.Connection
    ) -> h11.Request | None:
        """The next request's head (nothing of its body is read here); None when the peer
        closed or timed out. A malformed head is answered 400 and closed (`_Stop`). An
        authenticated connection waits `_READ_TIMEOUT` for it; one that is not, what is left
        of its `head_timeout` (the watchdog cuts it then in any case)."""
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    with self._lock:
                        deadline = self._pending.get(raw)
                    wait = _READ_TIMEOUT if deadline is None else deadline - time.monotonic()
                    sock.settimeout(max(0.001, wait))
                    conn.receive_data(sock.recv(65536))
                    continue
                if isinstance(event, h11.Request):
                    return event
                return None  # ConnectionClosed, or an unexpected event
        except h11.RemoteProtocolError as exc:
            reason = str(exc).splitlines()[0][:200] if str(exc) else "bad request"
            self._reply(sock, conn, 400, {"error": f"malformed request: {reason}"}, close=True)
            raise _Stop from None
        except OSError:
            return None

    def _body(
        self, sock: socket.socket, conn: h11.Connection, request: h11.Request, cap: int
    ) -> bytes | None:
        """The body of an authenticated request, at most `cap` bytes (else 413 and None)."""
        for name, value in request.headers:
            if name == b"content-length" and value.isdigit() and int(value) > cap:
                self._reply(sock, conn, 413, {"error": "request too large"}, close=True)
                return None
        body = bytearray()
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    sock.settimeout(_READ_TIMEOUT)
                    conn.receive_data(sock.recv(65536))
                    continue
                if isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > cap:
                        self._reply(sock, conn, 413, {"error": "request too large"}, close=True)
                        return None
                elif isinstance(event, h11.EndOfMessage):
                    return bytes(body)
                else:
                    return None
        except h11.RemoteProtocolError as exc:
            reason = str(exc).splitlines()[0][:200] if str(exc) else "bad request"
            self._reply(sock, conn, 400, {"error": f"malformed request: {reason}"}, close=True)
            return None
        except OSError:
            return None

    def _reply(
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
        with contextlib.suppress(OSError, h11.LocalProtocolError):
            sock.sendall(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
            sock.sendall(conn.send(h11.Data(data=body)) or b"")
            sock.sendall(conn.send(h11.EndOfMessage()) or b"")

    def _refuse(self, sock: socket.socket, conn: h11.Connection, status: int, error: str) -> bool:
        """Answer before the body, which is never read: the connection closes."""
        self._reply(sock, conn, status, {"error": error}, close=True)
        return False

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        expected = self._token_hash
        if expected is None:
            return False
        given = headers.get(b"x-agent-sandbox-token", b"")
        return hmac.compare_digest(hashlib.sha256(given).digest(), expected)

    def _is_pending(self, headers: dict[bytes, bytes]) -> bool:
        pending = self._pending_hash
        given = headers.get(b"x-agent-sandbox-token", b"")
        return bool(pending) and hmac.compare_digest(hashlib.sha256(given).digest(), pending)

    def _handle(self, raw: socket.socket, sock: socket.socket, conn: h11.Connection) -> bool:
        """One request: its head, then its route and credentials, and only then its body
        (no byte of a body is read before the token or bind secret is checked)."""
        request = self._head(raw, sock, conn)
        if request is None:
            return False
        method, target = request.method, request.target.split(b"?", 1)[0]
        headers = dict(request.headers)
        wanted = _ROUTES.get(target)
        if wanted is None:
            return self._refuse(sock, conn, 404, "no such route")
        if method != wanted:
            return self._refuse(sock, conn, 405, f"{target.decode()} takes {wanted.decode()}")
        if target == b"/healthz":
            # Not activity: probes every few seconds must not keep an idle session alive.
            ready = not self._stop.is_set() and (not self._bound or self._worker_alive())
            # A router may frame even an empty GET body as chunked (the upstream Python
            # router streams every request's body): at most `_MAX_PROBE_BODY` is read.
            probe_body = conn.their_state is h11.SEND_BODY and _has_body(request)
            if probe_body and self._body(sock, conn, request, _MAX_PROBE_BODY) is None:
                return False
            self._reply(sock, conn, 200 if ready else 503, {"ready": ready})
            return True
        if target == b"/v1/bind":
            secret = headers.get(b"x-agent-sandbox-bind", b"")
            if not hmac.compare_digest(secret, self._bind_secret):
                return self._refuse(sock, conn, 403, "missing or wrong bind secret")
            if not self._promote(raw):
                return self._refuse(sock, conn, 503, "too many connections; retry")
            body = self._body(sock, conn, request, _MAX_BIND_BODY)
            if body is None:
                return False
            return self._bind(sock, conn, body)
        if not self._authorized(headers):
            if self._binding and self._is_pending(headers):
                # The same session's other process, while its bind starts the worker.
                return self._refuse(sock, conn, 503, "the session is being bound; retry")
            return self._refuse(sock, conn, 403, "missing or wrong session token")
        if not self._promote(raw):
            return self._refuse(sock, conn, 503, "too many connections; retry")
        body = self._body(
            sock, conn, request, _MAX_RUN_BODY if target == b"/run" else _MAX_SMALL_BODY
        )
        if body is None:
            return False
        self._last_activity = time.monotonic()
        if target == b"/hello":
            hello = self.worker.hello
            assert hello is not None  # (a started worker)
            self._reply(sock, conn, 200, {**hello.to_dict(), "remote": self.remote_info})
            return True
        if target == b"/run":
            return self._run(sock, conn, body)
        if target == b"/interrupt":
            try:
                grace = float(json.loads(body or b"{}").get("grace", 2.0))
            except (ValueError, TypeError, AttributeError):
                grace = 2.0
            sent = bool(self._call.locked() and self.worker.interrupt(min(max(grace, 0.1), 60)))
            self._reply(sock, conn, 200, {"sent": sent})
            return True
        self._reply(sock, conn, 200, {"ok": True}, close=True)  # /shutdown
        self.stop("the host ended the session")
        return False

    def _worker_gone(self) -> bool:
        """After a call: the worker was killed or exited (cheap; the watchdog also looks
        for a stopped one)."""
        worker = self.worker
        proc = getattr(worker, "proc", None)
        return worker is None or bool(worker.dead) or (proc is not None and proc.poll() is not None)

    def _worker_alive(self) -> bool:
        worker = self.worker
        return worker is not None and bool(worker.alive())

    # -- bind ------------------------------------------------------------------------------

    def _bind(self, sock: socket.socket, conn: h11.Connection, body: bytes) -> bool:
        """The bind secret was checked from the head (`_handle`); the body is the session."""
        try:
            request = _bind_request(body)
        except ValueError as exc:
            self._reply(sock, conn, 400, {"error": f"bad bind request: {exc}"})
            return True
        with self._lock:
            if self._bound or self._binding:
                # Refused whoever asks: a replayed bind never changes the session.
                self._reply(sock, conn, 409, {"error": "this worker is already bound"})
                return True
            self._binding = True
            self._pending_hash = bytes.fromhex(request["token_sha256"])
        ok = False
        try:
            status, payload = self._start_session(request)
            ok = status == 200
            self._reply(sock, conn, status, payload)
            return True
        finally:
            with self._lock:
                self._binding = False
                self._pending_hash = b""
                self._bound = self._bound or ok
            if ok:
                self._last_activity = time.monotonic()
            # A bad bind leaves the server warm and unbound: it does not use the worker up.

    def _start_session(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        from agent_sandbox._errors import SandboxError
        from agent_sandbox._host.boundary import resolve_boundary
        from agent_sandbox._host.process import WorkerProcess
        from agent_sandbox.policies import policy_from_dict

        token_hash = bytes.fromhex(request["token_sha256"])
        wanted = request["fingerprint"]
        try:
            policy = policy_from_dict(dict(request["policy"]), source="<bind>")
        except (ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return 400, {"error": f"bad bind request: the policy: {first[:300]}"}
        if policy.fingerprint() != wanted:
            return 400, {
                "error": f"the policy's fingerprint here is {policy.fingerprint()}, the host "
                f"sent {wanted}: host and worker disagree on the policy schema (versions?)"
            }
        # The strongest provider that works here, or `subprocess` under a runtime boundary.
        name, accept = serve_provider(self.config.provider, self.runtime)
        opt_out = {"no_kernel_boundary": "accepted"} if accept else {}
        inside = policy.model_copy(update={"provider": name, **opt_out})
        try:
            boundary = resolve_boundary(inside, name)
            worker = WorkerProcess.start(
                inside, boundary.provider, start_timeout=self.config.start_timeout
            )
        except SandboxError as exc:
            # The host reports only the status: the pod's operator reads why here.
            _log.warning("refused a bind for policy %r: %s", policy.name, str(exc)[:1000])
            return 422, {"error": f"the worker could not start for this policy: {exc}"}
        stack = [self.runtime] * bool(self.runtime) + list(worker.plan.stack if worker.plan else ())
        self.remote_info = {
            "fingerprint": policy.fingerprint(),
            "provider": boundary.provider.name,
            "runtime": self.runtime,
            "runtime_source": self.runtime_source,
            "stack": stack,
        }
        self.worker = worker
        self._token_hash = token_hash
        _log.info("bound a session for policy %r (%s)", policy.name, "+".join(stack))
        return 200, {"bound": True, **self.remote_info}

    # -- run -------------------------------------------------------------------------------

    def _run(self, sock: socket.socket, conn: h11.Connection, body: bytes) -> bool:
        if not self._call.acquire(blocking=False):
            self._reply(sock, conn, 409, {"error": "a call is already running"})
            return True
        final: bytes | None = None
        try:
            final = self._proxy_run(sock, conn, body)
        finally:
            self._last_activity = time.monotonic()
            self._call.release()
            if self._worker_gone():
                self.stop("its worker ended")
        if final is None:
            return False
        # The last bytes go out once the worker is free: a host's next call on another
        # connection (asyncio after blocking) never meets this call's 409.
        try:
            sock.sendall(final)
        except OSError:
            return False
        return True

    def _proxy_run(self, sock: socket.socket, conn: h11.Connection, body: bytes) -> bytes | None:
        """The call relayed; its last bytes for the host (None: the call failed)."""
        worker = self.worker
        try:
            request = json.loads(body)
            wall = float(request.get("wall") or worker.policy.limits.wall_seconds)
        except (ValueError, TypeError, AttributeError):
            self._reply(sock, conn, 400, {"error": "bad run request"}, close=True)
            return None
        if request.get("hold_head") is not True:
            # The worker holds its response's head until the cell's first event, so a quiet
            # call reaches the relay in one write (one wake-up here); on a stream that stays
            # idle longer than `keepalive`, the relay sends the head itself (`_relay`).
            request["hold_head"] = True
            body = json.dumps(request).encode()
        deadline = time.monotonic() + wall + _WALL_GRACE
        inner, self._upstream = self._upstream, None
        if inner is None:
            inner = connect_unix(worker.socket_address())
            if inner is None:
                worker.discard()
                return None
        reader = ResponseReader()
        kept = False
        try:
            inner.sendall(run_request(worker.token, body))
            final = self._relay(sock, conn, inner, reader, deadline)
            kept = final is not None and reader.done and not reader.close
            return final
        except OSError:
            worker.discard()
            return None
        finally:
            if kept:
                self._upstream = inner  # kept for the next call
            else:
                inner.close()

    def _relay(
        self,
        sock: socket.socket,
        conn: h11.Connection,
        inner: socket.socket,
        reader: ResponseReader,
        deadline: float,
    ) -> bytes | None:
        """Stream the worker's response to the host, with keep-alive comments when idle.

        What the worker has already written goes out in one write (one TLS record, one
        wake-up of the host): the relay takes everything its socket holds before it sends,
        and sends before it waits, except before the call's first write, when it waits up
        to `_FIRST_WRITE_HOLD` for more. The response to the host is framed here
        (`serve_relay`), outside `conn`, which `_connection` then replaces."""
        worker = self.worker
        tail = b"\n\n"  # the last two bytes sent: keep-alives only go between events
        streaming = False  # the head went to the host
        pending = bytearray()
        flushed = False
        hold_until = time.monotonic() + _FIRST_WRITE_HOLD
        guard = None
        if getattr(worker, "guard_watch", None) is not None:
            from agent_sandbox._host.intake.events import HostBounds
            from agent_sandbox._host.remote.serve_guard import CallGuard

            cap = HostBounds.from_policy(worker.policy).max_event_bytes() + 1024
            guard = CallGuard(worker.guard_watch, cap)
        while True:
            now = time.monotonic()
            if now > deadline:
                worker.death_reason = "it ran past its wall time (seen by the pod)"
                worker.kill()
                return None  # the host's connection is dropped: it sees the call end
            data = b""
            if pending:
                if len(pending) < _COALESCE_MAX:
                    # Before the call's first write, wait a moment for the rest: a short
                    # call's head, `start`, result and `done` then go out together.
                    wait = hold_until - now if not flushed else 0.0
                    inner.settimeout(max(0.0, min(wait, deadline - now)))
                    with contextlib.suppress(BlockingIOError, TimeoutError):
                        data = inner.recv(262144)
                if not data:
                    sock.sendall(pending)
                    pending.clear()
                    flushed = True
            if not data:
                inner.settimeout(min(self.config.keepalive, deadline - now))
                try:
                    data = inner.recv(262144)
                except TimeoutError:
                    if not streaming:
                        # The worker holds its head until the cell's first event: the
                        # relay answers for it, so the idle stream gets its keep-alives.
                        sock.sendall(SSE_HEAD)
                        streaming = True
                    if tail == b"\n\n":
                        sock.sendall(chunk(KEEPALIVE_COMMENT))
                    continue
                if not data:  # the worker closed mid-response: the host sees the stream cut
                    if pending:
                        sock.sendall(pending)
                    return None
            try:
                pieces = reader.feed(data)
            except UpstreamError:
                worker.discard()
                return None
            if not streaming and reader.status is not None:
                if reader.status != 200 or not reader.chunked:
                    self._reply(sock, conn, 502, {"error": "the worker refused the call"}, True)
                    return None
                pending += SSE_HEAD
                streaming = True
            elif reader.status is not None and reader.status != 200:
                return None  # after the relay's own head: the host sees the stream cut
            for piece in pieces:
                out = piece if guard is None else guard.feed(piece)
                if out:
                    pending += chunk(out)
                    tail = (tail + out)[-2:]
                if guard is not None and guard.reason:
                    pending += chunk(guard.tamper_event(worker.policy.name))
                    sock.sendall(pending)
                    _log.warning("the worker's guards were tampered with: %s", guard.reason)
                    worker.death_reason = "its guards were switched off during a call"
                    worker.kill()
                    return None  # the stream is cut: the host withholds the call's output
            if reader.done:
                if guard is not None and (guard.held or guard.buf):
                    # The end was never verified (the worker went before `done` passed the
                    # check): what was held stays withheld, and the host sees the stream cut.
                    sock.sendall(pending)
                    worker.death_reason = "it ended before its call could be verified"
                    worker.kill()
                    return None
                pending += END
                return bytes(pending)  # sent by `_run` once the call is over


def main(config: ServeConfig, announce: Any = None) -> int:
    """Run a server until its session ends; `announce(port)` is called once it listens."""
    server = WorkerServer(config)
    if announce is not None:
        announce(server.port)
    reason = server.serve_forever()
    _log.info("worker serve exits: %s", reason)
    sys.stdout.flush()
    return 0
