"""The parent's side of the channel: an HTTP/1.1 client (h11) over the worker's Unix socket.

The protocol logic is sans-IO (`_Protocol`): it turns a request into bytes and received
bytes into a status, a JSON body or SSE events. `WorkerClient` (blocking, one persistent
connection) and `AsyncWorkerClient` (asyncio) only move bytes. Measured on this machine,
h11 on both ends is the fastest well-kept stack for one POST answered by an SSE stream
(see `benchmarks/bench_core.py`), which is why the hot path does not go through httpx.

Every wait has a deadline; a closed or garbled channel is a `TransportError` (or
`ConnectionLost`, which the caller turns into `WorkerCrashed` after looking at the process).
Reading is incremental and bounded: one `recv` of at most 64 KiB at a time, h11's own cap
on headers and chunk lines, and the SSE parser's per-kind cap on one event. An exception
raised by the event callback (the host's judge, `agent_sandbox._host.intake.events`, refusing an
event or a bound) stops the reading at once and closes the connection.
"""

from __future__ import annotations

import json
import math
import select
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent_sandbox._errors import TransportError
from agent_sandbox._host.intake.framing import KindCaps, SSEParser
from agent_sandbox._wire import HELLO_BYTES, Event, Hello, HelloError, value_budget

if TYPE_CHECKING:
    import h11

__all__ = [
    "AsyncWorkerClient",
    "ConnectionLost",
    "ReplyTooLarge",
    "WorkerClient",
    "decode_hello",
]

OnEvent = Callable[[Event], None]
#: Serves one host-tool request (the event's data, the seconds left before the call's
#: deadline) and returns the reply object.
HostCall = Callable[[Any, float], dict[str, Any]]


class ConnectionLost(TransportError):
    """The worker closed the connection before the response ended (it probably died)."""


class ReplyTooLarge(TransportError):
    """A simple (not streamed) reply of the worker passed the cap the host reads."""


def decode_hello(data: Any) -> Hello:
    """The host's one reading of a worker's handshake (a local worker's, and a remote
    one's without its pod's `remote` section): `Hello.from_dict`, which refuses an
    unknown or a missing key and a value of the wrong type with a `HelloError` naming it."""
    return Hello.from_dict(data)


#: How many request heads a connection keeps (one per body length seen last).
_HEADS_KEPT = 32


def _load_h11() -> None:
    """Import h11 (about 6 ms) with the first connection, not with this module.

    A worker's start connects only after its launch, so in a fresh process the import runs
    while the worker boots, on the host's idle core, instead of before the launch (the host
    imports this module with `Sandbox`).
    """
    global h11
    import h11


