"""The filesystem view a namespace provider (`bwrap`, `unshare`) builds for the worker.

What it decides: the ordered list of mounts that make up the worker's root: a read-only
`/usr` and the interpreter closure, a minimal `/dev`, a fresh `/proc`, a private `/tmp`
tmpfs, the worker's scratch directory writable, and only the paths the policy names. Every
host path appears at the same path inside, so no path translation is needed (the parent's
handshake, `$SCRATCH` and reported files all agree).

What it does not decide: how the mounts are made (each provider turns the list into its own
argv or set-up script), and fine-grained rules inside a bound tree: a glob in the policy binds
its fixed leading directory. Every existing path inside what is bound that matches
`files.hide` or `files.deny`, and the policy's own files, is masked (an empty read-only
tmpfs over a directory, an empty unreadable file over a file; see `_masks.py`).

`network_mode(policy)` says whether the worker gets no network or its own loopback with the
host's egress proxy on it (`egress_plan`); a rule the proxy cannot serve (UDP, a listener
for outside peers) is an error naming the rule, never a silent cut.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from agent_sandbox.policies._paths import expand_entry, is_glob, static_prefix, unescape

__all__ = [
    "HostLayout",
    "Mount",
    "host_layout",
    "host_layout_for",
    "mounts_for",
    "network_mode",
    "allow_proxy_port",
    "bound_paths",
    "egress_plan",
    "path_view",
    "policy_paths",
]

#: Size of the private tmpfs mounts (bytes); without a size a tmpfs may take half the RAM.
TMPFS_BYTES = 64 * 1024 * 1024
#: Top-level names that are symlinks into /usr on a merged-/usr system.
_TOP_LEVEL = ("/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin")
#: Host files the interpreter may read when present. NOTE: allowed because ld.so and the
#: `time` module read them; neither holds secrets.
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")
#: Mounted fresh in every view; never bound from the host.
_FRESH = ("/proc", "/dev")

Kind = Literal[
    "ro",
    "rw",
    "ro-try",
    "rw-try",
    "tmpfs",
    "scratch",
    "symlink",
    "dev",
    "proc",
    "mask-dir",
    "mask-file",
]


@dataclasses.dataclass(frozen=True)
class Mount:
    """One step of the view, applied in list order (a later mount covers an earlier one).

    `ro`/`rw` bind `src` at `dst` and fail when `src` is missing; the `-try` forms skip a
    missing source. `symlink` creates `dst` pointing at `src`. `tmpfs`, `dev` and `proc`
    create fresh file systems at `dst`; `scratch` is the worker's scratch directory, a
    fresh tmpfs of `src` bytes (`limits.scratch_mb`); `mask-dir`/`mask-file` hide a host path.
    """

    kind: Kind
    dst: str
    src: str = ""


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Facts about the host that the pure builders need: read once, passed in."""

    #: Top-level paths that are symlinks, with their targets (e.g. `/lib` -> `usr/lib`).
    symlinks: Mapping[str, str]
    #: Top-level paths that are real directories outside /usr (bound read-only).
    dirs: tuple[str, ...] = ()
    #: Kind of each path named in `files.deny`: "dir", "file" or "" (absent).
    kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Every entry of the host's `/` and of `/run` (firejail hides those not needed).
    top: tuple[str, ...] = ()
    run: tuple[str, ...] = ()
    #: Paths to mask inside what is bound (hidden and denied names, the policy files):
    #: host path -> "dir" or "file", from `_masks.find_masks`.
    masked: Mapping[str, str] = dataclasses.field(default_factory=dict)


def host_layout_for(policy: Any, spec: Any) -> HostLayout:
    """`host_layout` for one worker: the policy's denied paths, and the masks it needs."""
    from agent_sandbox.providers._masks import find_masks

    layout = host_layout(policy_paths(policy, spec)[2])
    return dataclasses.replace(layout, masked=dict(find_masks(policy, spec).paths))


