"""`Sandbox(policy)` with `provider = "remote"`: each session's worker is a claimed remote one.

`RemotePool` stands where a local `WorkerPool` stands in a `Sandbox`: `acquire(key)` claims
the worker of session `key` (a conversation thread) from the claim backend the policy's
`[remote]` table names, binds it (or adopts it, when another agent process of the same thread
bound it first) and hands back a `RemoteWorker`, whose calls go through the host's usual judge.
The claim's name is `claim_name(tenant, key, policy fingerprint)`, so the same thread under the
same policy reaches the same worker from every agent process of the tenant. A stateless call
(`Sandbox.run`) claims a worker under a one-off name and ends it after the call.

Nothing here falls back to a local worker: a claim not ready in time is a `ClaimCapacityError`
naming the pool, a refused bind is a `WorkerStartError`.

One `RemoteProvider` (and one claim backend) serves every sandbox of the process whose
`[remote]` table is the same: the per-process claim bound (`max_claims`) is the process's,
and a local backend's warm servers are shared. It ends when the last such sandbox closes.

Secrets never come from the policy: the session key, the bind secret and the router's token
are read from the files the table names, or else from `AGENT_SANDBOX_SESSION_KEY`,
`AGENT_SANDBOX_BIND_SECRET` and `AGENT_SANDBOX_ROUTER_TOKEN`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import threading
from typing import Any

from agent_sandbox._errors import PolicyError, SandboxError
from agent_sandbox._host.intake.remote_transport import RemoteTLS
from agent_sandbox._host.remote.claims import Claim, ClaimBackend, ClaimCapacityError, claim_name
from agent_sandbox._host.remote.local_claims import LocalClaimBackend, ServerFiles
from agent_sandbox._host.remote.provider import RemoteProvider
from agent_sandbox._host.remote.worker import (
    RemoteCall,
    RemoteWorker,
    SessionConflict,
    session_token,
)
from agent_sandbox.policies import Policy, RemotePolicy

__all__ = ["RemotePool", "claim_worker", "provider_for"]

_logger = logging.getLogger("agent_sandbox")

SESSION_KEY_ENV = "AGENT_SANDBOX_SESSION_KEY"
BIND_SECRET_ENV = "AGENT_SANDBOX_BIND_SECRET"
ROUTER_TOKEN_ENV = "AGENT_SANDBOX_ROUTER_TOKEN"


class ClaimedCall(RemoteCall):
    """A call on a claimed worker: as a remote one's, but a server the claim backend sees
    stopped (`ClaimedWorker.stopped`) is named as such."""

    def _on_stopped(self) -> None:
        """Its server was stopped by a signal: named as such, not as the code's timeout."""
        from agent_sandbox._host.result import RunError

        worker = self.worker
        worker.death_reason = "its server was stopped by a signal (SIGSTOP or SIGTSTP)"
        worker.dead = True
        self.builder.error = RunError(
            kind="crashed",
            type="WorkerStopped",
            message="the remote sandbox worker's server was stopped by a signal (SIGSTOP or "
            "SIGTSTP) and could not finish the call; it was ended, the session's variables "
            "are lost and the next call starts a fresh worker",
            rule="worker.crashed",
        )


class ClaimedWorker(RemoteWorker):
    """A remote worker that holds a claim and one of its provider's claim slots; discarding
    it gives both back (the claim is deleted unless another process bound its worker and
    that worker still runs: then this host only leaves)."""

    call_class = ClaimedCall

    def __init__(self) -> None:
        super().__init__()
        self.provider: RemoteProvider | None = None
        self.claim: Claim | None = None
        self._left = False
        self._leave_lock = threading.Lock()

    def end_cause(self) -> str:
        return self.death_reason or "its remote session ended"

    def stopped(self) -> bool:
        """Whether its server is stopped by a signal, where the claim backend can tell (a
        local `worker serve` process; a pod's cannot be seen from here)."""
        provider, claim = self.provider, self.claim
        check = getattr(provider.backend, "stopped", None) if provider is not None else None
        return bool(claim is not None and check is not None and check(claim))

    def discard(self) -> None:
        if self._busy:
            return  # a refused (busy) call leaves the session as it was
        self._leave()

    def close(self) -> None:
        self._leave()

    def _leave(self) -> None:
        with self._leave_lock:
            if self._left:
                return
            self._left = True
        adopted_alive = self.adopted and not self.dead
        try:
            if adopted_alive:
                self.detach()
            else:
                RemoteWorker.discard(self)
        finally:
            provider, claim = self.provider, self.claim
            self.claim = None
            if provider is not None:
                try:
                    if claim is not None and not adopted_alive:
                        provider.backend.release(claim)
                except Exception as exc:  # the claim's own expiry reaps what is left
                    _logger.warning("could not release a remote claim: %s", exc)
                finally:
                    provider._slots.release()


def claim_worker(provider: RemoteProvider, policy: Policy, thread: str) -> ClaimedWorker:
    """The worker of `thread` under `policy`: claimed (created or adopted), bound, handshaken."""
    if not provider._slots.acquire(timeout=provider.claim_timeout):
        raise ClaimCapacityError(
            provider.backend.pool,
            provider.claim_timeout,
            f"this process already holds max_claims = {provider.max_claims} remote sessions",
        )
    try:
        name = claim_name(provider.tenant, thread, policy.fingerprint())
        claim = provider.backend.claim(name, provider.claim_timeout)
        try:
            worker = ClaimedWorker.connect(
                policy,
                claim.url,
                token=session_token(provider.session_key, name),
                bind_secret=provider.bind_secret,
                tls=provider.tls,
                headers=claim.headers,
                start_timeout=provider.start_timeout,
            )
        except SessionConflict:
            raise  # someone else's live session: never deleted from here
        except BaseException:
            provider.backend.release(claim)
            raise
    except BaseException:
        provider._slots.release()
        raise
    assert isinstance(worker, ClaimedWorker)
    worker.provider = provider
    worker.claim = claim
    return worker


