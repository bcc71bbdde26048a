"""A stand-in for kubernetes-sigs/agent-sandbox's Python sandbox-router, behaving as its source
does at commit 2fd412d55ecae90861a101a5424a75473de97c36 (2026-08-22),
`clients/python/agentic-sandbox-client/sandbox-router/sandbox_router.py` (HTTP routes only;
its WebSocket route is not used by this library). Our code, written from that source:

* authentication first (`_check_router_auth`): with a token configured, no `Authorization`
  or one not `Bearer <one part>` is 401 "Missing or invalid Authorization header.", another
  token 401 "Invalid token." (compared in constant time);
* routing (`_resolve_target`), each failure a 400 with its sentence: `X-Sandbox-ID` required
  ("X-Sandbox-ID header is required.") and a DNS label ("Invalid sandbox ID format.");
  `X-Sandbox-Namespace` (default `default`) a DNS label ("Invalid namespace format.");
  `X-Sandbox-Port` (default 8888) an integer in 1-65535 ("Invalid port format.");
  `X-Sandbox-Pod-IP`, when given, an IP address ("Invalid target IP address format.") that is
  not loopback, link-local, multicast or unspecified ("Invalid target IP address."), dialled
  as such; without it, `<id>.<namespace>.svc.<cluster domain>`. Here `network` stands for
  cluster DNS and the pod network: it carries `host:port` (a Service name or a Pod IP) to the
  loopback port of the pod's process; what it lacks cannot be dialled (a connect error);
* the scheme toward the pod is always `http`; the raw path and query are kept;
* the request headers forwarded are the client's minus the five `X-Sandbox-*` routing
  headers, the hop-by-hop ones (and those `Connection` names), `host` and `authorization`;
  httpx adds its own defaults and `Host`; the body is streamed (here: read, then given to
  httpx as an iterator, so it goes with the client's `content-length` as upstream);
* the timeout (`_get_request_timeout`): `X-Sandbox-Timeout` when finite and positive, capped
  at the router's `PROXY_TIMEOUT_SECONDS` (default 180 s), else that; httpx
  `Timeout(t, connect=min(t, 5))`, so `t` bounds each read, not the whole response;
* answers: the pod's status and headers minus hop-by-hop ones (the body re-chunked,
  streamed as it comes, `aiter_bytes`); a 101 from the pod is 502; a connect error 502
  "Could not connect to the backend sandbox: <id>"; a timeout (connect included) 504
  "Timed out waiting for the backend sandbox: <id>"; any other error 500 "An internal error
  occurred in the proxy."; all as FastAPI's `{"detail": ...}`. A read timeout or error once
  the response has started cuts the stream (no last chunk). Methods other than GET, POST,
  PUT, DELETE, PATCH are 405 "Method Not Allowed".

The agents reach it over TLS (uvicorn's `--ssl-*` in front of the upstream router). Its pod
connections are kept alive (`max_keepalive_connections` 20), as upstream.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import math
import re
import socket
import ssl
import threading
from collections.abc import Iterator

import h11
import httpx

UPSTREAM_COMMIT = "2fd412d55ecae90861a101a5424a75473de97c36"

ROUTER_HEADERS = frozenset(
    {
        "x-sandbox-id",
        "x-sandbox-namespace",
        "x-sandbox-port",
        "x-sandbox-pod-ip",
        "x-sandbox-timeout",
    }
)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_DNS_LABEL = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?$")
_METHODS = {b"GET", b"POST", b"PUT", b"DELETE", b"PATCH"}


class _Refusal(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _label(value: str) -> bool:
    return bool(value) and len(value) <= 63 and bool(_DNS_LABEL.match(value))


def _hop_names(headers: dict[str, str]) -> set[str]:
    names = set(HOP_BY_HOP)
    for token in headers.get("connection", "").split(","):
        if token.strip():
            names.add(token.strip().lower())
    return names


class UpstreamRouter:
    """See the module docstring. `network`: `host:port` as dialled -> (address, port) here."""

    def __init__(
        self,
        cert: str,
        *,
        token: str | None,
        network: dict[str, tuple[str, int]] | None = None,
        proxy_timeout: float = 180.0,
        cluster_domain: str = "cluster.local",
    ) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert)
        self.token = token
        self.network = dict(network or {})
        self.proxy_timeout = proxy_timeout
        self.cluster_domain = cluster_domain
        self.client = httpx.Client(
            timeout=proxy_timeout, limits=httpx.Limits(max_keepalive_connections=20)
        )
        #: The headers of every request the router received (lower-cased names).
        self.received: list[dict[str, str]] = []
        #: What each forwarded request carried to the pod: (method, url, headers).
        self.forwarded: list[tuple[str, str, dict[str, str]]] = []
        #: The status of every answer the router made itself.
        self.refused: list[int] = []
        #: A test's hook: a status to answer instead of forwarding, per request (e.g. 502s).
        self.inject: list[int] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"https://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> UpstreamRouter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()
        self.client.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._conn, args=(raw,), daemon=True).start()

    # -- the router's logic -------------------------------------------------------------

    def _check_auth(self, headers: dict[str, str]) -> None:
        if not self.token:
            return
        value = headers.get("authorization")
        if not value:
            raise _Refusal(401, "Missing or invalid Authorization header.")
        parts = value.split()
        if len(parts) != 2 or parts[0].lower() != "bearer":
            raise _Refusal(401, "Missing or invalid Authorization header.")
        if not hmac.compare_digest(parts[1], self.token):
            raise _Refusal(401, "Invalid token.")

    def resolve(self, headers: dict[str, str], target: str) -> tuple[str, str]:
        """(URL to dial, sandbox id), or `_Refusal` (400)."""
        sandbox = headers.get("x-sandbox-id")
        if not sandbox:
            raise _Refusal(400, "X-Sandbox-ID header is required.")
        if not _label(sandbox):
            raise _Refusal(400, "Invalid sandbox ID format.")
        namespace = headers.get("x-sandbox-namespace", "default")
        if not _label(namespace):
            raise _Refusal(400, "Invalid namespace format.")
        try:
            port = int(headers.get("x-sandbox-port", "8888"))
            if not 1 <= port <= 65535:
                raise ValueError
        except ValueError:
            raise _Refusal(400, "Invalid port format.") from None
        pod_ip = headers.get("x-sandbox-pod-ip")
        if pod_ip:
            try:
                ip = ipaddress.ip_address(pod_ip)
            except ValueError:
                raise _Refusal(400, "Invalid target IP address format.") from None
            if ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified:
                raise _Refusal(400, "Invalid target IP address.")
            host = f"[{ip}]" if ip.version == 6 else str(ip)
        else:
            host = f"{sandbox}.{namespace}.svc.{self.cluster_domain}"
        path = target if target.startswith("/") else "/" + target
        return f"http://{host}:{port}{path}", sandbox

    def timeout(self, headers: dict[str, str]) -> float:
        raw = headers.get("x-sandbox-timeout")
        if raw is None:
            return self.proxy_timeout
        try:
            value = float(raw)
        except ValueError:
            return self.proxy_timeout
        if not math.isfinite(value) or value <= 0:
            return self.proxy_timeout
        return min(value, self.proxy_timeout)

    @staticmethod
    def proxy_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
        lower = {k.lower(): v for k, v in headers}
        excluded = ROUTER_HEADERS | _hop_names(lower) | {"host", "authorization"}
        return {k: v for k, v in headers if k.lower() not in excluded}

    # -- the wire -----------------------------------------------------------------------

    def _conn(self, raw: socket.socket) -> None:
        raw.settimeout(60)
        try:
            sock = self.ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            return
        down = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = None, bytearray()
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
                if not self._handle(sock, down, request, bytes(body)):
                    return
                down.start_next_cycle()
        except (OSError, h11.ProtocolError, ssl.SSLError):
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _answer(self, sock: socket.socket, down: h11.Connection, status: int, detail: str) -> None:
        self.refused.append(status)
        data = json.dumps({"detail": detail}).encode()
        head = [("content-type", "application/json"), ("content-length", str(len(data)))]
        sock.sendall(down.send(h11.Response(status_code=status, headers=head)) or b"")
        sock.sendall(down.send(h11.Data(data=data)) or b"")
        sock.sendall(down.send(h11.EndOfMessage()) or b"")

    def _handle(
        self, sock: socket.socket, down: h11.Connection, request: h11.Request, body: bytes
    ) -> bool:
        pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers]
        headers = {k.lower(): v for k, v in pairs}
        self.received.append(headers)
        if request.method not in _METHODS:
            self._answer(sock, down, 405, "Method Not Allowed")
            return True
        try:
            self._check_auth(headers)
            url, sandbox = self.resolve(headers, request.target.decode("latin-1"))
        except _Refusal as refusal:
            self._answer(sock, down, refusal.status, refusal.detail)
            return True
        if self.inject:
            self._answer(sock, down, self.inject.pop(0), "injected by the test")
            return True
        timeout = self.timeout(headers)
        forwarded = self.proxy_headers(pairs)
        self.forwarded.append((request.method.decode(), url, dict(forwarded)))

        def stream() -> Iterator[bytes]:
            yield body

        try:
            out = self.client.build_request(
                request.method.decode(),
                url,
                headers=forwarded,
                content=stream(),
                timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            )
            where = self.network.get(url.split("/")[2])
            if where is None:
                raise httpx.ConnectError(f"cannot connect to {url.split('/')[2]}")
            # The connection goes where the pod network carries it; the request keeps its
            # URL's target and Host, as sent to the pod.
            out.url = out.url.copy_with(host=where[0], port=where[1])
            out.headers["host"] = url.split("/")[2]
            response = self.client.send(out, stream=True)
        except httpx.ConnectError:
            self._answer(sock, down, 502, f"Could not connect to the backend sandbox: {sandbox}")
            return True
        except httpx.TimeoutException:
            self._answer(sock, down, 504, f"Timed out waiting for the backend sandbox: {sandbox}")
            return True
        except Exception:
            self._answer(sock, down, 500, "An internal error occurred in the proxy.")
            return True
        try:
            if response.status_code == 101:
                self._answer(
                    sock,
                    down,
                    502,
                    "Backend attempted a WebSocket upgrade over HTTP. "
                    "Connect using the WebSocket protocol instead.",
                )
                return True
            lower = {k.lower(): v for k, v in response.headers.items()}
            hop = _hop_names(lower)
            head = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in hop]
            sock.sendall(
                down.send(h11.Response(status_code=response.status_code, headers=head)) or b""
            )
            try:
                for piece in response.iter_bytes():
                    if piece:
                        sock.sendall(down.send(h11.Data(data=piece)) or b"")
            except (httpx.HTTPError, OSError):
                return False  # the stream is cut: no last chunk
            sock.sendall(down.send(h11.EndOfMessage()) or b"")
            return True
        finally:
            response.close()
