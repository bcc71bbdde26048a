"""Observing a run for learning mode: the envelope it runs in, one learning run, the adapter hook.

`learning_envelope` is step 1 of learning mode (see `agent_sandbox._tools.learn`): the
tool's policy in `mode = "learn"`, under a kernel provider, never wider than the policy it
starts from (`envelope_report` says what differs). `learn_run` runs code once in it and
proposes; `Learner` collects a conversation's results for the adapters.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import threading
from typing import TYPE_CHECKING, Any

from agent_sandbox._denial import Denial
from agent_sandbox._errors import LearningError
from agent_sandbox._host.result import RunResult
from agent_sandbox._tools.learn.findings import _LOADER_ENV, _SECRET_ENV, _rule_text, _source_path
from agent_sandbox._tools.learn.propose import propose
from agent_sandbox._tools.learn.review import file_digest, proposal_paths, write_proposal
from agent_sandbox.policies import Policy
from agent_sandbox.policies._paths import literal as as_literal

if TYPE_CHECKING:
    from agent_sandbox._tools.learn.review import Proposal, ProposalFiles

__all__ = ["Learner", "LearningRun", "envelope_report", "learn_run", "learning_envelope"]


# -- the learning envelope --------------------------------------------------------------


def learning_envelope(policy: Policy, *, provider: str | None = None) -> Policy:
    """The policy to run a learning session under: `policy` in mode `learn`, contained.

    The provider is `provider` when given (an error if it is unavailable), else the policy's
    own provider when it names one other than `subprocess`, else `auto`, which picks the
    deepest kernel stack that serves the policy and names it in the result (see
    `envelope_report`). Files, network, imports and calls stay as declared: the guards record
    what they would refuse, and the kernel provider still holds writes to the scratch
    directory and the declared write paths. Secret-looking and loader variables are dropped
    from `env.pass`, and the policy file and its proposal files are added to `files.deny`;
    nothing is widened.
    """
    from agent_sandbox.providers import get_provider, select_provider

    requested = provider
    if requested is None:
        requested = policy.provider if policy.provider != "subprocess" else "auto"
    if requested == "auto":
        get_provider("auto").require()
        name = "auto"
    else:
        name = select_provider(requested).name
    passthrough = tuple(p for p in policy.env.passthrough if not _env_pattern_unsafe(p))
    overrides: dict[str, Any] = {
        "mode": "learn",
        "provider": name,
        "env": {"pass": list(passthrough)},
    }
    path = _source_path(policy)
    if path:
        # The policy file and its proposal files are masked where the kernel provider can.
        own = [
            as_literal(p)
            for p in [os.path.abspath(path), *map(str, proposal_paths(os.path.abspath(path)))]
        ]
        overrides["files"] = {"deny": list(dict.fromkeys([*policy.files.deny, *own]))}
    return policy.merged(overrides)


def _boundary_names() -> list[str]:
    """The kernel providers `auto` can use here, strongest first."""
    from agent_sandbox.providers import get_provider

    details = get_provider("auto").probe().details
    names = [str(n) for n in details.get("candidates", ())]
    return [n for n in names if get_provider(n).is_boundary]


def envelope_report(policy: Policy, envelope: Policy, ran_under: str = "") -> list[str]:
    """What the learning run is allowed, in lines a person reads before trusting the result.

    `ran_under` is `RunResult.provider` after the run (what `auto` really chose).
    """
    from agent_sandbox.providers import get_provider

    lines = []
    unbounded = (
        "NO kernel boundary: operations the guards record also take effect; "
        "learn only on code you trust"
    )
    if ran_under:
        bounded = get_provider(ran_under).is_boundary
        lines.append(f"ran under: {ran_under}" + ("" if bounded else f" ({unbounded})"))
    elif envelope.provider == "auto":
        kernels = _boundary_names()
        if kernels:
            lines.append(
                f"provider: auto, the deepest kernel stack that serves this policy "
                f"(kernel boundary; candidates here: {', '.join(kernels)})"
            )
        else:
            lines.append(f"provider: auto, and no kernel provider works here ({unbounded})")
    elif get_provider(envelope.provider).is_boundary:
        lines.append(f"provider: {envelope.provider} (kernel boundary)")
    else:
        lines.append(f"provider: {envelope.provider} ({unbounded})")
    writes = [w for w in envelope.files.write if not w.startswith("$SCRATCH")]
    lines.append("writes: the scratch directory" + (f" and {', '.join(writes)}" if writes else ""))
    allowed = [_rule_text(r) for r in envelope.net.rules]
    lines.append("network: " + ("; ".join(allowed) if allowed else "none"))
    dropped = sorted(set(policy.env.passthrough) - set(envelope.env.passthrough))
    lines.append(
        "environment passed: "
        + (", ".join(envelope.env.passthrough) or "none")
        + (f" (withheld while learning: {', '.join(dropped)})" if dropped else "")
    )
    lines.append("mode: learn (operations the policy refuses are recorded and allowed)")
    return lines


def _env_pattern_unsafe(pattern: str) -> bool:
    """Whether passing `pattern` could hand a secret or a loader variable to the worker."""
    if _LOADER_ENV.match(pattern) or _SECRET_ENV.search(pattern):
        return True
    if any(ch in pattern for ch in "*?"):
        if pattern.strip("*?") == "":
            return True
        return any(
            (_SECRET_ENV.search(name) or _LOADER_ENV.match(name))
            and fnmatch.fnmatchcase(name, pattern)
            for name in os.environ
        )
    return False


# -- one learning run -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LearningRun:
    """One learning run: its result, the proposal, the envelope it ran in and its report."""

    result: RunResult
    proposal: Proposal
    envelope: Policy
    report: tuple[str, ...]
    #: The policy file's digest before the run (`""` for a policy without a file).
    digest: str = ""


def learn_run(
    code: str,
    policy: Policy | str | os.PathLike[str],
    *,
    provider: str | None = None,
    timeout: float | None = None,
    on_event: Any = None,
) -> LearningRun:
    """Run `code` once in the learning envelope of `policy` and propose from what it needed.

    Nothing is written: pass the result's proposal and digest to `write_proposal`. Raises
    `LearningError` when the policy file changed during the run.
    """
    from agent_sandbox._host.sandbox import Sandbox
    from agent_sandbox.policies import resolve_policy

    current = resolve_policy(policy)
    path = _source_path(current)
    digest = file_digest(path) if path else ""
    envelope = learning_envelope(current, provider=provider)
    report = tuple(envelope_report(current, envelope))
    with Sandbox(envelope, warm=0) as sandbox:
        result = sandbox.run(code, timeout=timeout, on_event=on_event)
    if path and file_digest(path) != digest:
        raise LearningError(
            "the policy file changed while the learning run ran; no proposal was made. "
            "Check the file: the run may have edited it",
            path=path,
        )
    if result.provider:
        report = (*report, envelope_report(current, envelope, ran_under=result.provider)[0])
    proposal = propose(current, [result])
    return LearningRun(result, proposal, envelope, report, digest)


# -- the adapter hook -------------------------------------------------------------------


class Learner:
    """Collects learning-mode results per tool across a conversation; one proposal per tool.

    Framework-free: an adapter in learning mode runs each call under `envelope(policy)` and
    hands the result to `record(tool, policy, result)`; at the end `write()` writes one
    proposal per tool beside its policy file (or in `out_dir` for policies without a file).
    Thread-safe. It remembers each policy file's digest at the first call, so a policy edited
    during the conversation is refused at `write()`.
    """

    def __init__(
        self, *, out_dir: str | os.PathLike[str] | None = None, provider: str | None = None
    ) -> None:
        self.out_dir = out_dir
        self.provider = provider
        self._lock = threading.Lock()
        self._policies: dict[str, Policy] = {}
        self._records: dict[str, list[Denial]] = {}
        self._digests: dict[str, str] = {}

    def envelope(self, policy: Policy, *, provider: str | None = None) -> Policy:
        """The learning envelope for `policy` (see `learning_envelope`); `provider` (the
        tool's own choice) beats the learner's."""
        return learning_envelope(policy, provider=provider or self.provider)

    def watch(self, tool: str, policy: Policy) -> None:
        """Register `tool` and its (enforced) policy before its first call."""
        with self._lock:
            known = self._policies.get(tool)
            if known is not None and known.fingerprint() != policy.fingerprint():
                raise LearningError(f"tool {tool!r} was registered with another policy")
            self._policies[tool] = policy
            self._records.setdefault(tool, [])
            path = _source_path(policy)
            if path and tool not in self._digests:
                self._digests[tool] = file_digest(path)

    def record(self, tool: str, policy: Policy, result: RunResult) -> None:
        """Add one call's result for `tool` (its would-be denials become learning records)."""
        self.watch(tool, policy)
        with self._lock:
            self._records[tool].extend(result.denials)

    def tools(self) -> list[str]:
        with self._lock:
            return sorted(self._policies)

    def proposals(self) -> dict[str, Proposal]:
        """One proposal per tool, from everything recorded so far."""
        with self._lock:
            items = [(t, self._policies[t], list(self._records[t])) for t in sorted(self._policies)]
        return {tool: propose(policy, records) for tool, policy, records in items}

    def write(self) -> dict[str, ProposalFiles]:
        """Write every tool's proposal; returns where each went.

        Beside a policy file the proposal is named after the file; tools that share one
        policy file share one proposal, learned from all their calls. With `out_dir`, each
        tool gets `<tool>.proposed.toml` there.
        """
        with self._lock:
            items = [(t, self._policies[t], list(self._records[t])) for t in sorted(self._policies)]
        groups: dict[str, list[tuple[str, Policy, list[Denial]]]] = {}
        for tool, policy, records in items:
            path = _source_path(policy) if self.out_dir is None else None
            groups.setdefault(os.path.abspath(path) if path else f"tool:{tool}", []).append(
                (tool, policy, records)
            )
        out: dict[str, ProposalFiles] = {}
        for members in groups.values():
            tool, policy, _ = members[0]
            records = [r for _, _, recs in members for r in recs]
            files = write_proposal(
                propose(policy, records),
                out_dir=self.out_dir,
                expect_digest=self._digests.get(tool),
                name=f"{_safe_name(tool)}.toml",
            )
            for member, _, _ in members:
                out[member] = files
        return out


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".") or "tool"
