"""The `gvisor` provider: the worker behind gVisor's user-space kernel (`runsc`), rootless.

The boundary is gVisor's Sentry: the worker's system calls are served by a kernel written in
Go that runs as an ordinary host process under its own seccomp filter, so a bug in the host
kernel's system-call surface is not reachable from the worker's code (the Sentry itself
uses a small set of host calls). It is the runtime the cluster path's templates ask for
(`runtimeClassName: gvisor`), so a policy tested here meets the same kernel in a pod.

How a worker starts (`build` is pure, `launch` writes what it says):

* an OCI bundle in the worker's private control directory (`<control>/gvisor/bundle`): a
  `config.json` (`bundle.bundle_config`, compared exactly by the tests) and an empty root directory
  that holds only the merged-/usr symlinks; the root is read-only;
* the mounts of the namespace providers' view (`_view.mounts_for`): `/usr`, the interpreter
  prefix, the import roots and the `agent_sandbox` packages read-only, the policy's read
  grants read-only, its write grants writable, a fresh `/proc`, gVisor's own `/dev`, a
  size-capped `/tmp`, the scratch directory as a tmpfs of `limits.scratch_mb`, and the masks
  over hidden and denied names; nothing else of the host;
* `runsc --rootless --network=none --host-uds=create run`: no network device but the
  Sentry's own loopback; the worker binds its server's Unix socket in a directory of the
  control directory shared for that purpose (`<control>/uds`), and the parent connects to
  it through a descriptor it pinned (never through a path the worker could swap for a link);
* the boot configuration on the worker's standard input (runsc hands the container its
  stdio and no other descriptor); the log gets its standard output and error;
* the worker runs as uid 0 of the sandbox with no capability in any set and
  no-new-privileges (checked in its handshake), under the policy's rlimits set by runsc
  (`RLIMIT_NPROC` is the process limit: gVisor enforces it for uid 0 without capabilities)
  and lowered again by the worker; the seccomp filter of `providers._seccomp` inside the
  Sentry (the exec program when the policy grants no process).

Limits outside the sandbox: the host's cgroups around runsc (memory: the sandbox's pages
live in the Sentry's memory file, charged there, so a hit is the host's OOM kill; CPU;
`pids.max` counts the Sentry's and gofer's own threads too, so it gets their slack), the
host's wall clock, the output bounds. A fork past `limits.processes` is refused inside
(RLIMIT_NPROC) and reported from the worker's count (`limit_report`, the worker side's
word). The Sentry's dentry cache is sized to the host's descriptor limit (`--dcache`).
Every plan's stack starts with `gvisor`. The parent's interrupt goes
through `runsc kill <id> INT` (`LaunchPlan.interrupt_argv`): `runsc run` does not forward
SIGINT, it dies of it.

Network: with `[net]` allow rules, the host's egress proxy as under `bwrap` (the same rules,
the same refusals in `_netcheck.py`): `launch` binds the host's end of the worker's proxy
route in the socket directory (and one socket per allowed loopback service) and the parent
attaches them to its proxy; inside, a relay process the worker forks before its
restrictions listens on the proxy address (and each service's) on the Sentry's loopback and
carries each connection to its socket (`--host-uds=all`).

Grants: walked and pinned at build, walked again on the host just before runsc starts
(`pins.check_pins_on_host`), and once more after the start in the gofer's own root
(`pins.check_pins_in_gofer`), which is what the sandbox was given.

Refused at construction, naming the cause: a grant of a device, a socket or a FIFO (gVisor
serves regular files and directories through its gofer), a `[net]` rule the proxy cannot
serve (UDP, a listener for outside peers), a missing runsc, a runsc older than
`MIN_RELEASE`.

This module is the provider (the plan builder, the probe, the launch); the rest of the
package: `bundle` (the OCI bundle: `GvisorPlan`, `bundle_config`, `write_bundle`), `pins`
(the grants walked again on the host and in the gofer's root), `relay` (the host's side of
the in-sandbox egress relay: the sockets it binds and sends to the parent's proxy).
"""

from __future__ import annotations

import functools
import os
import re
import resource
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping
from typing import IO, Any, ClassVar

from agent_sandbox._errors import ProviderUnavailable
from agent_sandbox.providers._base import (
    Answer,
    LaunchPlan,
    ProbeResult,
    Provider,
    WorkerSetup,
    WorkerSpec,
)
from agent_sandbox.providers._netcheck import namespace_net, standard_answers
from agent_sandbox.providers._probe_cache import cached_probe, file_key
from agent_sandbox.providers._view import (
    egress_plan,
    host_layout_for,
    mounts_for,
    policy_paths,
)
from agent_sandbox.providers.gvisor.bundle import GvisorPlan, _dirs, bundle_config, write_bundle
from agent_sandbox.providers.gvisor.pins import check_pins_on_host
from agent_sandbox.providers.gvisor.relay import send_egress_listener

