"""The agent's side of "nothing outlives the agent" (see `_host/guardian.py` for the mechanisms).

* `owner_tag()`, `control_dir_prefix()` and `owner_env()`: the marks every control directory
  and every launched process carries.
* `ensure_guardian()`: starts, once per agent process, the guardian that cleans up after an
  agent that dies (SIGKILL included), and sweeps what dead agents left.
* `launch(fn, ...)`: runs a process start in the one lasting launch thread. Sandboxes ask for
  SIGKILL when their parent dies (bwrap's --die-with-parent, the unshare launcher, setpriv
  in front of firejail) and the kernel means the parent *thread*; a worker forked from a
  short-lived thread (agent frameworks call tools from pool threads) would die with it.
  The thread is a daemon: it lasts as long as the process, and is never shut down under a
  start in progress.
* At interpreter exit (`atexit`), whether or not anything was closed: new starts are
  refused (quietly), the start in progress finishes, every pool stops, then every process,
  group and directory of this agent is ended and removed, synchronously.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from agent_sandbox._errors import SandboxClosed
from agent_sandbox._host import guardian

__all__ = [
    "START_GATE",
    "StartGate",
    "control_dir_prefix",
    "ensure_guardian",
    "launch",
    "on_exit",
    "owner_env",
    "owner_lock",
    "owner_tag",
    "shutting_down",
    "starting",
]

T = TypeVar("T")

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"pid": None, "tag": "", "guardian": None, "pipe": -1, "lock": -1}
_SHUTDOWN = threading.Event()
_EXITING = "the agent is exiting; no worker is started"


def owner_tag() -> str:
    """This process's owner token (16 random hex digits, drawn anew after a fork).

    Drawing it takes the owner lock (`guardian.hold_owner_lock`): held for this process's
    whole life, and its guardian's, before any name carrying the token exists.
    """
    pid = os.getpid()
    with _LOCK:
        if _STATE["pid"] != pid:
            tag, fd = guardian.hold_owner_lock(tempfile.gettempdir())
            _STATE.update(pid=pid, tag=tag, guardian=None, pipe=-1, lock=fd)
        return str(_STATE["tag"])


def owner_lock() -> int:
    """The descriptor holding this process's owner lock (-1 before `owner_tag()`)."""
    with _LOCK:
        return int(_STATE["lock"]) if _STATE["pid"] == os.getpid() else -1


def control_dir_prefix() -> str:
    return f"{guardian.DIR_PREFIX}{owner_tag()}-"


def owner_env() -> dict[str, str]:
    """The variable a launched process starts with (dropped from the worker's os.environ)."""
    return {guardian.OWNER_ENV: owner_tag()}


def shutting_down() -> bool:
    return _SHUTDOWN.is_set()


