"""The worker's HTTP/1.1 server on the inherited listening socket.

Routes, each requiring `Authorization: Bearer <token>` (compared in constant time):

* `GET /hello`    the handshake: interpreter, prefix, pid, and the provider's checks
* `POST /run`     body `{"code": ...}`; answered by an SSE stream of events ending in `done`
* `POST /shutdown` the worker exits after answering

Anything else gets a 4xx and the connection is closed. One request runs at a time; idle
connections are multiplexed with `selectors`.

The HTTP it speaks is the strict subset its clients (the host's `WorkerClient`, the remote
relay) send: a request head of at most 64 KiB, `Content-Length` bodies only (no transfer
coding), no folded or malformed header lines, HTTP/1.1 keep-alive (or HTTP/1.0, closed
after the answer). Anything else closes the connection unanswered. It is parsed here by
hand, not with h11: each request's parse is a few splits, which matters where the worker's
Python runs ~20x slower (a `qemu` guest under TCG); the host still parses every byte the
worker sends with h11.

It is longer than 600 lines because the parser, the routes and the run loop share one
selector loop and its state; each module the worker imports adds to every start (the start
budget in tests/worker/test_worker_startup.py), so the server stays one module.
"""

from __future__ import annotations

# NOTE: `_signal` rather than `signal`, whose enums of signals and handlers cost about 0.5 ms
# of the start; only SIGINT's handler is set here.
import _signal  # type: ignore[import-not-found]
import json
import os
import selectors
import socket
import sys
import threading
import time

# NOTE: allowed because it is exactly what hmac.compare_digest is, without importing OpenSSL
# (2 ms of the worker's start-up).
from _operator import _compare_digest as compare_digest

from agent_sandbox._denial import Denial
from agent_sandbox._wire import BootConfig, Hello, LimitReport, SetupChecks, encode_event
from agent_sandbox._worker import audit
from agent_sandbox._worker.backstop import BACKSTOP
from agent_sandbox._worker.hostcall import host_tool_caller
from agent_sandbox._worker.run import Runner, current_pid, on_interrupt
from agent_sandbox.guards._files import set_scratch_metadata

#: The worker's own listing of the sandbox's /proc (`_ProcessCount`), bound before the
#: guards wrap `os.listdir` (it is not user code).
_listdir = os.listdir

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["serve"]

