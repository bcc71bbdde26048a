"""One call on a worker, seen from the parent: send, wait, collect the evidence, build the result.

A `Call` belongs to one `agent_sandbox._host.process.WorkerProcess` and lives for one call:

1. arm every evidence source the worker registered (`agent_sandbox._host.evidence`);
2. send the code and read the worker's events until the call's deadline: each one is judged
   by the host as it arrives (`agent_sandbox._host.intake`), then screened by the guard
   check, which holds back what was read after the guards went off;
3. a call that ended in the transport (a timeout, a lost connection, a reply too large, a
   broken protocol) is told as such, with why the worker ended (`_on_failure`);
4. collect what every source found, let each judge whether the worker can be kept, and
   build the `RunResult`.

The process itself (its start, signals and end) stays the worker's: a call asks it to kill,
discard or interrupt, and reads its end from it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent_sandbox._denial import Denial
from agent_sandbox._errors import MessageTooLarge, TransportError, describe_exit
from agent_sandbox._hints import limit_hint
from agent_sandbox._host.evidence import EventScreen, EvidenceSource
from agent_sandbox._host.exit_status import cpu_exhausted, status_now, vm_end
from agent_sandbox._host.intake.builder import ResultBuilder
from agent_sandbox._host.intake.events import HostBounds
from agent_sandbox._host.intake.transport import AsyncWorkerClient, ConnectionLost, HostCall
from agent_sandbox._host.result import RunError, RunResult
from agent_sandbox.policies import Policy

if TYPE_CHECKING:
    from agent_sandbox._host.process import OnEvent, WorkerProcess

__all__ = ["STOPPED_REASON", "TEMPLATE_REASON", "Call"]

STOPPED_REASON = "it was stopped by a signal (SIGSTOP or SIGTSTP) and could not run"
TEMPLATE_REASON = "its worker template (the process that forks workers) ended, and it with it"
#: How long the host waits for the launcher of a worker without a host process to exit
#: once the worker's connection closed during a call (runsc took a few ms here).
_LAUNCHER_EXIT_GRACE = 2.0
_logger = logging.getLogger("agent_sandbox")


class Call:
    """One call on `worker`; `run()` or `arun()` it once.

    `timeout_source` says who set `timeout` (the tool's option, the CLI's flag), for the
    refusal's hint; `host_call` answers the code's host-tool requests during this call (None
    refuses them; see `agent_sandbox._host.hosttools`).
    """

    def __init__(
        self,
        worker: WorkerProcess,
        *,
        timeout: float | None = None,
        on_event: OnEvent | None = None,
        session: str | None = None,
        timeout_source: str | None = None,
        host_call: HostCall | None = None,
    ) -> None:
        assert worker.client is not None and worker.policy is not None
        self.worker = worker
        self._policy: Policy = worker.policy
        self.timeout = timeout
        self.wall = timeout if timeout is not None else self._policy.limits.wall_seconds
        self.on_event = on_event
        self.session = session
        self.timeout_source = timeout_source
        self.host_call = host_call
        #: The sources this call consults: exactly those the worker registered, in order.
        self.sources: list[EvidenceSource] = list(worker.evidence)
        worker.calls += 1
        self._builder = ResultBuilder(
            worker.decoder,
            self._policy,
            self.wall,
            bounds=worker.bounds or HostBounds.from_policy(self._policy),
            call=worker.calls,
            proxy_token=worker.egress_token,
        )

    # -- what an evidence source sees of the call (`evidence.CallView`) ------------------

    @property
    def builder(self) -> ResultBuilder:
        """The judge and accumulator of this call's events
        (`agent_sandbox._host.intake.events`): it has the host's policy, to make the hints
        it shows itself (`_hints.host_hint`)."""
        return self._builder

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def worker_dead(self) -> bool:
        return self.worker.dead

    def replace_worker(self, reason: str) -> None:
        self.worker.death_reason = reason
        self.worker.discard()

    # -- the call ------------------------------------------------------------------------

    def run(self, code: str, filename: str | None = None) -> RunResult:
        """Run the call; never raises for the code's own failures (they are in the result).
        `filename` is the name the code's frames carry (default `<cell-N>`)."""
        worker, client = self.worker, self.worker.client
        assert client is not None
        t0 = time.monotonic()
        forward = self._forwarder()
        worker._in_call = True
        client.host_call = self._with_scratch_metadata()
        try:
            try:
                client.run(code, t0 + self.wall, forward, filename)
            except KeyboardInterrupt:
                # Ctrl-C in the caller: the cell in the worker is interrupted too (its
                # variables stay), and the caller gets its KeyboardInterrupt.
                client.close()
                worker._in_call = False
                worker.interrupt()
                raise
            except (TimeoutError, TransportError) as exc:
                self._on_failure(exc)
            finally:
                worker._in_call = False
                if worker.client is not None:
                    worker.client.host_call = None
            return self._finish(t0)
        finally:
            worker._call_ended()

    async def arun(self, code: str, filename: str | None = None) -> RunResult:
        """The async twin of `run()` (an asyncio connection; no thread)."""
        import asyncio  # loaded already: this runs in its loop

        worker, sync = self.worker, self.worker.client
        assert sync is not None
        t0 = time.monotonic()
        client = AsyncWorkerClient(sync.path, worker.token, sync.max_event_bytes, sync.kind_caps)
        client.host_call = self._with_scratch_metadata()
        forward = self._forwarder()
        worker._in_call = True
        try:
            try:
                await client.run(code, t0 + self.wall, forward, filename)
            except asyncio.CancelledError:
                # A cancelled call: the cell in the worker is interrupted too (state kept).
                worker._in_call = False
                worker.interrupt()
                raise
            except (TimeoutError, TransportError) as exc:
                self._on_failure(exc)
            finally:
                worker._in_call = False
            return self._finish(t0)
        finally:
            worker._call_ended()

    def _with_scratch_metadata(self) -> HostCall | None:
        """`host_call`, serving the worker's chmod and utime requests in scratch too where
        the plan's seccomp filter refuses metadata changes and scratch is this host's
        directory (the landlock provider; `agent_sandbox._host.scratchmeta`)."""
        worker, host_call = self.worker, self.host_call
        plan = worker.plan
        if plan is None or not worker.scratch:
            return host_call
        seccomp = plan.worker_setup.get("seccomp")
        if seccomp is None or seccomp.get("metadata") is not True:
            return host_call
        from agent_sandbox._host.scratchmeta import metadata_handler

        root = "/"
        if plan.worker_setup.get("scratch_tmpfs"):
            # The worker's scratch is a tmpfs in its own mount namespace, over this path:
            # reached through the worker's root, as the host reads its memory.
            pid = worker.worker_pid()
            if pid is None:
                return host_call
            root = f"/proc/{pid}/root"
        return metadata_handler(worker.scratch, host_call, root=root)  # type: ignore[no-any-return]

    def _forwarder(self) -> Callable[[tuple[str, Any]], None]:
        """What the transport calls with each event: the host's judge, then the screens.

        Every event is judged as it arrives (`agent_sandbox._host.intake.events`: order,
        shape, the host's bounds and wording), held or not, so nothing the worker sends
        escapes the bounds. Then the sources that screen events (the guard check:
        `evidence.GuardEvidence.screen`) decide what is passed on now. Every source is armed
        first.
        """
        builder, on_event = self._builder, self.on_event
        for source in self.sources:
            source.arm()
        screens = [s for s in self.sources if isinstance(s, EventScreen)]

        def live(event: tuple[str, Any] | None) -> None:
            if event is not None and on_event is not None:
                on_event(*event)

        def forward(event: tuple[str, Any]) -> None:
            accepted = builder.add(*event)
            if event[0] == "start":
                # Framing, sent before the call arms and never passed on: the guard check
                # (which expects a call under way) starts with the first event of the call.
                return
            passed: list[tuple[str, Any] | None] = [accepted]
            for screen in screens:
                passed = [out for one in passed for out in screen.screen(builder, event[0], one)]
            for one in passed:
                live(one)

        return forward

    def _finish(self, t0: float) -> RunResult:
        """Collect every source's evidence, let each judge the worker, build the result."""
        worker, builder = self.worker, self._builder
        for source in self.sources:
            source.collect(self)
        for source in self.sources:
            source.judge(self)
        worker.rewind_log()
        for denial in builder.denials:
            if denial.rule.startswith("limits."):
                _logger.info("worker %s: %s hit (%s)", worker.id, denial.rule, denial.target)
        if builder.discard:
            self.replace_worker("a guard was tampered with")
        if not builder.done and not worker.dead:
            # The stream ended without `done`: the worker is in an unknown state.
            self.replace_worker("the call ended without completing its stream")
        plan = worker.plan
        return builder.build(
            duration=time.monotonic() - t0,
            worker_id=worker.id,
            session=self.session,
            policy=self._policy.name,
            fingerprint=self._policy.fingerprint(),
            provider=plan.provider if plan else "",
            stack=tuple(plan.stack) if plan else (),
        )

    # -- a call that ended in the transport ----------------------------------------------

    def _on_failure(self, exc: TimeoutError | TransportError) -> None:
        """How a call that ended in the transport is told (shared by `run` and `arun`)."""
        if isinstance(exc, TimeoutError):
            self._on_timeout()
        elif isinstance(exc, ConnectionLost):
            self._on_lost()
        elif isinstance(exc, MessageTooLarge):
            self._on_too_large(exc)
        else:
            self._on_transport_error(exc)

    def _limit(self, rule: str, target: str, detail: str, hint: str, error_type: str) -> None:
        denial = Denial(
            rule=rule,
            action="run",
            target=target,
            policy=self._policy.name,
            detail=detail,
            hint=hint,
        )
        self._builder.add_denial(denial)
        self._builder.error = RunError(
            kind="limit", type=error_type, message=denial.message(), rule=rule
        )

    def _on_timeout(self) -> None:
        worker, wall, timeout = self.worker, self.wall, self.timeout
        if worker.stopped():
            self._on_stopped()
            return
        worker.death_reason = f"it ran past the wall-clock limit of {wall:g} s"
        worker.kill()
        policy_wall = self._policy.limits.wall_seconds
        if timeout is None:
            origin = f"the policy's limits.wall_seconds = {policy_wall:g}"
            hint = limit_hint("limits.timeout", {"limits": {"wall_seconds": policy_wall}})
        else:
            who = self.timeout_source or "the caller's timeout argument"
            origin = f"{who} = {timeout:g} (the policy's own limit is {policy_wall:g} s)"
            hint = f"raise {who} (now {timeout:g} s); the policy is not what stopped it"
        self._limit(
            "limits.timeout",
            "the call",
            f"it ran longer than {wall:g} s, the limit set by {origin}; its process group was "
            "killed and the session's variables are lost",
            hint,
            "TimeoutError",
        )

    def _on_lost(self) -> None:
        worker, builder = self.worker, self._builder
        if worker._interrupt_expired is not None:
            worker.dead = True
            worker.kill()
            builder.error = RunError(
                kind="crashed",
                type="Interrupted",
                message=f"the call was interrupted and did not stop within "
                f"{worker._interrupt_expired:g} s, so its worker was replaced; the session's "
                "variables are lost and the next call starts a fresh interpreter",
                rule="worker.crashed",
            )
            return
        how, raw = status_now(worker)
        if how == "running" and worker.plan is not None and worker.plan.interrupt_launcher:
            # A worker behind its own kernel (gVisor, a VM) has no host process: its
            # connection closes when it dies, and its launcher exits a moment later.
            assert worker.proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(_LAUNCHER_EXIT_GRACE)
            how, raw = status_now(worker)
        status = worker.worker_status(raw)
        vm = vm_end(worker)  # read before the kill removes the control directory
        worker.dead = True
        worker.kill()
        if how == "stopped":
            self._on_stopped()
            return
        if how == "running":
            worker.death_reason = "it closed its connection to the host during a call"
            builder.error = RunError(
                kind="crashed",
                type="TransportLost",
                message="the sandbox worker closed its connection to the host during the "
                "call while it was still running; it was killed, the session's variables "
                "are lost and the next call starts a fresh interpreter",
                traceback=worker.log_tail(),
                rule="worker.crashed",
            )
            return
        if status == -signal.SIGXCPU or (status not in (None, 0) and cpu_exhausted(worker)):
            cpu = self._policy.limits.cpu_seconds
            worker.death_reason = "it used up its CPU time"
            self._limit(
                "limits.cpu",
                "the call",
                f"it used more than {cpu} s of CPU time and was killed",
                limit_hint("limits.cpu", {"limits": {"cpu_seconds": cpu}}),
                "LimitExceeded",
            )
            return
        template = getattr(worker.proc, "_template", None)
        if template is not None and not template.alive():
            worker.death_reason = TEMPLATE_REASON
            builder.error = RunError(
                kind="crashed",
                type="TemplateEnded",
                message="the sandbox worker ended during the call because its worker "
                "template (the process that forks workers) ended; the session's variables "
                "are lost and the next call starts a fresh interpreter",
                traceback=worker.log_tail(),
                rule="worker.crashed",
            )
            return
        if vm is not None:
            worker.death_reason = f"its virtual machine (QEMU) ended ({vm})"
            builder.error = RunError(
                kind="crashed",
                type="WorkerCrashed",
                message="the sandbox worker's virtual machine (the QEMU process) ended during "
                f"the call ({vm}); the session's variables are lost and "
                "the next call starts a fresh virtual machine",
                traceback=worker.log_tail(),
                rule="worker.crashed",
            )
            return
        worker.death_reason = f"it crashed ({describe_exit(status)})"
        builder.error = RunError(
            kind="crashed",
            type="WorkerCrashed",
            message=f"the sandbox worker died during the call ({describe_exit(status)}); "
            "the session's variables are lost and the next call starts a fresh interpreter",
            traceback=worker.log_tail(),
            rule="worker.crashed",
        )

    def _on_stopped(self) -> None:
        """The worker was stopped by a signal (SIGSTOP): it cannot run; it was killed."""
        self.worker.death_reason = STOPPED_REASON
        self.worker.kill()
        self._builder.error = RunError(
            kind="crashed",
            type="WorkerStopped",
            message="the sandbox worker was stopped by a signal (SIGSTOP or SIGTSTP) and "
            "could not finish the call; it was killed, the session's variables are lost and "
            "the next call starts a fresh interpreter",
            rule="worker.crashed",
        )

    def _on_too_large(self, exc: MessageTooLarge) -> None:
        """A host bound was crossed: the host stopped reading; the worker is killed, and the
        call keeps what fit (the output up to the cap, the denials so far)."""
        self.worker.death_reason = "it sent more than the host accepts from one call"
        self.worker.kill()
        self._builder.value = None
        output = {"limits": {"output_bytes": self._policy.limits.output_bytes}}
        if exc.setting == "limits.output_bytes":
            self._limit(
                "limits.output",
                "the worker's output",
                f"{exc}; the host stopped reading, the worker was killed and its variables "
                "are lost",
                limit_hint("limits.output", output),
                "MessageTooLarge",
            )
        else:
            self._limit(
                "limits.result",
                "the result",
                f"{exc}; the host stopped reading and the worker was killed",
                limit_hint("limits.result", {"limits": {"result_bytes": exc.cap}}),
                "MessageTooLarge",
            )

    def _on_transport_error(self, exc: TransportError) -> None:
        """The worker broke the protocol (malformed, out of order or contradictory): nothing
        more it says in this call is believed; it is killed and the call says so."""
        self.worker.death_reason = "it broke the protocol"
        self.worker.kill()
        self._builder.value = None
        self._builder.error = RunError(
            kind="crashed",
            type="WorkerMisbehaved",
            message=f"the sandbox worker broke the protocol and was discarded ({exc}); "
            "its result is not trusted, the session's variables are lost and the next call "
            "starts a fresh interpreter",
            rule="worker.protocol",
        )
