"""One worker process, seen from the parent: calls, interrupts, and a certain end.

Its start (control directory, launch, boot configuration, handshake) is
`agent_sandbox._host.startup`; the inputs of a start are in `agent_sandbox._host.launch`, and
the reading of what the worker sends is in `agent_sandbox._host.intake`.

A call has a wall-clock deadline; on expiry the whole process group gets SIGTERM, then
SIGKILL. A worker that dies is reported with its exit status, never waited on forever.

Why this module is longer than 600 lines: it is one class, `WorkerProcess`, whose calls,
interrupts and end share the same state (the process, its cgroups, its log, its guard watch,
its egress route); the call is cut out next (`agent_sandbox._host.call`).
"""

from __future__ import annotations

import contextlib
import json
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

from agent_sandbox._denial import Denial
from agent_sandbox._errors import (
    MessageTooLarge,
    TransportError,
    WorkerError,
    describe_exit,
)
from agent_sandbox._hints import limit_hint
from agent_sandbox._host import lifecycle
from agent_sandbox._host.guardian import remove_tree
from agent_sandbox._host.intake import guard_block
from agent_sandbox._host.intake.builder import Mark, ResultBuilder
from agent_sandbox._host.intake.events import HostBounds
from agent_sandbox._host.intake.transport import (
    AsyncWorkerClient,
    ConnectionLost,
    HostCall,
    WorkerClient,
)
from agent_sandbox._host.launch import (
    LOG_BYTES,
)
from agent_sandbox._host.limit_report import GuestLimits, record_limit_hits
from agent_sandbox._host.limits import WorkerCgroups, _descendants
from agent_sandbox._host.result import RunError, RunResult
from agent_sandbox._host.startup import start_worker
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
#: How long a worker seen exiting (after its connection closed) has to give its status.
_EXITING_WAIT = 2.0
_PF_EXITING = 0x4
_STOPPED_REASON = "it was stopped by a signal (SIGSTOP or SIGTSTP) and could not run"
_TEMPLATE_REASON = "its worker template (the process that forks workers) ended, and it with it"
_logger = logging.getLogger("agent_sandbox")


