"""The OCI bundle of one gVisor worker: the plan that carries it, its `config.json`, its files.

`bundle_config` is pure (the tests compare it exactly): the mounts of the namespace
providers' view (`_view.mounts_for`) as OCI mounts, the worker's command, environment,
rlimits, no capability, no-new-privileges, its namespaces. `write_bundle` makes what a plan
describes in the worker's control directory (`launch` calls it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from agent_sandbox.providers._base import LaunchPlan, WorkerSpec, base_env
from agent_sandbox.providers._view import TMPFS_BYTES, HostLayout, Mount, mounts_for

__all__ = ["GvisorPlan", "bundle_config", "write_bundle"]


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