class _Protocol:
    """Sans-IO HTTP/1.1 client for one connection to a worker."""

    def __init__(
        self,
        token: str,
        max_event_bytes: int,
        kind_caps: KindCaps | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        _load_h11()
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=65536)
        # A local worker checks `Authorization`; a remote one gets its own headers (its
        # token header, the router's) from `remote_transport`.
        self.head = (
            headers
            if headers is not None
            else [("host", "worker"), ("authorization", "Bearer " + token)]
        )
        self.max_event_bytes = max_event_bytes
        self.kind_caps = kind_caps
        # The worker keeps its results within value_budget(result_bytes); the host's budget,
        # from the result's byte cap (which has slack), is never below it.
        result_cap = kind_caps.get("result") if kind_caps is not None else None
        self.max_values = value_budget(result_cap[0]) if result_cap is not None else None
        self.status: int | None = None
        self.streaming = False
        self.parser = SSEParser(max_event_bytes, kind_caps, self.max_values)
        self.body = bytearray()
        #: The most of a simple reply read (`max_event_bytes` unless a request says less).
        self.body_cap = max_event_bytes
        self.done = False
        #: The request heads made so far, by (method, target, body length, has a body).
        self._heads: dict[tuple[str, str, int, bool], h11.Request] = {}

    def request(
        self, method: str, target: str, payload: Any | None = None, body_cap: int | None = None
    ) -> bytes:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        body = b"" if payload is None else json.dumps(payload).encode()
        key = (method, target, len(body), payload is not None)
        head = self._heads.get(key)
        if head is None:
            # h11 validates a request's headers as it is made; the head of a request is the
            # same for every body of one length, and an h11 event is immutable: made once.
            headers = [*self.head, ("content-length", str(len(body)))]
            if payload is not None:
                headers.append(("content-type", "application/json"))
            head = h11.Request(method=method, target=target, headers=headers)
            if len(self._heads) >= _HEADS_KEPT:
                del self._heads[next(iter(self._heads))]  # the oldest
            self._heads[key] = head
        self.status = None
        self.streaming = False
        self.parser.reset()
        self.body = bytearray()
        self.body_cap = self.max_event_bytes if body_cap is None else body_cap
        self.done = False
        out = self.conn.send(head) or b""
        if body:
            out += self.conn.send(h11.Data(data=body)) or b""
        out += self.conn.send(h11.EndOfMessage()) or b""
        return out

    def receive(self, data: bytes) -> list[Event]:
        """Feed bytes; return complete SSE events. Sets `done` at the end of the response."""
        try:
            self.conn.receive_data(data)
        except h11.RemoteProtocolError as exc:
            raise TransportError(f"the worker broke HTTP framing: {exc}") from None
        events: list[Event] = []
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                if not data:
                    raise ConnectionLost("the worker closed the connection mid-response") from None
                raise TransportError(f"the worker broke HTTP framing: {exc}") from None
            if event is h11.NEED_DATA:
                if not data:
                    raise ConnectionLost("the worker closed the connection mid-response")
                return events
            if event is h11.PAUSED:
                # h11 waits for the next cycle (the response ended, or a protocol switch):
                # asking again would return PAUSED forever. Found by tests/fuzz (a feed
                # after the end spun with the GIL held).
                if self.done:
                    return events
                raise TransportError("the worker's response paused the connection")
            if isinstance(event, h11.Response):
                self.status = event.status_code
                ctype = dict(event.headers).get(b"content-type", b"")
                self.streaming = ctype.startswith(b"text/event-stream")
            elif isinstance(event, h11.Data):
                if self.streaming:
                    events.extend(self.parser.feed(event.data))
                else:
                    self.body += event.data
                    if len(self.body) > self.body_cap:
                        raise ReplyTooLarge(
                            f"the worker's reply exceeds the size cap ({self.body_cap} bytes)"
                        )
            elif isinstance(event, h11.EndOfMessage):
                self.done = True
                return events
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionLost("the worker closed the connection")

    def json_body(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise TransportError("the worker's reply is not JSON") from None

    def reusable(self) -> bool:
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE


#: The most one `recv` reads (into the client's own buffer, reused call after call).
_RECV_BYTES = 65536


class WorkerClient:
    """A blocking client with one persistent connection to one worker.

    The socket itself never blocks: each wait is one `poll` bounded by the call's deadline,
    then one `recv_into` the client's buffer. A quiet call is then one `send`, one `poll`
    and one `recv` on the host, and no timeout is set on the socket per call.
    """

    def __init__(
        self, path: str, token: str, max_event_bytes: int, kind_caps: KindCaps | None = None
    ) -> None:
        self.path = path
        self.token = token
        self.max_event_bytes = max_event_bytes
        self.kind_caps = kind_caps
        self._sock: socket.socket | None = None
        self._proto: _Protocol | None = None
        self._poll: select.poll | None = None
        self._buffer: bytearray | None = None
        #: Answers the code's host-tool requests during a call (`_host/hosttools.py`);
        #: None refuses them.
        self.host_call: HostCall | None = None

    def _connect(self, deadline: float) -> tuple[socket.socket, _Protocol, select.poll]:
        if (
            self._sock is not None
            and self._proto is not None
            and self._poll is not None
            and self._proto.reusable()
        ):
            return self._sock, self._proto, self._poll
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise ConnectionLost(f"cannot connect to the worker: {exc}") from None
        sock.setblocking(False)
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        self._sock, self._poll = sock, poll
        self._proto = _Protocol(self.token, self.max_event_bytes, self.kind_caps)
        return sock, self._proto, poll

    def _exchange(
        self,
        method: str,
        target: str,
        payload: Any,
        deadline: float,
        on_event: OnEvent | None,
        body_cap: int | None = None,
    ) -> _Protocol:
        sock, proto, poll = self._connect(deadline)
        fd = sock.fileno()
        if self._buffer is None:
            self._buffer = bytearray(_RECV_BYTES)
        buffer = self._buffer
        received = memoryview(buffer)
        try:
            view = memoryview(proto.request(method, target, payload, body_cap))
            while view:
                try:
                    view = view[sock.send(view) :]
                except BlockingIOError:
                    # The worker is not reading (yet): wait until it does, or the deadline.
                    poll.modify(fd, select.POLLOUT)
                    _wait(poll, deadline)
                    poll.modify(fd, select.POLLIN)
            while not proto.done:
                # Checked before each read too: a worker that never stops sending never
                # lets a wait time out.
                _wait(poll, deadline)
                try:
                    n = sock.recv_into(buffer)
                except BlockingIOError:
                    continue
                for event in proto.receive(bytes(received[:n])):
                    if event[0] == "host_call":
                        reply = answer_host_call(self.host_call, event[1], deadline)
                        _send_all(sock, poll, reply, deadline)
                        continue
                    if on_event is not None:
                        on_event(event)
        except TimeoutError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise ConnectionLost(f"the connection to the worker failed: {exc}") from None
        except TransportError:
            self.close()
            raise
        return proto

    def hello(self, timeout: float) -> Hello:
        """The handshake, read by `decode_hello`; raises TimeoutError when the worker does
        not answer in time, HelloError when its answer is not a handshake the host reads
        (more than `HELLO_BYTES`, not JSON, or not a `Hello`)."""
        deadline = time.monotonic() + timeout
        try:
            proto = self._exchange("GET", "/hello", None, deadline, None, HELLO_BYTES)
        except ReplyTooLarge:
            raise HelloError(f"the handshake is more than {HELLO_BYTES} bytes") from None
        if proto.status != 200:
            raise TransportError(f"the worker refused the handshake (HTTP {proto.status})")
        try:
            data = json.loads(proto.body)
        except (ValueError, RecursionError):
            raise HelloError("the handshake is not JSON (or nested too deep)") from None
        return decode_hello(data)

    def run(
        self, code: str, deadline: float, on_event: OnEvent, filename: str | None = None
    ) -> None:
        """POST the code and deliver each event until the stream ends (or the deadline)."""
        body = _run_body(code, filename, deadline - time.monotonic())
        proto = self._exchange("POST", "/run", body, deadline, on_event)
        if proto.status != 200:
            raise TransportError(f"the worker refused the call (HTTP {proto.status})")

    def request_json(self, target: str, payload: Any, deadline: float) -> Any:
        """POST `payload` to `target` and return the worker's JSON reply (a simple response
        within `max_event_bytes`, not a stream); TransportError on any other status."""
        proto = self._exchange("POST", target, payload, deadline, None)
        if proto.status != 200 or proto.streaming:
            raise TransportError(f"the worker refused {target} (HTTP {proto.status})")
        return proto.json_body()

    def shutdown(self, timeout: float = 1.0) -> None:
        try:
            self._exchange("POST", "/shutdown", None, time.monotonic() + timeout, None)
        except (TransportError, TimeoutError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._proto = None
        self._poll = None


def answer_host_call(handler: HostCall | None, data: Any, deadline: float) -> bytes:
    """The framed reply (`<length>\n<json>`) to one host-tool request of the code; the
    handler waits for the tool until `deadline` (the call's) at the latest."""
    if handler is None:
        reply: dict[str, Any] = {
            "ok": False,
            "rule": "tools",
            "detail": "no host tools are served in this call",
            "hint": "call it through an agent framework's executor that serves its tools",
        }
    else:
        try:
            reply = handler(data, max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # the handler's own failure reaches the code as an error
            reply = {"ok": False, "error": f"the host could not serve the call ({exc})"}
    body = json.dumps(reply, default=str).encode()
    return b"%d\n%b" % (len(body), body)


def _send_all(sock: socket.socket, poll: select.poll, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    fd = sock.fileno()
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            poll.modify(fd, select.POLLOUT)
            try:
                _wait(poll, deadline)
            finally:
                poll.modify(fd, select.POLLIN)


def _wait(poll: select.poll, deadline: float) -> None:
    """Until the polled socket is ready (or closed), or TimeoutError at `deadline`."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the call exceeded its deadline")
        if poll.poll(math.ceil(remaining * 1000)):
            return


class AsyncWorkerClient:
    """An asyncio client; one connection per call (the worker multiplexes connections)."""

    def __init__(
        self, path: str, token: str, max_event_bytes: int, kind_caps: KindCaps | None = None
    ) -> None:
        self.path = path
        self.token = token
        self.max_event_bytes = max_event_bytes
        self.kind_caps = kind_caps
        self.host_call: HostCall | None = None
        self._deadline = 0.0

    async def run(
        self, code: str, deadline: float, on_event: OnEvent, filename: str | None = None
    ) -> None:
        import asyncio  # loaded already: this runs in its loop

        remaining = max(0.001, deadline - time.monotonic())
        self._deadline = deadline
        try:
            body = _run_body(code, filename, remaining)
            await asyncio.wait_for(self._run(body, on_event), remaining)
        except TimeoutError:
            raise TimeoutError("the call exceeded its deadline") from None

    async def _run(self, body: dict[str, Any], on_event: OnEvent) -> None:
        import asyncio

        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to the worker: {exc}") from None
        proto = _Protocol(self.token, self.max_event_bytes, self.kind_caps)
        try:
            writer.write(proto.request("POST", "/run", body))
            await writer.drain()
            while not proto.done:
                data = await reader.read(262144)
                for event in proto.receive(data):
                    if event[0] == "host_call":
                        reply = await asyncio.to_thread(
                            answer_host_call, self.host_call, event[1], self._deadline
                        )
                        writer.write(reply)
                        await writer.drain()
                        continue
                    on_event(event)
            if proto.status != 200:
                raise TransportError(f"the worker refused the call (HTTP {proto.status})")
        except OSError as exc:
            raise ConnectionLost(f"the connection to the worker failed: {exc}") from None
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


#: How long past a call's wall limit the worker's own backstop waits for the host, which
#: ends the call at the limit itself (an interrupt, then a kill).
BACKSTOP_GRACE = 10.0


def _run_body(code: str, filename: str | None, wall: float) -> dict[str, Any]:
    # `hold_head`: this client has no use for the response's head before the cell's first
    # event (a quiet call is then one write; see `_worker/server.py`). A relay that keeps
    # an idle stream alive (the remote pod) sends its own body without it. `backstop`: when
    # the worker ends itself if the call still runs (`_worker/server.py: _WallBackstop`):
    # what is left of its wall limit (`wall`) and a grace for the host to end it first.
    body: dict[str, Any] = {
        "code": code,
        "hold_head": True,
        "backstop": round(max(wall, 0.0) + BACKSTOP_GRACE, 3),
    }
    if filename:
        body["filename"] = filename
    return body
