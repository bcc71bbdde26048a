"""The `remote` provider: a conversation thread's worker runs elsewhere, reached over TLS.

Not a kernel provider (it builds no launch plan): it claims a worker from a *claim backend*
(`claims.py`), binds it to the session (`POST /v1/bind`) and calls it through
`RemoteWorker`, whose intake is the local one. Two backends:

* `LocalClaimBackend` (`agent_sandbox/_host/remote/local_claims.py`): `agent-sandbox worker
  serve` processes on this machine, on loopback with TLS (tests, benchmarks, a single host).
* `K8sClaimBackend` (`agent_sandbox/_host/remote/k8s.py`): SandboxClaims of kubernetes-sigs/
  agent-sandbox through its Python SDK (the `k8s` extra).

A thread maps to one claim with a deterministic name, `claim_name(tenant, thread, policy
fingerprint)`: two agent processes serving the same thread create-or-adopt the same claim
(the name is the lock: the API server, or the file system for the local backend, lets one
create win) and derive the same session token from the tenant's `session_key`, so both reach
the same worker. A process holds at most `max_claims` claims; a claim that is not ready in
`claim_timeout` is a `ClaimCapacityError` naming the pool. Nothing here ever falls back to
a local worker.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from agent_sandbox._errors import SandboxError
from agent_sandbox._host.remote.claims import (
    Claim,
    ClaimBackend,
    ClaimCapacityError,
    claim_name,
)
from agent_sandbox.providers._base import Answer, LaunchPlan, ProbeResult, Provider
from agent_sandbox.providers._netcheck import by_the_pods_provider, standard_answers

if TYPE_CHECKING:
    from agent_sandbox._host.intake.remote_transport import RemoteTLS
    from agent_sandbox._host.remote.worker import RemoteWorker
    from agent_sandbox._host.result import RunResult
    from agent_sandbox.policies import Policy

__all__ = [
    "RemoteBoundary",
    "RemoteProvider",
    "RemoteSession",
    "router_timeout",
]


class RemoteBoundary(Provider):
    """`provider = "remote"` as the host's provider registry sees it: it starts nothing here
    (no launch plan), its workers run under the pod's own provider, which each result names
    (`RunResult.stack`). A kernel boundary by construction: the host refuses a pod that
    reports none unless the policy accepts that (`no_kernel_boundary = "accepted"`)."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(
        by_the_pods_provider, by_the_pods_provider
    )

    name = "remote"
    strength = 0
    is_boundary = True

    def probe(self) -> ProbeResult:
        import importlib.util

        if importlib.util.find_spec("httpx") is None:
            from agent_sandbox._errors import DIST_NAME, install_hint

            return ProbeResult(
                self.name,
                False,
                f"the remote transport needs httpx, which {DIST_NAME} installs as an extra: "
                f"{install_hint('remote')}",
            )
        return ProbeResult(self.name, True)

    def build(self, policy: Any, spec: Any) -> LaunchPlan:
        raise SandboxError("the remote provider starts no local worker (it claims remote ones)")


#: What a router's timeout must leave beyond the policy's wall time: the pod's own grace
#: (`remote_serve._WALL_GRACE`, 2 s) and its keep-alive period (15 s: a silent cell's
#: response head comes that late), with margin.
ROUTER_MARGIN = 30.0


def router_timeout(policy: Policy) -> float:
    """`X-Sandbox-Timeout` for a call under `policy`: its wall time plus `ROUTER_MARGIN`.
    The Python router reads it per read (capped at its `PROXY_TIMEOUT_SECONDS`, 180 s by
    default), so the pod's keep-alives keep longer calls open; the Go router ignores it and
    bounds a whole call by its `--proxy-timeout` (docs/scale-out.md)."""
    return float(math.ceil(policy.limits.wall_seconds + ROUTER_MARGIN))


