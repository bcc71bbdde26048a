"""The provider interface: a pure builder from (policy, worker spec) to a launch plan.

A provider decides how the worker process is started and which kernel restrictions it
runs under. It has three parts:

1. `probe()` says whether it works on this machine and, if not, why (no side effects
   beyond harmless checks; results may be cached).
2. `build(policy, spec)` is a pure function returning a `LaunchPlan`: the argv, the
   environment, the inherited descriptors and the in-worker setup (for example a
   Landlock ruleset the worker applies to itself before serving). Tests compare plans
   exactly.
3. `launch(plan)` is the thin applier: one `subprocess.Popen` in a new session.

A provider named explicitly that cannot run raises `ProviderUnavailable`; only `auto`
chooses among providers.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Callable, Mapping
from typing import IO, Any, ClassVar

from agent_sandbox._errors import ProviderUnavailable
from agent_sandbox._wire import WorkerSetup

__all__ = [
    "Answer",
    "LaunchPlan",
    "ProbeResult",
    "Provider",
    "Unenforced",
    "WorkerSetup",
    "WorkerSpec",
]

#: What a provider cannot hold of one section of a policy, rule by rule: (the rule's index in
#: the section, or None for the whole section; why; which provider can).
Answer = Callable[[Any], list[tuple[int | None, str, str]]]
#: One such thing, with its section: (section, index or None, why, which provider can).
Unenforced = tuple[str, int | None, str, str]


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything about one worker that does not come from the policy.

    `scratch` is the worker's private, writable working directory; `control_dir` is the
    parent's 0700 directory holding the socket and the log (never visible to user code
    as writable); `listen_fd` is the inherited listening socket; `boot_fd` is the read end
    of the pipe that carries the boot configuration; `python` is the absolute interpreter
    (never `python3` from PATH); `boot_script` is the worker entry point; `sys_path` are the
    import roots the worker needs (standard library first); `package_dirs` maps each
    `agent_sandbox` package to its folder on disk; `env` is the environment already filtered
    by the policy.
    """

    python: str
    boot_script: str
    scratch: str
    control_dir: str
    listen_fd: int
    boot_fd: int
    sys_path: tuple[str, ...]
    package_dirs: Mapping[str, str]
    env: Mapping[str, str]
    prefix: str
    base_prefix: str
    #: The worker's end of the channel that carries its egress-proxy listener to the host
    #: (`_host/egress/proxy.py`); -1 when there is none.
    egress_fd: int = -1
    #: The read end of the worker's life line: a pipe whose only write end the agent holds.
    #: A provider whose worker no parent-death signal reaches passes it on (in `pass_fds`);
    #: the worker asks the kernel for SIGKILL when the pipe's last writer closes, that is
    #: when the agent is gone however it died (`_worker/boot.py`). -1 when there is none.
    life_fd: int = -1


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """How to start one worker: the result of a provider's pure `build()`.

    `worker_setup` is what the worker applies to itself before it serves (a `WorkerSetup`
    record of the shared wire module, for example its `landlock` ruleset); `cleanup_paths`
    are host paths the parent removes when the worker is gone.
    """

    provider: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    pass_fds: tuple[int, ...]
    cwd: str
    worker_setup: WorkerSetup = dataclasses.field(default_factory=WorkerSetup)
    stack: tuple[str, ...] = ()
    cleanup_paths: tuple[str, ...] = ()
    #: How many launcher processes stand above the worker (0: the launched process is the
    #: worker); None when the launcher's tree has no fixed shape. The parent uses it to
    #: place the worker in its cgroups (`_limits.WorkerCgroups`).
    worker_depth: int | None = 0
    #: The launched process forwards SIGINT to the worker (the worker has no host pid: it
    #: runs in a VM), so the parent's interrupt signals the launcher itself.
    interrupt_launcher: bool = False
    #: The launched process is the worker's keeper (`_worker/boot.py`): a subreaper that
    #: forks the worker below it (`worker_depth` 1) and ends the worker and everything it
    #: started, detached or not, when the host's launch thread dies (the agent and its
    #: guardian killed together). For providers with no pid namespace to die with.
    keeper: bool = False
    #: A host file where the launcher keeps the limit counters the sandbox side reported
    #: (a VM's guest agent: `qemu/relay.py`); the parent turns new counts into denials
    #: marked as the worker side's word (`_limits.GuestLimits`). "" when there is none.
    limit_reports: str = ""
    #: Run one constant call (`None`, file name `<warm-up>`) before the worker is handed
    #: out: a restored VM's translation cache starts cold, so the first call would pay for
    #: translating the whole call path (~0.1-0.2 s under TCG); a pool's worker pays it
    #: while it waits instead.
    warm_up: bool = False
    #: The host path of the socket the worker binds itself, inside a directory of its
    #: control directory the sandbox shares (gVisor hands a sandbox no listening socket);
    #: "" when the worker serves on the inherited `listen_fd`. The parent waits for it and
    #: connects through a descriptor pinned with O_NOFOLLOW, never through the path again.
    socket_path: str = ""
    #: Room in the worker's cgroups for a launcher that joins them itself and keeps running
    #: beside the worker (gVisor's Sentry and gofer: their own threads count in `pids.max`,
    #: their memory in the memory limit); the worker's own limits stay the policy's.
    launcher_tasks: int = 0
    launcher_mb: int = 0
    #: A command that delivers the parent's interrupt (SIGINT) to the worker, for a
    #: launcher that does not forward it (`runsc run` dies of it): () to signal the pid.
    interrupt_argv: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Whether a provider works here; `reason` says why not, `version` what was found."""

    name: str
    available: bool
    reason: str = ""
    version: str = ""
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Provider:
    """Base class: subclasses set `name`, `strength` and implement `probe` and `build`."""

    name: ClassVar[str] = ""
    #: Higher is stronger; `auto` picks the strongest available stack.
    strength: ClassVar[int] = 0
    #: Whether the provider is a kernel boundary against hostile code.
    is_boundary: ClassVar[bool] = False
    #: The most entries a plan's `stack` can list for a policy without network rules (None:
    #: unknown). `auto` builds no plan of a candidate that could not beat one it has.
    deepest_stack: ClassVar[int | None] = None
    #: What it enforces, declared on the class: for each section of the policy
    #: (`policies._model.SECTIONS`), a function listing what of that section it cannot hold
    #: below Python (`providers/_netcheck.py` has them). A section it does not answer is
    #: unenforceable: every policy is refused under it (`unenforceable`), and a test
    #: generated from the policy model names the provider and the section.
    answers: ClassVar[Mapping[str, Answer]] = {}

    def unenforceable(self, policy: Any) -> list[Unenforced]:
        """What of `policy` this provider cannot hold below Python, section by section; an
        unanswered section is unenforceable as a whole (each of its rules, when it has
        rules), so a provider that answers nothing refuses every policy."""
        from agent_sandbox.policies._model import SECTIONS

        out: list[Unenforced] = []
        for section in SECTIONS:
            answer = type(self).answers.get(section)
            if answer is not None:
                out.extend((section, *problem) for problem in answer(policy))
                continue
            why = (
                f"no statement of what {self.name or type(self).__name__!r} enforces of "
                f"[{section}] below Python (its class's `answers`)"
            )
            rules = getattr(getattr(policy, section, None), "rules", None) or ()
            if rules:
                fix = "a provider that answers it"
                out.extend((section, i, why, fix) for i in range(len(rules)))
            else:
                out.append((section, None, why, "a provider that answers it"))
        return out

    def probe(self) -> ProbeResult:
        """Say whether this provider works on this machine, and why not."""
        raise NotImplementedError

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        """Turn (policy, spec) into a launch plan. Must be pure: no I/O, no side effects."""
        raise NotImplementedError

    def prepare(self, policy: Any) -> None:
        """One-time set-up a start under `policy` needs (an image, a template), done before
        the start's timeout begins; raises ProviderUnavailable naming the fix. Nothing by
        default."""

    def require(self) -> ProbeResult:
        """Probe and raise `ProviderUnavailable` naming what is missing when it cannot run."""
        result = self.probe()
        if not result.available:
            raise ProviderUnavailable(self.name, result.reason or "probe failed")
        return result

    def launch(self, plan: LaunchPlan, log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start the worker: one Popen in a new session (its own process group)."""
        return subprocess.Popen(
            list(plan.argv),
            env=dict(plan.env),
            cwd=plan.cwd,
            pass_fds=plan.pass_fds,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


def worker_argv(spec: WorkerSpec) -> tuple[str, ...]:
    """The interpreter command line every provider ends with: isolated, no site."""
    return (spec.python, "-I", "-S", "-B", spec.boot_script, str(spec.boot_fd))


def base_env(spec: WorkerSpec, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker environment: the policy-filtered variables plus the fixed ones."""
    env = dict(spec.env)
    env.setdefault("HOME", spec.scratch)
    env["TMPDIR"] = spec.scratch
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("MPLCONFIGDIR", os.path.join(spec.scratch, ".mpl"))
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PATH", "/usr/bin:/bin")
    if extra:
        env.update(extra)
    return env


def package_folder() -> str:
    """The folder of `agent_sandbox/` on disk, after links (a strict editable install reaches
    it through a tree of per-file links): the worker side's modules a launcher or a probe runs
    standalone live under it (`_worker/_ns_launch.py`, `_worker/_inworker.py`)."""
    import agent_sandbox

    return os.path.dirname(os.path.realpath(agent_sandbox.__file__))
