"""The `bwrap` provider: the worker inside bubblewrap namespaces (works with bubblewrap 0.8.0).

What it enforces, for native code too:

* new user, mount, PID, network, IPC, UTS (and cgroup, where possible) namespaces
  (`--unshare-all --unshare-user`); nested user namespaces are disabled (`--disable-userns`);
* no capabilities (`--cap-drop ALL`; without it bwrap run as root keeps every capability and
  the sandbox can remount its read-only binds writable), and no-new-privileges;
* a filesystem view of only: `/usr` read-only, the interpreter prefix and virtualenv, the
  import roots and the `agent_sandbox` packages read-only, the policy's read paths read-only,
  the scratch directory and the policy's write paths writable, a minimal `/dev`, a fresh
  `/proc`, a size-capped private `/tmp` (see `_view.py`); the rest of the host is absent;
* no network of the host: only the namespace's own loopback exists (bwrap brings `lo` up),
  so host ports and host abstract Unix sockets are unreachable; a policy with `[net]` rules
  gets the host's egress proxy on that loopback (`_host/egress/proxy.py`), the only way out;
* a new session (`--new-session`, the TIOCSTI class of escape) and death with the parent
  (`--die-with-parent`); bwrap is PID 1 of the namespace and reaps orphans;
* the seccomp filter of `providers._seccomp` (`--seccomp FD`) and Landlock inside the
  namespace (the worker restricts itself) when both are available: see `LaunchPlan.stack`.

What it does not enforce: the worker runs as uid 0 mapped to the host's uid 0 (with no
capabilities), so files it can see and that root owns are readable as owner: the view, not
the uid, is the boundary. Globs and hidden names inside a bound tree are left to the guards
and Landlock. CPU, memory and process limits come from the worker's rlimits, not bwrap.
bubblewrap 0.8.0 lacks `--argv0` and the overlay options; neither is used.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import IO, Any, ClassVar

from agent_sandbox.providers._base import (
    Answer,
    LaunchPlan,
    ProbeResult,
    Provider,
    WorkerSetup,
    WorkerSpec,
    base_env,
    worker_argv,
)
from agent_sandbox.providers._grants import grant_pins
from agent_sandbox.providers._netcheck import namespace_net, standard_answers
from agent_sandbox.providers._probe_cache import cached_probe, file_key
from agent_sandbox.providers._view import (
    TMPFS_BYTES,
    HostLayout,
    Mount,
    allow_proxy_port,
    egress_plan,
    host_layout_for,
    mounts_for,
    path_view,
)

__all__ = [
    "SECCOMP_FD_SLOT",
    "TEMPLATE_CAPS",
    "BwrapPlan",
    "BwrapProvider",
    "bwrap_argv",
    "stacked_layers",
    "template_argv",
]

#: Stands in the argv for the descriptor number of the seccomp program; `launch()` puts the
#: program in a memfd and writes its number here (a plan is data: it cannot hold a live fd).
SECCOMP_FD_SLOT = "@seccomp-fd"
_MASK_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class BwrapPlan(LaunchPlan):
    """A launch plan plus the seccomp program that `launch()` hands to bwrap by descriptor."""

    seccomp_bpf: bytes = b""


def _mount_args(mount: Mount) -> list[str]:
    kind, dst, src = mount.kind, mount.dst, mount.src
    if kind == "ro":
        return ["--ro-bind", src, dst]
    if kind == "rw":
        return ["--bind", src, dst]
    if kind == "ro-try":
        return ["--ro-bind-try", src, dst]
    if kind == "rw-try":
        return ["--bind-try", src, dst]
    if kind == "symlink":
        return ["--symlink", src, dst]
    if kind == "dev":
        return ["--dev", dst]
    if kind == "proc":
        return ["--proc", dst]
    if kind == "tmpfs":
        return ["--size", str(TMPFS_BYTES), "--tmpfs", dst]
    if kind == "scratch":
        return ["--perms", "0700", "--size", src, "--tmpfs", dst]
    if kind == "mask-dir":
        return ["--size", str(_MASK_BYTES), "--tmpfs", dst, "--remount-ro", dst]
    if kind == "mask-file":
        return ["--ro-bind", "/dev/null", dst]
    raise ValueError(f"unknown mount kind {kind!r}")


def bwrap_argv(
    policy: Any, spec: WorkerSpec, host: HostLayout, *, bwrap: str = "bwrap", seccomp: bool = False
) -> tuple[str, ...]:
    """The whole bwrap command line for one worker (pure; unit tests compare it exactly).

    1. namespaces and privileges: everything unshared, nested user namespaces disabled,
       death with the parent, a new session, no capabilities;
    2. the mounts of `_view.mounts_for`, in order (bwrap applies them in argv order);
    3. the working directory (scratch), the seccomp program when there is one;
    4. `--` and the worker's own command line.
    """
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
    ]
    for mount in mounts_for(policy, spec, host):
        argv += _mount_args(mount)
    argv += ["--chdir", spec.scratch]
    if seccomp:
        argv += ["--seccomp", SECCOMP_FD_SLOT]
    argv += ["--", *worker_argv(spec)]
    return tuple(argv)


#: What a worker template inside the sandbox keeps (`_worker/nstemplate.py`): enough to give
#: each forked worker namespaces and mounts of its own (SYS_ADMIN, NET_ADMIN for `lo`), to let
#: the worker empty its bounding set (SETPCAP), and to forbid user namespaces in the whole
#: sandbox at its start (SYS_RESOURCE, dropped right after). No worker keeps any of them.
TEMPLATE_CAPS = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETPCAP", "CAP_SYS_RESOURCE")


def template_argv(worker_argv: tuple[str, ...]) -> tuple[str, ...]:
    """The command line of a worker template inside the sandbox, from a worker's (pure).

    The same view and namespaces, without the seccomp filter (each forked worker loads it
    itself) and without `--disable-userns` (its nested user namespace would lock the mounts
    the template needs to give each worker a fresh `/proc`; the template forbids new user
    namespaces itself instead), and with `TEMPLATE_CAPS` added after `--cap-drop ALL`.
    """
    argv = list(worker_argv)
    if "--seccomp" in argv:
        at = argv.index("--seccomp")
        del argv[at : at + 2]
    argv.remove("--disable-userns")
    at = argv.index("--cap-drop") + 2
    argv[at:at] = [word for cap in TEMPLATE_CAPS for word in ("--cap-add", cap)]
    return tuple(argv)


@functools.cache
def _probe(bwrap: str) -> ProbeResult:
    """Run a minimal sandbox once (cached in the process, and across processes while nothing
    it depends on changed: `_probe_cache`): the only honest answer to "does it work here"."""
    path = shutil.which(bwrap)
    if path is None:
        return ProbeResult("bwrap", False, "the `bwrap` executable (bubblewrap) is not on PATH")
    return cached_probe("bwrap", {"bwrap": file_key(path)}, lambda: _trial(path))


def _trial(path: str) -> ProbeResult:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        version = out.stdout.strip().rpartition(" ")[2]
        trial = subprocess.run(
            [
                path,
                "--unshare-all",
                "--unshare-user",
                "--disable-userns",
                "--die-with-parent",
                "--new-session",
                "--cap-drop",
                "ALL",
                "--ro-bind",
                "/",
                "/",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--",
                "/bin/sh",
                "-c",
                "exit 0",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ProbeResult("bwrap", False, f"running {path} failed: {exc}")
    if trial.returncode != 0:
        err = trial.stderr.strip().splitlines()
        return ProbeResult(
            "bwrap",
            False,
            f"bwrap cannot create its namespaces here ({err[-1] if err else trial.returncode}); "
            "user namespaces may be disabled (kernel.unprivileged_userns_clone, "
            "user.max_user_namespaces) or blocked by the container runtime",
            version=version,
        )
    return ProbeResult("bwrap", True, version=version, details={"path": path, "boundary": True})


def stacked_layers(
    policy: Any,
    spec: WorkerSpec,
    view: Mapping[str, str],
    pins: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], bytes, tuple[str, ...]]:
    """Landlock (the worker applies it) and seccomp (raw BPF) when each works here.

    Returns the `worker_setup` fragment, the BPF program (empty without seccomp) and the
    names of the layers added, for `LaunchPlan.stack`.
    """
    from agent_sandbox.providers import _landlock, _seccomp

    setup: dict[str, Any] = {}
    layers: list[str] = []
    if _landlock.probe_landlock().available:
        setup["landlock"] = _landlock.landlock_setup(policy, spec, view=view, pins=pins)
        layers.append("landlock")
    bpf = b""
    if _seccomp.probe_seccomp()[0]:
        bpf = _seccomp.build_bpf(policy)
        # bwrap loads `bpf` before it execs the worker; the exec program must come after.
        setup.update(_seccomp.exec_setup(policy))
        layers.append("seccomp")
    return setup, bpf, tuple(layers)


class BwrapProvider(Provider):
    """Start the worker under bubblewrap, optionally with Landlock and seccomp stacked inside."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(namespace_net)

    name: ClassVar[str] = "bwrap"
    strength: ClassVar[int] = 40
    deepest_stack: ClassVar[int | None] = 3  # the namespaces, Landlock, seccomp
    is_boundary: ClassVar[bool] = True

    def __init__(self, *, bwrap: str = "bwrap", stack: bool = True) -> None:
        self.bwrap = bwrap
        self.stack = stack

    def probe(self) -> ProbeResult:
        return _probe(self.bwrap)

    def build(self, policy: Any, spec: WorkerSpec) -> BwrapPlan:
        pins = grant_pins(policy, spec)  # refuses a grant that runs through a link
        egress, proxy_vars, egress_fds = egress_plan(self, policy, spec)
        probe = self.probe()
        exe = str(probe.details.get("path", self.bwrap))
        host = host_layout_for(policy, spec)
        setup: dict[str, Any] = {}
        bpf = b""
        layers: tuple[str, ...] = ()
        if self.stack:
            view = path_view(mounts_for(policy, spec, host))
            setup, bpf, layers = stacked_layers(policy, spec, view, pins)
        if pins:
            setup = {**setup, "pins": pins}
        if egress:
            setup.update(egress)
            allow_proxy_port(setup, egress["egress"]["port"])
        return BwrapPlan(
            provider=self.name,
            argv=bwrap_argv(policy, spec, host, bwrap=exe, seccomp=bool(bpf)),
            env=base_env(spec, proxy_vars),
            pass_fds=(spec.listen_fd, spec.boot_fd, *egress_fds),
            cwd=spec.scratch,
            worker_setup=WorkerSetup(**setup),
            stack=(self.name, *layers, *(("egress-proxy",) if egress else ())),
            worker_depth=2,  # bwrap, then its init (PID 1 inside), then the worker
            seccomp_bpf=bpf,
        )

    def launch(self, plan: LaunchPlan, log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start bwrap; the seccomp program travels in a memfd whose number fills the slot."""
        bpf = plan.seccomp_bpf if isinstance(plan, BwrapPlan) else b""
        if not bpf:
            return super().launch(plan, log)
        fd = os.memfd_create("agent-sandbox-seccomp", 0)  # not inheritable by default
        try:
            os.write(fd, bpf)
            os.lseek(fd, 0, os.SEEK_SET)
            argv = tuple(str(fd) if a == SECCOMP_FD_SLOT else a for a in plan.argv)
            real = dataclasses.replace(plan, argv=argv, pass_fds=(*plan.pass_fds, fd))
            return super().launch(real, log)
        finally:
            os.close(fd)
