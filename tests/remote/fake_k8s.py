"""A fake Kubernetes API for the SandboxClaim calls the agent-sandbox SDK makes, and a fake
sandbox-router; both on loopback, both only as faithful as the tests need.

`FakeKube` serves, for one namespace: create / get / delete of `sandboxclaims`
(extensions.agents.x-k8s.io/v1beta1; 409 on a duplicate name), the watch the SDK opens on a
claim (newline-delimited JSON events), and `sandboxes` (agents.x-k8s.io/v1beta1) with
`status.podIPs`. Its "controller" binds a new claim to the next idle pod of the warm pool
(`pods`), or never (`mode="never"`: no pod ready), or fails it with a terminal reason.

`FakeRouter` is the sandbox-router's contract as far as the host sees it: TLS, routing by
`X-Sandbox-ID` (a DNS-1123 label, else 400) and `X-Sandbox-Namespace`, `Authorization`
checked against its token and stripped before the pod, the response streamed through
unbuffered.

Not faked: the controller's real reconciliation, resourceVersion semantics beyond a counter,
admission, RBAC, NetworkPolicy, the real router's TLS reload and authz modes.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import h11

CLAIMS = "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/{ns}/sandboxclaims"
SANDBOXES = "/apis/agents.x-k8s.io/v1beta1/namespaces/{ns}/sandboxes"


class FakeKube:
    def __init__(
        self,
        pods: list[tuple[str, str, int]],
        namespace: str = "default",
        factory: Any = None,
    ) -> None:
        """`pods`: the warm pool, as (sandbox name, pod IP, port); `factory()`: a new pod
        when none is idle (the warm pool's replenishment, a cold start)."""
        self.ns = namespace
        self.idle = list(pods)
        self.factory = factory
        self.claims: dict[str, dict[str, Any]] = {}
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.bound: dict[str, tuple[str, str, int]] = {}
        self.created_bodies: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.mode = "ready"  # "ready" | "never" | a terminal reason such as "PodFailed"
        #: Answers the API server gives instead, per call: (status, message).
        self.create_errors: list[tuple[int, str]] = []
        self.delete_errors: list[tuple[int, str]] = []
        #: The UID preconditions the deletes carried.
        self.delete_preconditions: list[str | None] = []
        self.rv = 100
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length))
                status, out = fake.create(urlparse(self.path).path, body)
                self._send(status, out)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                if query.get("watch", [""])[0].lower() == "true":
                    fake.watch(self, url.path, query)
                    return
                status, out = fake.get(url.path)
                self._send(status, out)

            def do_DELETE(self) -> None:
                length = int(self.headers.get("content-length", 0) or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                uid = ((body or {}).get("preconditions") or {}).get("uid")
                status, out = fake.delete(urlparse(self.path).path, uid)
                self._send(status, out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeKube:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    def api_client(self) -> Any:
        from kubernetes import client

        config = client.Configuration(host=self.url)
        return client.ApiClient(config)

    # -- the API ---------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def create(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path != CLAIMS.format(ns=self.ns):
            return 404, {"kind": "Status", "code": 404}
        name = body["metadata"]["name"]
        with self.lock:
            self.created_bodies.append(body)
            if self.create_errors:
                status, message = self.create_errors.pop(0)
                return status, {"kind": "Status", "code": status, "message": message}
            if name in self.claims:
                return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"}
            claim = json.loads(json.dumps(body))
            claim["metadata"].update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv())
            self.claims[name] = claim
            self._reconcile(name)
            created = json.loads(json.dumps(claim))
            created.pop("status", None)  # the create response predates the controller
            return 201, created

    def _reconcile(self, name: str) -> None:
        """The controller: bind the claim to an idle pod (or not, by mode)."""
        claim = self.claims[name]
        if self.mode == "never":
            return
        if self.mode != "ready":
            claim["status"] = {
                "conditions": [
                    {"type": "Ready", "status": "False", "reason": self.mode, "message": "fake"}
                ]
            }
            return
        if not self.idle and self.factory is not None:
            self.idle.append(self.factory())
        if not self.idle:
            return
        sandbox, ip, port = self.idle.pop(0)
        self.bound[name] = (sandbox, ip, port)
        self.sandboxes[sandbox] = {
            "metadata": {"name": sandbox, "namespace": self.ns},
            "status": {"podIPs": [{"ip": ip}], "conditions": [{"type": "Ready", "status": "True"}]},
        }
        claim["metadata"]["resourceVersion"] = self._next_rv()
        claim["status"] = {
            "sandbox": {"name": sandbox, "podIPs": [ip]},
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}],
        }

    def finish(self, sandbox: str, reason: str = "PodSucceeded") -> None:
        """The controller seeing the sandbox's pod end (`restartPolicy: Never`): the Sandbox
        and its claim are no longer Ready and are Finished (upstream's reasons)."""
        with self.lock:
            ended = [
                {"type": "Ready", "status": "False", "reason": reason},
                {"type": "Finished", "status": "True", "reason": reason},
            ]
            if sandbox in self.sandboxes:
                self.sandboxes[sandbox]["status"]["conditions"] = ended
            for name, bound in self.bound.items():
                if bound[0] == sandbox:
                    claim = self.claims[name]
                    claim["status"]["conditions"] = ended
                    claim["metadata"]["resourceVersion"] = self._next_rv()

    def get(self, path: str) -> tuple[int, Any]:
        base, _, name = path.rpartition("/")
        with self.lock:
            if base == CLAIMS.format(ns=self.ns) and name in self.claims:
                return 200, self.claims[name]
            if base == SANDBOXES.format(ns=self.ns) and name in self.sandboxes:
                return 200, self.sandboxes[name]
        return 404, {"kind": "Status", "code": 404}

    def delete(self, path: str, uid: str | None = None) -> tuple[int, Any]:
        base, _, name = path.rpartition("/")
        with self.lock:
            self.delete_preconditions.append(uid)
            if self.delete_errors:
                status, message = self.delete_errors.pop(0)
                return status, {"kind": "Status", "code": status, "message": message}
            if base != CLAIMS.format(ns=self.ns) or name not in self.claims:
                return 404, {"kind": "Status", "code": 404}
            if uid is not None and self.claims[name]["metadata"]["uid"] != uid:
                message = f"Precondition failed: UID in precondition: {uid}"
                return 409, {"kind": "Status", "code": 409, "message": message}
            self.claims.pop(name)
            self.deleted.append(name)
            pod = self.bound.pop(name, None)
            if pod is not None:
                self.sandboxes.pop(pod[0], None)
        return 200, {"kind": "Status", "status": "Success"}

    def watch(
        self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, list[str]]
    ) -> None:
        selector = query.get("fieldSelector", [""])[0]
        name = selector.partition("metadata.name=")[2]
        timeout = float(query.get("timeoutSeconds", ["5"])[0])
        handler.send_response(200)
        handler.send_header("content-type", "application/json")
        handler.end_headers()
        deadline = time.monotonic() + min(timeout, 30)
        while time.monotonic() < deadline:
            with self.lock:
                claim = self.claims.get(name)
                snapshot = json.loads(json.dumps(claim)) if claim else None
            if snapshot is not None and snapshot.get("status"):
                line = json.dumps({"type": "MODIFIED", "object": snapshot}) + "\n"
                with contextlib.suppress(OSError):
                    handler.wfile.write(line.encode())
                    handler.wfile.flush()
                return
            time.sleep(0.05)


