"""The `remote` provider: a conversation thread's worker runs elsewhere, reached over TLS.

Not a kernel provider (it builds no launch plan): it claims a worker from a *claim backend*,
binds it to the session (`POST /v1/bind`) and calls it through `RemoteWorker`, whose
intake is the local one. Two backends:

* `LocalClaimBackend`: `agent-sandbox worker serve` processes on this machine, on loopback
  with TLS (tests, benchmarks, a single host).
* `K8sClaimBackend` (`agent_sandbox/_host/remote/k8s.py`): SandboxClaims of kubernetes-sigs/
  agent-sandbox through its Python SDK (the `k8s` extra).

A thread maps to one claim with a deterministic name, `claim_name(tenant, thread, policy
fingerprint)`: two agent processes serving the same thread create-or-adopt the same claim
(the name is the lock: the API server, or the file system for the local backend, lets one
create win) and derive the same session token from the tenant's `session_key`, so both reach
the same worker. A process holds at most `max_claims` claims; a claim that is not ready in
`claim_timeout` is a `ClaimCapacityError` naming the pool. Nothing here ever falls back to
a local worker.

This module is longer than 600 lines because it came whole from `providers/_remote.py`
(files move apart from behaviour changes); the claim backend is to be cut from the provider.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from agent_sandbox._errors import CapacityError, SandboxError
from agent_sandbox.providers._base import Answer, LaunchPlan, ProbeResult, Provider
from agent_sandbox.providers._netcheck import by_the_pods_provider, standard_answers

if TYPE_CHECKING:
    from agent_sandbox._host.intake.remote_transport import RemoteTLS
    from agent_sandbox._host.remote.worker import RemoteWorker
    from agent_sandbox._host.result import RunResult
    from agent_sandbox.policies import Policy

__all__ = [
    "Claim",
    "ClaimBackend",
    "ClaimCapacityError",
    "ClaimError",
    "LocalClaimBackend",
    "RemoteBoundary",
    "RemoteProvider",
    "RemoteSession",
    "ServerFiles",
    "claim_name",
]


class ClaimCapacityError(CapacityError):
    """No worker could be claimed in time from a pool (or the process's claim bound is full)."""

    def __init__(self, pool: str, waited: float, reason: str) -> None:
        self.pool = pool
        self.waited = waited
        self.reason = reason
        SandboxError.__init__(
            self,
            f"no remote worker from pool {pool!r} within {waited:g} s: {reason}; add ready "
            "workers to the pool (SandboxWarmPool replicas), raise claim_timeout, or close "
            "sessions that are done",
        )


class ClaimError(SandboxError):
    """A claim the cluster refused or gave up on (not capacity): `reason` names the case
    (Forbidden, Invalid, Terminating, ClaimFailed, WarmPoolNotFound, ...), `status` the API
    server's HTTP status when there was one; the SDK's or the API's error is the cause."""

    def __init__(self, message: str, *, reason: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


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


def claim_name(tenant: str, thread: str, fingerprint: str) -> str:
    """`ags-` + 20 base32 characters of SHA-256(tenant, thread, policy fingerprint): a valid
    DNS-1123 label, the same in every process, different for every (tenant, thread, policy)."""
    digest = hashlib.sha256("\0".join((tenant, thread, fingerprint)).encode()).digest()
    return "ags-" + base64.b32encode(digest).decode().lower().rstrip("=")[:20]


@dataclasses.dataclass(frozen=True)
class Claim:
    """A claimed worker: where to reach it, and whether this process created the claim."""

    name: str
    pool: str
    url: str
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    created: bool = True
    #: The claim's UID where the backend has one (k8s): its delete is made on it.
    uid: str | None = None


class ClaimBackend(Protocol):
    """Where remote workers come from. `claim` creates the named claim or adopts it when it
    exists, and waits until its worker is ready (else `ClaimCapacityError`); `release`
    deletes a claim this process created; `close` ends everything the backend started."""

    pool: str

    def claim(self, name: str, timeout: float) -> Claim: ...

    def release(self, claim: Claim) -> None: ...

    def close(self) -> None: ...


# -- the local backend -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerFiles:
    """The TLS files of local `worker serve` processes (`client_ca` set: mTLS required)."""

    cert: str
    key: str
    client_ca: str | None = None


@dataclasses.dataclass
class _Server:
    proc: subprocess.Popen[bytes]
    url: str


class LocalClaimBackend:
    """`worker serve` processes on loopback with TLS; claims are files in `state_dir`.

    `warm` servers are kept started and unbound (the warm pool); a claim takes one (or starts
    one, up to `max_workers`), and records `state_dir/<name>.json` with a create-if-absent
    link, so processes sharing `state_dir` agree on one worker per claim name. A claim's
    worker lives as long as the process that created it (`--exit-with-parent`).
    """

    def __init__(
        self,
        files: ServerFiles,
        *,
        bind_secret: str,
        pool: str = "local",
        warm: int = 1,
        max_workers: int = 8,
        provider: str = "auto",
        runtime_boundary: str = "",
        state_dir: str | None = None,
        idle_exit: float = 900.0,
        keepalive: float = 15.0,
        start_timeout: float = 15.0,
        python: str | None = None,
        bind_secret_file: str | None = None,
    ) -> None:
        self.files = files
        #: The servers read the bind secret from this file (as a pod does from its secret
        #: volume) instead of their environment.
        self.bind_secret_file = bind_secret_file
        self.pool = pool
        self.warm = max(0, warm)
        self.max_workers = max(1, max_workers)
        self.provider = provider
        self.runtime_boundary = runtime_boundary
        self.idle_exit = idle_exit
        self.keepalive = keepalive
        self.start_timeout = start_timeout
        self.python = python or sys.executable
        self._secret = bind_secret
        self._private_state = state_dir is None
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="agent-sandbox-claims-")
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        st = os.stat(self.state_dir)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            # Anyone else who can write there could plant a claim naming their own worker.
            raise ValueError(
                f"the claim state directory {self.state_dir!r} is not this user's alone "
                f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): use a directory "
                "owned by this user and writable by no one else (mode 700)"
            )
        self._lock = threading.Condition()
        self._ready: deque[_Server] = deque()
        self._claimed: dict[str, _Server] = {}
        self._starting = 0
        self._closed = False
        self._refill: threading.Thread | None = None
        self.started = 0

    # -- servers ---------------------------------------------------------------------------

    def _argv(self) -> list[str]:
        argv = [
            self.python,
            "-m",
            "agent_sandbox",
            "worker",
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--tls-cert",
            self.files.cert,
            "--tls-key",
            self.files.key,
            "--provider",
            self.provider,
            "--idle-exit",
            str(self.idle_exit),
            "--keepalive",
            str(self.keepalive),
            "--exit-with-parent",
        ]
        if self.files.client_ca:
            argv += ["--client-ca", self.files.client_ca]
        if self.runtime_boundary:
            argv += ["--runtime-boundary", self.runtime_boundary]
        if self.bind_secret_file:
            argv += ["--bind-secret-file", self.bind_secret_file]
        return argv

    def _start_server(self) -> _Server:
        from agent_sandbox._host import lifecycle

        env = {**os.environ, **lifecycle.owner_env()}
        if not self.bind_secret_file:
            env["AGENT_SANDBOX_BIND_SECRET"] = self._secret
        proc = subprocess.Popen(
            self._argv(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, remaining))
            chunk = os.read(proc.stdout.fileno(), 256) if ready else b""
            if not chunk:
                _stop_server(proc)
                raise SandboxError(
                    f"a local `worker serve` did not start within {self.start_timeout:g} s "
                    f"(exit status {proc.poll()}); run `agent-sandbox worker serve` by hand "
                    "to see why"
                )
            line += chunk
        text = line.decode(errors="replace").strip()
        if not text.startswith("listening on tcp://"):
            _stop_server(proc)
            raise SandboxError(f"unexpected first line from `worker serve`: {text[:200]!r}")
        hostport = text[len("listening on tcp://") :]
        self.started += 1
        return _Server(proc, "https://" + hostport)

    def fill(self) -> None:
        """Start servers until `warm` are ready (blocking)."""
        while True:
            with self._lock:
                if self._closed or len(self._ready) + self._starting >= self.warm:
                    return
                if len(self._ready) + len(self._claimed) + self._starting >= self.max_workers:
                    return
                self._starting += 1
            try:
                server = self._start_server()
            finally:
                with self._lock:
                    self._starting -= 1
            with self._lock:
                if self._closed:
                    _stop_server(server.proc)
                    return
                self._ready.append(server)
                self._lock.notify_all()

    def _schedule_refill(self) -> None:
        with self._lock:
            if self._closed or (self._refill is not None and self._refill.is_alive()):
                return
            self._refill = threading.Thread(target=self._refill_quietly, daemon=True)
            self._refill.start()

    def _refill_quietly(self) -> None:
        with contextlib.suppress(SandboxError, OSError):
            self.fill()

    def _take(self, deadline: float, timeout: float) -> _Server:
        """A warm server, or a new one when under `max_workers`, or wait for one."""
        while True:
            with self._lock:
                if self._closed:
                    raise SandboxError("the claim backend is closed")
                while self._ready:
                    server = self._ready.popleft()
                    if server.proc.poll() is None:
                        return server
                total = len(self._ready) + len(self._claimed) + self._starting
                can_start = total < self.max_workers
                if can_start:
                    self._starting += 1
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ClaimCapacityError(
                            self.pool,
                            timeout,
                            f"all {self.max_workers} local workers are claimed",
                        )
                    self._lock.wait(min(remaining, 0.1))
                    continue
            try:
                return self._start_server()
            finally:
                with self._lock:
                    self._starting -= 1

    # -- claims ----------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.state_dir, name + ".json")

    def _read_claim(self, name: str) -> Claim | None:
        """The claim recorded for `name`, None when there is none (or it is malformed);
        ClaimError for anything there that is not a claim file of this user's (a link, a
        FIFO, another user's file): never followed, never read."""
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ClaimError(
                f"the claim file {path!r} is not a file of this process's user ({exc}): "
                "it was not followed; remove it",
                reason="ClaimFileRefused",
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ClaimError(
                    f"the claim file {path!r} is not a regular file of this process's user: "
                    "it was not read; remove it",
                    reason="ClaimFileRefused",
                )
            with os.fdopen(fd, encoding="utf-8", closefd=False) as fh:
                data = json.loads(fh.read(1 << 16))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if not isinstance(data, dict):
            return None
        owner = int(data.get("owner", 0))
        if owner != os.getpid() and not _pid_alive(owner):
            # Its creator is gone, and its worker with it (exit-with-parent): a stale claim.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(name))
            return None
        return Claim(name, self.pool, str(data["url"]), created=owner == os.getpid())

    def claim(self, name: str, timeout: float) -> Claim:
        deadline = time.monotonic() + timeout
        while True:
            existing = self._read_claim(name)
            if existing is not None:
                return dataclasses.replace(existing, created=False)
            server = self._take(deadline, timeout)
            # A fresh file of an unpredictable name (O_EXCL | O_NOFOLLOW, mode 0600): a link
            # planted at any name in the directory is never written through.
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.state_dir)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"url": server.url, "owner": os.getpid(), "pid": server.proc.pid}, fh)
            try:
                os.link(tmp, self._path(name))  # create-if-absent: one creator wins
            except OSError as exc:
                if exc.errno != errno.EEXIST:
                    raise
                with self._lock:
                    self._ready.appendleft(server)  # lost the race: adopt the winner's
                    self._lock.notify_all()
                continue
            finally:
                os.unlink(tmp)
            with self._lock:
                self._claimed[name] = server
            self._schedule_refill()
            return Claim(name, self.pool, server.url, created=True)

    def stopped(self, claim: Claim) -> bool:
        """Whether the local server of `claim` is stopped by a signal (SIGSTOP): it then
        answers nothing, and a call waiting on it is not the code's timeout."""
        with self._lock:
            server = self._claimed.get(claim.name)
        return server is not None and server.proc.poll() is None and _is_stopped(server.proc.pid)

    def release(self, claim: Claim) -> None:
        if not claim.created:
            return
        with self._lock:
            server = self._claimed.pop(claim.name, None)
            self._lock.notify_all()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(claim.name))
        if server is not None:
            _stop_server(server.proc)
        self._schedule_refill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            servers = list(self._ready) + list(self._claimed.values())
            names = list(self._claimed)
            self._ready.clear()
            self._claimed.clear()
            refill = self._refill
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(name))
        for server in servers:
            _stop_server(server.proc)
        if refill is not None and refill is not threading.current_thread():
            refill.join(self.start_timeout + 1.0)
        if self._private_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> LocalClaimBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T or t in /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :][:1] in (b"T", b"t")


def _stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server ends its worker), then SIGKILL its group; always reaped. A server
    stopped by a signal cannot act on SIGTERM: its group gets SIGKILL at once (the grace
    would only be waited out)."""
    if proc.poll() is None:
        stopped = _is_stopped(proc.pid)
        if not stopped:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            if stopped:
                raise subprocess.TimeoutExpired(proc.args, 0)
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5.0)
    if proc.stdout is not None:
        proc.stdout.close()


# -- the provider -------------------------------------------------------------------------


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
