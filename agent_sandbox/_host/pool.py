"""Warm workers per policy fingerprint: acquiring one is a pop, not a process start.

A pool keeps `warm` started, handshaken workers for one (policy, provider) pair and refills
in a background thread after each acquire, once the call of the worker it handed out has
ended (or after `REFILL_GRACE`), so that the refill does not compete with that call. Pools
are shared between sandboxes with the same policy through `PoolRegistry` only when they ask
for it (`Sandbox(share_workers=True)`), and closed when the last sandbox using one is
closed. By default each sandbox has its own pool, so workers forked for one sandbox never
come from another sandbox's template: forked workers share their template's hash secret and
memory layout (see `_worker/template.py`), and that sharing stays within one sandbox. The
cost is one template (and `warm` workers) per sandbox.

The pool also keeps a worker template (`_host/templates.py`): a pre-imported process that
forks new workers, so a start costs a fork instead of the worker's imports. For `subprocess`
and `landlock` it is a plain child; for `bwrap` and `unshare` it lives inside the sandbox and
each forked worker takes namespaces of its own. If the template cannot start (or cannot hold
as a fresh worker would for this policy), workers are started directly (the same plan and
restrictions either way).

The template is not on the first result's path: the pool's first start in a caller's thread
starts its worker directly (from scratch), and the template starts only once that worker is
handed back (a stateless run's end, its session's end), in the background after a short grace
(`TEMPLATE_GRACE`), or when a second worker is needed, whichever comes first. A process that
makes one call and closes never starts a template, and the template's start never competes
with the first call (on a machine of two cores it made the first result and the exit of a
one-call process slower: measured by benchmarks/bench_fresh.py). Every later start forks from
the template, waiting for it while it starts (a start in flight is nearer its end than a
fresh one); the refill thread always does.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

from agent_sandbox._errors import SandboxClosed, WorkerStartError
from agent_sandbox._host import lifecycle
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox._host.templates import TEMPLATE_PROVIDERS, WorkerTemplate
from agent_sandbox.policies import Policy
from agent_sandbox.providers import Provider

__all__ = ["PoolRegistry", "WorkerPool"]

_log = logging.getLogger("agent_sandbox.pool")

#: Seconds between the hand-back of a pool's first worker and its template's start in the
#: background: a pool closed meanwhile (a process that made one call) starts none.
TEMPLATE_GRACE = 0.2
#: The longest a refill waits for the call of the worker `acquire` handed out: it starts
#: when that call ends, or after this many seconds (a long call), whichever comes first. A
#: refill started at once competed with that call (the refill thread's Python work holds
#: the GIL the caller's thread needs to read its result, and the new worker's start takes a
#: core): the first call on a warm worker took 4.7-4.8 ms instead of 2.2 (issue 19).
REFILL_GRACE = 0.05


class WorkerPool:
    """Started workers for one policy and provider, ready to be handed out."""

    def __init__(
        self, policy: Policy, provider: Provider, *, warm: int = 1, start_timeout: float = 15.0
    ) -> None:
        self.policy = policy
        self.provider = provider
        self.warm = max(0, warm)
        self.start_timeout = start_timeout
        self._ready: collections.deque[WorkerProcess] = collections.deque()
        self._lock = threading.Lock()
        #: Signals the pool's refill thread (started on the first refill, lasting until
        #: close): starting a thread per refill made the caller of `acquire` wait for it.
        self._wake = threading.Condition(self._lock)
        self._wanted = False
        self._refill_at = 0.0  # (monotonic) when the asked refill starts at the latest
        self._refill_thread: threading.Thread | None = None
        self._closed = False
        self.started = 0
        self.last_error: BaseException | None = None
        self.use_template = provider.name in TEMPLATE_PROVIDERS
        if not provider.is_boundary:
            _log.warning(
                "policy %r runs under provider %r with no kernel boundary (its explicit "
                "no_kernel_boundary opt-out): only the Python guards and rlimits hold the "
                "code, and hostile code gets past them",
                policy.name,
                provider.name,
            )
        self._template: WorkerTemplate | None = None
        self._template_lock = threading.Lock()
        #: Whether the first start went (or goes) directly, the template started behind it.
        self._direct_first = False
        #: The template being started (so that `close` can cancel it), and the background
        #: thread starting it after the first direct start.
        self._starting: WorkerTemplate | None = None
        self._template_thread: threading.Thread | None = None
        #: Set by close: a background start still in its grace ends at once.
        self._closing = threading.Event()
        if self.warm:
            # Started now, idle until asked: the first `acquire` only signals it.
            self._start_refill_thread()

    def template(self) -> WorkerTemplate | None:
        """The pool's worker template, started on first use (None where it does not apply)."""
        if not self.use_template or self._closed:
            return None
        with self._template_lock:
            if self._closed:
                # close() may have run since the check above: no template after it.
                return None
            if self._template is not None and self._template.alive():
                return self._template
            if self._template is not None:
                self._template.close()
            try:
                template = WorkerTemplate.start(
                    self.policy, self.provider, timeout=self.start_timeout, started=self._track
                )
            except SandboxClosed:
                return None  # the agent is exiting (`lifecycle`): no template after that
            except (WorkerStartError, OSError) as exc:
                if self._closed:
                    return None  # cancelled by close(): not a failure of templates
                self.last_error = exc
                self.use_template = False  # start workers directly from now on
                self._template = None
                return None
            finally:
                self._track(None)
            if self._closed:  # closed while it started: nothing of it stays
                template.close()
                return None
            self._template = template
            return self._template

    def _track(self, template: WorkerTemplate | None) -> None:
        """Remember the template being started (None once its start ended); cancel it at
        once if the pool closed meanwhile."""
        with self._lock:
            self._starting = template
            cancel = template is not None and self._closed
        if cancel and template is not None:
            template.close()

    def _start_template_later(self, grace: float = 0.0) -> None:
        """Start the template in a background thread, after `grace` seconds unless the pool
        closes first (the first worker started directly and was handed back)."""
        with self._lock:
            if (
                self._closed
                or self._template_thread is not None
                or not self.use_template
                or self._template is not None
            ):
                return
            thread = threading.Thread(
                target=self._template_in_background,
                args=(grace,),
                name="agent-sandbox-template-start",
                daemon=True,
            )
            self._template_thread = thread
        thread.start()

    def _template_in_background(self, grace: float = 0.0) -> None:
        """The background thread's start of the template. Whatever it meets becomes the
        pool's `last_error`, and the pool starts its workers directly; nothing reaches the
        thread's own traceback, which would print at the interpreter's exit."""
        if grace > 0 and self._closing.wait(grace):
            return  # closed within the grace: no template
        try:
            self.template()
        except Exception as exc:  # any failure: workers start directly
            self.last_error = exc
            self.use_template = False
            _log.debug("the template of policy %r did not start: %s", self.policy.name, exc)

    def _start(self, *, direct_first: bool = False) -> WorkerProcess:
        with lifecycle.START_GATE.slot():
            return self._start_now(direct_first)

    def _start_now(self, direct_first: bool = False) -> WorkerProcess:
        if direct_first and self.use_template and self._template is None:
            with self._lock:
                direct, self._direct_first = not self._direct_first, True
            if direct:
                # The pool's first worker: from scratch; the template starts once it is
                # handed back (or when a second worker is needed, below).
                first = WorkerProcess.start(
                    self.policy, self.provider, start_timeout=self.start_timeout
                )
                first.on_discard = lambda: self._start_template_later(TEMPLATE_GRACE)
                self.started += 1
                return first
        template = self.template()
        if template is None and self._closed:
            raise SandboxClosed("the worker pool is closed")
        worker: WorkerProcess | None = None
        if template is not None:
            try:
                worker = WorkerProcess.start(
                    self.policy, self.provider, start_timeout=self.start_timeout, template=template
                )
            except WorkerStartError as exc:
                self.last_error = exc  # then started directly, below
        if worker is None:
            worker = WorkerProcess.start(
                self.policy, self.provider, start_timeout=self.start_timeout
            )
        self.started += 1
        return worker

    def acquire(self) -> WorkerProcess:
        """A ready worker: a warm one if there is one, otherwise a freshly started one."""
        if self._closed:
            raise SandboxClosed("the worker pool is closed")
        worker = None
        with self._lock:
            while self._ready:
                candidate = self._ready.popleft()
                if candidate.alive():
                    worker = candidate
                    break
                candidate.discard()
        if worker is None:
            worker = self._start(direct_first=True)
        worker.after_call = self._schedule_refill
        self._schedule_refill(REFILL_GRACE)
        return worker

    def fill(self) -> None:
        """Start workers until `warm` are ready (blocking; used to pre-warm)."""
        while not self._closed:
            with self._lock:
                if len(self._ready) >= self.warm:
                    return
            worker = self._start()
            with self._lock:
                if self._closed:
                    worker.discard()
                    return
                self._ready.append(worker)

    def _schedule_refill(self, delay: float = 0.0) -> None:
        """Ask the refill thread to fill the pool, in `delay` seconds at the latest (the
        earliest of the pending asks wins)."""
        with self._lock:
            if self._closed or len(self._ready) >= self.warm:
                return
            at = time.monotonic() + delay
            self._refill_at = min(self._refill_at, at) if self._wanted else at
            self._wanted = True
            self._wake.notify()  # the refill thread is waiting, or sees `_wanted` next
        self._start_refill_thread()

    def _start_refill_thread(self) -> None:
        with self._lock:
            if self._refill_thread is not None or self._closed:
                return
            thread = threading.Thread(target=self._refill, name="agent-sandbox-refill", daemon=True)
            self._refill_thread = thread
        thread.start()

    def _refill(self) -> None:
        """The refill thread: fill the pool each time it is asked, until the pool closes."""
        while True:
            with self._lock:
                while not self._closed:
                    if not self._wanted:
                        self._wake.wait()
                        continue
                    wait = self._refill_at - time.monotonic()
                    if wait <= 0:
                        break
                    self._wake.wait(wait)
                if self._closed:
                    return
                self._wanted = False
            try:
                self.fill()
                self.last_error = None
            except (WorkerStartError, OSError) as exc:
                # Reported on the next acquire, which starts a worker in the caller's thread.
                self.last_error = exc
            except SandboxClosed:
                return

    def ready_count(self) -> int:
        with self._lock:
            return len(self._ready)

    def close(self) -> None:
        """Stop refilling and end every warm worker."""
        with self._lock:
            self._closed = True
            self._closing.set()
            self._wake.notify_all()
            ready = list(self._ready)
            self._ready.clear()
            starting = self._starting
        if starting is not None:
            starting.close()  # a template start in flight ends now (see `_track`)
        for worker in ready:
            worker.discard()
        for thread in (self._refill_thread, self._template_thread):
            if thread is not None and thread is not threading.current_thread():
                # A start in progress discards its worker (or template) when it sees the pool
                # closed; wait for it, so that nothing of this pool is left once close() returns.
                thread.join(self.start_timeout + 1.0)
        with self._template_lock:
            if self._template is not None:
                self._template.close()
                self._template = None