class WorkerProcess:
    """A started, handshaken worker; use `start()` to make one."""

    def __init__(self) -> None:
        self.id = "w-" + secrets.token_hex(4)
        self.proc: ChildProcess | None = None
        self.control_dir = ""
        self.scratch = ""
        self.plan: LaunchPlan | None = None
        self.hello: dict[str, Any] = {}
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
        #: What a VM's guest reported of its limits (`LaunchPlan.limit_reports`).
        self.guest_limits: GuestLimits | None = None
        self._egress_channel: socket.socket | None = None
        #: The host's reader of the worker's Landlock denials in the kernel's audit log,
        #: where the kernel writes them (`_host/denial_log.py`).
        self.kernel_log: Watch | None = None
        #: The host's own reader of the worker's arming counter (`_host/intake/guard_block.py`), and
        #: the
        self._held_mark: Mark | None = None
        self.bounds: HostBounds | None = None
        #: events of the current call it holds back until the call's end is verified.
        self.guard_watch: guard_block.GuardWatch | None = None
        self._held: list[tuple[str, Any]] = []
        #: The O_PATH descriptor of a socket the worker bound itself (`_pin_socket`).
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

    def _forwarder(
        self, builder: ResultBuilder, on_event: OnEvent | None
    ) -> Callable[[tuple[str, Any]], None]:
        """What the transport calls with each event: the host's judge, then its guard check.

        Every event is judged as it arrives (`agent_sandbox._host.intake.events`: order, shape, the
        host's bounds and wording), held or not, so nothing the worker sends escapes the
        bounds. Then the guard check: events read while the guards are armed are passed on;
        events after the disarming are held (and marked in the builder, so they can be
        withdrawn) until the end of the call is verified; after tampering nothing is passed on.
        """
        watch = self.guard_watch
        held = self._held = []
        self._held_mark = None
        if watch is not None:
            watch.begin_call()

        def live(event: tuple[str, Any] | None) -> None:
            if event is not None and on_event is not None:
                on_event(*event)

        def forward(event: tuple[str, Any]) -> None:
            accepted = builder.add(*event)
            if event[0] == "start":
                # Framing, sent before the call arms and never passed on: the guard check
                # (which expects a call under way) starts with the first event of the call.
                return
            if watch is not None:
                verdict = watch.judge(event[0])
                if verdict == guard_block.HOLD:
                    if self._held_mark is None:
                        self._held_mark = builder.mark()
                    if accepted is not None:
                        held.append(accepted)
                    return
                if verdict == guard_block.TAMPERED:
                    held.clear()
                    return
                self._held_mark = None
                while held:
                    live(held.pop(0))
            live(accepted)

        return forward

    def socket_address(self) -> str:
        """Where the worker's server listens, as the host connects to it: the socket in the
        control directory, or the pinned descriptor of one the worker bound itself."""
        if self.client is not None:
            return self.client.path
        return os.path.join(self.control_dir, "ctl.sock")

    # -- calls ---------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def alive(self) -> bool:
        """Running and able to answer: a worker stopped by a signal (SIGSTOP) is not."""
        if self.dead or self.proc is None or self.proc.poll() is not None:
            return False
        if self.stopped():
            self.death_reason = self.death_reason or _STOPPED_REASON
            return False
        return True

    def stopped(self) -> bool:
        """Whether the worker (or its launcher) is stopped by a signal (state T or t)."""
        if self.proc is None:
            return False
        pids = [self.proc.pid]
        if self._host_pid is not None or self.hello:
            inner = self.worker_pid()
            if inner is not None and inner != self.proc.pid:
                pids.append(inner)
        return any(self._stat(pid)[0] in ("T", "t") for pid in pids)

    def _stat(self, pid: int) -> tuple[str, int]:
        """`_proc_state` of one of this worker's processes through a descriptor opened once
        (a `pread` at offset 0 renders the file afresh): checked twice per call. The open
        descriptor stays with the process it was opened for, never a later holder of its
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
                return _parse_stat(os.pread(fd, 4096, 0))
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

    def _vm_end(self) -> str | None:
        """How the worker's VM ended, when its launcher saw QEMU end before the guest said
        the worker ended (`qemu-ended.json`, written by the launcher in a directory the
        guest cannot write); None otherwise."""
        if self.plan is None or not self.plan.interrupt_launcher or not self.control_dir:
            return None
        path = os.path.join(self.control_dir, "vm", "qemu-ended.json")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                code = json.loads(fh.read(256)).get("returncode")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(code, int):
            return None
        return describe_exit(code)

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
            return _TEMPLATE_REASON
        status = self.proc.poll() if self.proc is not None else None
        return f"it ended ({describe_exit(self._worker_status(status))})"

    def _status_now(self) -> tuple[str, int | None]:
        """After the transport was lost: ("exited", status), ("stopped", None) or
        ("running", None), decided now; the only wait is for a worker already exiting
        (its connection closes before its exit status exists), and it ends as soon as the
        status does."""
        assert self.proc is not None
        status = self.proc.poll()
        if status is not None:
            return "exited", status
        if self.stopped():
            return "stopped", None
        inner = self.worker_pid() if self.hello else self.proc.pid
        state, flags = _proc_state(inner) if inner is not None else ("", 0)  # None: gone
        template = getattr(self.proc, "_template", None)
        exiting = (
            state in ("", "Z", "X")
            or bool(flags & _PF_EXITING)
            or (template is not None and not template.alive())
        )
        vm = self.plan is not None and self.plan.interrupt_launcher
        if not exiting and vm and not _live_children(self.proc.pid):
            # A VM: the launcher outlives its QEMU, its only child, by a moment. No live
            # child left means the VM itself ended: wait for the launcher's exit.
            return "exited", self.wait_exit(_EXITING_WAIT)
        if not exiting:
            return "running", None
        return "exited", self.wait_exit(_EXITING_WAIT)

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
        """Run one call; never raises for the code's own failures (they are in the result).

        `timeout_source` says who set `timeout` (the tool's option, the CLI's flag), for the
        refusal's hint; `filename` is the name the code's frames carry (default `<cell-N>`).
        `host_call` answers the code's host-tool requests during this call (None refuses
        them; see `agent_sandbox._host.hosttools`).
        """
        assert self.client is not None and self.policy is not None
        wall = timeout if timeout is not None else self.policy.limits.wall_seconds
        builder = self._builder(wall)
        t0 = time.monotonic()
        forward = self._forwarder(builder, on_event)
        self._in_call = True
        self.client.host_call = self._with_scratch_metadata(host_call)
        try:
            try:
                self.client.run(code, t0 + wall, forward, filename)
            except KeyboardInterrupt:
                # Ctrl-C in the caller: the cell in the worker is interrupted too (its
                # variables stay), and the caller gets its KeyboardInterrupt.
                self.client.close()
                self._in_call = False
                self.interrupt()
                raise
            except (TimeoutError, TransportError) as exc:
                self._on_call_failure(builder, exc, wall, timeout, timeout_source)
            finally:
                self._in_call = False
                if self.client is not None:
                    self.client.host_call = None
            return self._finish(builder, t0, session)
        finally:
            self._call_ended()

    def _with_scratch_metadata(self, host_call: HostCall | None) -> HostCall | None:
        """`host_call`, serving the worker's chmod and utime requests in scratch too where
        the plan's seccomp filter refuses metadata changes and scratch is this host's
        directory (the landlock provider; `agent_sandbox._host.scratchmeta`)."""
        plan = self.plan
        if plan is None or not self.scratch:
            return host_call
        seccomp = plan.worker_setup.get("seccomp")
        if not (isinstance(seccomp, dict) and seccomp.get("metadata") is True):
            return host_call
        from agent_sandbox._host.scratchmeta import metadata_handler

        root = "/"
        if plan.worker_setup.get("scratch_tmpfs"):
            # The worker's scratch is a tmpfs in its own mount namespace, over this path:
            # reached through the worker's root, as the host reads its memory.
            pid = self.worker_pid()
            if pid is None:
                return host_call
            root = f"/proc/{pid}/root"
        return metadata_handler(self.scratch, host_call, root=root)  # type: ignore[no-any-return]

    def _on_call_failure(
        self,
        builder: ResultBuilder,
        exc: TimeoutError | TransportError,
        wall: float,
        timeout: float | None,
        timeout_source: str | None,
    ) -> None:
        """How a call that ended in the transport is told (shared by `run` and `arun`)."""
        if isinstance(exc, TimeoutError):
            self._on_timeout(builder, wall, timeout, timeout_source)
        elif isinstance(exc, ConnectionLost):
            self._on_lost(builder)
        elif isinstance(exc, MessageTooLarge):
            self._on_too_large(builder, exc)
        else:
            self._on_transport_error(builder, exc)

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
        import asyncio  # loaded already: this runs in its loop

        assert self.client is not None and self.policy is not None
        wall = timeout if timeout is not None else self.policy.limits.wall_seconds
        builder = self._builder(wall)
        t0 = time.monotonic()
        client = AsyncWorkerClient(
            self.client.path, self.token, self.client.max_event_bytes, self.client.kind_caps
        )
        client.host_call = self._with_scratch_metadata(host_call)
        forward = self._forwarder(builder, on_event)
        self._in_call = True
        try:
            try:
                await client.run(code, t0 + wall, forward, filename)
            except asyncio.CancelledError:
                # A cancelled call: the cell in the worker is interrupted too (state kept).
                self._in_call = False
                self.interrupt()
                raise
            except (TimeoutError, TransportError) as exc:
                self._on_call_failure(builder, exc, wall, timeout, timeout_source)
            finally:
                self._in_call = False
            return self._finish(builder, t0, session)
        finally:
            self._call_ended()

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

    def _builder(self, wall: float) -> ResultBuilder:
        """The judge and accumulator of the next call's events
        (`agent_sandbox._host.intake.events`):
        it has the host's policy, to make the hints it shows itself (`_hints.host_hint`)."""
        assert self.policy is not None
        self.calls += 1
        return ResultBuilder(
            self.decoder,
            self.policy,
            wall,
            bounds=self.bounds or HostBounds.from_policy(self.policy),
            call=self.calls,
        )

    # -- interrupts ----------------------------------------------------------------------

    def worker_pid(self) -> int | None:
        """The worker's pid on the host (below its launcher, in its pid namespace or not)."""
        if self._host_pid is not None or self.proc is None:
            return self._host_pid
        if self.plan is not None and self.plan.interrupt_launcher:
            self._host_pid = self.proc.pid  # it forwards the signal into the VM
            return self._host_pid
        inner = str(self.hello.get("pid", ""))
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
        except (TimeoutError, TransportError, OSError):
            return False
        finally:
            probe.close()

    def _finish(self, builder: ResultBuilder, t0: float, session: str | None) -> RunResult:
        assert self.policy is not None
        if self.egress is not None:
            # The proxy's refusals, recorded on the host: the worker cannot drop or forge them.
            for denial in self.egress.drain():
                builder.add_denial(denial)
            self.egress.end_call()  # no tunnel of this call outlives it (net.keep_connections)
        if self.kernel_log is not None:
            # Landlock's refusals as the kernel logged them, recorded by the host; the
            # ones the Python guards already reported for the same target are not repeated.
            from agent_sandbox._host.denial_log import merge_into

            merge_into(builder.add_denial, builder.denials, self.kernel_log.drain())
        if self.egress is not None and self.egress.failure is not None and not self.dead:
            # The proxy never served this worker (see EgressProxy.attach): not kept.
            self.death_reason = self.egress.failure
            builder.notices.append(f"the egress proxy failed: {self.egress.failure}")
            self.discard()
        watch = self.guard_watch
        if watch is not None and watch.reason:
            self._on_tampered(builder, watch.reason)
        elif watch is not None and watch.lost:
            self._on_unverified(builder)
        self.rewind_log()
        if (
            record_limit_hits(
                builder,
                self.cgroups,
                self.policy,
                scratch=self.scratch,
                guest=self.guest_limits,
                scratch_in_memory=self.scratch_in_memory(),
            )
            and not self.dead
        ):
            self.death_reason = "it hit a resource limit"
            self.discard()
        for denial in builder.denials:
            if denial.rule.startswith("limits."):
                _logger.info("worker %s: %s hit (%s)", self.id, denial.rule, denial.target)
        if builder.discard:
            self.death_reason = "a guard was tampered with"
            self.discard()
        if not builder.done and not self.dead:
            # The stream ended without `done`: the worker is in an unknown state.
            self.death_reason = "the call ended without completing its stream"
            self.discard()
        return builder.build(
            duration=time.monotonic() - t0,
            worker_id=self.id,
            session=session,
            policy=self.policy.name,
            fingerprint=self.policy.fingerprint(),
            provider=self.plan.provider if self.plan else "",
            stack=tuple(self.plan.stack) if self.plan else (),
        )

    def _limit(
        self,
        builder: ResultBuilder,
        rule: str,
        target: str,
        detail: str,
        hint: str,
        error_type: str,
    ) -> None:
        assert self.policy is not None
        denial = Denial(
            rule=rule,
            action="run",
            target=target,
            policy=self.policy.name,
            detail=detail,
            hint=hint,
        )
        builder.add_denial(denial)
        builder.error = RunError(kind="limit", type=error_type, message=denial.message(), rule=rule)

    def _on_tampered(self, builder: ResultBuilder, reason: str) -> None:
        """The host saw the guards switched off: withhold the call's output, end the worker."""
        assert self.policy is not None
        self.death_reason = "its guards were switched off during a call"
        self.discard()
        builder.withhold()
        denial = Denial(
            rule="guard.tampered",
            action="tamper",
            target="the guards' arming state",
            policy=self.policy.name,
            detail=f"the host read the worker's guard counter: {reason}; the call's output "
            "was withheld and the worker discarded (the next call starts a fresh interpreter)",
        )
        builder.add_denial(denial)
        builder.error = RunError(
            kind="denied",
            type="GuardTampered",
            message=denial.message(),
            rule="guard.tampered",
        )

    def _on_unverified(self, builder: ResultBuilder) -> None:
        """The worker ended before the host could verify the call: what it held stays
        withheld. A tampering the worker reported itself is believed (it only discards)."""
        reported = [
            str(data.get("target", ""))
            for kind, data in self._held
            if kind == "denial" and isinstance(data, dict) and data.get("rule") == "guard.tampered"
        ]
        self._held = []
        if self._held_mark is not None:
            builder.rollback(self._held_mark)
            self._held_mark = None
        if reported:
            self._on_tampered(builder, "the worker reported: " + "; ".join(reported)[:500])
            return
        if builder.error is None:
            self.death_reason = "it ended before its call could be verified"
            self.discard()
            builder.error = RunError(
                kind="crashed",
                type="WorkerCrashed",
                message="the sandbox worker ended before the host could verify its guards for "
                "this call; the rest of the call's output was withheld and the next call "
                "starts a fresh interpreter",
                rule="worker.crashed",
            )

    def _on_timeout(
        self, builder: ResultBuilder, wall: float, timeout: float | None, source: str | None
    ) -> None:
        assert self.policy is not None
        if self.stopped():
            self._on_stopped(builder)
            return
        self.death_reason = f"it ran past the wall-clock limit of {wall:g} s"
        self.kill()
        policy_wall = self.policy.limits.wall_seconds
        if timeout is None:
            origin = f"the policy's limits.wall_seconds = {policy_wall:g}"
            hint = limit_hint("limits.timeout", {"limits": {"wall_seconds": policy_wall}})
        else:
            who = source or "the caller's timeout argument"
            origin = f"{who} = {timeout:g} (the policy's own limit is {policy_wall:g} s)"
            hint = f"raise {who} (now {timeout:g} s); the policy is not what stopped it"
        self._limit(
            builder,
            "limits.timeout",
            "the call",
            f"it ran longer than {wall:g} s, the limit set by {origin}; its process group was "
            "killed and the session's variables are lost",
            hint,
            "TimeoutError",
        )

    def _on_lost(self, builder: ResultBuilder) -> None:
        assert self.policy is not None
        if self._interrupt_expired is not None:
            self.dead = True
            self.kill()
            builder.error = RunError(
                kind="crashed",
                type="Interrupted",
                message=f"the call was interrupted and did not stop within "
                f"{self._interrupt_expired:g} s, so its worker was replaced; the session's "
                "variables are lost and the next call starts a fresh interpreter",
                rule="worker.crashed",
            )
            return
        how, raw = self._status_now()
        if how == "running" and self.plan is not None and self.plan.interrupt_launcher:
            # A worker behind its own kernel (gVisor, a VM) has no host process: its
            # connection closes when it dies, and its launcher exits a moment later.
            assert self.proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(_LAUNCHER_EXIT_GRACE)
            how, raw = self._status_now()
        status = self._worker_status(raw)
        vm = self._vm_end()  # read before the kill removes the control directory
        self.dead = True
        self.kill()
        if how == "stopped":
            self._on_stopped(builder)
            return
        if how == "running":
            self.death_reason = "it closed its connection to the host during a call"
            builder.error = RunError(
                kind="crashed",
                type="TransportLost",
                message="the sandbox worker closed its connection to the host during the "
                "call while it was still running; it was killed, the session's variables "
                "are lost and the next call starts a fresh interpreter",
                traceback=self.log_tail(),
                rule="worker.crashed",
            )
            return
        if status == -signal.SIGXCPU or (status not in (None, 0) and self._cpu_exhausted()):
            cpu = self.policy.limits.cpu_seconds
            self.death_reason = "it used up its CPU time"
            self._limit(
                builder,
                "limits.cpu",
                "the call",
                f"it used more than {cpu} s of CPU time and was killed",
                limit_hint("limits.cpu", {"limits": {"cpu_seconds": cpu}}),
                "LimitExceeded",
            )
            return
        template = getattr(self.proc, "_template", None)
        if template is not None and not template.alive():
            self.death_reason = _TEMPLATE_REASON
            builder.error = RunError(
                kind="crashed",
                type="TemplateEnded",
                message="the sandbox worker ended during the call because its worker "
                "template (the process that forks workers) ended; the session's variables "
                "are lost and the next call starts a fresh interpreter",
                traceback=self.log_tail(),
                rule="worker.crashed",
            )
            return
        if vm is not None:
            self.death_reason = f"its virtual machine (QEMU) ended ({vm})"
            builder.error = RunError(
                kind="crashed",
                type="WorkerCrashed",
                message="the sandbox worker's virtual machine (the QEMU process) ended during "
                f"the call ({vm}); the session's variables are lost and "
                "the next call starts a fresh virtual machine",
                traceback=self.log_tail(),
                rule="worker.crashed",
            )
            return
        self.death_reason = f"it crashed ({describe_exit(status)})"
        builder.error = RunError(
            kind="crashed",
            type="WorkerCrashed",
            message=f"the sandbox worker died during the call ({describe_exit(status)}); "
            "the session's variables are lost and the next call starts a fresh interpreter",
            traceback=self.log_tail(),
            rule="worker.crashed",
        )

    def _on_stopped(self, builder: ResultBuilder) -> None:
        """The worker was stopped by a signal (SIGSTOP): it cannot run; it was killed."""
        self.death_reason = _STOPPED_REASON
        self.kill()
        builder.error = RunError(
            kind="crashed",
            type="WorkerStopped",
            message="the sandbox worker was stopped by a signal (SIGSTOP or SIGTSTP) and "
            "could not finish the call; it was killed, the session's variables are lost and "
            "the next call starts a fresh interpreter",
            rule="worker.crashed",
        )

    def _worker_status(self, status: int | None) -> int | None:
        """The worker's own status: a launcher (bwrap, unshare) relays a worker killed by
        signal N as exit status 128 + N, read back here as -N."""
        if status is None or status <= 128 or self.plan is None or self.plan.worker_depth == 0:
            return status
        try:
            return -signal.Signals(status - 128)
        except ValueError:
            return status

    def _cpu_exhausted(self) -> bool:
        # A death after the worker's group used up its CPU time: the hard RLIMIT_CPU's
        # SIGKILL (user code ignored SIGXCPU), however a launcher relays it.
        assert self.policy is not None
        used = self.cgroups.cpu_seconds() if self.cgroups is not None else 0.0
        return used >= self.policy.limits.cpu_seconds

    def _on_too_large(self, builder: ResultBuilder, exc: MessageTooLarge) -> None:
        """A host bound was crossed: the host stopped reading; the worker is killed, and the
        call keeps what fit (the output up to the cap, the denials so far)."""
        assert self.policy is not None
        self.death_reason = "it sent more than the host accepts from one call"
        self.kill()
        builder.value = None
        output = {"limits": {"output_bytes": self.policy.limits.output_bytes}}
        if exc.setting == "limits.output_bytes":
            self._limit(
                builder,
                "limits.output",
                "the worker's output",
                f"{exc}; the host stopped reading, the worker was killed and its variables "
                "are lost",
                limit_hint("limits.output", output),
                "MessageTooLarge",
            )
        else:
            self._limit(
                builder,
                "limits.result",
                "the result",
                f"{exc}; the host stopped reading and the worker was killed",
                limit_hint("limits.result", {"limits": {"result_bytes": exc.cap}}),
                "MessageTooLarge",
            )

    def _on_transport_error(self, builder: ResultBuilder, exc: TransportError) -> None:
        """The worker broke the protocol (malformed, out of order or contradictory): nothing
        more it says in this call is believed; it is killed and the call says so."""
        self.death_reason = "it broke the protocol"
        self.kill()
        builder.value = None
        builder.error = RunError(
            kind="crashed",
            type="WorkerMisbehaved",
            message=f"the sandbox worker broke the protocol and was discarded ({exc}); "
            "its result is not trusted, the session's variables are lost and the next call "
            "starts a fresh interpreter",
            rule="worker.protocol",
        )

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
            if self.guard_watch is not None:
                self.guard_watch.close()
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
        if self.egress is not None:
            self.egress.close()  # no connection of a discarded worker outlives this call
        if self.kernel_log is not None:
            self.kernel_log.close()
        if not self.dead:
            level = logging.INFO if self.death_reason else logging.DEBUG
            _logger.log(level, "worker %s ended: %s", self.id, self.death_reason or "discarded")
        with self._lock:
            self.dead = True
            if self.guard_watch is not None:
                self.guard_watch.close()
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
        if self.egress is not None:
            self.egress.close()
        if self.kernel_log is not None:
            self.kernel_log.close()
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


#: How long the host waits for the launcher of a worker without a host process to exit
#: once the worker's connection closed during a call (runsc took a few ms here).
_LAUNCHER_EXIT_GRACE = 2.0


def _live_children(pid: int) -> list[int]:
    """The children of `pid` that have not ended (zombies excluded)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                words = fh.read().split()
        except OSError:
            continue
        out += [int(w) for w in words if _proc_state(int(w))[0] not in ("", "Z", "X")]
    return out


def _proc_state(pid: int) -> tuple[str, int]:
    """A process's state letter and flags from /proc (("", 0) when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return "", 0
    return _parse_stat(raw)


def _parse_stat(stat: bytes) -> tuple[str, int]:
    fields = stat[stat.rfind(b")") + 2 :].split(None, 7)  # the state and the flags are enough
    try:
        return fields[0].decode(), int(fields[6])
    except (IndexError, ValueError):
        return "", 0


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