__all__ = [
    "INSTALL_HINT",
    "MIN_RELEASE",
    "GvisorProvider",
    "refuse_unservable",
    "release_of",
    "runsc_argv",
]


#: The oldest runsc release this provider trusts (the Debian 12 package's): earlier ones
#: lack the rootless `run` with `--host-uds=create` it relies on.
MIN_RELEASE = 20221219
#: What `doctor` and the probe name when runsc is missing.
INSTALL_HINT = (
    "apt-get install runsc (Debian, Ubuntu) or https://gvisor.dev/docs/user_guide/install/"
)
#: The Sentry platform: ptrace works without KVM on every x86-64 and arm64 host.
PLATFORM = "ptrace"
#: Why the provider does not pick gVisor's `kvm` platform by itself (`doctor` prints it).
PLATFORM_NOTE = (
    "the kvm platform (no ptrace stop per system call) is not picked by itself: where "
    "/dev/kvm is nested (kvm_pvm, as on the development host) `runsc --platform=kvm` hangs "
    "at its start, so choosing it would take a trial that may not end; "
    "GvisorProvider(platform='kvm') asks for it"
)
#: Where the worker binds its server's socket, inside `<control>/uds`.
SOCKET_NAME = "ctl.sock"
#: The host's end of the egress proxy route, in the same directory.
EGRESS_SOCKET = "egress.sock"
#: The worker's limit report, in the same directory (`LaunchPlan.limit_reports`).
LIMIT_REPORT = "limits.json"
#: Room in the host's cgroups for runsc, its gofer and the Sentry beside the worker: about
#: 40 host threads at rest (more under load: Go starts threads for blocked calls); the
#: worker's own processes are held inside by RLIMIT_NPROC, which gVisor enforces. Memory:
#: the sandbox's memory (the worker's and its children's pages) lives in the Sentry's memory
#: file, charged to the host's memory cgroup like the Sentry's own heap, so the group's
#: limit is `memory_mb` plus the Sentry's, runsc's and the gofer's own charge: 16-23 MiB
#: here (an idle worker, and one that imported pandas; `memory.stat` rss), with room for
#: more under load. A hit is the host kernel's OOM kill, reported as `limits.memory`.
LAUNCHER_TASKS = 512
LAUNCHER_MB = 64
#: The Sentry's dentry cache (`--dcache`): each cached file holds host descriptors open in
#: the Sentry and the gofer, and without it every mount (the view has dozens) caches up to
#: 1000, so importing pandas ran the gofer past a normal user's `ulimit -n 1024` and the
#: sandbox answered EMFILE (`limits.open_files`, seen in the non-root run). One cache for
#: all mounts, sized to the host's descriptor limit (`dentry_cache_size`), this at most.
DCACHE = 1000


def release_of(version_text: str) -> int | None:
    """The release date (yyyymmdd) in `runsc --version`'s first line, or None."""
    first = version_text.strip().splitlines()[0] if version_text.strip() else ""
    match = re.search(r"(20\d{6})", first)
    return int(match.group(1)) if match else None