def host_layout(deny: Iterable[str] = ()) -> HostLayout:
    """Read the host's top-level layout and the kind of each denied path (small, cached I/O)."""
    links: dict[str, str] = {}
    dirs: list[str] = []
    for path in _TOP_LEVEL:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            links[path] = os.readlink(path)
        elif stat.S_ISDIR(st.st_mode):
            dirs.append(path)
    kinds: dict[str, str] = {}
    for path in deny:
        try:
            st = os.stat(path)
        except OSError:
            kinds[path] = ""
            continue
        kinds[path] = "dir" if stat.S_ISDIR(st.st_mode) else "file"
    return HostLayout(
        symlinks=links, dirs=tuple(dirs), kinds=kinds, top=_listing("/"), run=_listing("/run")
    )


def _listing(folder: str) -> tuple[str, ...]:
    try:
        return tuple(sorted(os.path.join(folder, name) for name in os.listdir(folder)))
    except OSError:
        return ()


def policy_paths(
    policy: Any, spec: Any
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The policy's read, write and deny paths as absolute host paths.

    `$SCRATCH` becomes the worker's scratch directory, `~` the parent's home; escapes are
    removed (`policies/_paths.py`); a glob becomes its fixed leading directory for read and
    write (the finer rule is the guards' and Landlock's job) and is dropped from deny
    (masking needs a concrete path).
    """
    home = os.path.expanduser("~")

    def expand(entry: str) -> str:
        return expand_entry(entry, scratch=spec.scratch, home=home)

    files = policy.files
    read = tuple(os.path.normpath(static_prefix(expand(p))) for p in files.read)
    write = tuple(os.path.normpath(static_prefix(expand(p))) for p in files.write)
    deny = tuple(
        os.path.normpath(unescape(expand(p))) for p in files.deny if not is_glob(expand(p))
    )
    return read, write, deny


def _under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def _coalesce(paths: Iterable[str]) -> list[str]:
    """Drop duplicates and paths already inside another path of the list."""
    out: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if not any(_under(path, kept) for kept in out):
            out.append(path)
    return out


def _depth(path: str) -> int:
    return 0 if path == "/" else path.rstrip("/").count("/")


def bound_paths(policy: Any, spec: Any) -> tuple[list[str], list[str], list[str]]:
    """The host paths a worker needs: (read-only for the interpreter, read-only for the
    policy, writable), each without duplicates or paths nested in another of its kind.

    Read-only for the interpreter: its prefix, the virtualenv, the import roots, the
    `agent_sandbox` packages and the boot script's folder. Writable: the scratch directory
    first, then the policy's write paths. A read path inside `/usr` or inside something
    already bound is dropped, and so is any path under `/proc` or `/dev` (mounted fresh).
    """
    read, write, _ = policy_paths(policy, spec)
    # NOTE: a policy path under /proc or /dev is not bound: the view's own fresh /proc and
    # minimal /dev stand for them (binding the host's would expose host processes).
    read = tuple(p for p in read if not any(_under(p, f) for f in _FRESH))
    write = tuple(p for p in write if not any(_under(p, f) for f in _FRESH))
    needed = [
        spec.base_prefix,
        spec.prefix,
        *spec.sys_path,
        *spec.package_dirs.values(),
        os.path.dirname(spec.boot_script),
    ]
    writable = _coalesce([spec.scratch, *write])
    ro_needed = [p for p in _coalesce(needed) if not any(_under(p, w) for w in writable)]
    ro_policy = [
        p for p in _coalesce(read) if not any(_under(p, k) for k in [*ro_needed, *writable, "/usr"])
    ]
    return ro_needed, ro_policy, writable


def mounts_for(policy: Any, spec: Any, host: HostLayout) -> list[Mount]:
    """The ordered mount list for one worker (pure: depends only on its arguments).

    Order, shallow destinations first so nothing is covered by a later parent mount:
    1. `/usr` read-only, the merged-/usr symlinks, other top-level system dirs read-only;
    2. `/dev` (minimal device set), `/proc` (fresh, this pid namespace), `/tmp` (tmpfs);
    3. read-only: the interpreter prefix, the virtualenv, the import roots, the
       `agent_sandbox` packages, the optional /etc files and the policy's read paths;
    4. writable: the scratch directory and the policy's write paths;
    5. masks over the policy's denied paths that fall inside something bound.
    """
    deny = policy_paths(policy, spec)[2]
    system: list[Mount] = [Mount("ro", "/usr", "/usr")]
    for path, target in sorted(host.symlinks.items()):
        system.append(Mount("symlink", path, target))
    for path in host.dirs:
        system.append(Mount("ro", path, path))
    system += [Mount("dev", "/dev"), Mount("proc", "/proc"), Mount("tmpfs", "/tmp")]

    ro_needed, ro_policy, writable = bound_paths(policy, spec)
    binds: list[Mount] = [Mount("ro", p, p) for p in ro_needed]
    binds += [Mount("ro-try", p, p) for p in _ETC_FILES]
    binds += [Mount("ro-try", p, p) for p in ro_policy]
    binds += [Mount("scratch", spec.scratch, str(scratch_bytes(policy)))]
    binds += [Mount("rw-try", p, p) for p in writable if p != spec.scratch]
    binds.sort(key=lambda m: _depth(m.dst))  # stable: keeps the order above within a depth

    bound = [m.dst for m in system + binds if m.kind in ("ro", "rw", "ro-try", "rw-try")]
    masks: list[Mount] = []
    wanted = {path: host.kinds.get(path, "") for path in deny}
    wanted.update(host.masked)
    for path, kind in sorted(wanted.items()):
        if kind and any(_under(path, b) for b in bound):
            masks.append(Mount("mask-dir" if kind == "dir" else "mask-file", path))
    masks.sort(key=lambda m: _depth(m.dst))
    # One stable sort by depth, so a shallow policy path cannot cover the fresh /proc or /dev.
    return sorted(system + binds, key=lambda m: _depth(m.dst)) + masks


def scratch_bytes(policy: Any) -> int:
    """The size of the worker's scratch tmpfs: `limits.scratch_mb`."""
    return int(getattr(policy.limits, "scratch_mb", 512)) * 1024 * 1024


def path_view(mounts: Iterable[Mount]) -> dict[str, str]:
    """Host path -> in-sandbox path for every bound path (the identity here, by design)."""
    return {m.src: m.dst for m in mounts if m.kind in ("ro", "rw", "ro-try", "rw-try")}


def network_mode(policy: Any) -> Literal["none", "proxy"]:
    """`proxy` when the policy allows any network (`lo` up, the host's egress proxy on it,
    `_host/egress/proxy.py`), else `none` (no interface up)."""
    return "proxy" if any(r.action == "allow" for r in policy.net.rules) else "none"


def egress_plan(
    provider: Any, policy: Any, spec: Any
) -> tuple[dict[str, Any], dict[str, str], tuple[int, ...]]:
    """What a namespace provider adds for a policy with network rules (pure): the
    `worker_setup` fragment, the proxy variables for the environment and the descriptor
    to pass. Raises ProviderUnavailable for a rule the proxy cannot serve (UDP, a
    listener), naming it; returns empty parts for a policy without network."""
    if network_mode(policy) != "proxy":
        return {}, {}, ()
    # Only now: a policy without network never needs the proxy's modules.
    from agent_sandbox._host.egress.handoff import (
        PROXY_HOST,
        PROXY_PORT,
        loopback_forwards,
        proxy_env,
    )
    from agent_sandbox.providers._netcheck import refuse_unenforceable

    refuse_unenforceable(provider, policy)
    # A dry build (no channel yet: egress_fd -1) describes the same plan; a real start
    # always prepares the channel, and a worker without it fails its start.
    setup = {
        "egress": {
            "fd": spec.egress_fd,
            "host": PROXY_HOST,
            "port": PROXY_PORT,
            # Allowed loopback services, listened for at the same address inside and
            # forwarded by the host: reachable by clients that ignore HTTP_PROXY too.
            "forwards": [list(pair) for pair in loopback_forwards(policy)],
        }
    }
    fds = (spec.egress_fd,) if spec.egress_fd >= 0 else ()
    return setup, proxy_env(PROXY_HOST, PROXY_PORT), fds


def allow_proxy_port(setup: dict[str, Any], port: int) -> None:
    """Let a stacked Landlock ruleset connect to the egress proxy's port (in place)."""
    landlock = setup.get("landlock")
    if landlock and landlock.get("tcp_connect") is not None:
        landlock["tcp_connect"] = sorted({*landlock["tcp_connect"], port})
