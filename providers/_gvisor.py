"""The `gvisor` provider: the worker behind gVisor's user-space kernel (`runsc`), rootless.

The boundary is gVisor's Sentry: the worker's system calls are served by a kernel written in
Go that runs as an ordinary host process under its own seccomp filter, so a bug in the host
kernel's system-call surface is not reachable from the worker's code (the Sentry itself
uses a small set of host calls). It is the runtime the cluster path's templates ask for
(`runtimeClassName: gvisor`), so a policy tested here meets the same kernel in a pod.

How a worker starts (`build` is pure, `launch` writes what it says):

* an OCI bundle in the worker's private control directory (`<control>/gvisor/bundle`): a
  `config.json` (`bundle_config`, compared exactly by the tests) and an empty root directory
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
(`check_pins_on_host`), and once more after the start in the gofer's own root
(`check_pins_in_gofer`), which is what the sandbox was given.

Refused at construction, naming the cause: a grant of a device, a socket or a FIFO (gVisor
serves regular files and directories through its gofer), a `[net]` rule the proxy cannot
serve (UDP, a listener for outside peers), a missing runsc, a runsc older than
`MIN_RELEASE`.

It is longer than 600 lines for now: the bundle, the pins and the launch are one provider's
plan, and its cut into a `providers/gvisor/` package (as `providers/qemu/`) is still to do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
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
    base_env,
)
from agent_sandbox.providers._netcheck import namespace_net, standard_answers
from agent_sandbox.providers._probe_cache import cached_probe, file_key
from agent_sandbox.providers._view import (
    TMPFS_BYTES,
    HostLayout,
    Mount,
    egress_plan,
    host_layout_for,
    mounts_for,
    policy_paths,
)

__all__ = [
    "INSTALL_HINT",
    "MIN_RELEASE",
    "GvisorPlan",
    "GvisorProvider",
    "bundle_config",
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
#: The host's sockets of the allowed loopback services there: `fwd-<address>-<port>.sock`.
FORWARD_PREFIX = "fwd-"
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
_MASK_BYTES = 4096
_MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class GvisorPlan(LaunchPlan):
    """A launch plan plus the bundle `launch()` writes: the OCI config, the symlinks of the
    root directory, and the descriptor that becomes the worker's standard input."""

    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    bundle_dir: str = ""
    state_dir: str = ""
    #: The granted paths' pins (`_grants.py`), checked again on the host just before runsc
    #: starts: the Sentry's inode numbers are its own, so the worker cannot check them.
    pins: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    root_links: Mapping[str, str] = dataclasses.field(default_factory=dict)
    stdin_fd: int = -1
    #: The worker's end of the egress channel (`WorkerSpec.egress_fd`): `launch` binds the
    #: host's end of the proxy route in the socket directory and sends it there; -1: none.
    egress_fd: int = -1


def release_of(version_text: str) -> int | None:
    """The release date (yyyymmdd) in `runsc --version`'s first line, or None."""
    first = version_text.strip().splitlines()[0] if version_text.strip() else ""
    match = re.search(r"(20\d{6})", first)
    return int(match.group(1)) if match else None


def _dirs(spec: WorkerSpec) -> tuple[str, str, str]:
    """(bundle, runsc state root, socket directory), all inside the control directory."""
    base = os.path.join(spec.control_dir, "gvisor")
    return (
        os.path.join(base, "bundle"),
        os.path.join(base, "state"),
        os.path.join(spec.control_dir, "uds"),
    )


def _oci_mount(mount: Mount, empty_file: str) -> dict[str, Any] | None:
    kind, dst, src = mount.kind, mount.dst, mount.src
    if kind in ("ro", "ro-try"):
        return {"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro"]}
    if kind in ("rw", "rw-try"):
        return {"destination": dst, "type": "bind", "source": src, "options": ["rbind", "rw"]}
    if kind == "dev":
        return {"destination": dst, "type": "tmpfs", "source": "tmpfs", "options": ["mode=0755"]}
    if kind == "proc":
        return {"destination": dst, "type": "proc", "source": "proc"}
    if kind == "tmpfs":
        return {
            "destination": dst,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": [f"size={TMPFS_BYTES}", "mode=1777"],
        }
    if kind == "scratch":
        return {
            "destination": dst,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": [f"size={src}", "mode=0700"],
        }
    if kind == "mask-dir":
        return {
            "destination": dst,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": [f"size={_MASK_BYTES}", "mode=0000", "ro"],
        }
    if kind == "mask-file":
        # An empty file of mode 0000 the bundle holds (gVisor's gofer serves no device, so
        # the host's /dev/null cannot stand over a file as under bwrap).
        return {"destination": dst, "type": "bind", "source": empty_file, "options": ["ro"]}
    if kind == "symlink":
        return None  # made in the root directory (`GvisorPlan.root_links`)
    raise ValueError(f"unknown mount kind {kind!r}")


