"""Running one call of user code inside the worker, and turning its outcome into events.

The runner owns the session namespace (variables persist between calls on one worker),
compiles the code so the value of a last expression is returned, captures `sys.stdout` and
`sys.stderr` as live, coalesced event streams with an output cap, and encodes the value as
JSON-safe data. Output written straight to file descriptor 1 or 2 by native code is not
captured here; it goes to the worker log, a 1 MiB memory file the host bounds.

Why this module is longer than 600 lines: it is what the user's code runs inside, and
the host believes none of it; keeping the runner, the output streams and the encoding
of an outcome together keeps the worker's whole part of one call in one reading.
"""

from __future__ import annotations

import ast
import binascii  # (base64's codec itself: `base64` adds struct and 0.5 ms to the start)
import builtins
import collections
import errno
import io
import json
import linecache
import math
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable

from agent_sandbox._denial import Denial
from agent_sandbox._errors import LimitExceeded, SandboxDenied
from agent_sandbox._hints import grant_hint
from agent_sandbox._wire import json_values, value_budget
from agent_sandbox._worker import audit, objects

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

    Emit = Callable[[str, Any], None]

__all__ = ["Runner", "to_data"]


_FLUSH_BYTES = 8192
_FLUSH_SECONDS = 0.02
_MAX_DEPTH = 20
_MAX_ITEMS = 10_000
_MAX_IMAGES = 8
_MAX_IMAGE_BYTES = 4_000_000


class _Output(io.TextIOBase):
    """A text stream that sends coalesced chunks as events and enforces the output cap."""

    def __init__(self, kind: str, emit: Emit, budget: _Budget) -> None:
        self._kind = kind
        self._emit = emit
        self._budget = budget
        self._buf: list[str] = []
        self._size = 0
        self._last = time.monotonic()
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        allowed = self._budget.take(len(text.encode("utf-8", "replace")))
        if not allowed:
            raise LimitExceeded(self._budget.denial())
        with self._lock:
            self._buf.append(text)
            self._size += len(text)
            now = time.monotonic()
            if self._size >= _FLUSH_BYTES or now - self._last >= _FLUSH_SECONDS:
                self._flush_locked(now)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked(time.monotonic())

    def _flush_locked(self, now: float) -> None:
        if self._buf:
            chunk = "".join(self._buf)
            self._buf.clear()
            self._size = 0
            self._emit(self._kind, chunk)
        self._last = now


class _Budget:
    """The shared stdout+stderr byte budget of one call."""

    def __init__(self, cap: int, policy: str) -> None:
        self.cap = cap
        self.used = 0
        self.policy = policy
        self.exceeded = False
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.cap:
                if not self.exceeded:
                    self.exceeded = True
                    audit.record(self.denial())
                return False
            self.used += n
            return True

    def denial(self) -> Denial:
        return Denial(
            rule="limits.output",
            action="write",
            target="stdout/stderr",
            policy=self.policy,
            detail=f"the call printed more than {self.cap} bytes; further output was refused "
            "and the worker is replaced (its variables are lost)",
            hint=grant_hint({"limits.output_bytes": self.cap * 4}),
        )


#: Whether the user's code is running now: only then does SIGINT (the host's interrupt)
#: raise KeyboardInterrupt, as in a Jupyter kernel; between calls it is ignored.
_INTERRUPTIBLE = [False]

#: The bound on cell sources kept for tracebacks (see `Runner._keep_source`).
# The built-ins the runner itself calls, bound when the module is imported (before the
# guards wrap them): the guards' wrappers let the runner's own calls through unchanged (it
# is not user code, and it passes its namespace and flags explicitly), so calling the
# originals skips only their per-call frame inspection. User code calls the wrapped ones.
_compile_builtin = builtins.compile
_exec_builtin = builtins.exec
_eval_builtin = builtins.eval
# The runner's own listing of scratch (`Runner._scan_scratch`), for the same reason: the
# file guard's wrapper resolves the path again on each call (a `getcwd` and an `lstat`,
# each a trip through gVisor's Sentry under `gvisor`).
_scandir = os.scandir

