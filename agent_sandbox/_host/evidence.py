"""What the host itself found out about a call, behind one interface.

The host does not take the worker's word for how a call went: sources on the host's side of
the boundary record what happened, and the end of every call (`agent_sandbox._host.call`)
consults each source a worker registered, in one order (`ORDER`):

- `EgressEvidence`: the worker's route on the egress proxy (`_host/egress/proxy.py`): the
  connections it refused, and whether it could serve the worker at all;
- `KernelLogEvidence`: the worker's Landlock denials as the kernel logged them
  (`_host/denial_log.py`), those the guards already reported left out;
- `GuardEvidence`: the host's own reading of the worker's guard arming counter
  (`_host/intake/guard_block.py`); it also screens each event as it arrives, holding back
  those read after the guards went off until the call's end is verified;
- `LimitEvidence`: the worker's cgroups, its host scratch directory, what a VM's guest or a
  gVisor worker reported, and the limit errors in the result (`_host/limit_report.py`).

Each is an `EvidenceSource`: `arm()` before a call's first event, `collect(call)` once its
stream ended (what the source recorded goes into the result), `judge(call)` once every
source collected (whether the worker can be kept: a source that says no ends it through
`call.replace_worker`), and `close()` when the worker ends. Collecting from all before any
judges keeps the result's denials in the same order whichever source ends the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agent_sandbox._denial import Denial
from agent_sandbox._host.intake import guard_block
from agent_sandbox._host.limit_report import GuestLimits, record_limit_hits
from agent_sandbox._host.result import RunError

if TYPE_CHECKING:
    from agent_sandbox._host.denial_log import Watch
    from agent_sandbox._host.egress.proxy import Route
    from agent_sandbox._host.intake.builder import Mark, ResultBuilder
    from agent_sandbox._host.limits import WorkerCgroups
    from agent_sandbox.policies import Policy

__all__ = [
    "ORDER",
    "CallView",
    "EgressEvidence",
    "EventScreen",
    "EvidenceSet",
    "EvidenceSource",
    "GuardEvidence",
    "KernelLogEvidence",
    "LimitEvidence",
]

#: The order in which the end of a call consults the sources (by `name`): the proxy's
#: refusals first, then the kernel's (which leave out what is already there), the guard
#: check, and the limit report last (it reads the error the others may have set).
ORDER = ("egress", "kernel_log", "guard", "limits")


class CallView(Protocol):
    """What a source sees of the call it reports on (`agent_sandbox._host.call.Call`)."""

    @property
    def builder(self) -> ResultBuilder: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def worker_dead(self) -> bool:
        """Whether the worker has ended already (killed or discarded during the call)."""
        ...

    def replace_worker(self, reason: str) -> None:
        """End the worker now, `reason` being why in words for the model (its end cause)."""
        ...


@runtime_checkable
class EvidenceSource(Protocol):
    """One host-side source of evidence about a worker's calls."""

    #: Its place in `ORDER`.
    name: str

    def arm(self) -> None:
        """A call starts: count from here."""
        ...

    def collect(self, call: CallView) -> None:
        """The call's stream ended: add what this source recorded to `call.builder`."""
        ...

    def judge(self, call: CallView) -> None:
        """Every source collected: end the worker (`call.replace_worker`) if it cannot be
        kept, saying so in the result."""
        ...

    def close(self) -> None:
        """The worker ended: release what the source holds (idempotent)."""
        ...


@runtime_checkable
class EventScreen(Protocol):
    """A source that sees each event of a call as it arrives (the guard check)."""

    def screen(
        self, builder: ResultBuilder, kind: str, accepted: tuple[str, Any] | None
    ) -> list[tuple[str, Any] | None]:
        """The events to pass on now (`accepted` among them, or held back)."""
        ...


class EvidenceSet:
    """The sources one worker registered, kept in `ORDER` (a name registered again replaces
    the earlier source)."""

    def __init__(self) -> None:
        self._sources: list[EvidenceSource] = []

    def register(self, source: EvidenceSource) -> None:
        kept = [s for s in self._sources if s.name != source.name]
        rank = {name: i for i, name in enumerate(ORDER)}
        self._sources = sorted([*kept, source], key=lambda s: rank.get(s.name, len(ORDER)))

    def __iter__(self) -> Iterator[EvidenceSource]:
        return iter(list(self._sources))

    def __len__(self) -> int:
        return len(self._sources)

    def close(self) -> None:
        for source in self:
            source.close()


class EgressEvidence:
    """The worker's route on the host's egress proxy (namespace providers with `[net]`)."""

    name = "egress"

    def __init__(self, route: Route) -> None:
        self.route = route

    def arm(self) -> None:
        pass  # (the route records from its attach on; a drain starts each call afresh)

    def collect(self, call: CallView) -> None:
        # The proxy's refusals, recorded on the host: the worker cannot drop or forge them.
        for denial in self.route.drain():
            call.builder.add_proxy_denial(denial)
        self.route.end_call()  # no tunnel of this call outlives it (net.keep_connections)

    def judge(self, call: CallView) -> None:
        failure = self.route.failure
        if failure is not None and not call.worker_dead:
            # The proxy never served this worker (see EgressProxy.attach): not kept.
            call.builder.notices.append(f"the egress proxy failed: {failure}")
            call.replace_worker(failure)

    def close(self) -> None:
        self.route.close()  # no connection of an ended worker outlives it


