"""The local claim backend: `agent-sandbox worker serve` processes on this machine, on
loopback with TLS (tests, benchmarks, a single host); claims are files in a state directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
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

from agent_sandbox._errors import SandboxError
from agent_sandbox._host.hostfile import HostFileRefused, read_regular
from agent_sandbox._host.remote.claims import Claim, ClaimCapacityError, ClaimError

__all__ = ["LocalClaimBackend", "ServerFiles"]


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
            data = json.loads(read_regular(path, 1 << 16, own=True))
        except FileNotFoundError:
            return None
        except HostFileRefused as exc:
            raise ClaimError(
                f"the claim file {path!r} is not a regular file of this process's user "
                f"({exc}): it was neither followed nor read; remove it",
                reason="ClaimFileRefused",
            ) from None
        except (OSError, ValueError):
            return None
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