_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class FakeRouter:
    """TLS in front, plain HTTP to the pod (as the real router's pod hop usually is)."""

    def __init__(self, cert: str, routes: dict[str, tuple[str, int]], token: str) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert)
        self.routes = routes
        self.token = token
        self.seen_authorization: list[bool] = []
        self.refused: list[int] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"https://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeRouter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._conn, args=(raw,), daemon=True).start()

    def _reply(self, sock: socket.socket, conn: h11.Connection, status: int) -> None:
        self.refused.append(status)
        body = b'{"error": "router"}'
        headers = [("content-length", str(len(body))), ("connection", "close")]
        sock.sendall(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
        sock.sendall(conn.send(h11.Data(data=body)) or b"")
        sock.sendall(conn.send(h11.EndOfMessage()) or b"")

    def _conn(self, raw: socket.socket) -> None:
        raw.settimeout(30)
        try:
            sock = self.ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            return
        down = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = None, b""
                while True:
                    event = down.next_event()
                    if event is h11.NEED_DATA:
                        down.receive_data(sock.recv(65536))
                        continue
                    if isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                assert request is not None
                if not self._forward(sock, down, request, body):
                    return
                down.start_next_cycle()
        except (OSError, h11.ProtocolError, ssl.SSLError):
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _forward(
        self, sock: socket.socket, down: h11.Connection, request: h11.Request, body: bytes
    ) -> bool:
        headers = {k.lower(): v for k, v in request.headers}
        sandbox = headers.get(b"x-sandbox-id", b"").decode()
        auth = headers.get(b"authorization", b"")
        self.seen_authorization.append(bool(auth))
        if auth != b"Bearer " + self.token.encode():
            self._reply(sock, down, 401)
            return False
        if not _LABEL.match(sandbox) or sandbox not in self.routes:
            self._reply(sock, down, 400 if not _LABEL.match(sandbox) else 404)
            return False
        host, port = self.routes[sandbox]
        forwarded = [
            (k, v)
            for k, v in request.headers
            if k.lower() not in (b"authorization", b"host", b"connection")
        ] + [(b"host", b"pod")]
        up_sock = socket.create_connection((host, port), timeout=30)
        up_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up = h11.Connection(h11.CLIENT)
        try:
            up_sock.sendall(
                up.send(
                    h11.Request(method=request.method, target=request.target, headers=forwarded)
                )
                or b""
            )
            if body:
                up_sock.sendall(up.send(h11.Data(data=body)) or b"")
            up_sock.sendall(up.send(h11.EndOfMessage()) or b"")
            while True:
                event = up.next_event()
                if event is h11.NEED_DATA:
                    up.receive_data(up_sock.recv(65536))
                    continue
                if isinstance(event, h11.Response):
                    out = [(k, v) for k, v in event.headers if k.lower() != b"connection"]
                    sock.sendall(
                        down.send(h11.Response(status_code=event.status_code, headers=out)) or b""
                    )
                elif isinstance(event, h11.Data):
                    sock.sendall(down.send(h11.Data(data=event.data)) or b"")  # no buffering
                elif isinstance(event, h11.EndOfMessage):
                    sock.sendall(down.send(h11.EndOfMessage()) or b"")
                    return True
                else:
                    return False
        finally:
            up_sock.close()