def _rlimits(policy: Any) -> list[dict[str, Any]]:
    limits = policy.limits
    cpu = int(limits.cpu_seconds)

    def rl(kind: str, value: int, hard: int | None = None) -> dict[str, Any]:
        return {"type": kind, "soft": value, "hard": value if hard is None else hard}

    return [
        rl("RLIMIT_AS", int(limits.memory_mb) * _MB),
        rl("RLIMIT_CORE", 0),
        rl("RLIMIT_CPU", cpu, cpu + 1),
        rl("RLIMIT_FSIZE", int(limits.file_size_mb) * _MB),
        rl("RLIMIT_NOFILE", int(limits.open_files)),
        rl("RLIMIT_NPROC", int(limits.processes)),
    ]


def bundle_config(
    policy: Any,
    spec: WorkerSpec,
    host: HostLayout,
    present: frozenset[str],
    proxy_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The OCI `config.json` of one worker (pure: unit tests compare it exactly).

    `present` holds the optional sources (`-try` mounts) that exist on the host; the others
    are left out, as bwrap's `--ro-bind-try` skips them.
    """
    bundle, _state, uds = _dirs(spec)
    empty_file = os.path.join(bundle, "empty")
    mounts: list[dict[str, Any]] = []
    for mount in mounts_for(policy, spec, host):
        if mount.kind in ("ro-try", "rw-try") and mount.src not in present:
            continue
        entry = _oci_mount(mount, empty_file)
        if entry is not None:
            mounts.append(entry)
    mounts.append({"destination": uds, "type": "bind", "source": uds, "options": ["rbind", "rw"]})
    env = base_env(spec, proxy_env)
    return {
        "ociVersion": "1.0.0",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": [spec.python, "-I", "-S", "-B", spec.boot_script, "0"],
            "env": [f"{k}={v}" for k, v in sorted(env.items())],
            "cwd": spec.scratch,
            "capabilities": {
                "bounding": [],
                "effective": [],
                "inheritable": [],
                "permitted": [],
                "ambient": [],
            },
            "noNewPrivileges": True,
            "rlimits": _rlimits(policy),
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "network"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
            ]
        },
    }


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
        from agent_sandbox._host.egress.handoff import loopback_forwards
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


def check_pins_on_host(pins: Mapping[str, Any]) -> None:
    """Each granted path, walked again without following links, must still be the object
    the build pinned; raises WorkerStartError naming the path otherwise.

    runsc's gofer opens each bind source by path a few tens of milliseconds later; a swap
    inside that window is caught after the start by `check_pins_in_gofer`.
    """
    from agent_sandbox._errors import PolicyError, WorkerStartError
    from agent_sandbox.providers._grants import _walk

    for path, pin in pins.items():
        try:
            now: Any = _walk(path, "files", path, None)
        except PolicyError:
            now = "a link"
        if now != (list(pin) if pin is not None else None):
            raise WorkerStartError(
                f"the granted path {path} is not the object the policy check pinned (a link "
                "planted or a directory swapped between the check and the start); start the "
                "worker again, and see which tool can write there"
            )


def forward_socket_name(host: str, port: int) -> str:
    """The name of the host's socket for the forwarded loopback service host:port (the
    parent matches it against its own list: `_host/egress/handoff.receive_listeners`)."""
    return f"{FORWARD_PREFIX}{host}-{int(port)}.sock"


def check_pins_in_gofer(plan: GvisorPlan, runsc_pid: int) -> None:
    """After the start, before any call: each granted path as runsc's gofer mounted it (in
    the gofer's own root, `/proc/<gofer>/root`, walked without following a link) must be
    the object the build pinned; raises WorkerStartError naming the path otherwise.

    This closes the window `check_pins_on_host` leaves: the gofer opens each bind source by
    path some tens of milliseconds after that check, and a swap inside that window mounts
    what the swapped-in link points to, which this walk sees (another device or inode).
    """
    from agent_sandbox._errors import WorkerStartError

    gofer = _gofer_pid(runsc_pid)
    if gofer is None:
        raise WorkerStartError(
            "runsc's gofer was not found, so the granted paths it mounted "
            "could not be checked; start the worker again"
        )
    masked = {
        m["destination"]
        for m in plan.config.get("mounts", ())
        if m.get("type") == "tmpfs" or m.get("source") == os.path.join(plan.bundle_dir, "empty")
    }
    try:
        root = os.open(f"/proc/{gofer}/root", os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise WorkerStartError(
            f"cannot read the root of runsc's gofer ({exc}), so the granted paths it mounted "
            "could not be checked"
        ) from None
    try:
        for path, pin in plan.pins.items():
            if pin is None or path in masked or path.startswith(("/proc/", "/dev/")):
                continue
            if _walk_in(root, path) != list(pin):
                raise WorkerStartError(
                    f"the granted path {path} as the sandbox mounted it is not the object the "
                    "policy check pinned (a link planted or a directory swapped between the "
                    "check and the mount); start the worker again, and see which tool can "
                    "write there"
                )
    finally:
        os.close(root)


def _gofer_pid(runsc_pid: int) -> int | None:
    """The pid of runsc's gofer: a descendant of the runsc process (a child as root; as a
    normal user runsc first runs itself again in a user namespace) whose command line starts
    with `runsc-gofer`."""
    from agent_sandbox._host.limits import _descendants

    for pid, _level in _descendants(runsc_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if fh.read().split(b"\0", 1)[0] == b"runsc-gofer":
                    return pid
        except OSError:
            continue
    return None


def _walk_in(root: int, path: str) -> list[int] | None:
    """[st_dev, st_ino] of `path` below the directory `root`, every component opened without
    following a link; None where a component is missing or a link."""
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.dup(root)
    try:
        for part in (p for p in path.split("/") if p):
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = child
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                return None
        info = os.fstat(fd)
        return [info.st_dev, info.st_ino]
    finally:
        os.close(fd)


def send_egress_listener(plan: GvisorPlan) -> None:
    """Bind the host's end of the proxy route in the socket directory, and one socket for
    each allowed loopback service, and send them over the egress channel, where the parent
    takes them onto its egress proxy (as it takes a worker's listeners under bwrap, or the
    QEMU relay's)."""
    import socket

    relay = plan.worker_setup.get("egress_relay") or {}
    paths = [str(relay["socket"]), *(str(path) for _h, _p, path in relay.get("forwards", ()))]
    listeners: list[socket.socket] = []
    try:
        for path in paths:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listeners.append(listener)
            listener.bind(path)
            listener.listen(128)
        channel = socket.socket(fileno=os.dup(plan.egress_fd))
        try:
            socket.send_fds(channel, [b"egress"], [sock.fileno() for sock in listeners])
        finally:
            channel.close()
    finally:
        for sock in listeners:
            sock.close()


def _runsc_env() -> dict[str, str]:
    """runsc's own environment: only PATH (the worker's is in the bundle)."""
    return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def write_bundle(plan: GvisorPlan) -> None:
    """Create the bundle a plan describes (in the worker's control directory)."""
    bundle = plan.bundle_dir
    root = os.path.join(bundle, "rootfs")
    os.makedirs(root, mode=0o700)
    os.chmod(root, 0o755)  # the sandbox's `/`: read-only to it (`root.readonly`)
    for path, target in plan.root_links.items():
        os.symlink(target, os.path.join(root, path.lstrip("/")))
    fd = os.open(os.path.join(bundle, "empty"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0)
    os.close(fd)
    os.mkdir(os.path.dirname(plan.socket_path), 0o700)
    os.mkdir(plan.state_dir, 0o700)
    with open(os.path.join(bundle, "config.json"), "x", encoding="utf-8") as fh:
        json.dump(plan.config, fh)
