"""The host's side of the channel to a remote worker: the same HTTP/SSE protocol over TCP + TLS.

The local transport (`_host/intake/transport.py`) speaks h11 over a Unix socket; this one speaks the
same routes (`GET /hello`, `POST /run` answered by an SSE stream, `POST /shutdown`) plus the remote
worker's `POST /v1/bind`, through `httpx` (an optional dependency, the `remote` extra): TLS with
verification on by default, client certificates for mTLS, per-phase timeouts and proxies.

What the host receives is judged exactly as on the local path: the bytes go through the same
bounded `SSEParser` (per-kind caps, value budget) and every event through the caller's judge
(`agent_sandbox._host.intake.events`). The stream is read incrementally (`iter_raw`) and the call's
deadline is checked after every chunk, so a worker that trickles bytes cannot outlive it.

The session token travels in `X-Agent-Sandbox-Token`, not `Authorization`: the
agent-sandbox router strips `Authorization` (it may carry the router's own scoped token).
Plain `http://` is refused unless the caller accepts it in so many words
(`plaintext="accepted"`, for a hop a TLS-terminating router already protects).

This module is longer than 600 lines because the blocking and the asyncio calls are twins
over one protocol object with one set of checks (deadline, caps, framing), and the retries
of the bind and handshake sit with the requests they repeat; split, the checks would be kept
in step in two places.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from agent_sandbox._errors import DIST_NAME, TransportError, install_hint
from agent_sandbox._host.intake.framing import KindCaps, SSEParser
from agent_sandbox._host.intake.transport import ConnectionLost, _Protocol, decode_hello
from agent_sandbox._wire import Event, Hello, value_budget

if TYPE_CHECKING:
    import httpx

__all__ = [
    "TOKEN_HEADER",
    "BIND_HEADER",
    "RemoteBusy",
    "RemoteNotReady",
    "RemoteTLS",
    "RemoteWorkerClient",
    "import_httpx",
]

#: The header carrying the per-session token (the router strips `Authorization`).
TOKEN_HEADER = "x-agent-sandbox-token"
#: The header carrying the template-wide bootstrap secret, on `POST /v1/bind` only.
BIND_HEADER = "x-agent-sandbox-bind"

OnEvent = Callable[[Event], None]

#: The waits between attempts of a bind or a handshake that met a passing failure (as the
#: agent-sandbox SDK's urllib3 `Retry(backoff_factor=0.5)`: 0.5, 1, 2, 4 s).
RETRY_DELAYS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
#: The answers that are passing failures (a router's 502/504, a pod not ready yet).
RETRY_STATUSES = frozenset({500, 502, 503, 504})


def _tls_refused(exc: BaseException) -> bool:
    """A certificate or handshake refused somewhere in `exc`'s chain."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RemoteNotReady(TransportError):
    """The worker is being bound by another process of the same session (HTTP 503)."""


class RemoteBusy(TransportError):
    """The remote worker is already running a call for this session (one call at a time)."""


def import_httpx() -> Any:
    """httpx, or an ImportError that says which extra installs it."""
    try:
        import httpx
    except ImportError:
        raise ImportError(
            f"the remote transport needs httpx, which {DIST_NAME} installs as an extra: "
            f"{install_hint('remote')}"
        ) from None
    return httpx


@dataclasses.dataclass(frozen=True)
class RemoteTLS:
    """How the host reaches remote workers: the CA it trusts, its client certificate, a proxy.

    `ca_file` is the CA bundle that signs the workers' (or the router's) certificates; None
    means the system's trust store. Verification cannot be switched off; a hop without TLS
    needs `plaintext="accepted"` and an `http://` URL.
    """

    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    proxy: str | None = None
    connect_timeout: float = 5.0
    plaintext: Literal["", "accepted"] = ""
    #: The name the worker's certificate must carry, instead of the URL's host: direct
    #: pod-IP mode, where one certificate (e.g. `ags-worker.<namespace>.svc`) serves every
    #: pod of a template and cannot name each pod's IP. Also sent as SNI.
    server_name: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.client_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx

    def check_url(self, url: str) -> None:
        if url.startswith("https://"):
            return
        if url.startswith("http://"):
            if self.plaintext == "accepted":
                return
            raise ValueError(
                f"the remote worker's URL {url!r} is plain HTTP: the session token and the "
                "code would cross the network unencrypted; use https:// (the default), or, "
                "for a hop already inside a TLS-terminating router, opt out in so many words "
                'with RemoteTLS(plaintext="accepted")'
            )
        raise ValueError(f"the remote worker's URL {url!r} must start with https://")


