"""The `unshare` provider: the worker in new namespaces built by a small Python launcher.

What it enforces, for native code too (the steps are in `_worker/_ns_launch.py`):

* new user, PID, mount, network, IPC, UTS and cgroup namespaces; the worker is not PID 1
  (a tiny init reaps orphans) and dies with its parent;
* a read-only view of the system: a tmpfs root holding only `/usr`, the interpreter prefix
  and virtualenv, the import roots and the `agent_sandbox` packages (read-only), the
  policy's read paths (read-only), the scratch directory and the policy's write paths
  (writable), a minimal `/dev`, a fresh `/proc`, a size-capped `/tmp`; nothing else of the
  host exists inside (see `_view.py`);
* no network of the host: `lo` stays down without `[net]` rules; with them it is up and
  carries the host's egress proxy (`_host/egress/proxy.py`), the only way out;
* no capabilities, for good: the bounding and ambient sets are emptied, securebits lock
  out root's privileges on exec, no-new-privileges is set; nested user namespaces are
  refused (`user.max_user_namespaces = 0`), so read-only binds cannot be remounted;
* Landlock and the seccomp filter applied by the worker itself when both are available
  (see `LaunchPlan.stack`).

What it does not enforce: the worker is uid 0 mapped to the parent's uid (0 here), without
capabilities: files it can see that the parent's uid owns are readable as owner; the view
is the boundary, not the uid. Globs and hidden names inside a bound tree are left to the
guards and Landlock. Resource limits are the worker's rlimits. It needs unprivileged user
namespaces (or root) and the `x86_64` `pivot_root` syscall number.
"""

from __future__ import annotations

import functools
import marshal
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any, ClassVar

from agent_sandbox.providers._base import (
    Answer,
    LaunchPlan,
    ProbeResult,
    Provider,
    WorkerSetup,
    WorkerSpec,
    base_env,
    package_folder,
)
from agent_sandbox.providers._grants import grant_pins
from agent_sandbox.providers._netcheck import namespace_net, standard_answers
from agent_sandbox.providers._probe_cache import cached_probe, file_key
from agent_sandbox.providers._view import (
    TMPFS_BYTES,
    HostLayout,
    allow_proxy_port,
    egress_plan,
    host_layout,
    host_layout_for,
    mounts_for,
    network_mode,
    path_view,
)

__all__ = [
    "LAUNCHER",
    "UnshareProvider",
    "launcher_argv",
    "launcher_config",
    "stack_in_worker",
    "template_argv",
    "unshare_argv",
    "view_words",
]

#: The launcher module (standard library only; run with `-I -S -B`).
LAUNCHER = os.path.join(package_folder(), "_worker", "_ns_launch.py")
# Imported rather than run as a script, so its bytecode cache serves (a script is always
# compiled from source); the providers folder leaves `sys.path` before `main()` runs.
_LAUNCH_CODE = (
    f"import sys; sys.path.insert(0, {os.path.dirname(LAUNCHER)!r}); import _ns_launch; "
    "del sys.path[0]; _ns_launch.main()"
)


def launcher_argv(python: str, config: dict[str, Any]) -> tuple[str, ...]:
    """The launcher's command line: the interpreter, isolated, and the configuration.

    The configuration travels as `marshal` bytes in hex: the launcher runs the same
    interpreter (so the format matches) and avoids importing `json` (see `_worker/_ns_launch.py`).
    """
    return (python, "-I", "-S", "-B", "-c", _LAUNCH_CODE, marshal.dumps(config).hex())


def launcher_config(policy: Any, spec: WorkerSpec, host: HostLayout) -> dict[str, Any]:
    """What the launcher applies, as JSON-safe data (pure; tests compare it exactly)."""
    return {
        "root": os.path.join(spec.control_dir, "nsroot"),
        "mounts": [[m.kind, m.dst, m.src] for m in mounts_for(policy, spec, host)],
        "tmpfs_bytes": TMPFS_BYTES,
        "net": network_mode(policy),
        "hostname": "sandbox",
        "cwd": spec.scratch,
        # The launcher's own interpreter becomes the worker (the same `-I -S -B` run).
        "boot": [spec.boot_script, spec.boot_fd],
    }


def template_argv(argv: tuple[str, ...]) -> tuple[str, ...]:
    """A worker's launcher command line turned into its worker template's (pure): the same
    configuration plus `template`, so the launcher's C keeps what the template needs
    (`_ns_launch.TEMPLATE_KEEP`)."""
    config = marshal.loads(bytes.fromhex(argv[-1]))
    return (*argv[:-1], marshal.dumps({**config, "template": True}).hex())


