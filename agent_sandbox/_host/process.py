"""One worker process, seen from the parent: its start, handshake, signals and end.

`WorkerProcess` keeps the process: its start (control directory, launch, boot
configuration, handshake) is `agent_sandbox._host.startup`; each call on it is a
`agent_sandbox._host.call.Call`, which consults the host's evidence sources the start
registered (`agent_sandbox._host.evidence`); how a process ended is read by
`agent_sandbox._host.exit_status`. The inputs of a start are in `agent_sandbox._host.launch`,
the reading of what the worker sends in `agent_sandbox._host.intake`.

A call has a wall-clock deadline; on expiry the whole process group gets SIGTERM, then
SIGKILL. A worker that dies is reported with its exit status, never waited on forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, Protocol

from agent_sandbox._errors import TransportError, WorkerError, describe_exit
from agent_sandbox._host import lifecycle
from agent_sandbox._host.call import STOPPED_REASON, TEMPLATE_REASON, Call
from agent_sandbox._host.evidence import EvidenceSet, LimitEvidence
from agent_sandbox._host.exit_status import parse_stat
from agent_sandbox._host.guardian import remove_tree
from agent_sandbox._host.intake import guard_block
from agent_sandbox._host.intake.events import HostBounds
from agent_sandbox._host.intake.transport import HostCall, WorkerClient
from agent_sandbox._host.launch import LOG_BYTES
from agent_sandbox._host.limit_report import GuestLimits
from agent_sandbox._host.limits import WorkerCgroups, _descendants
from agent_sandbox._host.result import RunResult
from agent_sandbox._host.startup import start_worker
from agent_sandbox._wire import Hello, HelloError
from agent_sandbox.policies import Policy
from agent_sandbox.providers import LaunchPlan, Provider

if TYPE_CHECKING:
    from agent_sandbox._host.denial_log import Watch
    from agent_sandbox._host.egress.proxy import Route
    from agent_sandbox._host.intake.unpickle import Decoder
    from agent_sandbox._host.templates import WorkerTemplate

__all__ = ["WorkerProcess"]

OnEvent = Callable[[str, Any], None]


class ChildProcess(Protocol):
    """What the parent needs of a worker process: a `subprocess.Popen`, or a worker forked by
    a template (`_host.templates.TemplateChild`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


_TERM_GRACE = 0.5
_DISCARD_WAIT = 2.0
#: How long an interrupted cell has to stop before its worker is replaced.
_INTERRUPT_GRACE = 2.0
_logger = logging.getLogger("agent_sandbox")


class WorkerProcess:
    """A started, handshaken worker; use `start()` to make one."""

    #: What runs one call on it (a remote worker's differs: `_host/remote/worker.py`).
    call_class: type[Call] = Call

    def __init__(self) -> None:
        self.id = "w-" + secrets.token_hex(4)
        self.proc: ChildProcess | None = None
        self.control_dir = ""
        self.scratch = ""
        self.plan: LaunchPlan | None = None
        #: The worker's handshake, read by the host (`_host/intake/transport.decode_hello`).
        self.hello: Hello | None = None
        self.policy: Policy | None = None
        self.decoder: Decoder | None = None
        self.token = secrets.token_urlsafe(32)
        self.client: WorkerClient | None = None
        self.started_at = 0.0
        self.calls = 0
        self.dead = False
        self.death_reason = ""
        self._log: IO[bytes] | None = None
        self._reaped = False
        self._lock = threading.Lock()
        #: Called once when the worker is discarded (a pool starts its template once its
        #: first worker is handed back; see `_host/pool.py`).
        self.on_discard: Callable[[], object] | None = None
        #: Called once when the worker's next call ends, or at its discard if it makes none
        #: (a pool refills once the call of the worker it handed out is over).
        self.after_call: Callable[[], object] | None = None
        self.cgroups: WorkerCgroups | None = None
        self._in_call = False
        self._host_pid: int | None = None
        self._stat_fds: dict[int, int] = {}
        self._stat_lock = threading.Lock()
        #: A descriptor on the worker's scratch when it is a tmpfs counted in its memory
        #: cgroup (kept so its use can still be measured after an OOM kill), and that use
        #: as measured when the worker was ended.
        self._scratch_fd = -1
        self._scratch_used: int | None = None
        self._interrupt_expired: float | None = None
        #: The worker's route on the host's egress proxy (namespace providers with [net]).
        self.egress: Route | None = None
        #: The refusal token of its route (`_denial.new_token`): in its boot configuration
        #: only, never in the plan; "" without a route.
        self.egress_token = ""
        #: What a VM's guest reported of its limits (`LaunchPlan.limit_reports`).
        self.guest_limits: GuestLimits | None = None
        self._egress_channel: socket.socket | None = None
        #: The host's reader of the worker's Landlock denials in the kernel's audit log,
        #: where the kernel writes them (`_host/denial_log.py`).
        self.kernel_log: Watch | None = None
        #: The host's own reader of the worker's arming counter (`_host/intake/guard_block.py`).
        self.guard_watch: guard_block.GuardWatch | None = None
        self.bounds: HostBounds | None = None
        #: The host's sources of evidence about each call, as `agent_sandbox._host.call`
        #: consults them: the start registers each source it opens (`_host/startup.py`);
        #: the limit report is always there (it reads the worker's own limit errors too).
        self.evidence = EvidenceSet()
        self.evidence.register(LimitEvidence())
        #: The O_PATH descriptor of a socket the worker bound itself (`startup.pin_socket`).
        self._socket_pin: int | None = None
        #: The write end of the worker's life line (`WorkerSpec.life_fd`), closed once the
        #: worker is reaped; None when its provider does not use one.
        self._life: int | None = None

    # -- start ---------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        policy: Policy,
        provider: Provider,
        *,
        start_timeout: float = 15.0,
        template: WorkerTemplate | None = None,
    ) -> WorkerProcess:
        """Start a worker for `policy` under `provider` and wait for its handshake
        (`agent_sandbox._host.startup.start_worker`), inside the exit clean-up's bracket of
        starts.

        With a `template` (see `_host/templates.py`) the worker is forked from a pre-imported
        template instead of started from scratch; the plan, the boot configuration, the
        limits and every restriction are the same.
        """
        with lifecycle.starting():
            return start_worker(
                cls, policy, provider, start_timeout=start_timeout, template=template
            )

    def socket_address(self) -> str:
        """Where the worker's server listens, as the host connects to it: the socket in the
        control directory, or the pinned descriptor of one the worker bound itself."""
        if self.client is not None:
            return self.client.path
        return os.path.join(self.control_dir, "ctl.sock")

    # -- the process, and its calls -------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def alive(self) -> bool:
        """Running and able to answer: a worker stopped by a signal (SIGSTOP) is not."""
        if self.dead or self.proc is None or self.proc.poll() is not None:
            return False
        if self.stopped():
            self.death_reason = self.death_reason or STOPPED_REASON
            return False
        return True

    def stopped(self) -> bool:
        """Whether the worker (or its launcher) is stopped by a signal (state T or t)."""
        if self.proc is None:
            return False
        pids = [self.proc.pid]
        if self._host_pid is not None or self.hello is not None:
            inner = self.worker_pid()
            if inner is not None and inner != self.proc.pid:
                pids.append(inner)
        return any(self._stat(pid)[0] in ("T", "t") for pid in pids)

    def _stat(self, pid: int) -> tuple[str, int]:
        """`exit_status.proc_state` of one of this worker's processes through a descriptor
        opened once (a `pread` at offset 0 renders the file afresh): checked twice per call.
        The open descriptor stays with the process it was opened for, never a later holder of its
        number (reads fail once it is gone: ("", 0))."""
        with self._stat_lock:  # never a read of a descriptor closed meanwhile
            fd = self._stat_fds.get(pid)
            if fd is None:
                if self.dead:
                    return "", 0
                try:
                    fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    return "", 0
                self._stat_fds[pid] = fd
            try:
                return parse_stat(os.pread(fd, 4096, 0))
            except OSError:
                return "", 0

    def scratch_in_memory(self) -> int | None:
        """Bytes the worker's files hold in its tmpfs scratch (None: not a tmpfs in memory)."""
        if self._scratch_used is not None:
            return self._scratch_used
        if self._scratch_fd < 0:
            return None
        try:
            st = os.fstatvfs(self._scratch_fd)
        except OSError:
            return None
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _release_scratch(self) -> None:
        if self._scratch_fd >= 0:
            self._scratch_used = self.scratch_in_memory()
            with contextlib.suppress(OSError):
                os.close(self._scratch_fd)
            self._scratch_fd = -1

    def _close_stat_fds(self) -> None:
        with self._stat_lock:
            fds, self._stat_fds = self._stat_fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def end_cause(self) -> str:
        """Why a worker that is no longer alive ended, in words for the model."""
        if self.death_reason:
            return self.death_reason
        template = getattr(self.proc, "_template", None)
        if template is not None and not template.alive():
            return TEMPLATE_REASON
        status = self.proc.poll() if self.proc is not None else None
        return f"it ended ({describe_exit(self.worker_status(status))})"

    def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: OnEvent | None = None,
        session: str | None = None,
        timeout_source: str | None = None,
        filename: str | None = None,
        host_call: HostCall | None = None,
    ) -> RunResult:
        """Run one call (`agent_sandbox._host.call.Call`); never raises for the code's own
        failures (they are in the result).

        `timeout_source` says who set `timeout` (the tool's option, the CLI's flag), for the
        refusal's hint; `filename` is the name the code's frames carry (default `<cell-N>`).
        `host_call` answers the code's host-tool requests during this call (None refuses
        them; see `agent_sandbox._host.hosttools`).
        """
        call = self.call_class(
            self,
            timeout=timeout,
            on_event=on_event,
            session=session,
            timeout_source=timeout_source,
            host_call=host_call,
        )
        return call.run(code, filename)

    async def arun(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: OnEvent | None = None,
        session: str | None = None,
        timeout_source: str | None = None,
        filename: str | None = None,
        host_call: HostCall | None = None,
    ) -> RunResult:
        """The async twin of `run()` (an asyncio connection; no thread)."""
        call = self.call_class(
            self,
            timeout=timeout,
            on_event=on_event,
            session=session,
            timeout_source=timeout_source,
            host_call=host_call,
        )
        return await call.arun(code, filename)

    def file_request(self, payload: dict[str, Any], timeout: float) -> Any:
        """One request of the session files API (`_host/files.py`), between calls.

        On its own connection, whose reply bound fits one chunk of a download. A worker that
        does not answer within `timeout`, or breaks the protocol, is discarded (its scratch
        with it) and the error says so.
        """
        from agent_sandbox._host.files import CHUNK

        client = self.client
        if client is None or self.dead:
            raise WorkerError("the worker has ended")
        files_client = WorkerClient(client.path, self.token, CHUNK * 4 // 3 + 65536)
        try:
            return files_client.request_json("/files", payload, time.monotonic() + timeout)
        except TimeoutError:
            self.death_reason = f"it did not answer a files request within {timeout:g} s"
            self.discard()
            raise WorkerError(
                f"the worker did not answer the files request within {timeout:g} s; "
                "it was discarded"
            ) from None
        except TransportError as exc:
            self.death_reason = f"it broke the files protocol ({exc})"
            self.discard()
            raise WorkerError(
                f"the worker's files reply was refused ({exc}); it was discarded"
            ) from None
        finally:
            files_client.close()

    def _call_ended(self) -> None:
        hook, self.after_call = self.after_call, None
        if hook is not None:
            with contextlib.suppress(Exception):
                hook()

    # -- interrupts ----------------------------------------------------------------------

    def worker_pid(self) -> int | None:
        """The worker's pid on the host (below its launcher, in its pid namespace or not)."""
        if self._host_pid is not None or self.proc is None:
            return self._host_pid
        if self.plan is not None and self.plan.interrupt_launcher:
            self._host_pid = self.proc.pid  # it forwards the signal into the VM
            return self._host_pid
        inner = str(self.hello.pid) if self.hello is not None else ""
        for pid, _level in [(self.proc.pid, 0), *_descendants(self.proc.pid)]:
            try:
                with open(f"/proc/{pid}/status") as fh:
                    status = fh.read()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == inner:
                    self._host_pid = pid
                    return pid
        return None

    def interrupt(self, grace: float | None = None) -> bool:
        """Interrupt the running cell (SIGINT: KeyboardInterrupt in the code, as in Jupyter).

        The session's variables stay. If the cell has not stopped `grace` seconds later,
        the worker is replaced and the next result says so. False when nothing was sent.
        """
        grace = _INTERRUPT_GRACE if grace is None else grace
        if not self.alive():
            return False
        pid = self.worker_pid()
        if pid is None:
            return False
        attached = self._in_call
        seq = self.calls
        argv = self.plan.interrupt_argv if self.plan is not None else ()
        try:
            if argv:
                # The launcher's own command delivers it (gVisor: `runsc kill <id> INT`).
                sent = subprocess.run(
                    list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=5
                )
                if sent.returncode != 0:
                    return False
            else:
                os.kill(pid, signal.SIGINT)
        except (OSError, subprocess.TimeoutExpired):
            return False

        def expire() -> None:
            if not self.alive() or self.calls != seq:
                return
            stuck = self._in_call if attached else not self._responds(0.25)
            if stuck:
                self._interrupt_expired = grace
                self.death_reason = f"it did not stop within {grace:g} s of an interrupt"
                self.kill()

        timer = threading.Timer(grace, expire)
        timer.daemon = True
        timer.start()
        return True

    def _responds(self, timeout: float) -> bool:
        if self.client is None:
            return False
        probe = WorkerClient(self.client.path, self.token, self.client.max_event_bytes)
        try:
            probe.hello(timeout)
            return True
        except (TimeoutError, TransportError, OSError, HelloError):
            return False
        finally:
            probe.close()

    def worker_status(self, status: int | None) -> int | None:
        """The worker's own status: a launcher (bwrap, unshare) relays a worker killed by
        signal N as exit status 128 + N, read back here as -N."""
        if status is None or status <= 128 or self.plan is None or self.plan.worker_depth == 0:
            return status
        try:
            return -signal.Signals(status - 128)
        except ValueError:
            return status

    # -- end -----------------------------------------------------------------------------

    def wait_exit(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """TERM the whole process group, then KILL it; reap and remove the directories."""
        with self._lock:
            self.dead = True
            self.evidence.close()
            if self.client is not None:
                self.client.close()
            proc = self.proc
            if proc is not None and not self._reaped:
                # A stopped process cannot act on SIGTERM (it stays pending until SIGCONT):
                # the grace would only be waited out, past the call's limit. Straight to KILL.
                if not self.stopped():
                    _signal_group(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(_TERM_GRACE)
                    except subprocess.TimeoutExpired:
                        pass
                _signal_group(proc.pid, signal.SIGKILL)
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    pass
                self._reaped = True
            self._cleanup_dirs()

    def discard(self) -> None:
        """End the worker now: KILL its group and cgroups, reap it, remove its directories.

        Synchronous (a killed process is reaped within milliseconds); only a process that
        does not go within `_DISCARD_WAIT` is left to a background reaper, and the exit hook
        (`_host.lifecycle`) removes whatever that one has not.
        """
        hook, self.on_discard = self.on_discard, None
        if hook is not None:
            with contextlib.suppress(Exception):
                hook()
        self._call_ended()  # handed out and discarded without a call
        self.evidence.close()  # no connection of a discarded worker outlives this call
        if not self.dead:
            level = logging.INFO if self.death_reason else logging.DEBUG
            _logger.log(level, "worker %s ended: %s", self.id, self.death_reason or "discarded")
        with self._lock:
            self.dead = True
            if self.client is not None:
                self.client.close()
            proc = self.proc
            if proc is not None and not self._reaped:
                _signal_group(proc.pid, signal.SIGKILL)
                if self.cgroups is not None:
                    self.cgroups.kill()
                self._reaped = True
                try:
                    proc.wait(_DISCARD_WAIT)
                except subprocess.TimeoutExpired:
                    threading.Thread(target=self._reap, args=(proc,), daemon=True).start()
                    return
            self._cleanup_dirs()

    def _reap(self, proc: ChildProcess) -> None:
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            pass
        self._cleanup_dirs()

    def close(self) -> None:
        """Ask the worker to exit, then make sure it did."""
        if self.alive() and self.client is not None:
            self.client.shutdown(0.5)
        self.kill()

    def _cleanup_dirs(self) -> None:
        self._close_stat_fds()
        if self._life is not None:
            with contextlib.suppress(OSError):
                os.close(self._life)  # (the worker, if any of it is left, is SIGKILLed)
            self._life = None
        if self._socket_pin is not None:
            with contextlib.suppress(OSError):
                os.close(self._socket_pin)
            self._socket_pin = None
        self._release_scratch()
        if self._egress_channel is not None:
            self._egress_channel.close()
        self.evidence.close()
        if self.cgroups is not None:
            self.cgroups.kill()
            self.cgroups.remove()
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
        if self.plan is not None:
            for path in self.plan.cleanup_paths:
                remove_tree(path)
        if self.control_dir:
            remove_tree(self.control_dir)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the worker wrote to its descriptors 1 and 2 (see `bounded_log`)."""
        if self._log is None or self._log.closed:
            return ""
        try:
            fd = self._log.fileno()
            end = os.lseek(fd, 0, os.SEEK_CUR)  # the offset the worker shares with us
            data = os.pread(fd, min(end, 8192), max(0, end - 8192))
            if self.plan is not None and self.plan.socket_path:
                # gVisor's Sentry writes the worker's output at an offset of its own from
                # the log's start (the launcher's own lines at the shared one): the written
                # part is what precedes the zeros the log was created with.
                head = os.pread(fd, 65536, 0).rstrip(b"\0")
                if len(head) > end:
                    data = head[-8192:]
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])

    def rewind_log(self) -> None:
        """Between calls: once past half the log's size, write the next output from its
        start again, so the tail stays the latest output (the size stays `LOG_BYTES`)."""
        if self._log is None or self._log.closed:
            return
        with contextlib.suppress(OSError):
            fd = self._log.fileno()
            if os.lseek(fd, 0, os.SEEK_CUR) > LOG_BYTES // 2:
                os.lseek(fd, 0, os.SEEK_SET)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
