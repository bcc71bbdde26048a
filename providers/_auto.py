"""The `auto` provider: the deepest stack of kernel boundaries that works here for a policy.

What it does: for each policy it builds the plan of every candidate that its probe says
works (`bwrap`, `unshare`, `landlock`), drops those that cannot serve the policy, and
takes the deepest stack, the provider's strength breaking ties. A policy with network
allow rules goes only to a namespace provider with the host's egress proxy (host names
enforced on the host); where none can serve it, the build raises and says why, never
falling back to Landlock's port rules. The chosen stack is in the
plan: `LaunchPlan.stack`, e.g. `("bwrap", "landlock", "seccomp")`, and the provider's name
in `LaunchPlan.provider` (so results say what really ran).

A policy whose `min_boundary` is above `host-kernel` goes to the fastest provider of that
class or stronger that works here and can serve it (`STRONGER_CANDIDATES`: `gvisor`, then
`qemu`), never to a weaker one.

What it does not do: choose `firejail` (a setuid program with a history of escalations;
only a policy that names it gets it), or fall back to no boundary: when no kernel boundary
works here (or none can serve the policy) it raises `ProviderUnavailable` naming what each
one lacks and pointing at `agent-sandbox doctor`. Running without a kernel boundary takes a
policy that says `provider = "subprocess"` and `no_kernel_boundary = "accepted"`.
A provider named explicitly never goes through here: it runs or raises.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping
from typing import IO, Any, ClassVar

from agent_sandbox._errors import ProviderUnavailable
from agent_sandbox.providers._base import Answer, LaunchPlan, ProbeResult, Provider, WorkerSpec
from agent_sandbox.providers._bwrap import BwrapProvider
from agent_sandbox.providers._landlock import LandlockProvider
from agent_sandbox.providers._netcheck import by_the_chosen_candidate, standard_answers
from agent_sandbox.providers._unshare import UnshareProvider

__all__ = ["AUTO_CANDIDATES", "STRONGER_CANDIDATES", "AutoProvider", "choose_plan"]

_log = logging.getLogger("agent_sandbox.provider")
_logged: set[tuple[str, tuple[str, ...]]] = set()


def _log_choice(policy: Any, plan: LaunchPlan, refused: list[str]) -> None:
    """INFO the first time a policy gets a stack in this process (and why not a deeper one);
    DEBUG after that."""
    key = (str(getattr(policy, "name", "")), tuple(plan.stack))
    level = logging.DEBUG if key in _logged else logging.INFO
    _logged.add(key)
    _log.log(
        level,
        "auto chose %s for policy %r%s",
        "+".join(plan.stack),
        key[0],
        f" (not available for it: {'; '.join(refused)})" if refused else "",
    )


#: The providers `auto` considers for a policy with `min_boundary` above `host-kernel`,
#: fastest first (by name: qemu's module is imported only when asked for).
STRONGER_CANDIDATES: tuple[str, ...] = ("gvisor", "qemu")

#: The providers `auto` considers, strongest first. NOTE: firejail is left out on purpose.
AUTO_CANDIDATES: tuple[type[Provider], ...] = (
    BwrapProvider,
    UnshareProvider,
    LandlockProvider,
)


def choose_plan(plans: list[tuple[Provider, LaunchPlan]]) -> tuple[Provider, LaunchPlan]:
    """The deepest stack among candidate plans; the stronger provider wins a tie (pure)."""
    if not plans:
        raise ProviderUnavailable("auto", "no kernel sandbox can serve this policy here")
    return max(plans, key=lambda pair: (len(pair[1].stack), pair[0].strength))


class AutoProvider(Provider):
    """Choose, per policy, the deepest provider stack that works on this machine."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(
        by_the_chosen_candidate, by_the_chosen_candidate
    )

    name: ClassVar[str] = "auto"
    strength: ClassVar[int] = 0
    is_boundary: ClassVar[bool] = False

    def __init__(
        self,
        candidates: tuple[Provider, ...] | None = None,
        stronger: tuple[Provider, ...] | None = None,
    ) -> None:
        self.candidates = candidates or tuple(cls() for cls in AUTO_CANDIDATES)
        self._stronger = stronger

    @property
    def stronger(self) -> tuple[Provider, ...]:
        """The providers for a policy whose `min_boundary` is above `host-kernel`, fastest
        first: gVisor (a user-space kernel), then QEMU (a virtual machine)."""
        if self._stronger is None:
            # Their own modules, not the registry's lookup: the registry imports this module
            # (qemu's brings its image builder, so it is imported only here, when asked for).
            from agent_sandbox.providers.gvisor.provider import GvisorProvider
            from agent_sandbox.providers.qemu.provider import QemuProvider

            classes: dict[str, type[Provider]] = {"gvisor": GvisorProvider, "qemu": QemuProvider}
            self._stronger = tuple(classes[name]() for name in STRONGER_CANDIDATES)
        return self._stronger

    def provider_named(self, name: str) -> Provider:
        """The candidate (of either list) called `name`."""
        for provider in self.candidates:
            if provider.name == name:
                return provider
        for provider in self.stronger:  # built only when a plan names one of them
            if provider.name == name:
                return provider
        raise ProviderUnavailable("auto", f"the plan names an unknown provider {name!r}")

    def available(self) -> list[Provider]:
        return [p for p in self.candidates if p.probe().available]

    def probe(self) -> ProbeResult:
        usable = self.available()
        why = {p.name: p.probe().reason for p in self.candidates if p not in usable}
        names = [p.name for p in usable]
        return ProbeResult(
            self.name,
            bool(usable),
            reason="" if usable else _no_boundary(why),
            version=" > ".join(names),
            details={"candidates": names, "unavailable": why},
        )

    def _build_stronger(self, policy: Any, spec: WorkerSpec, minimum: str) -> LaunchPlan:
        """The first provider of `stronger` (fastest first) that meets `minimum`, works here
        and can serve the policy; never one below `minimum`."""
        from agent_sandbox.policies._model import meets_boundary

        refused: list[str] = []
        for provider in self.stronger:
            if not meets_boundary(provider.name, minimum):
                continue
            probe = provider.probe()
            if not probe.available:
                refused.append(f"{provider.name}: {probe.reason}")
                continue
            try:
                plan = provider.build(policy, spec)
            except ProviderUnavailable as exc:
                refused.append(f"{provider.name}: {exc.reason}")
                continue
            _log_choice(policy, plan, refused)
            return plan
        raise ProviderUnavailable(
            "auto",
            f'no provider meeting min_boundary = "{minimum}" can serve this policy here'
            + (f" ({'; '.join(refused)})" if refused else ""),
        )

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        minimum = str(getattr(policy, "min_boundary", "host-kernel"))
        if minimum != "host-kernel":
            return self._build_stronger(policy, spec, minimum)
        plans: list[tuple[Provider, LaunchPlan]] = []
        refused: list[str] = []
        networked = policy.net.allows_any()
        # Strongest first: a candidate whose deepest stack cannot beat (or tie) the best plan
        # so far is never built (building is the Landlock rules' walk of the policy's paths,
        # the seccomp program, ...; three builds were most of a `Sandbox()` under `auto`).
        for provider in sorted(self.available(), key=lambda p: -p.strength):
            best = choose_plan(plans) if plans and not networked else None
            if (
                best is not None
                and provider.deepest_stack is not None
                and (provider.deepest_stack, provider.strength)
                < (len(best[1].stack), best[0].strength)
            ):
                continue
            try:
                plans.append((provider, provider.build(policy, spec)))
            except ProviderUnavailable as exc:
                refused.append(f"{provider.name}: {exc.reason}")
        if networked:
            # Never weaker for a policy with network rules than for one without: host names
            # hold only behind the egress proxy of a namespace provider (Landlock alone
            # refuses such rules in its own build, `_netcheck`).
            from agent_sandbox.providers._netcheck import refuse_unenforceable

            held = []
            for p, plan in plans:
                try:
                    refuse_unenforceable(p, policy)
                except ProviderUnavailable as exc:
                    refused.append(f"{p.name}: {exc.reason}")
                    continue
                if "egress" in plan.worker_setup or p.name == "landlock":
                    held.append((p, plan))
            if not held:
                raise ProviderUnavailable(
                    "auto",
                    "the policy's [net] rules need a namespace provider (bwrap or unshare) "
                    "whose egress proxy enforces host names"
                    + (f" ({'; '.join(refused)})" if refused else ""),
                )
            plans = held
        if not plans:
            if refused:
                raise ProviderUnavailable(
                    "auto",
                    f"no kernel sandbox can serve this policy here ({'; '.join(refused)})",
                )
            self.require()
        plan = choose_plan(plans)[1]
        _log_choice(policy, plan, refused)
        return plan

    def launch(self, plan: LaunchPlan, log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Launch with the provider that built the plan (its launcher may be special)."""
        return self.provider_named(plan.provider).launch(plan, log)


def _no_boundary(why: dict[str, str]) -> str:
    missing = "; ".join(f"{name}: {reason}" for name, reason in why.items())
    return f"no kernel sandbox works here ({missing or 'no candidates'})"