def view_words(argv: tuple[str, ...], scratch: str, mark: str) -> tuple[str, ...]:
    """The launcher configuration's view (mounts, sizes, network, host name) as words, the
    scratch path replaced by `mark`: equal for every worker of a policy (pure)."""
    config = marshal.loads(bytes.fromhex(argv[-1]))
    words = [str(config["tmpfs_bytes"]), str(config["net"]), str(config["hostname"])]
    for kind, dst, src in config["mounts"]:
        words += [kind, mark if dst == scratch else dst, src]
    return tuple(words)


def unshare_argv(policy: Any, spec: WorkerSpec, host: HostLayout) -> tuple[str, ...]:
    """The launcher's command line for one worker."""
    return launcher_argv(spec.python, launcher_config(policy, spec, host))


@functools.cache
def _probe(python: str) -> ProbeResult:
    """Run the real launcher once (cached in the process, and across processes while nothing
    it depends on changed: `_probe_cache`) on a minimal view; report why it fails, if it does.

    The trial goes through every step a worker start takes (namespaces, the tmpfs root, a
    bind, a fresh /proc, pivot_root, the privilege drop), with `/usr/bin/true` as the worker.
    """
    if os.uname().machine != "x86_64":
        return ProbeResult("unshare", False, "the launcher knows pivot_root only on x86_64")
    return cached_probe("unshare", {"python": file_key(python)}, lambda: _trial(python))


def _trial(python: str) -> ProbeResult:
    host = host_layout()
    control = tempfile.mkdtemp(prefix="agent-sandbox-probe-")
    try:
        config = {
            "root": os.path.join(control, "nsroot"),
            "mounts": [["ro", "/usr", "/usr"]]
            + [["symlink", path, target] for path, target in sorted(host.symlinks.items())]
            + [["dev", "/dev", ""], ["proc", "/proc", ""], ["tmpfs", "/tmp", ""]],
            "tmpfs_bytes": 1024 * 1024,
            "net": "none",
            "hostname": "sandbox",
            "cwd": "/",
            "argv": ["/usr/bin/true"],
        }
        argv = launcher_argv(python, config)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ProbeResult("unshare", False, f"running the launcher failed: {exc}")
    finally:
        shutil.rmtree(control, ignore_errors=True)
    if out.returncode != 0:
        why = out.stderr.strip().splitlines()[-1:] or [f"exit status {out.returncode}"]
        return ProbeResult(
            "unshare",
            False,
            f"the namespace launcher failed here ({why[0]}); unprivileged user namespaces may "
            "be disabled (user.max_user_namespaces, kernel.unprivileged_userns_clone) or "
            "blocked by a container runtime",
        )
    return ProbeResult(
        "unshare",
        True,
        version=os.uname().release,
        details={"launcher": LAUNCHER, "boundary": True},
    )


class UnshareProvider(Provider):
    """Start the worker in fresh namespaces with a minimal read-only view of the system."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(namespace_net)

    name: ClassVar[str] = "unshare"
    strength: ClassVar[int] = 30
    deepest_stack: ClassVar[int | None] = 3  # the namespaces, Landlock, seccomp
    is_boundary: ClassVar[bool] = True

    def __init__(self, *, stack: bool = True) -> None:
        self.stack = stack

    def probe(self) -> ProbeResult:
        return _probe(os.path.realpath(sys.executable))

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        pins = grant_pins(policy, spec)  # refuses a grant that runs through a link
        egress, proxy_vars, egress_fds = egress_plan(self, policy, spec)
        host = host_layout_for(policy, spec)
        setup: dict[str, Any] = {"no_new_privs": True, "drop_caps": True}
        layers: tuple[str, ...] = ()
        if self.stack:
            setup_more, layers = stack_in_worker(policy, spec, host, pins)
            setup.update(setup_more)
        if pins:
            setup["pins"] = pins
        if egress:
            setup.update(egress)
            allow_proxy_port(setup, egress["egress"]["port"])
        return LaunchPlan(
            provider=self.name,
            argv=unshare_argv(policy, spec, host),
            env=base_env(spec, proxy_vars),
            pass_fds=(spec.listen_fd, spec.boot_fd, *egress_fds),
            cwd=spec.scratch,
            worker_setup=WorkerSetup(**setup),
            stack=(self.name, *layers, *(("egress-proxy",) if egress else ())),
            worker_depth=2,  # the launcher L, then B (PID 1 inside), then the worker C
        )


def stack_in_worker(
    policy: Any, spec: WorkerSpec, host: HostLayout, pins: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Landlock and seccomp as `worker_setup` fragments, each only when it works here."""
    from agent_sandbox.providers import _landlock, _seccomp

    setup: dict[str, Any] = {}
    layers: list[str] = []
    if _landlock.probe_landlock().available:
        view = path_view(mounts_for(policy, spec, host))
        setup["landlock"] = _landlock.landlock_setup(policy, spec, view=view, pins=pins)
        layers.append("landlock")
    if _seccomp.probe_seccomp()[0]:
        setup.update(_seccomp.seccomp_setup(policy))
        layers.append("seccomp")
    return setup, tuple(layers)