class PoolRegistry:
    """Pools shared by fingerprint and provider, reference-counted by the sandboxes using them."""

    def __init__(self) -> None:
        self._pools: dict[tuple[str, str, int, int], tuple[WorkerPool, int]] = {}
        self._owners = itertools.count(1)
        self._lock = threading.Lock()

    def get(
        self,
        policy: Policy,
        provider: Provider,
        *,
        warm: int,
        start_timeout: float,
        owner: int = 0,
    ) -> WorkerPool:
        """The pool for (policy, provider, warm); a non-zero `owner` (from `new_owner()`) keeps
        it private to that owner, 0 shares it with every other caller that passes 0."""
        key = (policy.fingerprint(), provider.name, warm, owner)
        with self._lock:
            entry = self._pools.get(key)
            if entry is None:
                pool = WorkerPool(policy, provider, warm=warm, start_timeout=start_timeout)
                self._pools[key] = (pool, 1)
                return pool
            pool, refs = entry
            self._pools[key] = (pool, refs + 1)
            return pool

    def new_owner(self) -> int:
        """A token no other caller gets (for a private pool)."""
        return next(self._owners)

    def close_all(self) -> None:
        """Close every pool (at interpreter exit)."""
        with self._lock:
            pools = [pool for pool, _refs in self._pools.values()]
            self._pools.clear()
        for pool in pools:
            pool.close()

    def release(self, pool: WorkerPool) -> None:
        with self._lock:
            for key, (candidate, refs) in list(self._pools.items()):
                if candidate is pool:
                    if refs <= 1:
                        del self._pools[key]
                        pool.close()
                    else:
                        self._pools[key] = (candidate, refs - 1)
                    return


#: The process-wide registry used by `Sandbox`.
REGISTRY = PoolRegistry()
lifecycle.on_exit(REGISTRY.close_all)