class RemoteSession:
    """One thread's session on a remote worker: `run()` / `arun()` like a local session."""

    def __init__(self, provider: RemoteProvider, policy: Policy, thread: str) -> None:
        self.provider = provider
        self.policy = policy
        self.thread = thread
        self.name = claim_name(provider.tenant, thread, policy.fingerprint())
        self.claim: Claim | None = None
        self.worker: RemoteWorker | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._pending_interrupt: Any = None  # an interrupt sent for a cancelled `arun`

    def _connect(self) -> RemoteWorker:
        from agent_sandbox._errors import WorkerStartError
        from agent_sandbox._host.remote.worker import RemoteWorker, SessionConflict, session_token

        p = self.provider
        claim = p.backend.claim(self.name, p.claim_timeout)
        self.claim = claim
        headers = dict(claim.headers)
        if "X-Sandbox-ID" in headers:
            # Through a router: its per-request timeout, from the policy's wall time.
            headers["X-Sandbox-Timeout"] = f"{router_timeout(self.policy):g}"
        try:
            worker = RemoteWorker.connect(
                self.policy,
                claim.url,
                token=session_token(p.session_key, self.name),
                bind_secret=p.bind_secret,
                tls=p.tls,
                headers=headers,
                start_timeout=p.start_timeout,
            )
        except SessionConflict:
            self.claim = None  # someone else's live session: never deleted from here
            raise
        except WorkerStartError:
            p.backend.release(claim)
            self.claim = None
            raise
        self.worker = worker
        return worker

    def run(self, code: str, **kwargs: Any) -> RunResult:
        with self._lock:
            if self._closed:
                from agent_sandbox._errors import SandboxClosed

                raise SandboxClosed("this remote session is closed")
            worker = self.worker
            notice = ""
            if worker is None or not worker.alive():
                if worker is not None:
                    notice = (
                        f"the previous remote interpreter of this session ended "
                        f"({worker.death_reason or 'it ended'}); its variables and imports "
                        "were lost, so define them again"
                    )
                self._drop()
                worker = self._connect()
            result = worker.run(code, session=self.thread, **kwargs)
            if notice:
                result = dataclasses.replace(
                    result, notices=(notice, *result.notices), state_lost=True
                )
            return result

    def interrupt(self, grace: float | None = None) -> bool:
        """Interrupt the running call (KeyboardInterrupt in the cell; variables kept). False
        when no call runs."""
        worker = self.worker
        if worker is None or not self._lock.locked():
            return False
        return worker.interrupt(grace)

    async def arun(self, code: str, **kwargs: Any) -> RunResult:
        """On a live worker, the call in the caller's event loop (`RemoteWorker.arun`);
        otherwise (the first call binds a worker, a busy lock, a proxy) `run()` in a thread.
        A cancelled await interrupts the cell (variables kept)."""
        import asyncio

        worker = self.worker
        native = (
            worker is not None
            and worker.alive()
            and worker.remote_client is not None
            and worker.remote_client.native_async()
        )
        if native and worker is not None and self._lock.acquire(blocking=False):
            if self._closed or not worker.alive():
                self._lock.release()
            else:
                released = False

                def release(_: object = None) -> None:
                    nonlocal released
                    if not released:
                        released = True
                        self._lock.release()

                task = asyncio.ensure_future(worker.arun(code, session=self.thread, **kwargs))
                task.add_done_callback(release)
                try:
                    return await asyncio.shield(task)
                except asyncio.CancelledError:
                    # The cell is interrupted (the pod's SIGINT); its stream drains in the
                    # loop. The session is free at once: a call before that drain ends is
                    # answered `remote.busy`, as when a thread ran the cancelled call.
                    self._pending_interrupt = asyncio.get_running_loop().run_in_executor(
                        None, worker.interrupt
                    )
                    release()
                    raise
        call = asyncio.ensure_future(asyncio.to_thread(self.run, code, **kwargs))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self.interrupt()
            raise

    def _drop(self) -> None:
        """Leave the claim: delete it when this session bound its worker, or when the worker
        is dead (a dead claim must go before the same name can be claimed again); a live
        worker another process bound (adopted here) stays for that process."""
        worker, claim = self.worker, self.claim
        adopted_alive = worker is not None and worker.adopted and worker.alive()
        if worker is not None:
            if adopted_alive:
                worker.detach()
            else:
                worker.close()
            self.worker = None
        if claim is not None:
            if not adopted_alive:
                self.provider.backend.release(claim)
            self.claim = None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._drop()
            finally:
                self.provider._slots.release()

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteProvider:
    """Sessions on remote workers from `backend`.

    `session_key` (bytes, shared by the tenant's agent processes, never given to workers)
    derives each session's token; `bind_secret` is the template-wide secret the workers
    check on bind. `max_claims` bounds the sessions one process holds at once.
    """

    name = "remote"

    def __init__(
        self,
        backend: ClaimBackend,
        *,
        session_key: bytes,
        bind_secret: str,
        tls: RemoteTLS | None = None,
        tenant: str = "default",
        max_claims: int = 16,
        claim_timeout: float = 30.0,
        start_timeout: float = 15.0,
    ) -> None:
        from agent_sandbox._host.intake.remote_transport import RemoteTLS

        if len(session_key) < 16:
            raise ValueError("session_key must be at least 16 random bytes")
        self.backend = backend
        self.session_key = bytes(session_key)
        self.bind_secret = bind_secret
        self.tls = tls or RemoteTLS()
        self.tenant = tenant
        self.max_claims = max(1, max_claims)
        self.claim_timeout = claim_timeout
        self.start_timeout = start_timeout
        self._slots = threading.BoundedSemaphore(self.max_claims)

    def session(self, policy: Policy, *, thread: str) -> RemoteSession:
        """The session of conversation `thread` under `policy` (claimed on its first call)."""
        if not self._slots.acquire(timeout=self.claim_timeout):
            raise ClaimCapacityError(
                self.backend.pool,
                self.claim_timeout,
                f"this process already holds max_claims = {self.max_claims} sessions",
            )
        return RemoteSession(self, policy, thread)