class RemotePool:
    """A `Sandbox`'s source of workers when its policy says `provider = "remote"`."""

    def __init__(self, policy: Policy, provider: RemoteProvider, key: str) -> None:
        self.policy = policy
        self.provider = provider
        self._key = key
        self._closed = False

    def acquire(self, key: str | None = None, scope: str = "") -> ClaimedWorker:
        """Session `key`'s worker, or (no key) a worker for one stateless call. `scope` (a
        tool's name) keeps the same key of two tools apart, as their local sessions are."""
        if self._closed:
            raise SandboxError("the sandbox's remote pool is closed")
        if key is None:
            thread = "call:" + secrets.token_hex(12)
        else:
            thread = json.dumps([scope, key]) if scope else key
        return claim_worker(self.provider, self.policy, thread)

    def ready_count(self) -> int:
        return 0  # every acquire claims over the network: never without blocking

    def fill(self) -> None:
        """Start a local backend's warm servers now (a cluster's warm pool is its own)."""
        fill = getattr(self.provider.backend, "fill", None)
        if fill is not None:
            fill()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _REGISTRY.release(self._key)


# -- one provider per [remote] table --------------------------------------------------------


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[RemoteProvider, int]] = {}
        self._atexit = False

    def get(self, remote: RemotePolicy, source: str | None) -> tuple[RemoteProvider, str]:
        key = json.dumps(remote.model_dump(mode="json"), sort_keys=True) + f"\0{os.getpid()}"
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries[key] = (entry[0], entry[1] + 1)
                return entry[0], key
            provider = build_provider(remote, source)
            self._entries[key] = (provider, 1)
            if not self._atexit:
                atexit.register(self.close_all)
                self._atexit = True
            return provider, key

    def release(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            if entry[1] > 1:
                self._entries[key] = (entry[0], entry[1] - 1)
                return
            del self._entries[key]
        entry[0].backend.close()

    def close_all(self) -> None:
        with self._lock:
            providers = [p for p, _ in self._entries.values()]
            self._entries.clear()
        for provider in providers:
            with contextlib.suppress(Exception):
                provider.backend.close()


_REGISTRY = _Registry()


def provider_for(policy: Policy) -> RemotePool:
    """The pool of a `provider = "remote"` policy (its provider shared per `[remote]` table)."""
    if policy.remote is None:
        raise PolicyError(
            'provider = "remote" needs a [remote] table', source=policy.source, key="remote"
        )
    provider, key = _REGISTRY.get(policy.remote, policy.source)
    return RemotePool(policy, provider, key)


def _secret(path: str, env: str, what: str, key: str, source: str | None) -> bytes:
    if path:
        try:
            with open(os.path.expanduser(path), "rb") as fh:
                value = fh.read(65536).strip()
        except OSError as exc:
            raise PolicyError(
                f"cannot read the {what} from {path!r}: {exc.strerror or exc}",
                source=source,
                key=f"remote.{key}",
            ) from None
    else:
        value = os.environ.get(env, "").strip().encode()
    if not value:
        raise PolicyError(
            f"no {what}: name its file in remote.{key}, or set {env}",
            source=source,
            key=f"remote.{key}",
        )
    return value


def build_provider(remote: RemotePolicy, source: str | None = None) -> RemoteProvider:
    """A `RemoteProvider` (and its claim backend) from a policy's `[remote]` table."""
    session_key = _secret(
        remote.session_key_file, SESSION_KEY_ENV, "session key", "session_key_file", source
    )
    if len(session_key) < 16:
        raise PolicyError(
            "the session key is shorter than 16 bytes; make one with "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`",
            source=source,
            key="remote.session_key_file",
        )
    bind_secret = _secret(
        remote.bind_secret_file, BIND_SECRET_ENV, "bind secret", "bind_secret_file", source
    ).decode("utf-8", "replace")
    tls = RemoteTLS(
        ca_file=remote.ca_file or None,
        client_cert=remote.client_cert or None,
        client_key=remote.client_key or None,
        proxy=remote.proxy or None,
        plaintext=remote.plaintext,
        server_name=remote.server_name or None,
    )
    backend: ClaimBackend
    if remote.backend == "local":
        backend = LocalClaimBackend(
            ServerFiles(
                remote.server_cert,
                remote.server_key or remote.server_cert,
                remote.client_ca or None,
            ),
            bind_secret=bind_secret,
            pool=remote.pool or "local",
            warm=remote.warm,
            max_workers=remote.max_workers,
            provider=remote.worker_provider,
            state_dir=remote.state_dir or None,
        )
    else:
        backend = _k8s_backend(remote, source)
    return RemoteProvider(
        backend,
        session_key=session_key,
        bind_secret=bind_secret,
        tls=tls,
        tenant=remote.tenant,
        max_claims=remote.max_claims,
        claim_timeout=remote.claim_timeout,
        start_timeout=remote.start_timeout,
    )


def _k8s_backend(remote: RemotePolicy, source: str | None) -> Any:
    from agent_sandbox._host.remote.k8s import K8sClaimBackend

    token: str | None = None
    if remote.router_token_file or os.environ.get(ROUTER_TOKEN_ENV):
        token = _secret(
            remote.router_token_file, ROUTER_TOKEN_ENV, "router token", "router_token_file", source
        ).decode("utf-8", "replace")
    return K8sClaimBackend(
        remote.pool,
        namespace=remote.namespace,
        router_url=remote.router_url or None,
        router_token=token,
        shutdown_after_seconds=remote.shutdown_after_seconds or None,
    )