def dentry_cache_size(nofile: int) -> int:
    """The Sentry's dentry cache for a host descriptor limit of `nofile` (the hard limit
    runsc inherits: Go raises its soft limit to it): a sixteenth of it, between 64 and
    DCACHE. The gofer holds several descriptors per cached file and more for the mounts
    (measured here: about 330 at rest and 740 after importing pandas with a cache of 64,
    1000 with 256, 2000 with runsc's own per-mount caches), and the code's open files
    (`limits.open_files`) come on top."""
    if nofile == resource.RLIM_INFINITY or nofile < 0:
        return DCACHE
    return max(64, min(DCACHE, nofile // 16))


def container_id(spec: WorkerSpec) -> str:
    """The container's name: its control directory's, unique on the host (runsc names the
    sandbox's control socket after it in the host's abstract socket namespace)."""
    name = re.sub(r"[^\w.+-]", "_", os.path.basename(spec.control_dir.rstrip("/")))
    return name or "agent-sandbox-worker"


def runsc_argv(
    runsc: str,
    state_dir: str,
    bundle_dir: str,
    container_id: str,
    platform: str = PLATFORM,
    *,
    egress: bool = False,
    dcache: int = DCACHE,
) -> tuple[str, ...]:
    """The runsc command line for one worker (pure).

    `--rootless`: runsc sets up its sandbox without root; `--ignore-cgroups`: it makes no
    cgroup of its own (as root it would make one named after the container in every
    hierarchy and leave it when the sandbox ends), so the worker's own groups, which runsc
    is started in, hold it; `--network=none`: no device but the Sentry's loopback;
    `--host-uds=create`: the worker may bind its server's socket in the shared socket
    directory, and connects to no host socket; with egress, `--host-uds=all`: its relay
    also connects to the host's end of the proxy route there (and, as under bwrap, the
    code may connect to a host socket inside what the view binds); `--dcache`: the Sentry's
    dentry cache, one cache for all mounts (`dentry_cache_size`).
    """
    return (
        runsc,
        "--rootless",
        "--ignore-cgroups",
        "--network=none",
        "--host-uds=all" if egress else "--host-uds=create",
        f"--platform={platform}",
        f"--dcache={dcache}",
        "--root",
        state_dir,
        "run",
        "--bundle",
        bundle_dir,
        container_id,
    )


def refuse_unservable(policy: Any, spec: WorkerSpec) -> None:
    """Raise ProviderUnavailable for a grant gVisor cannot serve: a device, a socket, a FIFO.

    gVisor's gofer opens regular files and directories for the sandbox; a grant of anything
    else would not reach the worker, so the policy is refused rather than run without it.
    """
    read, write, _deny = policy_paths(policy, spec)
    for key, paths in (("files.read", read), ("files.write", write)):
        for path in paths:
            if path.startswith(("/proc/", "/dev/")) or path in ("/proc", "/dev"):
                continue  # the view's own fresh /proc and /dev stand for them
            try:
                mode = os.stat(path).st_mode
            except OSError:
                continue
            kind = _special_kind(mode)
            if kind:
                raise ProviderUnavailable(
                    "gvisor",
                    f"{key} {path!r} is {kind}; gVisor serves regular files and directories "
                    "only (remove the grant, or use provider bwrap)",
                )


def _special_kind(mode: int) -> str:
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return ""


@functools.cache
def _probe(runsc: str) -> ProbeResult:
    path = shutil.which(runsc)
    if path is None:
        return ProbeResult(
            "gvisor",
            False,
            f"the `runsc` executable (gVisor) is not on PATH; install: {INSTALL_HINT}",
        )
    return cached_probe("gvisor", {"runsc": file_key(path)}, lambda: _trial(path))


def _trial(path: str) -> ProbeResult:
    """Ask the version, then run `/bin/true` in a rootless sandbox once."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ProbeResult("gvisor", False, f"running {path} --version failed: {exc}")
    version = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    release = release_of(out.stdout)
    if release is None:
        return ProbeResult(
            "gvisor", False, f"cannot read runsc's release from {version!r}", version=version
        )
    if release < MIN_RELEASE:
        return ProbeResult(
            "gvisor",
            False,
            f"runsc {release} is older than {MIN_RELEASE}, the oldest this provider trusts; "
            f"upgrade: {INSTALL_HINT}",
            version=version,
        )
    state = tempfile.mkdtemp(prefix="agent-sandbox-runsc-probe-")
    try:
        trial = subprocess.run(
            [
                path,
                "--rootless",
                "--network=none",
                f"--platform={PLATFORM}",
                "--root",
                state,
                "do",
                "/bin/true",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=state,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ProbeResult("gvisor", False, f"running {path} failed: {exc}", version=version)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    if trial.returncode != 0:
        err = trial.stderr.strip().splitlines()
        return ProbeResult(
            "gvisor",
            False,
            f"runsc cannot start a rootless sandbox here ({err[-1] if err else trial.returncode})",
            version=version,
        )
    return ProbeResult(
        "gvisor",
        True,
        version=version,
        details={"path": path, "boundary": True, "platform": PLATFORM, "release": release},
    )


class GvisorProvider(Provider):
    """Start the worker inside gVisor (`runsc run`, rootless) from a generated OCI bundle."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(namespace_net)

    name: ClassVar[str] = "gvisor"
    strength: ClassVar[int] = 50
    deepest_stack: ClassVar[int | None] = 2  # gVisor, seccomp inside it
    is_boundary: ClassVar[bool] = True

    def __init__(self, *, runsc: str = "runsc", platform: str = PLATFORM) -> None:
        self.runsc = runsc
        self.platform = platform

    def probe(self) -> ProbeResult:
        return _probe(self.runsc)

    def build(self, policy: Any, spec: WorkerSpec) -> GvisorPlan:
        from agent_sandbox._host.egress.handoff import forward_socket_name, loopback_forwards
        from agent_sandbox.providers import _seccomp
        from agent_sandbox.providers._grants import grant_pins
        from agent_sandbox.providers._netcheck import refuse_unenforceable

        refuse_unenforceable(self, policy)  # egress_plan refuses again, same rules
        # Refuses a grant that runs through a link. The pins are checked again by `launch`,
        # on the host: the Sentry's device and inode numbers are its own, not the host's.
        pins = grant_pins(policy, spec)
        refuse_unservable(policy, spec)
        host = host_layout_for(policy, spec)
        present = frozenset(
            m.src
            for m in mounts_for(policy, spec, host)
            if m.kind in ("ro-try", "rw-try") and os.path.exists(m.src)
        )
        bundle, state, uds = _dirs(spec)
        setup: dict[str, Any] = {
            "no_new_privs": True,
            "drop_caps": True,
            "listen_path": os.path.join(uds, SOCKET_NAME),
            # gVisor's kernel refuses a fork past RLIMIT_NPROC and keeps no count of it the
            # host could read: the worker counts the sandbox's processes where a call ends
            # and reports the calls that ended at the limit (`GuestLimits`, the worker
            # side's word).
            "limit_report": {
                "path": os.path.join(uds, LIMIT_REPORT),
                "processes": int(policy.limits.processes),
            },
        }
        layers: tuple[str, ...] = ()
        if _seccomp.probe_seccomp()[0]:
            setup.update(_seccomp.seccomp_setup(policy))
            layers = ("seccomp",)
        egress, proxy_vars, _fds = egress_plan(self, policy, spec)
        if egress:
            # The parent's proxy route ends in the socket directory (`launch` binds it and
            # sends it over the egress channel); a relay inside carries the proxy address
            # on the Sentry's loopback to it (`_inworker.start_egress_relay`).
            setup.update(egress)
            setup["egress"] = {**egress["egress"], "fd": -1}
            setup["egress_relay"] = {
                "host": egress["egress"]["host"],
                "port": egress["egress"]["port"],
                "socket": os.path.join(uds, EGRESS_SOCKET),
                # Allowed loopback services, each through a socket of its own there (named
                # after its address, which the host matches against its own list).
                "forwards": [
                    [host, port, os.path.join(uds, forward_socket_name(host, port))]
                    for host, port in loopback_forwards(policy)
                ],
            }
            layers += ("egress-proxy",)
        exe = str(self.probe().details.get("path", self.runsc))
        return GvisorPlan(
            provider=self.name,
            argv=runsc_argv(
                exe,
                state,
                bundle,
                container_id(spec),
                self.platform,
                egress=bool(egress),
                dcache=dentry_cache_size(resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
            ),
            env=_runsc_env(),
            pass_fds=(),
            cwd=spec.control_dir,
            worker_setup=WorkerSetup(**setup),
            stack=(self.name, *layers),
            worker_depth=None,
            interrupt_launcher=True,
            # The first call on a fresh worker faults in its memory through the Sentry (each
            # first touch is a trip through it under ptrace): a pool's worker pays it while
            # it waits, not the first result (benchmarks/bench_gvisor.py).
            warm_up=True,
            socket_path=os.path.join(uds, SOCKET_NAME),
            limit_reports=os.path.join(uds, LIMIT_REPORT),
            interrupt_argv=(exe, "--rootless", "--root", state, "kill", container_id(spec), "INT"),
            launcher_tasks=LAUNCHER_TASKS,
            launcher_mb=LAUNCHER_MB,
            config=bundle_config(policy, spec, host, present, proxy_vars),
            bundle_dir=bundle,
            state_dir=state,
            pins=pins,
            root_links={p: t for p, t in sorted(host.symlinks.items())},
            stdin_fd=spec.boot_fd,
            egress_fd=spec.egress_fd if egress else -1,
        )

    def launch(self, plan: LaunchPlan, log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Write the bundle (root directory, symlinks, mask file, config), then start runsc
        with the boot pipe as its standard input."""
        if not isinstance(plan, GvisorPlan):
            raise ProviderUnavailable("gvisor", "the plan is not a gVisor plan")
        check_pins_on_host(plan.pins)
        write_bundle(plan)
        if plan.egress_fd >= 0:
            send_egress_listener(plan)
        return subprocess.Popen(
            list(plan.argv),
            env=dict(plan.env),
            cwd=plan.cwd,
            stdin=plan.stdin_fd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            preexec_fn=_death_signal(),
        )


_PR_SET_PDEATHSIG = 1


def _death_signal() -> Any:
    """What the child runs before it execs runsc: SIGKILL when the thread that started it
    (the host's lasting launch thread) ends, the agent gone however it died. runsc has no
    such option, and without one `runsc run` and its sandbox outlived an agent killed with
    its guardian (3 of 8 runs here). Its sandbox and gofer end with `runsc run`.
    `prctl` is looked up here, in the parent: the child only calls it."""
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return die_with_parent


def _runsc_env() -> dict[str, str]:
    """runsc's own environment: only PATH (the worker's is in the bundle)."""
    return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