#: Calls (`POST /run`) go over the client's own TLS socket with h11 unless a proxy is set
#: (then through httpx, which speaks CONNECT); the contract tests run both.
DIRECT_RUNS = True


class RemoteWorkerClient:
    """A blocking client for one remote worker.

    Same interface as `_host.intake.transport.WorkerClient` (`hello`, `run`, `shutdown`, `close`),
    so `WorkerProcess`'s call logic runs unchanged over it.

    The calls themselves, the hot path, go over one persistent TLS connection of the
    client's own, with the local transport's sans-IO h11 protocol (`_Protocol`): the request
    in one write (one TLS record; httpx writes head and body apart), no per-call URL, header
    and timeout objects. Measured by `benchmarks/bench_remote.py`, this is what brings the
    warm remote call near the local one. Bind, handshake, interrupt and shutdown (rare) and
    every request through a proxy go through httpx. Both read the stream with the same
    bounded `SSEParser`, check the deadline after every read and treat a stream without
    `done` as a lost connection.
    """

    def __init__(
        self,
        url: str,
        token: str,
        max_event_bytes: int,
        kind_caps: KindCaps | None = None,
        *,
        tls: RemoteTLS | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.tls = tls or RemoteTLS()
        self.tls.check_url(url)
        self.url = url.rstrip("/")
        self.path = self.url  # what WorkerProcess shows; no socket path here
        self.token = token
        self.max_event_bytes = max_event_bytes
        self.kind_caps = kind_caps
        result_cap = kind_caps.get("result") if kind_caps is not None else None
        self.max_values = value_budget(result_cap[0]) if result_cap is not None else None
        self.headers = dict(headers or {})
        self.retries = 0  # the last bind's or handshake's retries
        self._client: httpx.Client | None = None
        parts = urllib.parse.urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._tls_name = self.tls.server_name or self._host
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._netloc = parts.netloc.rpartition("@")[2]
        self._ssl: ssl.SSLContext | None = None
        self._sock: socket.socket | None = None
        self._proto: _Protocol | None = None
        # The asyncio twin: (its loop, reader, writer, protocol).
        self._aconn: tuple[Any, Any, Any, _Protocol] | None = None
        self._ainuse: list[tuple[Any, Any, Any, _Protocol]] = []  # calls running on one

    # -- connection ------------------------------------------------------------------------

    def _http(self) -> httpx.Client:
        if self._client is None:
            httpx = import_httpx()
            self._client = httpx.Client(
                verify=self.tls.ssl_context(),
                proxy=self.tls.proxy,
                trust_env=False,  # a proxy comes from RemoteTLS, never from the environment
                http1=True,
                http2=False,
                follow_redirects=False,
                timeout=httpx.Timeout(30.0, connect=self.tls.connect_timeout),
                limits=httpx.Limits(max_connections=4, max_keepalive_connections=1),
            )
        return self._client

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {**self.headers, TOKEN_HEADER: self.token}
        if extra:
            headers.update(extra)
        return headers

    def _timeout(self, deadline: float) -> Any:
        httpx = import_httpx()
        remaining = max(0.001, deadline - time.monotonic())
        return httpx.Timeout(remaining, connect=min(remaining, self.tls.connect_timeout))

    def _request_json(
        self,
        method: str,
        route: str,
        payload: Any,
        deadline: float,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        httpx = import_httpx()
        body = b"" if payload is None else json.dumps(payload).encode()
        try:
            with self._http().stream(
                method,
                self.url + route,
                content=body,
                headers={**self._headers(headers), "content-type": "application/json"},
                timeout=self._timeout(deadline),
                extensions={"sni_hostname": self._tls_name} if self.tls.server_name else None,
            ) as response:
                data = bytearray()
                for chunk in response.iter_raw():
                    data += chunk
                    if len(data) > self.max_event_bytes:
                        raise TransportError("the remote worker's reply exceeds the size cap")
                    if time.monotonic() > deadline:
                        raise TimeoutError("the request exceeded its deadline")
                status = response.status_code
        except httpx.TimeoutException:
            self.close()
            raise TimeoutError("the remote worker did not answer in time") from None
        except httpx.TransportError as exc:
            self.close()
            if _tls_refused(exc):
                # Not a passing failure (never retried): the peer's certificate is wrong.
                raise TransportError(
                    f"the TLS handshake with the remote worker failed: {exc}"
                ) from None
            raise ConnectionLost(f"the connection to the remote worker failed: {exc}") from None
        try:
            return status, json.loads(data) if data else None
        except ValueError:
            raise TransportError("the remote worker's reply is not JSON") from None

    # -- routes ----------------------------------------------------------------------------

    def healthz(self, timeout: float) -> bool:
        """The readiness probe's route (no token needed); True when the worker is ready."""
        try:
            status, _ = self._request_json("GET", "/healthz", None, time.monotonic() + timeout)
        except (TransportError, TimeoutError):
            return False
        return status == 200

    def _retrying(
        self,
        method: str,
        route: str,
        payload: Any,
        deadline: float,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        """`_request_json`, retried with backoff (`RETRY_DELAYS`, within `deadline`) on what
        a router or a pod in its start answers for a moment: 500, 502, 503 (but not the
        session's own "being bound"), 504, and a connection refused or reset. The last
        answer, or error, is the caller's."""
        self.retries = 0
        for delay in (*RETRY_DELAYS, None):
            try:
                status, data = self._request_json(method, route, payload, deadline, headers)
            except ConnectionLost:
                if delay is None or time.monotonic() + delay >= deadline:
                    raise
            else:
                pending = status == 503 and route == "/hello"
                if status not in RETRY_STATUSES or pending or delay is None:
                    return status, data
                if time.monotonic() + delay >= deadline:
                    return status, data
            self.retries += 1
            time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def bind(self, bind_secret: str, payload: dict[str, Any], timeout: float) -> int:
        """`POST /v1/bind`: hand the worker its session; returns the HTTP status (200 bound,
        409 already bound). The bootstrap secret goes in its own header, never in the body.
        Retried on a router's or a starting pod's passing failures (`_retrying`)."""
        status, _body = self._retrying(
            "POST",
            "/v1/bind",
            payload,
            time.monotonic() + timeout,
            headers={BIND_HEADER: bind_secret},
        )
        return status

    def hello(self, timeout: float) -> tuple[Hello, Any]:
        """The pod's handshake: its worker's (read by `transport.decode_hello`, which
        raises HelloError naming what it refuses) and the pod's own `remote` section (the
        policy and stack it serves, checked by `RemoteWorker`)."""
        status, data = self._retrying("GET", "/hello", None, time.monotonic() + timeout)
        if status == 503:
            raise RemoteNotReady("the remote worker is being bound by this session's other process")
        if status != 200:
            raise TransportError(f"the remote worker refused the handshake (HTTP {status})")
        if not isinstance(data, dict):
            raise TransportError("the remote worker's handshake is not a JSON object")
        remote = data.pop("remote", None)
        return decode_hello(data), remote

    def run(
        self,
        code: str,
        deadline: float,
        on_event: OnEvent,
        filename: str | None = None,
        wall: float | None = None,
    ) -> None:
        """POST the code and deliver each event until the stream ends (or the deadline)."""
        body = self._run_body(code, deadline, filename, wall)
        if DIRECT_RUNS and self.tls.proxy is None:
            self._run_direct(body, deadline, on_event)
            return
        for event in self._stream(body, deadline):
            on_event(event)

    @staticmethod
    def _run_body(
        code: str, deadline: float, filename: str | None, wall: float | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"code": code}
        if filename:
            body["filename"] = filename
        # The pod enforces the call's wall time itself (and kills its worker past it).
        body["wall"] = wall if wall is not None else round(max(0.0, deadline - time.monotonic()), 3)
        return body

    # -- the direct path: one TLS socket, h11 -------------------------------------------------

    def _direct(self, deadline: float) -> tuple[socket.socket, _Protocol]:
        if self._sock is not None and self._proto is not None and self._proto.reusable():
            return self._sock, self._proto
        self._close_direct()
        timeout = max(0.001, min(deadline - time.monotonic(), self.tls.connect_timeout))
        try:
            raw = socket.create_connection((self._host, self._port), timeout=timeout)
        except TimeoutError:
            raise TimeoutError("the remote worker did not accept a connection in time") from None
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to the remote worker: {exc}") from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = raw
            if self._https:
                if self._ssl is None:
                    self._ssl = self.tls.ssl_context()
                sock = self._ssl.wrap_socket(raw, server_hostname=self._tls_name)
        except TimeoutError:
            raw.close()
            raise TimeoutError("the remote worker's TLS handshake did not end in time") from None
        except OSError as exc:  # ssl.SSLError included: a certificate not trusted
            raw.close()
            raise ConnectionLost(
                f"the TLS handshake with the remote worker failed: {exc}"
            ) from None
        head = [("host", self._netloc), *self.headers.items(), (TOKEN_HEADER, self.token)]
        proto = _Protocol(self.token, self.max_event_bytes, self.kind_caps, headers=head)
        self._sock, self._proto = sock, proto
        return sock, proto

    def _run_direct(self, body: dict[str, Any], deadline: float, on_event: OnEvent) -> None:
        sock, proto = self._direct(deadline)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(proto.request("POST", self._prefix + "/run", body))
            checked = done = False
            while not proto.done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # Checked here too: a pod that never stops sending never lets recv time out.
                    raise TimeoutError("the call exceeded its deadline")
                sock.settimeout(remaining)
                checked, seen = self._feed(proto, sock.recv(262144), on_event, checked)
                done = done or seen
            if not done:
                raise ConnectionLost("the remote worker ended the stream before `done`")
        except TimeoutError:
            self._close_direct()
            raise TimeoutError("the call exceeded its deadline") from None
        except OSError as exc:
            self._close_direct()
            raise ConnectionLost(f"the connection to the remote worker failed: {exc}") from None
        except BaseException:
            # The judge refused an event, the pod broke the protocol, or the caller was
            # interrupted: the connection is in an unknown state.
            self._close_direct()
            raise

    def _close_direct(self) -> None:
        sock, self._sock, self._proto = self._sock, None, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    # -- the same, in asyncio: one TLS connection per event loop ------------------------------

    def native_async(self) -> bool:
        """Whether `arun` speaks asyncio itself (the direct path: no proxy)."""
        return DIRECT_RUNS and self.tls.proxy is None

    async def arun(
        self,
        code: str,
        deadline: float,
        on_event: OnEvent,
        filename: str | None = None,
        wall: float | None = None,
    ) -> None:
        """`run()` in the caller's event loop, on a persistent asyncio TLS connection of
        its own (kept for the next call in the same loop): the same request bytes, the same
        sans-IO h11 protocol and bounded parser, the same checks."""
        import asyncio

        body = self._run_body(code, deadline, filename, wall)
        try:
            await asyncio.wait_for(
                self._arun_direct(body, on_event, deadline),
                max(0.001, deadline - time.monotonic()),
            )
        except TimeoutError:
            self._close_async()
            raise TimeoutError("the call exceeded its deadline") from None

    async def _aconnect(self, deadline: float) -> tuple[Any, Any, _Protocol]:
        import asyncio

        loop = asyncio.get_running_loop()
        if self._aconn is not None:
            owner, reader, writer, proto = self._aconn
            if owner is loop and proto.reusable() and not writer.is_closing():
                return reader, writer, proto
            if any(conn is self._aconn for conn in self._ainuse):
                self._aconn = None  # a cancelled call still drains it; it closes it itself
            else:
                self._close_async()
        ctx = None
        if self._https:
            if self._ssl is None:
                self._ssl = self.tls.ssl_context()
            ctx = self._ssl
        timeout = max(0.001, min(deadline - time.monotonic(), self.tls.connect_timeout))
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    self._host, self._port, ssl=ctx, server_hostname=self._tls_name if ctx else None
                ),
                timeout,
            )
        except TimeoutError:
            raise TimeoutError("the remote worker did not accept a connection in time") from None
        except OSError as exc:  # ssl.SSLError included: a certificate not trusted
            raise ConnectionLost(f"cannot connect to the remote worker: {exc}") from None
        head = [("host", self._netloc), *self.headers.items(), (TOKEN_HEADER, self.token)]
        proto = _Protocol(self.token, self.max_event_bytes, self.kind_caps, headers=head)
        self._aconn = (loop, reader, writer, proto)
        return reader, writer, proto

    async def _arun_direct(self, body: dict[str, Any], on_event: OnEvent, deadline: float) -> None:
        reader, writer, proto = await self._aconnect(deadline)
        conn = self._aconn
        assert conn is not None
        self._ainuse.append(conn)
        try:
            writer.write(proto.request("POST", self._prefix + "/run", body))
            await writer.drain()
            checked = done = False
            while not proto.done:
                data = await reader.read(262144)
                checked, seen = self._feed(proto, data, on_event, checked)
                done = done or seen
            if not done:
                raise ConnectionLost("the remote worker ended the stream before `done`")
        except OSError as exc:
            self._drop_async(conn)
            raise ConnectionLost(f"the connection to the remote worker failed: {exc}") from None
        except BaseException:
            # Refused, broken, timed out or cancelled: the connection is in an unknown state.
            self._drop_async(conn)
            raise
        finally:
            self._ainuse.remove(conn)
        if self._aconn is not conn:
            self._drop_async(conn)  # superseded while it drained (a call after a cancel)

    def _drop_async(self, conn: tuple[Any, Any, Any, _Protocol]) -> None:
        if self._aconn is conn:
            self._aconn = None
        try:
            conn[2].close()  # in its own loop: the call runs there
        except Exception:  # closing never raises to the caller
            pass

    def _close_async(self) -> None:
        import asyncio

        conn, self._aconn = self._aconn, None
        if conn is None:
            return
        loop, _reader, writer, _proto = conn
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is loop:
                writer.close()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(writer.close)  # from another thread (a kill)
        except Exception:  # closing never raises to the caller
            pass

    @classmethod
    def _feed(
        cls, proto: _Protocol, data: bytes, on_event: OnEvent, checked: bool
    ) -> tuple[bool, bool]:
        """One read of a direct call's stream: the status checked once it is known, each
        event passed on; returns (status checked, `done` seen)."""
        events = proto.receive(data)
        if not checked and proto.status is not None:
            checked = True
            cls._check_status(proto)
        done = False
        for event in events:
            done = done or event[0] == "done"
            on_event(event)
        return checked, done

    @staticmethod
    def _check_status(proto: _Protocol) -> None:
        if proto.status == 409:
            raise RemoteBusy("the remote worker is already running a call")
        if proto.status != 200:
            raise TransportError(f"the remote worker refused the call (HTTP {proto.status})")
        if not proto.streaming:
            raise TransportError("the remote worker did not answer with an event stream")

    # -- through httpx (a proxy) ---------------------------------------------------------------

    def _stream(self, body: dict[str, Any], deadline: float) -> Iterator[Event]:
        httpx = import_httpx()
        parser = SSEParser(self.max_event_bytes, self.kind_caps, self.max_values)
        try:
            with self._http().stream(
                "POST",
                self.url + "/run",
                content=json.dumps(body).encode(),
                headers={**self._headers(), "content-type": "application/json"},
                timeout=self._timeout(deadline),
            ) as response:
                if response.status_code == 409:
                    raise RemoteBusy("the remote worker is already running a call")
                if response.status_code != 200:
                    raise TransportError(
                        f"the remote worker refused the call (HTTP {response.status_code})"
                    )
                ctype = response.headers.get("content-type", "")
                if not ctype.startswith("text/event-stream"):
                    raise TransportError("the remote worker did not answer with an event stream")
                done = False
                for chunk in response.iter_raw():
                    if time.monotonic() > deadline:
                        raise TimeoutError("the call exceeded its deadline")
                    for event in parser.feed(chunk):
                        done = done or event[0] == "done"
                        yield event
                if not done:
                    raise ConnectionLost("the remote worker ended the stream before `done`")
        except httpx.TimeoutException:
            self.close()
            raise TimeoutError("the call exceeded its deadline") from None
        except httpx.TransportError as exc:
            self.close()
            raise ConnectionLost(f"the connection to the remote worker failed: {exc}") from None
        except (TransportError, TimeoutError):
            self.close()
            raise

    def interrupt(self, grace: float, timeout: float = 2.0) -> bool:
        """`POST /interrupt` on a connection of its own (the call's is streaming)."""
        probe = RemoteWorkerClient(
            self.url,
            self.token,
            self.max_event_bytes,
            self.kind_caps,
            tls=self.tls,
            headers=self.headers,
        )
        try:
            status, data = probe._request_json(
                "POST", "/interrupt", {"grace": grace}, time.monotonic() + timeout
            )
        except (TransportError, TimeoutError):
            return False
        finally:
            probe.close()
        return status == 200 and isinstance(data, dict) and data.get("sent") is True

    def shutdown(self, timeout: float = 1.0) -> None:
        try:
            self._request_json("POST", "/shutdown", None, time.monotonic() + timeout)
        except (TransportError, TimeoutError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        self._close_direct()
        self._close_async()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing never raises to the caller
                pass
        self._client = None
