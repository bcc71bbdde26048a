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

Limits outside the sandbox: the host's cgroups around runsc (memory and CPU; `pids.max`
counts the Sentry's and gofer's own threads too, so it gets their slack), the host's wall
clock, the output bounds. Every plan's stack starts with `gvisor`. The parent's interrupt goes
through `runsc kill <id> INT` (`LaunchPlan.interrupt_argv`): `runsc run` does not forward
SIGINT, it dies of it.

Network: with `[net]` allow rules, the host's egress proxy as under `bwrap` (the same rules,
the same refusals in `_netcheck.py`): `launch` binds the host's end of the worker's proxy
route in the socket directory and the parent attaches it to its proxy; inside, a relay
process the worker forks before its restrictions listens on the proxy address on the
Sentry's loopback and carries each connection to that socket (`--host-uds=all`).

Refused at construction, naming the cause: a grant of a device, a socket or a FIFO (gVisor
serves regular files and directories through its gofer), a `[net]` rule the proxy cannot
serve (UDP, a listener for outside peers), a missing runsc, a runsc older than
`MIN_RELEASE`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping
from typing import IO, Any, ClassVar

from agent_sandbox._errors import ProviderUnavailable
from agent_sandbox.providers._base import LaunchPlan, ProbeResult, Provider, WorkerSpec, base_env
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
#: Where the worker binds its server's socket, inside `<control>/uds`.
SOCKET_NAME = "ctl.sock"
#: The host's end of the egress proxy route, in the same directory.
EGRESS_SOCKET = "egress.sock"
#: Room in the host's cgroups for runsc, its gofer and the Sentry beside the worker: about
#: 40 host threads at rest (more under load: Go starts threads for blocked calls) and 70 MiB
#: resident here; the worker's own processes and memory are held
#: inside by its rlimits (RLIMIT_NPROC, RLIMIT_AS), which gVisor enforces.
LAUNCHER_TASKS = 512
LAUNCHER_MB = 192
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
) -> tuple[str, ...]:
    """The runsc command line for one worker (pure).

    `--rootless`: runsc sets up its sandbox without root; `--ignore-cgroups`: it makes no
    cgroup of its own (as root it would make one named after the container in every
    hierarchy and leave it when the sandbox ends), so the worker's own groups, which runsc
    is started in, hold it; `--network=none`: no device but the Sentry's loopback;
    `--host-uds=create`: the worker may bind its server's socket in the shared socket
    directory, and connects to no host socket; with egress, `--host-uds=all`: its relay
    also connects to the host's end of the proxy route there (and, as under bwrap, the
    code may connect to a host socket inside what the view binds).
    """
    return (
        runsc,
        "--rootless",
        "--ignore-cgroups",
        "--network=none",
        "--host-uds=all" if egress else "--host-uds=create",
        f"--platform={platform}",
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
        from agent_sandbox.providers import _seccomp
        from agent_sandbox.providers._grants import grant_pins
        from agent_sandbox.providers._netcheck import refuse_unenforceable

        refuse_unenforceable(self.name, policy)  # egress_plan refuses again, same rules
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
        }
        layers: tuple[str, ...] = ()
        if _seccomp.probe_seccomp()[0]:
            setup.update(_seccomp.seccomp_setup(policy))
            layers = ("seccomp",)
        egress, proxy_vars, _fds = egress_plan(self.name, policy, spec)
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
            }
            layers += ("egress-proxy",)
        exe = str(self.probe().details.get("path", self.runsc))
        return GvisorPlan(
            provider=self.name,
            argv=runsc_argv(
                exe, state, bundle, container_id(spec), self.platform, egress=bool(egress)
            ),
            env=_runsc_env(),
            pass_fds=(),
            cwd=spec.control_dir,
            worker_setup=setup,
            stack=(self.name, *layers),
            worker_depth=None,
            interrupt_launcher=True,
            # The first call on a fresh worker faults in its memory through the Sentry (each
            # first touch is a trip through it under ptrace): a pool's worker pays it while
            # it waits, not the first result (benchmarks/bench_gvisor.py).
            warm_up=True,
            socket_path=os.path.join(uds, SOCKET_NAME),
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

    NOTE: runsc's gofer opens each bind source by path a few tens of milliseconds later; a
    swap inside that window is not caught (docs/providers.md, gvisor).
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


def send_egress_listener(plan: GvisorPlan) -> None:
    """Bind the host's end of the proxy route in the socket directory and send it over the
    egress channel, where the parent takes it onto its egress proxy (as it takes a worker's
    listener under bwrap, or the QEMU relay's)."""
    import socket

    relay = plan.worker_setup.get("egress_relay") or {}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(relay["socket"]))
        listener.listen(128)
        channel = socket.socket(fileno=os.dup(plan.egress_fd))
        try:
            socket.send_fds(channel, [b"egress"], [listener.fileno()])
        finally:
            channel.close()
    finally:
        listener.close()


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