_MAX_BODY = 16 * 1024 * 1024
_MAX_HEAD = 65536
_READ_TIMEOUT = 30.0
_REASONS = {200: b"OK", 400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found"}
_REASONS[413] = b"Payload Too Large"
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-store\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_STREAM_END = b"0\r\n\r\n"


class _Stop(Exception):
    """Raised to leave the serve loop after a shutdown request."""


class _Request:
    __slots__ = ("close", "headers", "method", "target")

    def __init__(self, method: bytes, target: bytes, headers: dict[bytes, bytes], close: bool):
        self.method = method
        self.target = target
        self.headers = headers
        self.close = close


class _Conn:
    """One client connection: its unread bytes and whether it must close after the answer."""

    __slots__ = ("buf", "close")

    def __init__(self) -> None:
        self.buf = b""
        self.close = False


def _parse_head(head: bytes) -> _Request | None:
    """The request line and headers (names lower-cased), or None when outside the subset."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[0].isalpha():
        return None
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or b"\n" in line or b"\r" in line:
            return None
        name = name.lower()
        value = value.strip(b" \t")
        if name in (b"content-length", b"authorization") and headers.get(name, value) != value:
            return None
        headers[name] = value
    close = parts[2] == b"HTTP/1.0" or headers.get(b"connection", b"").lower() == b"close"
    return _Request(parts[0], parts[1], headers, close)


class _Server:
    def __init__(self, boot: dict[str, Any], runner: Runner, checks: dict[str, Any]) -> None:
        self.token = ("Bearer " + boot["token"]).encode()
        self.runner = runner
        self.checks = checks
        self.boot = boot
        self.tamper_check: Any = None
        #: This worker's pid (the server is made in the worker's own process).
        self.pid = os.getpid()
        #: Under gVisor: where to report the calls that ended with the sandbox at
        #: `limits.processes` (`_ProcessCount`); None elsewhere.
        report = BootConfig.from_dict(boot).worker_setup.limit_report
        self.process_count = _ProcessCount(report) if report is not None else None
        self._files: Any = None  # the session files API (`_worker/files.py`), on first use

    # -- connection handling -------------------------------------------------------------

    def handle(self, sock: socket.socket, conn: _Conn) -> bool:
        """Serve one request on `sock`; return False when the connection should be closed."""
        request, body = self._read_request(sock, conn)
        if request is None:
            return False
        conn.close = request.close
        auth = request.headers.get(b"authorization", b"")
        if not compare_digest(auth, self.token):
            self._send_simple(sock, conn, 403, {"error": "missing or wrong token"}, close=True)
            return False
        target = request.target
        if request.method == b"GET" and target == b"/hello":
            self._send_simple(sock, conn, 200, self._hello())
        elif request.method == b"POST" and target == b"/run":
            self._run(sock, conn, body)
        elif request.method == b"POST" and target == b"/files":
            self._file_op(sock, conn, body)
        elif request.method == b"POST" and target == b"/shutdown":
            self._send_simple(sock, conn, 200, {"ok": True})
            raise _Stop
        else:
            self._send_simple(sock, conn, 404, {"error": "no such route"}, close=True)
            return False
        return not conn.close

    def _read_request(self, sock: socket.socket, conn: _Conn) -> tuple[_Request | None, bytes]:
        # The request is normally whole when the selector wakes: read it without waiting,
        # and set the read timeout only for a request that comes in pieces.
        timed = False

        def more(size: int = 65536) -> bytes:
            nonlocal timed
            if not timed:
                try:
                    return sock.recv(size, socket.MSG_DONTWAIT) or b""
                except (BlockingIOError, InterruptedError):
                    pass
                sock.settimeout(_READ_TIMEOUT)
                timed = True
            return sock.recv(size)

        try:
            while True:
                end = conn.buf.find(b"\r\n\r\n")
                if end >= 0:
                    break
                if len(conn.buf) > _MAX_HEAD:
                    return None, b""
                data = more()
                if not data:
                    return None, b""
                conn.buf += data
            request = _parse_head(conn.buf[:end])
            if request is None or b"transfer-encoding" in request.headers:
                return None, b""
            length_text = request.headers.get(b"content-length", b"0")
            if not length_text.isdigit():
                return None, b""
            length = int(length_text)
            if length > _MAX_BODY:
                self._send_simple(sock, conn, 413, {"error": "request too large"}, True)
                return None, b""
            start = end + 4
            while len(conn.buf) - start < length:
                data = more(max(65536, length - (len(conn.buf) - start)))
                if not data:
                    return None, b""
                conn.buf += data
            body = conn.buf[start : start + length]
            conn.buf = conn.buf[start + length :]
            return request, body
        except OSError:
            return None, b""
        finally:
            if timed:
                sock.settimeout(None)

    def _send_simple(
        self,
        sock: socket.socket,
        conn: _Conn,
        status: int,
        payload: dict[str, Any],
        close: bool = False,
    ) -> None:
        body = json.dumps(payload).encode()
        if close:
            conn.close = True
        head = (
            b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n"
            % (
                status,
                _REASONS.get(status, b""),
                len(body),
                b"connection: close\r\n" if conn.close else b"",
            )
        )
        try:
            sock.sendall(head + body)
        except OSError:
            pass

    # -- routes --------------------------------------------------------------------------

    def _hello(self) -> dict[str, Any]:
        """The handshake's record (`_wire.Hello`): a check the record does not know fails
        here, in the worker, before the host would refuse it."""
        version = sys.version_info
        return Hello(
            pid=os.getpid(),
            version=(version[0], version[1], version[2]),
            prefix=sys.prefix,
            base_prefix=sys.base_prefix,
            executable=sys.executable or "",
            worker_id=str(self.boot.get("worker_id", "")),
            checks=SetupChecks(**self.checks),
        ).to_dict()

    def _file_op(self, sock: socket.socket, conn: _Conn, body: bytes) -> None:
        """One operation of the session files API, between calls (`_worker/files.py`)."""
        if self._files is None:
            from agent_sandbox._worker.files import FileOps

            runner = self.runner
            limits = runner.policy.get("limits", {})
            scratch_bytes = int(limits.get("scratch_mb", 512)) * 1024 * 1024

            def changed(name: str, signature: Any) -> None:
                seen = runner._scratch_seen
                if seen is None:
                    seen = runner._scratch_seen = runner._scan_scratch()
                if signature is None:
                    seen.pop(name, None)
                else:
                    seen[name] = signature

            self._files = FileOps(runner.scratch, scratch_bytes, changed)
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise TypeError("not an object")
        except (ValueError, TypeError) as exc:
            self._send_simple(sock, conn, 400, {"error": f"bad files request: {exc}"}, close=True)
            return
        self._send_simple(sock, conn, 200, self._files.handle(request))

    def _run(self, sock: socket.socket, conn: _Conn, body: bytes) -> None:
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
        # Held events are kept unframed and go out as one chunk: the host's HTTP parser
        # then meets one body chunk per write, not one per event.
        held: list[bytes] = []
        holding = request.get("hold_head") is True  # until the first event of the cell
        final = False  # from the result on: everything waits for the last write
        head = _STREAM_HEAD  # the response's head, until it is written

        owner = self.pid

        def write(data: bytes) -> None:
            nonlocal broken
            if broken:
                return
            try:
                sock.sendall(data)
            except OSError:
                broken = True

        def flush(end: bytes = b"") -> None:
            """Write the head (when still held), the held events as one chunk, and `end`."""
            nonlocal head
            data = head + _chunk(b"".join(held)) + end
            head = b""
            held.clear()
            write(data)

        def emit(kind: str, data: Any) -> None:
            """What the cell's run emits with: a forked child never writes on its parent's
            connection."""
            if current_pid() == owner:
                put(kind, data)

        def put(kind: str, data: Any) -> None:
            nonlocal holding
            event = encode_event(kind, data)
            with lock:
                if broken:
                    return
                if final:
                    held.append(event)
                elif holding:
                    held.append(event)
                    holding = False
                    flush()
                else:
                    write(_chunk(event))

        def hold(kind: str, data: Any) -> None:
            nonlocal final
            with lock:
                final = True  # from here on, emit() keeps its events for the last write
            emit(kind, data)

        filename = request.get("filename")
        # `encode_event("start", {"call": n})`, written out: the same bytes.
        held.append(b'event: start\ndata: {"call":%d}\n\n' % (self.runner.calls + 1))
        if holding:
            if _caller_left(sock):
                return  # a cancelled call: nobody waits for this code's result
        else:
            flush()
            if broken:
                return  # the caller left (a cancelled call): nobody waits for this code's result
        audit.begin_call(lambda d: emit("denial", d.to_dict()))
        # Always present (a policy without tools refuses every call on the host, by rule).
        host_tool = host_tool_caller(
            sock, put, owner, self.runner.policy_name, self.boot.get("policy", {})
        )
        self.runner.namespace["_host_tool"] = host_tool
        # The landlock provider's chmod and utime in scratch, made by the host (its
        # seccomp filter refuses them here): only during the call, on its connection.
        set_scratch_metadata(host_tool.scratch_metadata)
        started = time.perf_counter()
        after = request.get("backstop")
        backstop = BACKSTOP if isinstance(after, (int, float)) and after > 0 else None
        if backstop is not None:
            backstop.arm(float(after))
        try:
            self.runner.run(code, emit, filename if isinstance(filename, str) else None, last=hold)
        finally:
            set_scratch_metadata(None)
            if os.getpid() != owner:
                os._exit(1)  # a child the cell forked never goes on with the server's work
            if backstop is not None:
                backstop.arm(0.0)
            counted = audit.end_call()
            with lock:
                final = True
        if self.process_count is not None:
            self.process_count.check()
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
            flush(_STREAM_END)
        if tampered:
            raise _Stop


class _ProcessCount:
    """Under gVisor, the calls that ended with the sandbox at `limits.processes`.

    gVisor's kernel refuses a fork past RLIMIT_NPROC (EAGAIN) and keeps no count of the
    refusals; the host sees only the Sentry's threads. So where a call ends the worker
    (the sandbox's pid 1: every orphan becomes its child) asks whether it has any child
    (one `waitid` that reaps nothing), and only then counts the sandbox's processes in its
    `/proc`; a call that ends at the limit, after one that did not, adds one to the report
    the host reads (`agent_sandbox._host.limit_report.GuestLimits`, which names it the worker
    side's word).
    """

    def __init__(self, report: LimitReport) -> None:
        self.path = str(report["path"])
        self.limit = int(report["processes"])
        self.hits = 0
        self.at_limit = False

    def check(self) -> None:
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            self.at_limit = False  # no child: nothing of the code's runs
            return
        except OSError:
            return
        try:
            count = sum(1 for name in _listdir("/proc") if name.isdigit())
        except OSError:
            return
        at_limit = count >= self.limit
        if at_limit and not self.at_limit:
            self.hits += 1
            self._write({"pids_at_limit": self.hits})
        self.at_limit = at_limit

    def _write(self, report: dict[str, int]) -> None:
        # Written beside and renamed over: the host never reads half a report.
        part = self.path + ".part"
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, json.dumps(report).encode())
            finally:
                os.close(fd)
            os.rename(part, self.path)
        except OSError:
            pass


def _chunk(data: bytes) -> bytes:
    """One chunk of the chunked response body (never empty: an empty chunk ends the body)."""
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


def _bind_listener(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    return listener


def serve(boot: dict[str, Any]) -> None:
    """Set up the worker from its boot configuration, then serve until shutdown."""
    from agent_sandbox._worker.setup import prepare

    # Read into its record: an unknown or a missing key ends the start, named in the log.
    config = BootConfig.from_dict(boot)
    path = config.worker_setup.listen_path
    # A sandbox that hands the worker no listening socket (gVisor): the worker binds its own
    # (the parent waits for the name, and for it to accept connections).
    listener = _bind_listener(str(path)) if path else socket.socket(fileno=int(config.listen_fd))
    runner, checks, hooks = prepare(boot)
    # The host's interrupt: KeyboardInterrupt in the running cell only (see `on_interrupt`).
    _signal.signal(_signal.SIGINT, on_interrupt)
    server = _Server(boot, runner, checks)
    server.tamper_check = hooks.get("tamper_check")
    _first_call_ahead(runner)
    listener.setblocking(True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    try:
        while True:
            for key, _ in selector.select():
                if key.data is None:
                    client, _addr = listener.accept()
                    selector.register(client, selectors.EVENT_READ, _Conn())
                    continue
                client = key.fileobj  # type: ignore[assignment]
                try:
                    keep = server.handle(client, key.data)
                except OSError:
                    keep = False  # this connection broke; the worker serves the next one
                if not keep:
                    selector.unregister(client)
                    client.close()
    except _Stop:
        pass
    finally:
        sys.stdout.flush()
        os._exit(0)


#: A cell like the ones a worker checks and compiles in its calls (no import, no name a
#: policy could refuse), for `exercise`.
_WARM_CELL = (
    "total = 0\nfor i in range(3):\n    total += i\n"
    "def twice(v):\n    return [v, v][0] * 2\n"
    "text = f'{twice(total)}'\ntext\n"
)
#: A `[files]` section for `exercise`: the default hide list and one entry of each kind.
_WARM_FILES: dict[str, Any] = {
    "read": ["~/data/*.csv", "/usr/share"],
    "write": ["$SCRATCH/out/**"],
    "deny": ["**/.ssh/**"],
    "hide": [".env", ".env.*", "*.pem", "*.key", "id_rsa*", "id_ed25519*", ".netrc"],
}
_WARM_HEAD = (
    b"POST /run HTTP/1.1\r\nhost: worker\r\nauthorization: Bearer x\r\n"
    b"content-type: application/json\r\ncontent-length: 2"
)


def _first_call_ahead(runner: Runner) -> None:
    """Before the handshake, so while the worker waits in its pool: the first call's one-time
    work on this worker's own runner and code layer, on a cell no policy refuses (`0`) under
    a name no call uses, without arming, recording, numbering or keeping anything. The code
    (the request parse, the code layer's check and rewrite with this policy's rules, the
    compile, the value's encoding, the events) then runs for the first time here, not in the
    caller's first call, whose time it took (issue 19: about 0.7 ms in the worker: pages
    written for the first time, and, in a worker forked from a template, copied)."""
    BACKSTOP.prepare()
    try:
        _parse_head(_WARM_HEAD)
        check = runner.code_check
        if check is not None:
            # Only a cell the rules accept (a refusal would be recorded, and carried into
            # the first call): asked first of the pure part of the check.
            import ast

            from agent_sandbox.guards._code_check import find_violations

            rules = getattr(check, "rules", None)
            if rules is None or find_violations(ast.parse("0"), rules):
                return
        runner._compile_new("0", "<first-call-ahead>")
        runner._outcome(0, None, "<first-call-ahead>")
        encode_event("result", {"value": 0})
    except Exception:  # an optimisation only: the first call does the same work anyway
        pass


def exercise(strict: bool = False) -> None:
    """In a worker template, before it forks workers: run the worker's pure per-call code
    (the code layer's check, rewrite and compile of a cell, the runner's compile and value
    encoding, its output stream, the request parse, the event encoding) and the `[files]`
    section's compile a few times, on data of its own, so that Python's adaptive
    interpreter has specialised that code and `re` has compiled those patterns here: a
    forked worker then writes less into the template's code objects and data in its first
    calls (pages it would otherwise copy; issue 19: memory per session). Touches no guard,
    no `builtins`, no state a worker reads; the code layer's rule cache is emptied again."""
    import ast
    import builtins

    from agent_sandbox._wire import encode_event
    from agent_sandbox._worker.run import Runner, _Budget, _Output
    from agent_sandbox.guards import _code_budget, _code_check, _files

    policy: dict[str, Any] = {}
    # A runner of its own, not the workers': only its compile of a new cell (no source kept
    # for tracebacks, no code check) and its encoding of a value are used.
    runner = Runner({"name": "template-warm-up"}, os.getcwd())
    try:
        for _ in range(10):
            tree = ast.parse(_WARM_CELL, "<warm>", "exec")
            rules = _code_check.compile_rules(policy, "")
            _code_check.check_tree(tree, rules, "<warm>", source=_WARM_CELL)
            _code_budget.rewrite(tree, rules)
            compile(tree, "<warm>", "exec")
            body, tail = runner._compile_new(_WARM_CELL, "<warm>")
            namespace: dict[str, Any] = {"__name__": "__warm__", "__builtins__": builtins}
            exec(body, namespace)
            value = eval(tail, namespace)
            runner._outcome(value, None, "<warm>")
            runner._outcome([value, 1, {"k": [1.5, None]}], None, "<warm>")
            out = _Output("stdout", lambda kind, data: None, _Budget(1 << 16, "template-warm-up"))
            out.write("warm\n")
            out.flush()
            _parse_head(_WARM_HEAD)
            encode_event("stdout", {"text": "x"})
            # The `[files]` section's compile (paths resolved, globs and hide patterns made
            # regexes, kept in `re`'s cache): a rules object of the template's own, dropped
            # at once; no guard is configured here, each worker builds its own rules.
            _files.FileRules(_WARM_FILES, scratch=os.getcwd(), import_roots=sys.path)
    except Exception:  # an optimisation only: a failure here changes nothing
        if strict:  # (the tests' call: a failure would otherwise go unnoticed)
            raise
    finally:
        _code_check._RULES_CACHE.clear()
