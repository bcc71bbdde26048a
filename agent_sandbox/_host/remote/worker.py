"""A remote worker seen from the host: bound over TLS, called through the same judge.

`RemoteWorker` is a `WorkerProcess` whose channel is `RemoteWorkerClient` (httpx, TLS) and
whose process is somewhere else (a pod started by `agent-sandbox worker serve`). The call
logic is the local one, unchanged: every event goes through `ResultBuilder`
(`agent_sandbox._host.intake.events`) with the host's bounds, and a worker that breaks the protocol,
sends too much or passes its deadline is dropped exactly as a local one is.

What the host cannot do remotely, and so does not claim: signal the worker itself (an
interrupt is a request to the pod, which signals it; the pod enforces the wall time itself
and the host ends the session), read its guard
counter (`_host.intake.guard_block`), or put it in cgroups (the pod's resources are its limits). The
boundary it reports (`RunResult.stack`) is what the pod said at bind time, before any user
code ran there; a pod that reports no kernel boundary is refused unless the policy accepts
that in so many words (`no_kernel_boundary = "accepted"`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Mapping
from typing import Any

from agent_sandbox._errors import TransportError, WorkerStartError
from agent_sandbox._host.call import Call
from agent_sandbox._host.intake.events import HostBounds
from agent_sandbox._host.intake.remote_transport import (
    RemoteBusy,
    RemoteNotReady,
    RemoteTLS,
    RemoteWorkerClient,
)
from agent_sandbox._host.intake.unpickle import Decoder
from agent_sandbox._host.process import OnEvent, WorkerProcess
from agent_sandbox._host.result import NO_BOUNDARY, RunError, RunResult, boundary_name
from agent_sandbox._wire import HelloError
from agent_sandbox.policies import Policy
from agent_sandbox.providers import LaunchPlan

__all__ = ["RemoteWorker", "SessionConflict", "session_token"]

_logger = logging.getLogger("agent_sandbox")


class SessionConflict(WorkerStartError):
    """The claimed worker is bound to another session (its token is not this one's)."""


def session_token(key: bytes, claim_name: str) -> str:
    """The session token for a claim: HMAC(key, claim name). Every agent process holding the
    tenant's key derives the same token, so two processes serving one thread share its pod
    without the token ever being sent anywhere but in the token header."""
    message = b"agent-sandbox-session:" + claim_name.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class RemoteCall(Call):
    """One call on a remote worker: the local call, judged the same way, but the worker's
    call number is not checked against this host's count (another agent process serving
    the same thread makes calls on the same worker too), a busy pod leaves the session as
    it was, and a lost stream is told as the pod's."""

    worker: RemoteWorker

    def __init__(self, worker: WorkerProcess, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.builder.call = None

    async def arun_remote(
        self, client: RemoteWorkerClient, code: str, filename: str | None
    ) -> RunResult:
        """The call over the pod's own asyncio TLS connection (`RemoteWorker.arun`)."""
        worker = self.worker
        t0 = time.monotonic()
        forward = self._forwarder()
        worker._in_call = True
        try:
            await client.arun(code, t0 + self.wall, forward, filename)
        except (TimeoutError, TransportError) as exc:
            self._on_failure(exc)
        finally:
            worker._in_call = False
        return self._finish(t0)

    def _on_transport_error(self, exc: TransportError) -> None:
        if isinstance(exc, RemoteBusy):
            self.worker._busy = True
            self.builder.error = RunError(
                kind="limit",
                type="SessionBusy",
                message="this thread's remote worker is already running a call (one call at a "
                "time per session); wait for it to finish, then call again",
                rule="remote.busy",
            )
            return
        super()._on_transport_error(exc)

    def _on_lost(self) -> None:
        worker, builder = self.worker, self.builder
        tampered = [d for d in builder.denials if d.rule == "guard.tampered"]
        if tampered:
            # The pod read its worker's guard counter, found it tampered with and cut the
            # stream: as on a local host, the call's output is withheld and the worker gone.
            worker.death_reason = "its guards were switched off during a call"
            worker.kill()
            builder.withhold()
            builder.error = RunError(
                kind="denied",
                type="GuardTampered",
                message=tampered[-1].message(),
                rule="guard.tampered",
            )
            return
        worker.death_reason = "the connection to it was lost"
        worker.kill()
        builder.error = RunError(
            kind="crashed",
            type="WorkerCrashed",
            message="the remote sandbox worker's connection was lost during the call (the "
            "worker died, or its pod or the network went away); the session's variables "
            "are lost and the next call starts a fresh worker",
            rule="worker.crashed",
        )


class RemoteWorker(WorkerProcess):
    """A handshaken remote worker; use `connect()` to bind (or adopt) one."""

    call_class = RemoteCall

    def __init__(self) -> None:
        super().__init__()
        self.url = ""
        self.remote: dict[str, Any] = {}
        self.adopted = False
        self._busy = False
        self.remote_client: RemoteWorkerClient | None = None
        self._tasks: set[asyncio.Future[Any]] = set()  # calls draining after a cancel

    @classmethod
    def connect(
        cls,
        policy: Policy,
        url: str,
        *,
        token: str,
        bind_secret: str,
        tls: RemoteTLS | None = None,
        headers: Mapping[str, str] | None = None,
        start_timeout: float = 15.0,
    ) -> RemoteWorker:
        """Bind the worker at `url` to this session (or adopt it when another process of
        the same thread bound it with the same token), then handshake."""
        self = cls()
        self.policy = policy
        self.decoder = Decoder.from_policy(policy)
        self.url = url
        self.token = token
        self.bounds = HostBounds.from_policy(policy)
        t0 = time.monotonic()
        client = RemoteWorkerClient(
            url,
            token,
            self.bounds.max_event_bytes(),
            self.bounds.kind_caps(),
            tls=tls,
            headers=headers,
        )
        self.client = client  # type: ignore[assignment]
        self.remote_client = client
        payload = {
            "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
            # The [remote] table says where this host reaches workers: none of the pod's
            # business (and not part of the fingerprint the pod checks).
            "policy": policy.model_dump(mode="json", by_alias=True, exclude={"remote"}),
            "fingerprint": policy.fingerprint(),
        }
        try:
            status = client.bind(bind_secret, payload, start_timeout)
            if status == 409:
                self.adopted = True  # bound already: only the same session's token works
            elif status != 200:
                raise WorkerStartError(f"the remote worker refused the bind (HTTP {status})")
            try:
                while True:
                    remaining = max(0.05, start_timeout - (time.monotonic() - t0))
                    try:
                        self.hello, remote = client.hello(remaining)
                        break
                    except RemoteNotReady:
                        # Adopted while the other process's bind still starts the worker.
                        if time.monotonic() - t0 > start_timeout:
                            raise TimeoutError("the other process's bind did not end") from None
                        time.sleep(0.02)
            except TransportError as exc:
                if self.adopted:
                    raise SessionConflict(
                        "the remote worker is bound to another session (its token does not "
                        "match this one's)"
                    ) from None
                raise WorkerStartError(f"the remote worker's handshake failed: {exc}") from None
            self._verify_remote(remote)
        except HelloError as exc:
            client.close()
            self.dead = True
            raise WorkerStartError(f"the remote worker's handshake was refused: {exc}") from None
        except TimeoutError as exc:
            client.close()
            self.dead = True
            raise WorkerStartError(f"the remote worker did not answer in time ({exc})") from None
        except TransportError as exc:
            client.close()
            self.dead = True
            raise WorkerStartError(f"cannot reach the remote worker at {url}: {exc}") from None
        except BaseException:
            client.close()
            self.dead = True
            raise
        self.started_at = time.monotonic()
        return self

    def _verify_remote(self, remote: Any) -> None:
        assert self.policy is not None
        if not isinstance(remote, dict):
            raise WorkerStartError("the remote worker's handshake lacks its `remote` section")
        if remote.get("fingerprint") != self.policy.fingerprint():
            raise WorkerStartError(
                f"the remote worker runs policy {remote.get('fingerprint')!r}, not this "
                f"session's {self.policy.fingerprint()!r}"
            )
        stack = remote.get("stack")
        if not isinstance(stack, list) or not all(isinstance(s, str) for s in stack):
            raise WorkerStartError("the remote worker's handshake has no valid `stack`")
        if (
            boundary_name(tuple(stack)) == NO_BOUNDARY
            and self.policy.no_kernel_boundary != "accepted"
        ):
            raise WorkerStartError(
                f"the remote worker runs with no kernel boundary ({'+'.join(stack)}), and "
                f"policy {self.policy.name!r} does not accept that: run the pod under a "
                "runtime that is a boundary (--runtime-boundary gvisor) or a kernel provider "
                '(--provider auto), or opt out with no_kernel_boundary = "accepted"'
            )
        self.remote = dict(remote)
        self.plan = LaunchPlan(
            provider="remote",
            argv=(),
            env={},
            pass_fds=(),
            cwd="",
            stack=tuple(str(s)[:40] for s in stack[:8]),
        )

    # -- what differs from a local process -------------------------------------------------

    def alive(self) -> bool:
        return not self.dead

    def wait_exit(self, timeout: float) -> int | None:
        return None

    def kill(self) -> None:
        """End the remote session: ask the pod to exit (it kills its worker), drop the channel."""
        with self._lock:
            if self.dead and self.client is None:
                return
            self.dead = True
            client, self.client = self.client, None
        if client is not None:
            client.shutdown(1.0)

    def discard(self) -> None:
        if self._busy:
            return  # a refused (busy) call leaves the session as it was
        if not self.dead:
            _logger.info("remote worker %s ended: %s", self.id, self.death_reason or "discarded")
        self.kill()

    def close(self) -> None:
        self.kill()

    def detach(self) -> None:
        """Drop this host's channel but leave the worker running (another process bound it)."""
        with self._lock:
            self.dead = True
            client, self.client = self.client, None
        if client is not None:
            client.close()

    def interrupt(self, grace: float | None = None) -> bool:
        """Ask the pod to interrupt the running cell (SIGINT there; replaced after `grace`)."""
        client = self.remote_client
        if self.dead or client is None:
            return False
        return client.interrupt(2.0 if grace is None else grace)

    def run(self, code: str, **kwargs: Any) -> RunResult:
        if self.client is None:
            raise WorkerStartError("the remote session is closed")
        self._busy = False
        try:
            return super().run(code, **kwargs)
        finally:
            self._busy = False

    async def arun(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: OnEvent | None = None,
        session: str | None = None,
        timeout_source: str | None = None,
        filename: str | None = None,
        host_call: Any = None,
    ) -> RunResult:
        """The call in the caller's event loop (its own asyncio TLS connection; no thread),
        judged as `run()` judges it. Cancelled, it asks the pod to interrupt the cell (the
        variables stay) and lets the call's stream drain in the loop, so the connection and
        the session stay usable. Through a proxy (httpx) the call runs in a thread. Host
        tools (`host_call`) are not served to a remote worker (`Session` refuses them)."""
        if host_call is not None:
            raise WorkerStartError("host tools need a local provider")
        kwargs: dict[str, Any] = {
            "timeout": timeout,
            "on_event": on_event,
            "session": session,
            "timeout_source": timeout_source,
            "filename": filename,
        }
        client = self.remote_client
        if self.client is None or client is None:
            raise WorkerStartError("the remote session is closed")
        if not client.native_async():
            return await asyncio.to_thread(self.run, code, **kwargs)
        call = asyncio.ensure_future(self._arun(client, code, **kwargs))
        self._tasks.add(call)
        call.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            stop = asyncio.get_running_loop().run_in_executor(None, self.interrupt)
            self._tasks.add(stop)
            stop.add_done_callback(self._tasks.discard)
            raise

    async def _arun(
        self,
        client: RemoteWorkerClient,
        code: str,
        *,
        timeout: float | None,
        on_event: OnEvent | None,
        session: str | None,
        timeout_source: str | None,
        filename: str | None,
    ) -> RunResult:
        call = RemoteCall(
            self,
            timeout=timeout,
            on_event=on_event,
            session=session,
            timeout_source=timeout_source,
        )
        self._busy = False
        try:
            return await call.arun_remote(client, code, filename)
        finally:
            self._busy = False
