"""The public entry point: `Sandbox(policy)` runs code in sandboxed workers.

* `sandbox.run(code)` is stateless: a fresh worker from the warm pool, discarded after.
* `sandbox.session(key)` returns a `Session` whose worker keeps its variables between
  calls. Calls on one session are serialized; calls on different sessions run in parallel.
  At most `max_sessions` sessions hold an interpreter: a new one takes a free slot, or,
  when its first call is waiting for one, the slot of the least recently used session idle
  for at least `evict_idle` seconds (a conversation between two turns keeps its state);
  else it waits up to `session_wait`, then raises `CapacityError`. Sessions idle longer
  than `session_ttl` give theirs up too. An
  evicted session stays usable: its next call gets a fresh interpreter and says so.
* `await sandbox.arun(code)` and `await session.arun(code)` are the async twins.

A worker that dies (timeout, crash, tampering) is replaced on the next call of its
session, and that call's result says the state was lost.

Why this module is longer than 600 lines: `Sandbox` and `Session` are one public surface;
admission, eviction, interrupts and closing share the sandbox's lock and its sessions, and
read as one piece (the call lock itself is `agent_sandbox._host.calllock`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from agent_sandbox._errors import CapacityError, SandboxClosed, SandboxError
from agent_sandbox._host.boundary import Boundary, resolve_boundary
from agent_sandbox._host.calllock import CallLock
from agent_sandbox._host.pool import REGISTRY, WorkerPool
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox._host.result import RunError, RunResult
from agent_sandbox.policies import Policy, resolve_policy
from agent_sandbox.providers import Provider

if TYPE_CHECKING:
    import asyncio  # imported where used: a program that never awaits does not load it

    from agent_sandbox._host.files import FileInfo
    from agent_sandbox._host.remote.pool import RemotePool

__all__ = ["Sandbox", "Session"]

OnEvent = Callable[[str, Any], None]

#: The wait for a slot re-checks at least this often (a call's end also wakes it).
_RECHECK = 0.05


class Session:
    """One interpreter that persists between calls; get one from `Sandbox.session()`."""

    def __init__(self, sandbox: Sandbox, key: str) -> None:
        self.sandbox = sandbox
        self.key = key
        self._worker: WorkerProcess | None = None
        self._had_worker = False
        self._lost_reason = ""
        self._lock = CallLock(f"session {key!r} is closed")
        self._closed = False
        self._admitted = False  # holds one of the sandbox's `max_sessions` slots
        self._evicted_notice = ""  # why its interpreter was taken (said at the next call)
        # Notices a files operation met (a replaced interpreter): said at the next call.
        self._pending_notices: list[str] = []
        self._pending_lost = False
        self.last_used = time.monotonic()

    @property
    def worker(self) -> WorkerProcess | None:
        return self._worker

    def _prepare(self) -> tuple[WorkerProcess, list[str], bool]:
        if self._closed or self.sandbox.closed:
            raise SandboxClosed(f"session {self.key!r} is closed")
        notices: list[str] = []
        lost = False
        if not self._admitted:
            self.sandbox._admit(self)  # may wait for a slot; CapacityError after the wait
        if self._evicted_notice:
            lost = True
            notices.append(self._evicted_notice)
            self._evicted_notice = ""
        if self._worker is not None and not self._worker.alive():
            self._lost_reason = self._worker.end_cause()
            self._worker.discard()
            self._worker = None
        if self._worker is None:
            if self._had_worker:
                lost = True
                notices.append(
                    f"the previous interpreter of this session ended ({self._lost_reason}); "
                    "its variables and imports were lost, so define them again"
                )
            worker = self.sandbox._session_worker(self.key)
            if self._closed or self.sandbox.closed:
                worker.discard()  # closed while it started: it runs nothing
                raise SandboxClosed(f"session {self.key!r} is closed")
            self._worker = worker
            self._had_worker = True
        return self._worker, notices, lost

    def _after(
        self, worker: WorkerProcess, result: RunResult, notices: list[str], lost: bool
    ) -> RunResult:
        self.last_used = time.monotonic()
        if worker.dead:
            # Ended by the call (a limit, tampering, a crash): said now. One that ends
            # between calls is found by the next call's `_prepare`, which asks the process.
            self._lost_reason = worker.end_cause()
        if self._closed or self.sandbox.closed:
            result = _closed_error(result)
        if self._pending_notices or self._pending_lost:
            notices = self._pending_notices + notices
            lost = lost or self._pending_lost
            self._pending_notices, self._pending_lost = [], False
        if notices or lost:
            result = _replace(result, notices=tuple(notices) + result.notices, state_lost=lost)
        return result

    def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: OnEvent | None = None,
        timeout_source: str | None = None,
        filename: str | None = None,
        host_tools: Mapping[str, Callable[..., Any]] | None = None,
    ) -> RunResult:
        """Run `code` in this session's interpreter; variables persist across calls.

        `timeout` overrides the policy's `limits.wall_seconds` for this call; `timeout_source`
        names who set it (for the refusal's hint). `filename` is the name the code's frames
        carry in tracebacks (default `<cell-N>`). `host_tools` (name -> function of this
        process) are callable from the code as `_host_tool(name, args, kwargs)` during this
        call, each only when the policy's `tools.allow` lists it (`_host/hosttools.py`).
        """
        self._lock.acquire()
        try:
            worker, notices, lost = self._prepare()
            result = worker.run(
                code,
                timeout=timeout,
                on_event=on_event,
                session=self.key,
                timeout_source=timeout_source,
                filename=filename,
                **self._host_call(host_tools),
            )
            result = _with_files(worker, self.sandbox.policy, result)
            return self.sandbox._logged(self._after(worker, result, notices, lost))
        finally:
            self._lock.release()
            self.sandbox._room_changed()

    async def arun(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: OnEvent | None = None,
        timeout_source: str | None = None,
        filename: str | None = None,
        host_tools: Mapping[str, Callable[..., Any]] | None = None,
    ) -> RunResult:
        """The async twin of `run()`. Cancelling it at any point leaves the session usable."""
        await self._lock.acquire_async()
        ownership = _Ownership()
        try:
            if self._worker is None or not self._worker.alive():
                worker, notices, lost = await self._prepare_in_thread(ownership)
            else:
                worker, notices, lost = self._prepare()
            result = await worker.arun(
                code,
                timeout=timeout,
                on_event=on_event,
                session=self.key,
                timeout_source=timeout_source,
                filename=filename,
                **self._host_call(host_tools),
            )
            if result.files:
                import asyncio

                result = await asyncio.to_thread(_with_files, worker, self.sandbox.policy, result)
            return self.sandbox._logged(self._after(worker, result, notices, lost))
        finally:
            if ownership.release():
                self._lock.release()
                self.sandbox._room_changed()

    def _host_call(self, host_tools: Mapping[str, Callable[..., Any]] | None) -> dict[str, Any]:
        if host_tools is None:
            return {}
        if self.sandbox.provider.name == "remote":
            raise SandboxError(
                "host tools need a local provider (a remote worker's channel is relayed)"
            )
        from agent_sandbox._host.hosttools import make_handler

        return {"host_call": make_handler(self.sandbox.policy, host_tools)}

    async def _prepare_in_thread(
        self, ownership: _Ownership
    ) -> tuple[WorkerProcess, list[str], bool]:
        """`_prepare()` in a thread, with the lock held.

        Cancelled while the thread starts a worker, the coroutine leaves at once and the
        thread releases the lock when it is done: the session's worker is never changed by
        two callers at a time, and the lock is never left taken.
        """

        def body() -> tuple[WorkerProcess, list[str], bool]:
            try:
                return self._prepare()
            finally:
                if ownership.finish():
                    self._lock.release()
                    self.sandbox._room_changed()

        import asyncio

        try:
            return await asyncio.to_thread(body)
        except asyncio.CancelledError:
            ownership.abandon()
            raise

    # -- files in scratch (the host side is `agent_sandbox._host.files`) -----------------

    def _files(self, op: Callable[[WorkerProcess, Policy, float], Any]) -> Any:
        """Run one files operation on this session's worker, with the call lock held."""
        self._lock.acquire()
        try:
            if self.sandbox.provider.name == "remote":
                raise SandboxError(
                    "the session files API needs a local provider; a remote session's "
                    "scratch is on another machine (use files.read/write grants there)"
                )
            worker, notices, lost = self._prepare()
            self._pending_notices += notices
            self._pending_lost = self._pending_lost or lost
            self.last_used = time.monotonic()
            policy = self.sandbox.policy
            return op(worker, policy, float(policy.limits.wall_seconds))
        finally:
            self._lock.release()
            self.sandbox._room_changed()

    def put_file(
        self,
        name: str,
        data: bytes | bytearray | memoryview | None = None,
        *,
        source: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
    ) -> FileInfo:
        """Place `data` (or the host file `source`) in this session's scratch as `name`.

        The code sees it as `name` in its working directory. `name` is one plain file name
        (no `/`, `..` or NUL, not a `files.hide` pattern); the size is bounded by
        `limits.transfer_mb` and what is left of `limits.scratch_mb`; an existing name is
        refused unless `overwrite`. A host file that changes while it is read is refused.
        Every refusal is a `FileTransferRefused` whose `.denial` names the rule. Files live
        with the session's interpreter: a replaced interpreter starts with an empty scratch.
        """
        from agent_sandbox._host import files

        policy = self.sandbox.policy
        name = files.check_name(policy, name, "put")
        if (data is None) == (source is None):
            raise TypeError(
                "put_file needs exactly one of `data` (bytes) or `source` (a host path)"
            )
        if data is not None:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise TypeError(f"`data` must be bytes, not {type(data).__name__}")
            payload = bytes(data)
        else:
            assert source is not None
            payload = files.read_host_file(policy, source, name)
        return self._files(  # type: ignore[no-any-return]
            lambda w, p, t: files.put(w, p, name, payload, overwrite=overwrite, timeout=t)
        )

    def get_file(self, name: str) -> bytes:
        """The bytes of the scratch file `name` (a regular file, no link followed), bounded by
        `limits.transfer_mb`; refused if it changes while it is read."""
        from agent_sandbox._host import files

        name = files.check_name(self.sandbox.policy, name, "get")
        return self._files(lambda w, p, t: files.get(w, p, name, timeout=t))  # type: ignore[no-any-return]

    def list_files(self) -> list[FileInfo]:
        """The entries of this session's scratch directory, by name."""
        from agent_sandbox._host import files

        return self._files(lambda w, p, t: files.listing(w, p, timeout=t))  # type: ignore[no-any-return]

    def remove_file(self, name: str) -> None:
        """Remove the scratch file `name` (a link is removed itself, never what it names)."""
        from agent_sandbox._host import files

        name = files.check_name(self.sandbox.policy, name, "remove")
        self._files(lambda w, p, t: files.remove(w, p, name, timeout=t))

    async def aput_file(
        self,
        name: str,
        data: bytes | bytearray | memoryview | None = None,
        *,
        source: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
    ) -> FileInfo:
        """The async twin of `put_file()` (in a thread; a cancelled one still finishes)."""
        import asyncio

        return await asyncio.to_thread(
            lambda: self.put_file(name, data, source=source, overwrite=overwrite)
        )

    async def aget_file(self, name: str) -> bytes:
        """The async twin of `get_file()`."""
        import asyncio

        return await asyncio.to_thread(self.get_file, name)

    async def alist_files(self) -> list[FileInfo]:
        """The async twin of `list_files()`."""
        import asyncio

        return await asyncio.to_thread(self.list_files)

    async def aremove_file(self, name: str) -> None:
        """The async twin of `remove_file()`."""
        import asyncio

        await asyncio.to_thread(self.remove_file, name)

    def interrupt(self, grace: float | None = None) -> bool:
        """Interrupt this session's running call, as Ctrl-C in a Jupyter kernel.

        The code sees KeyboardInterrupt and the call returns it as its error; the session's
        variables stay. A cell that does not stop within `grace` seconds (2 by default) has
        its worker replaced, and the result says so. False when no call was running.
        """
        worker = self._worker
        if worker is None or not self._lock.locked():
            return False
        return worker.interrupt(grace)

    def reset(self) -> None:
        """Drop this session's interpreter; the next call starts from a clean one."""
        self._lock.acquire()
        try:
            if self._worker is not None:
                self._worker.discard()
            self._worker = None
            self._had_worker = False
        finally:
            self._lock.release()

    def close(self) -> None:
        """End the session's worker; further calls raise `SandboxClosed`."""
        self._closed = True
        self._lock.close()
        worker = self._worker
        if worker is not None:
            worker.discard()
        self.sandbox._forget(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ownership:
    """Who releases a session's lock when a coroutine hands a locked step to a thread."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._finished = False
        self._abandoned = False

    def finish(self) -> bool:
        """The thread's step ended; True when the thread must release (its caller left)."""
        with self._mutex:
            self._finished = True
            return self._abandoned

    def abandon(self) -> None:
        """The coroutine was cancelled; a step still running now owns the lock."""
        with self._mutex:
            self._abandoned = not self._finished

    def release(self) -> bool:
        """True when the coroutine still owns the lock and must release it."""
        with self._mutex:
            return not self._abandoned


class Sandbox:
    """Runs code under one policy; see the module docstring for sessions and the pool.

    `policy` is a `Policy`, the name of a shipped policy, or a TOML path. `provider`
    overrides the policy's provider (default `auto`: the strongest kernel sandbox that works
    here). A provider that is unknown, cannot run here or cannot serve the policy raises
    `ProviderUnavailable` here, at construction; `auto` never falls back to no boundary, and
    `subprocess` needs the policy's `no_kernel_boundary = "accepted"` (else `PolicyError`).
    `boundary.name` says what holds the workers, e.g. `"bwrap+landlock+seccomp"`.
    `share_workers=True` lets sandboxes with the same policy share one pool (its warm workers
    and its worker template, so one template start for all of them); by default each
    sandbox has its own, and workers of different sandboxes never share a template's hash
    secret or memory layout.
    """

    def __init__(
        self,
        policy: Policy | str | None = None,
        *,
        provider: str | None = None,
        warm: int = 1,
        max_sessions: int = 16,
        session_ttl: float = 1800.0,
        start_timeout: float = 15.0,
        session_wait: float = 30.0,
        evict_idle: float = 2.0,
        tool: str = "",
        share_workers: bool = False,
    ) -> None:
        resolved = resolve_policy(policy)
        # Everything that can be wrong about the provider fails here, not at the first call.
        self.boundary: Boundary = resolve_boundary(resolved, provider)
        if provider is not None and provider != resolved.provider:
            resolved = resolved.model_copy(update={"provider": provider})
        self.policy = resolved
        #: The provider workers start with (`auto` resolved to the one it chose here).
        self.provider: Provider = self.boundary.provider
        self.max_sessions = max(1, max_sessions)
        self.session_ttl = session_ttl
        self._pool: WorkerPool | RemotePool
        if self.provider.name == "remote":
            # Workers claimed elsewhere, one per session key (`_host/remote/pool.py`); the
            # [remote] table sets the warm pool, the claim bound and the timeouts.
            from agent_sandbox._host.remote.pool import provider_for

            self._pool = provider_for(resolved)
        else:
            # Private unless asked: forked workers share their template's hash secret and
            # memory layout, so templates (and warm workers) are not shared between sandboxes
            # by default.
            self._pool_owner = 0 if share_workers else REGISTRY.new_owner()
            self._pool = REGISTRY.get(
                resolved,
                self.provider,
                warm=warm,
                start_timeout=start_timeout,
                owner=self._pool_owner,
            )
        self.session_wait = session_wait
        if evict_idle < 0:
            raise ValueError(f"evict_idle must be 0 or more seconds, not {evict_idle!r}")
        #: A session idle for less than this many seconds is never evicted for a newcomer.
        self.evict_idle = float(evict_idle)
        # Sessions holding a slot (least recently used first), and evicted ones kept usable.
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._parked: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._active: set[WorkerProcess] = set()
        self.closed = False
        self._counter = 0
        #: The name the operator's refusal log gives this sandbox's calls (a tool's name).
        self.tool = tool

    def _logged(self, result: RunResult) -> RunResult:
        from agent_sandbox._host import oplog

        oplog.write(result, tool=self.tool, policy=self.policy)
        return result

    # -- stateless calls -----------------------------------------------------------------

    def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: OnEvent | None = None,
        timeout_source: str | None = None,
        filename: str | None = None,
    ) -> RunResult:
        """Run `code` in a fresh worker that is discarded afterwards (see `Session.run`)."""
        self._check_open()
        with self._borrowed(self._pool.acquire()) as worker:
            result = worker.run(
                code,
                timeout=timeout,
                on_event=on_event,
                timeout_source=timeout_source,
                filename=filename,
            )
            result = _with_files(worker, self.policy, result)
        return self._stateless_end(result)

    async def arun(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: OnEvent | None = None,
        timeout_source: str | None = None,
        filename: str | None = None,
    ) -> RunResult:
        """The async twin of `run()`."""
        self._check_open()
        with self._borrowed(await self._acquire_async()) as worker:
            result = await worker.arun(
                code,
                timeout=timeout,
                on_event=on_event,
                timeout_source=timeout_source,
                filename=filename,
            )
            if result.files:
                import asyncio

                result = await asyncio.to_thread(_with_files, worker, self.policy, result)
        return self._stateless_end(result)

    def _session_worker(self, key: str) -> WorkerProcess:
        """A worker for session `key`: any pool worker locally; remotely, the key's claim."""
        if isinstance(self._pool, WorkerPool):
            return self._pool.acquire()
        return self._pool.acquire(key, scope=self.tool)

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxClosed("the sandbox is closed")

    async def _acquire_async(self) -> WorkerProcess:
        """A pool worker without blocking the loop; one started for a cancelled caller is
        discarded when its start ends (never left running untracked)."""
        if self._pool.ready_count():
            return self._pool.acquire()
        import asyncio

        future = asyncio.ensure_future(asyncio.to_thread(self._pool.acquire))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_discard_started)
            raise

    @contextlib.contextmanager
    def _borrowed(self, worker: WorkerProcess) -> Iterator[WorkerProcess]:
        """One stateless call's worker: tracked while it runs (close() ends it), discarded
        after; a sandbox closed while the worker was acquired runs nothing."""
        with self._lock:
            admitted = not self.closed
            if admitted:
                self._active.add(worker)
        try:
            if not admitted:
                raise SandboxClosed("the sandbox is closed")
            yield worker
        finally:
            with self._lock:
                self._active.discard(worker)
            worker.discard()

    def _stateless_end(self, result: RunResult) -> RunResult:
        if self.closed:
            result = _closed_error(result)
        return self._logged(result)

    # -- sessions ------------------------------------------------------------------------

    def session(self, key: str | None = None) -> Session:
        """The session called `key` (created on first use); a new unique one if `key` is None.

        At most `max_sessions` sessions hold an interpreter. A new session takes a free
        slot; when there is none, its first call takes the slot of the least recently used
        session that is not in a call and has been idle for at least `evict_idle` seconds;
        that session stays usable, and its next call gets a fresh interpreter and a notice
        that it was evicted and its state lost. A session in a call, or idle for less than
        `evict_idle`, is never evicted: the new session's first call waits up to
        `session_wait` seconds for a slot, then raises `CapacityError`.
        """
        if self.closed:
            raise SandboxClosed("the sandbox is closed")
        discard: list[WorkerProcess] = []
        with self._lock:
            if key is None:
                self._counter += 1
                key = f"session-{self._counter}"
            self._evict_expired(key, discard)
            session = self._sessions.get(key) or self._parked.get(key)
            if session is None or session._closed:
                session = Session(self, key)
                self._parked[key] = session
                # A free slot now; else its first call waits for one (and may evict).
                self._try_admit(session, discard, evict=False)
            elif session._admitted:
                self._sessions.move_to_end(key)
        for worker in discard:
            worker.discard()
        return session

    # -- admission (all under self._lock) --------------------------------------------------

    def _admit(self, session: Session) -> None:
        """Give `session` a slot, waiting up to `session_wait` (called with its lock held)."""
        discard: list[WorkerProcess] = []
        try:
            with self._lock:
                deadline = time.monotonic() + self.session_wait
                while not self._try_admit(session, discard):
                    if self.closed or session._closed:
                        raise SandboxClosed(f"session {session.key!r} is closed")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise CapacityError(self.max_sessions, self._busy(), self.session_wait)
                    self._room.wait(min(remaining, _RECHECK))
        finally:
            for worker in discard:
                worker.discard()

    def _try_admit(
        self, session: Session, discard: list[WorkerProcess], *, evict: bool = True
    ) -> bool:
        if session._admitted:
            return True
        if len(self._sessions) >= self.max_sessions:
            victim = self._idle_victim(session) if evict else None
            if victim is None:
                return False
            idle = time.monotonic() - victim.last_used
            self._evict(
                victim,
                f"this session was evicted after {idle:.1f} s idle (the least recently used "
                f"of those idle for at least evict_idle = {self.evict_idle:g} s) to make room "
                f"for another session (max_sessions = {self.max_sessions}); its variables "
                "and imports were lost, so define them again",
                discard,
            )
        self._parked.pop(session.key, None)
        self._sessions[session.key] = session
        session._admitted = True
        return True

    def _idle_victim(self, newcomer: Session) -> Session | None:
        """The least recently used session not in a call and idle for at least `evict_idle`
        seconds (or None)."""
        now = time.monotonic()
        eligible = [
            other
            for other in self._sessions.values()
            if other is not newcomer and now - other.last_used >= self.evict_idle
        ]
        for other in sorted(eligible, key=lambda s: s.last_used):
            if other._lock.acquire(timeout=0):  # not in a call, nobody waiting
                other._lock.release()
                return other
        return None

    def _evict(self, victim: Session, notice: str, discard: list[WorkerProcess]) -> None:
        """Take `victim`'s slot and interpreter; it stays usable (called under self._lock)."""
        if not victim._lock.acquire(timeout=0):
            return
        try:
            self._sessions.pop(victim.key, None)
            victim._admitted = False
            if victim._worker is not None:
                discard.append(victim._worker)
                victim._worker = None
                victim._had_worker = False
                victim._evicted_notice = notice
            if not victim._closed:
                self._parked[victim.key] = victim
        finally:
            victim._lock.release()

    def _evict_expired(self, keep: str, discard: list[WorkerProcess]) -> None:
        now = time.monotonic()
        for other_key, other in list(self._sessions.items()):
            if other_key != keep and now - other.last_used > self.session_ttl:
                self._evict(
                    other,
                    f"this session's interpreter was ended after {self.session_ttl:g} s "
                    "without a call (session_ttl); its variables and imports were lost, so "
                    "define them again",
                    discard,
                )

    def _busy(self) -> int:
        return sum(1 for s in self._sessions.values() if s._lock.locked())

    def _room_changed(self) -> None:
        with self._room:
            self._room.notify_all()

    def sessions(self) -> list[str]:
        """Keys of the live sessions, least recently used first."""
        with self._lock:
            return list(self._sessions)

    def _forget(self, session: Session) -> None:
        with self._lock:
            if self._sessions.get(session.key) is session:
                del self._sessions[session.key]
            if self._parked.get(session.key) is session:
                del self._parked[session.key]
            session._admitted = False
            self._room.notify_all()

    # -- lifetime ------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Start the pool's warm workers now (blocking) instead of on first use."""
        self._pool.fill()

    def close(self) -> None:
        """End every session and worker of this sandbox; running calls end with an error."""
        if self.closed:
            return
        self.closed = True
        with self._lock:
            sessions = list(self._sessions.values()) + list(self._parked.values())
            self._sessions.clear()
            self._parked.clear()
            active = list(self._active)
            self._room.notify_all()
        for session in sessions:
            session._closed = True
            session._lock.close()
            if session._worker is not None:
                session._worker.discard()
        for worker in active:
            worker.discard()
        if isinstance(self._pool, WorkerPool):
            REGISTRY.release(self._pool)
        else:
            self._pool.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _discard_started(future: asyncio.Future[WorkerProcess]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().discard()


def _closed_error(result: RunResult) -> RunResult:
    """Report a call cut short by close() as SandboxClosed rather than as a crash."""
    if result.error is None or result.error.kind not in ("crashed", "internal"):
        return result
    return _replace(
        result,
        error=RunError(
            kind="internal",
            type="SandboxClosed",
            message="the sandbox was closed while the call was running",
        ),
    )


def _with_files(worker: Any, policy: Policy, result: RunResult) -> RunResult:
    """`result` with the bytes of the files the call wrote (`_host/files.py`)."""
    if not result.files:
        return result
    from agent_sandbox._host.files import with_output_files

    return with_output_files(worker, policy, result)  # type: ignore[no-any-return]


def _replace(result: RunResult, **changes: Any) -> RunResult:
    import dataclasses

    return dataclasses.replace(result, **changes)