#: This process's pid, kept by a fork hook (`os.fork` and the namespace template's fork run
#: it), so the per-event checks that a forked child never writes on its parent's connection
#: cost no system call (under `gvisor` each one is a trip through the Sentry). A fork that
#: runs no hook (libc's, through ctypes) is still caught where a call ends: the server
#: compares `os.getpid()` there (`_worker/server.py`).
_PID = [os.getpid()]


def _forked() -> None:
    _PID[0] = os.getpid()


os.register_at_fork(after_in_child=_forked)


def current_pid() -> int:
    """This process's pid as of its last fork hook (see `_PID`)."""
    return _PID[0]


#: The compiled cells kept for reuse (`Runner._compile`): how many, and how long each.
_REUSE_CELLS = 64
_REUSE_CHARS = 16 * 1024

_SOURCE_CELLS = 200
_SOURCE_BYTES = 4 * 1024 * 1024


def on_interrupt(signum: int, frame: Any) -> None:
    """The worker's SIGINT handler (installed by `_worker.server.serve`)."""
    if _INTERRUPTIBLE[0]:
        raise KeyboardInterrupt


class Runner:
    """Executes calls in one persistent namespace; one runner per worker."""

    def __init__(self, policy: dict[str, Any], scratch: str) -> None:
        self.policy = policy
        self.policy_name = str(policy.get("name", ""))
        self.scratch = scratch
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.calls = 0
        self.cells = 0
        self.code_check: Callable[[str, ast.Module], None] | None = None
        #: The code layer's per-call start alone (a fresh budget), for a reused compile.
        self.code_start: Callable[[], None] | None = None
        #: Whether an accepted cell's compiled code may be reused for an identical cell:
        #: true when the code check depends on the text alone (or there is none).
        self.reuse_compiled = True
        self._compiled: dict[str, tuple[Any, Any]] = {}
        #: `run_armed(fn, *args)`: the guards' arming around one call (see `_install.py`).
        self.run_armed: Callable[..., Any] | None = None
        self.objects = policy.get("result_mode") == "objects"
        #: Marks a host-given file name as user code (set by the worker's set-up).
        self.register_file: Callable[[str], None] | None = None
        #: The scratch files as they were when the last call ended (before the first call:
        #: as they were then): name -> (mtime_ns, size).
        self._scratch_seen: dict[str, tuple[int, int]] | None = None
        self._sources: collections.deque[tuple[str, int]] = collections.deque()
        self._source_size = 0

    def run(
        self, code: str, emit: Emit, filename: str | None = None, *, last: Emit | None = None
    ) -> None:
        """Run `code`, emitting stdout/stderr/image/files/result/error events (not `done`).

        The final `result` or `error` event goes to `last` when given (the server batches it
        with the end of the response).

        `filename` is the name the code's frames carry (a script run from the CLI keeps its
        own); by default `<cell-N>`. Every call arms the guards exactly once and disarms them
        exactly once, also when the code does not compile: the host counts the writes of the
        arming flag and expects one pair per call (see `guards/_state.py`).
        """
        self.calls += 1
        if filename:
            _USER_FILES.add(filename)
            if self.register_file is not None:
                self.register_file(filename)
        else:
            self.cells += 1  # only unnamed calls are numbered cells
            filename = f"<cell-{self.cells}>"
        limits = self.policy.get("limits", {})
        budget = _Budget(int(limits.get("output_bytes", 1_000_000)), self.policy_name)
        out, err = _Output("stdout", emit, budget), _Output("stderr", emit, budget)
        started = time.time()
        if self._scratch_seen is None:
            self._scratch_seen = self._scan_scratch()
        outcome: tuple[str, Any]
        try:
            if self.run_armed is not None:
                outcome = self.run_armed(self._run_armed, code, filename, emit, out, err, started)
            else:
                outcome = self._run_armed(code, filename, emit, out, err, started)
        except BaseException as exc:
            outcome = "error", _error_info(exc, filename)
        (last or emit)(*outcome)

    def _run_armed(
        self, code: str, filename: str, emit: Emit, out: _Output, err: _Output, started: float
    ) -> tuple[str, Any]:
        """Compile and run `code` while armed; returns the `result` or `error` event."""
        try:
            compiled = self._compile(code, filename)
        except SandboxDenied as exc:  # before SyntaxError: CodeRejected is both
            return "error", _error_info(exc, filename)
        except SyntaxError as exc:
            return "error", _syntax_error(exc)
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        value: Any = None
        failure: BaseException | None = None
        owner = current_pid()
        try:
            try:
                value = self._execute(compiled)
            except BaseException as exc:
                failure = exc
            if current_pid() != owner:
                # A child the code forked finished the cell: it must never unwind into
                # the server loop and write on the parent's connection.
                os._exit(0 if failure is None else 1)
            # Encoded while still armed: pickling, repr() and str() run user methods.
            outcome = self._outcome(value, failure, filename)
            # Figures are saved while armed too: savefig runs user artists' code.
            self._collect_outputs(emit, started)
            return outcome
        finally:
            sys.stdout, sys.stderr = saved
            for stream in (out, err):
                try:
                    stream.flush()
                except Exception:
                    pass

    def _outcome(self, value: Any, failure: BaseException | None, filename: str) -> tuple[str, Any]:
        """The `result` or `error` event of a call (see `agent_sandbox._worker.objects`).

        An encoded result larger than `limits.result_bytes` is refused here with a
        `limits.result` error, so the worker survives and nothing is truncated.
        """
        cap = int(self.policy.get("limits", {}).get("result_bytes", 4_000_000))
        try:
            if failure is not None:
                if isinstance(failure, SystemExit) and failure.code in (None, 0):
                    return self._outcome(None, None, filename)
                return "error", self._failure(failure, filename, cap)
            if self.objects:
                return "result", objects.encode_value(value, cap)
            plain = to_data(value)
            if plain is None or type(plain) in _SCALARS:
                # One JSON value of at most a few dozen bytes (a huge int or a NaN comes
                # back marked, as a dict): within every cap and budget, nothing to measure.
                return "result", {"value": plain}
            data = {"value": plain}
            # Measured as the wire sends it: a lone surrogate as its JSON escape (the host
            # makes it U+FFFD), not an error.
            text = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode(
                "utf-8", "backslashreplace"
            )
            if len(text) > cap:
                raise objects.TooLarge(len(text), cap)
            budget = value_budget(cap)
            if json_values(text, budget) > budget:
                # The host refuses more values than this (decoding costs more than the text).
                raise objects.TooLarge(json_values(text, budget) * 32, cap)
            return "result", data
        except objects.TooLarge as big:
            denial = audit.record(objects.result_too_large(big.size, big.cap, self.policy_name))
            return "error", {
                "kind": "limit",
                "type": "LimitExceeded",
                "message": denial.message(),
                "rule": denial.rule,
                "denial": denial.to_dict(),
            }
        except BaseException as exc:
            try:
                return "error", self._failure(exc, filename, cap)
            except BaseException:
                return "error", {
                    "kind": "internal",
                    "type": "EncodingError",
                    "message": "the value or exception could not be encoded",
                }

    def _keep_source(self, filename: str, code: str) -> None:
        """Keep the cell's source for tracebacks, within a bound: the newest cells up to
        `_SOURCE_CELLS` cells and `_SOURCE_BYTES` characters (a long session does not grow
        by every cell it ran; a traceback into an older cell shows no source line)."""
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self._sources.append((filename, len(code)))
        self._source_size += len(code)
        while len(self._sources) > 1 and (
            len(self._sources) > _SOURCE_CELLS or self._source_size > _SOURCE_BYTES
        ):
            old, size = self._sources.popleft()
            self._source_size -= size
            linecache.cache.pop(old, None)

    def _failure(self, exc: BaseException, filename: str, cap: int) -> dict[str, Any]:
        info = _error_info(exc, filename)
        info["exception"] = objects.exception_payload(exc, objects=self.objects, cap=cap // 8)
        return info

    def _compile(self, code: str, filename: str) -> tuple[Any, Any]:
        """The cell's code: checked, rewritten and compiled, or, for a text this worker
        already accepted (and when the check depends on the text alone), the same code
        again under this cell's file name, after the code layer's per-call start."""
        self._keep_source(filename, code)
        reused = self._compiled.get(code) if self.reuse_compiled else None
        if reused is not None:
            if self.code_start is not None:
                self.code_start()
            body, tail = reused
            return _renamed(body, filename), _renamed(tail, filename) if tail else None
        compiled = self._compile_new(code, filename)
        if self.reuse_compiled and len(code) <= _REUSE_CHARS:
            if len(self._compiled) >= _REUSE_CELLS:
                del self._compiled[next(iter(self._compiled))]  # the oldest
            self._compiled[code] = compiled
        return compiled

    def _compile_new(self, code: str, filename: str) -> tuple[Any, Any]:
        tree = _compile_builtin(code, filename, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        assert isinstance(tree, ast.Module)
        if self.code_check is not None:
            self.code_check(code, tree)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            tail_stmt = tree.body.pop()
            assert isinstance(tail_stmt, ast.Expr)
            last = ast.Expression(tail_stmt.value)
        flags: int = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        body = _compile_builtin(tree, filename, "exec", flags=flags, dont_inherit=True)
        tail = (
            _compile_builtin(last, filename, "eval", flags=flags, dont_inherit=True)
            if last
            else None
        )
        return body, tail

    def _execute(self, compiled: tuple[Any, Any]) -> Any:
        body, tail = compiled
        ns = self.namespace
        _INTERRUPTIBLE[0] = True
        try:
            if _is_async(body) or (tail is not None and _is_async(tail)):
                import asyncio  # only for code that uses top-level await

                return asyncio.run(_run_async(body, tail, ns))
            _exec_builtin(body, ns)
            return _eval_builtin(tail, ns) if tail is not None else None
        finally:
            _INTERRUPTIBLE[0] = False

    def _scan_scratch(self) -> dict[str, tuple[int, int]]:
        seen: dict[str, tuple[int, int]] = {}
        try:
            for entry in _scandir(self.scratch):
                if entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    seen[entry.name] = (st.st_mtime_ns, st.st_size)
                    if len(seen) >= 10_000:
                        break
        except OSError:
            pass
        return seen

    def _collect_outputs(self, emit: Emit, started: float) -> None:
        """Send the images this call produced, once: PNG files it wrote to scratch, and the
        matplotlib figures it left open that were not already drawn into a file.

        A scratch file counts as this call's when it changed since the previous call ended
        (one listing per call: the end of one call is the start of the next; a file a
        background thread wrote between calls shows with the next call).

        At most `_MAX_IMAGES` images, and their base64 text together within
        `limits.result_bytes` (the host's own bounds, `agent_sandbox._host.intake.events`); the rest
        are counted in an `images.dropped` notice.
        """
        budget = int(self.policy.get("limits", {}).get("result_bytes", 4_000_000))
        sent = {"count": 0, "chars": 0, "dropped": 0}

        def send(name: str, data: bytes) -> None:
            chars = (len(data) + 2) // 3 * 4
            if (
                sent["count"] >= _MAX_IMAGES
                or len(data) > _MAX_IMAGE_BYTES
                or sent["chars"] + chars > budget
            ):
                sent["dropped"] += 1
                return
            emit("image", _image(name, data))
            sent["count"] += 1
            sent["chars"] += chars

        before = self._scratch_seen or {}
        now = self._scan_scratch()
        self._scratch_seen = now
        changed = sorted(n for n, sig in now.items() if before.get(n) != sig)
        for name in changed:
            if not name.lower().endswith(".png"):
                continue
            if now[name][1] > _MAX_IMAGE_BYTES or sent["count"] >= _MAX_IMAGES:
                sent["dropped"] += 1
                continue
            try:
                with open(os.path.join(self.scratch, name), "rb") as fh:
                    send(name, fh.read())
            except OSError:
                pass
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is not None:
            try:
                for num in list(plt.get_fignums()):
                    fig = plt.figure(num)
                    # A figure drawn since its last change was saved (or shown) by the code:
                    # the file carries it. One never drawn is sent as the code left it.
                    if changed and not getattr(fig, "stale", True):
                        continue
                    if sent["count"] >= _MAX_IMAGES:
                        sent["dropped"] += 1
                        continue
                    buf = io.BytesIO()
                    fig.savefig(buf, format="png")
                    send(f"figure-{num}.png", buf.getvalue())
                plt.close("all")
            except Exception:
                pass
        if changed:
            emit("files", [{"name": n, "size": now[n][1]} for n in changed[:100]])
        if sent["dropped"]:
            data = {"count": sent["dropped"], "max_images": _MAX_IMAGES, "max_chars": budget}
            emit("notice", {"code": "images.dropped", "data": data})


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """`code` and the code objects nested in it under another file name (the cell's)."""
    if code.co_filename == filename:
        return code
    consts = tuple(
        _renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


_CO_COROUTINE = 0x0080  # inspect.CO_COROUTINE, without importing inspect at start-up


def _is_async(code: Any) -> bool:
    return bool(code.co_flags & _CO_COROUTINE)


async def _run_async(body: Any, tail: Any, ns: dict[str, Any]) -> Any:
    import types

    result = _eval_builtin(body, ns)
    if isinstance(result, types.CoroutineType):
        await result
    if tail is None:
        return None
    value = _eval_builtin(tail, ns)
    if isinstance(value, types.CoroutineType):
        value = await value
    return value


def _image(name: str, data: bytes) -> dict[str, str]:
    text = binascii.b2a_base64(data, newline=False).decode()
    return {"name": name, "mime": "image/png", "data": text}


def _syntax_error(exc: SyntaxError) -> dict[str, Any]:
    text = (exc.text or "").rstrip("\n")
    where = f"line {exc.lineno}, column {exc.offset}" if exc.lineno else "unknown position"
    message = f"{exc.msg} ({where})"
    tb = "".join(traceback.format_exception_only(type(exc), exc))
    return {
        "kind": "syntax",
        "type": "SyntaxError",
        "message": message,
        "traceback": tb,
        "line": exc.lineno,
        "column": exc.offset,
        "text": text,
    }


def _error_info(exc: BaseException, filename: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "kind": "exception",
        "type": _qualname(type(exc)),
        "message": _safe_str(exc),
        "traceback": _user_traceback(exc),
    }
    refused = _chain_denials(exc)
    if refused:
        # The refusals the error carries: its own, or ones a library turned into this error
        # (requests wraps a refused connect in ConnectionError). Those are the user's.
        info["refusals"] = [d.to_dict() for d in refused]
    from agent_sandbox.guards._net_refusal import proxy_refusals

    # After the texts above were made: the proxy's refusals the net guard found genuine in
    # them (marked with this worker's token), for the host's attribution; never shown.
    marked = proxy_refusals(_chain(exc))
    if marked:
        info["proxy_refusals"] = marked
    cause = exc if isinstance(exc, SandboxDenied) else None
    if cause is None and refused:
        cause = next(e for e in _chain(exc) if isinstance(e, SandboxDenied))
    if cause is not None:
        assert isinstance(cause, SandboxDenied)
        info["kind"] = "limit" if isinstance(cause, LimitExceeded) else "denied"
        info["rule"] = cause.denial.rule
        info["denial"] = cause.denial.to_dict()
    elif isinstance(exc, MemoryError):
        info["kind"] = "limit"
        info["rule"] = "limits.memory"
        info["memory"] = _memory_report(exc)
    elif isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        info["kind"] = "limit"
        info["rule"] = "limits.file-size"
    elif isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        info["kind"] = "limit"
        info["rule"] = "limits.scratch"
    elif isinstance(exc, OSError) and exc.errno == errno.EMFILE:
        info["kind"] = "limit"
        info["rule"] = "limits.open-files"
    elif isinstance(exc, BlockingIOError | OSError) and exc.errno == errno.EAGAIN:
        info["kind"] = "limit"
        info["rule"] = "limits.processes"
    if isinstance(exc, SyntaxError) and not isinstance(exc, SandboxDenied):
        info.update({"line": exc.lineno, "column": exc.offset})
    return info


def _memory_report(exc: BaseException) -> dict[str, int]:
    """What this worker knows of a MemoryError: its peak resident size (`peak`, bytes) and,
    when the failed allocation says it (numpy's `_ArrayMemoryError`), the size it asked for
    (`asked`). The host takes both as the worker's word, for a hint's number only."""
    out: dict[str, int] = {}
    try:
        import resource

        out["peak"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError, ValueError):
        pass
    asked = None
    if str(getattr(type(exc), "__module__", "")).startswith("numpy."):
        try:
            asked = getattr(exc, "_total_size", None)  # numpy's: shape x itemsize
        except Exception:
            pass
    if type(asked) is int and asked > 0:
        out["asked"] = asked
    return out


_MAX_CHAIN = 30


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc`, its causes and contexts, and the members of exception groups, each once."""
    out: list[BaseException] = []
    seen: set[int] = set()
    todo = [exc]
    while todo and len(out) < _MAX_CHAIN:
        item = todo.pop(0)
        if id(item) in seen:
            continue
        seen.add(id(item))
        out.append(item)
        for nxt in (item.__cause__, item.__context__):
            if nxt is not None:
                todo.append(nxt)
        members = getattr(item, "exceptions", None)
        if isinstance(item, BaseExceptionGroup) and isinstance(members, tuple):
            todo.extend(m for m in members if isinstance(m, BaseException))
    return out


def _chain_denials(exc: BaseException) -> list[Denial]:
    return [e.denial for e in _chain(exc) if isinstance(e, SandboxDenied)][:10]


def _qualname(cls: type) -> str:
    module = getattr(cls, "__module__", "builtins")
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: unprintable>"


_SANDBOX_DIRS: tuple[str, ...] | None = None
_MAX_MESSAGE = 2000


def _sandbox_dirs() -> tuple[str, ...]:
    """The folders of agent_sandbox's own modules (their frames are never shown)."""
    global _SANDBOX_DIRS
    if _SANDBOX_DIRS is None:
        dirs = set()
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if (name == "agent_sandbox" or name.startswith("agent_sandbox.")) and file:
                dirs.add(os.path.join(os.path.dirname(os.path.realpath(file)), ""))
                dirs.add(os.path.join(os.path.dirname(file), ""))
        _SANDBOX_DIRS = tuple(sorted(dirs))
    return _SANDBOX_DIRS


def _short_path(filename: str) -> str:
    """A library file's path relative to its import root (`requests/api.py`): no host paths."""
    best = ""
    for root in sys.path:
        if root and filename.startswith(os.path.join(root, "")) and len(root) > len(best):
            best = root
    if best:
        return filename[len(best) :].lstrip("/")
    return os.path.basename(filename)


#: File names the host gave calls' code (scripts run from the CLI): user code.
_USER_FILES: set[str] = set()


def _is_user_file(filename: str) -> bool:
    if filename in _USER_FILES:
        return True
    return filename.startswith("<") and not filename.startswith("<frozen ")


def _user_traceback(exc: BaseException) -> str:
    """The traceback a model and an operator read: the user's own frames in full (with the
    source line and its caret), library frames as their import-relative path, runs of them
    shortened, the sandbox's own frames removed, then one line per chained cause."""
    try:
        te = traceback.TracebackException.from_exception(exc, capture_locals=False)
        frames: list[traceback.FrameSummary | None] = []
        hidden = _sandbox_dirs()
        run: list[traceback.FrameSummary] = []

        def flush_run() -> None:
            if not run:
                return
            keep = [run[0]] if len(run) == 1 else [run[0], run[-1]]
            for i, f in enumerate(keep):
                frames.append(
                    traceback.FrameSummary(
                        _short_path(f.filename), f.lineno, f.name, lookup_line=False, line=""
                    )
                )
                if i == 0 and len(run) > 2:
                    frames.append(None)  # a marker for the elided middle
                    skipped[len(frames) - 1] = len(run) - 2
            run.clear()

        skipped: dict[int, int] = {}
        for f in te.stack:
            if f.filename.startswith(hidden):
                continue
            if _is_user_file(f.filename):
                flush_run()
                frames.append(f)
            else:
                run.append(f)
        flush_run()
        lines = ["Traceback (most recent call last):\n"] if frames else []
        for i, shown in enumerate(frames):
            if shown is None:
                lines.append(f"  [... {skipped[i]} more library frames ...]\n")
            else:
                lines.append("".join(traceback.StackSummary.from_list([shown]).format()))
        lines.extend(_cap(line) for line in te.format_exception_only())
        for cause in _chain(exc)[1:6]:
            lines.append(f"Caused by: {_qualname(type(cause))}: {_cap(_safe_str(cause))}\n")
        return "".join(lines)
    except Exception:
        return f"{type(exc).__name__}: {_safe_str(exc)}\n"


def _cap(text: str) -> str:
    if len(text) <= _MAX_MESSAGE:
        return text
    return text[:_MAX_MESSAGE] + f"...[{len(text) - _MAX_MESSAGE} more characters]\n"


#: Result types whose JSON form is one short value (`_outcome`'s fast path).
_SCALARS = frozenset({bool, int, float})


def to_data(value: Any, depth: int = 0) -> Any:
    """Convert a value to JSON-safe data; anything else becomes a marked repr.

    Lists, tuples and dicts with string keys are converted element by element; other
    objects become `{"__repr__": "...", "__type__": "module.Class"}`.
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else _marked(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else _marked(value)
    if depth >= _MAX_DEPTH:
        return _marked(value)
    if (
        isinstance(value, list | tuple)
        and type(value) in (list, tuple)
        and len(value) <= _MAX_ITEMS
    ):
        return [to_data(v, depth + 1) for v in value]
    if type(value) is dict and len(value) <= _MAX_ITEMS and all(isinstance(k, str) for k in value):
        return {k: to_data(v, depth + 1) for k, v in value.items()}
    numeric = _numpy_data(value, depth)
    if numeric is not _NOT_NUMPY:
        return numeric
    return _marked(value)


_NOT_NUMPY = object()


def _numpy_data(value: Any, depth: int) -> Any:
    """numpy scalars become numbers and small numeric arrays lists (what a reader expects)."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return _NOT_NUMPY
    if isinstance(value, numpy.generic) and isinstance(value, numpy.number | numpy.bool_):
        return to_data(value.item(), depth + 1)
    if type(value) is numpy.ndarray and value.size <= _MAX_ITEMS and value.dtype.kind in "biuf":
        return to_data(value.tolist(), depth + 1)
    return _NOT_NUMPY


def _marked(value: Any) -> dict[str, str]:
    try:
        text = repr(value)
    except Exception:
        text = f"<unrepresentable {type(value).__name__}>"
    if len(text) > 10_000:
        text = text[:10_000] + "...<truncated repr>"
    # A module user code holds is the guards' view of it (a module subclass): name the type
    # user code would expect.
    cls = types.ModuleType if isinstance(value, types.ModuleType) else type(value)
    return {"__repr__": text, "__type__": _qualname(cls)}