class KernelLogEvidence:
    """The worker's Landlock denials as the kernel logged them, read by the host."""

    name = "kernel_log"

    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def arm(self) -> None:
        pass  # (the watch files records from the worker's start; a drain empties it)

    def collect(self, call: CallView) -> None:
        # Recorded by the host; the ones the Python guards already reported for the same
        # target are not repeated.
        from agent_sandbox._host.denial_log import merge_into

        builder = call.builder
        merge_into(builder.add_denial, builder.denials, self.watch.drain())

    def judge(self, call: CallView) -> None:
        pass  # (a denial ends no worker)

    def close(self) -> None:
        self.watch.close()


class GuardEvidence:
    """The host's reading of the worker's guard arming counter, and the events it holds
    back until the call's end is verified (`_host/intake/guard_block.py`)."""

    name = "guard"

    def __init__(self, watch: guard_block.GuardWatch) -> None:
        self.watch = watch
        #: Events of the current call held back (read after the disarming), and the
        #: builder's mark before the first of them (so they can be withdrawn).
        self.held: list[tuple[str, Any]] = []
        self.mark: Mark | None = None

    def arm(self) -> None:
        self.held = []
        self.mark = None
        self.watch.begin_call()

    def screen(
        self, builder: ResultBuilder, kind: str, accepted: tuple[str, Any] | None
    ) -> list[tuple[str, Any] | None]:
        """Events read while the guards are armed are passed on; events after the disarming
        are held (and marked in the builder) until the end of the call is verified; after
        tampering nothing is passed on."""
        verdict = self.watch.judge(kind)
        if verdict == guard_block.HOLD:
            if self.mark is None:
                self.mark = builder.mark()
            if accepted is not None:
                self.held.append(accepted)
            return []
        if verdict == guard_block.TAMPERED:
            self.held.clear()
            return []
        self.mark = None
        out: list[tuple[str, Any] | None] = [*self.held, accepted]
        self.held.clear()
        return out

    def collect(self, call: CallView) -> None:
        pass  # (what it found decides whether the call's output stands: `judge`)

    def judge(self, call: CallView) -> None:
        if self.watch.reason:
            self._tampered(call, self.watch.reason)
        elif self.watch.lost:
            self._unverified(call)

    def _tampered(self, call: CallView, reason: str) -> None:
        """The host saw the guards switched off: withhold the call's output, end the worker."""
        call.replace_worker("its guards were switched off during a call")
        builder = call.builder
        builder.withhold()
        denial = Denial(
            rule="guard.tampered",
            action="tamper",
            target="the guards' arming state",
            policy=call.policy.name,
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

    def _unverified(self, call: CallView) -> None:
        """The worker ended before the host could verify the call: what it held stays
        withheld. A tampering the worker reported itself is believed (it only discards)."""
        builder = call.builder
        reported = [
            str(data.get("target", ""))
            for kind, data in self.held
            if kind == "denial" and isinstance(data, dict) and data.get("rule") == "guard.tampered"
        ]
        self.held = []
        if self.mark is not None:
            builder.rollback(self.mark)
            self.mark = None
        if reported:
            self._tampered(call, "the worker reported: " + "; ".join(reported)[:500])
            return
        if builder.error is None:
            call.replace_worker("it ended before its call could be verified")
            builder.error = RunError(
                kind="crashed",
                type="WorkerCrashed",
                message="the sandbox worker ended before the host could verify its guards for "
                "this call; the rest of the call's output was withheld and the next call "
                "starts a fresh interpreter",
                rule="worker.crashed",
            )

    def close(self) -> None:
        self.watch.close()


class LimitEvidence:
    """The limit report of a call (`_host/limit_report.record_limit_hits`): the worker's
    cgroups, its host scratch directory, a guest's report, and the limit errors the result
    holds. Every worker has one (without cgroups it still reads the result); the cgroups
    themselves belong to the process, which removes them at its end."""

    name = "limits"

    def __init__(
        self,
        cgroups: WorkerCgroups | None = None,
        *,
        scratch: str = "",
        guest: GuestLimits | None = None,
        scratch_in_memory: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.cgroups = cgroups
        self.scratch = scratch
        self.guest = guest
        self.scratch_in_memory = scratch_in_memory

    def arm(self) -> None:
        pass  # (cgroup events and guest counters are read as growth since the last call)

    def collect(self, call: CallView) -> None:
        pass  # (it reads the result as the other sources left it: `judge`)

    def judge(self, call: CallView) -> None:
        replace = record_limit_hits(
            call.builder,
            self.cgroups,
            call.policy,
            scratch=self.scratch,
            guest=self.guest,
            scratch_in_memory=self.scratch_in_memory(),
        )
        if replace and not call.worker_dead:
            call.replace_worker("it hit a resource limit")

    def close(self) -> None:
        pass  # (the cgroups are the process's: `WorkerProcess` kills and removes them)