_STARTS = threading.Condition()
_STARTS_IN_FLIGHT = [0]


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Bracket a worker start, from making its control directory to the end of its start.

    Refused once the agent is exiting; the exit clean-up waits (bounded) for the starts in
    flight to leave the bracket before it removes this agent's directories, so a start in a
    daemon thread (a pool's refill) cannot make a directory after the clean-up and then be
    frozen by the interpreter's finalization before its own clean-up runs.
    """
    with _STARTS:
        if _SHUTDOWN.is_set():
            raise SandboxClosed(_EXITING)
        _STARTS_IN_FLIGHT[0] += 1
    try:
        yield
    finally:
        with _STARTS:
            _STARTS_IN_FLIGHT[0] -= 1
            _STARTS.notify_all()


def _wait_for_starts(timeout: float) -> bool:
    """Wait (bounded) until no start is in flight; whether none is."""
    with _STARTS:
        return _STARTS.wait_for(lambda: _STARTS_IN_FLIGHT[0] == 0, timeout=timeout)


def _bases() -> list[str]:
    from agent_sandbox._host.cgroups import hierarchy_bases

    return hierarchy_bases()


def ensure_guardian() -> None:
    """Start this agent's guardian unless it runs (cheap when it does)."""
    tag = owner_tag()
    with _LOCK:
        proc = _STATE["guardian"]
        if proc is not None and proc.poll() is None:
            return
        if _SHUTDOWN.is_set():
            return
        if _STATE["pipe"] >= 0:
            with contextlib.suppress(OSError):
                os.close(_STATE["pipe"])
            _STATE["pipe"] = -1
        read_end, write_end = os.pipe()  # neither is inheritable
        folder = os.path.dirname(os.path.realpath(guardian.__file__))
        code = (
            f"import os, sys; sys.path.insert(0, {folder!r}); import guardian; "
            "del sys.path[0]; guardian.main(); os._exit(0)"
        )
        argv = [
            sys.executable,
            "-I",
            "-S",
            "-B",
            "-c",
            code,
            str(read_end),
            str(_STATE["lock"]),
            tag,
            tempfile.gettempdir(),
            *_bases(),
        ]
        try:
            proc = subprocess.Popen(
                argv,
                pass_fds=(read_end, _STATE["lock"]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError:
            os.close(write_end)
            return  # no guardian: the exit hook still cleans a normal exit
        finally:
            os.close(read_end)
        _STATE["guardian"] = proc
        _STATE["pipe"] = write_end


def _forget_after_fork() -> None:
    # A forked child must not keep the guardian's pipe open (the guardian would wait for
    # the child too) nor act as the agent.
    # Nor the parent's owner lock: the child draws its own token when it makes anything.
    for key in ("pipe", "lock"):
        fd = _STATE.get(key, -1)
        if isinstance(fd, int) and fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    _STATE.update(pid=None, tag="", guardian=None, pipe=-1, lock=-1)


os.register_at_fork(after_in_child=_forget_after_fork)


class _Pending(Generic[T]):
    """One submitted start: its result or its exception, once the launch thread has it
    (what `concurrent.futures.Future` would give, without importing that package)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set_result(self, value: T) -> None:
        self._value = value
        self._done.set()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def result(self) -> T:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]


class _Launcher:
    """One lasting daemon thread that runs every process start, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._busy = threading.Lock()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any) -> _Pending[T]:
        if _SHUTDOWN.is_set():
            raise SandboxClosed(_EXITING)
        future: _Pending[T] = _Pending()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="agent-sandbox-launch", daemon=True
                )
                self._thread.start()
            self._queue.put((future, fn, args))
        return future

    def _loop(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            with self._busy:
                if _SHUTDOWN.is_set():
                    future.set_exception(SandboxClosed(_EXITING))
                    continue
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)

    def drain(self, timeout: float) -> bool:
        """Wait (bounded) for the start in progress; later ones are refused. Whether it
        ended within the time."""
        if self._busy.acquire(timeout=timeout):
            self._busy.release()
            return True
        return False


_LAUNCHER = _Launcher()


class StartGate:
    """At most `slots` worker starts at once, served first come, first served.

    A start is mostly CPU (an interpreter's imports, a sandbox's namespaces and mounts):
    more at once than there are cores only makes each of them slower, and a burst of
    fifty would otherwise start fifty together.
    """

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self.peak = 0
        self._cond = threading.Condition()
        self._running = 0
        self._queue: collections.deque[object] = collections.deque()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        me = object()
        with self._cond:
            self._queue.append(me)
            self._cond.wait_for(lambda: self._queue[0] is me and self._running < self.slots)
            self._queue.popleft()
            self._running += 1
            self.peak = max(self.peak, self._running)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()


#: Worker starts at once: the machine's cores, at least 2, at most 8.
START_GATE = StartGate(min(8, max(2, os.cpu_count() or 2)))


def launch(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` (a process start) in the lasting launch thread and return its result."""
    return _LAUNCHER.submit(fn, *args).result()


#: Clean-ups run at exit, after the launch thread drained and before the owner's clean-up.
_EXIT_HOOKS: list[Callable[[], object]] = []


def on_exit(hook: Callable[[], object]) -> None:
    """Run `hook` at interpreter exit, before the owner's clean-up (the pool registry
    closes its workers there); an exception it raises is ignored."""
    _EXIT_HOOKS.append(hook)


@atexit.register
def _at_exit() -> None:
    """End and remove everything of this agent, whether or not it was closed."""
    if _STATE["pid"] != os.getpid():
        return  # nothing was started by this process
    with _STARTS:
        _SHUTDOWN.set()
    settled = _LAUNCHER.drain(5.0)
    settled = _wait_for_starts(5.0) and settled
    for hook in list(_EXIT_HOOKS):
        with contextlib.suppress(Exception):
            hook()
    try:
        if not guardian.clean_owner(owner_tag(), _bases(), tempfile.gettempdir()):
            settled = False
    except Exception:
        settled = False
    if settled and _STATE["lock"] >= 0:
        # Everything of this owner is gone: its lock file goes last (the guardian keeps
        # the lock itself until it exits). Unsettled, the guardian finishes and removes it.
        guardian.release_owner(tempfile.gettempdir(), owner_tag(), _STATE["lock"])
        _STATE["lock"] = -1
    fd = _STATE["pipe"]
    if fd >= 0:
        if settled:
            # Nothing was in flight and the clean-up ran to its end: the guardian need not
            # scan again (it exits at once). Otherwise it cleans up after this process.
            with contextlib.suppress(OSError):
                os.write(fd, guardian.CLEANED)
        with contextlib.suppress(OSError):
            os.close(fd)
        _STATE["pipe"] = -1
    proc = _STATE["guardian"]
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2.0)  # reaped: no zombie, no warning at exit
