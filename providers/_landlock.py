"""The `landlock` provider: the worker restricts itself with Landlock before it serves.

What it enforces (kernel, against hostile native code too), applied by the worker to itself
while it still has a single thread (see `_worker/_inworker.py` for the order):

* Files: read-only access to what the interpreter needs (its executable, the standard
  library, the site-packages in use, the `agent_sandbox` package folders, libpython,
  `/usr/lib` with ld.so) and to the policy's `files.read`; write access only to the scratch
  directory and the policy's `files.write`. Not all of `/etc` (time-zone data, and the
  resolver files only with network rules), not `/tmp`, never `/proc` or `/sys` (a policy
  path reaching them is refused). Only `/dev/null` (read-write) and `/dev/zero`,
  `/dev/urandom`, `/dev/random` (read) of `/dev`.
* Execution: EXECUTE only on the interpreter and its ELF loader, unless the policy grants
  `process-exec` category (then also `/usr/bin` and `/usr/local/bin`). `posix.system`, a
  ctypes `execve` of `/bin/sh` and `_posixsubprocess.fork_exec` fail with EACCES.
* TCP bind and connect only to the ports the policy's `net.rules` allow (ABI 4 and later).
* Abstract Unix sockets and signals scoped to the worker's own domain (ABI 6 and later).
* Metadata changes (chmod, chown, utimes, extended attributes), which Landlock has no right
  for: its seccomp filter refuses every one, inside the grants too (`_seccomp.metadata_rules`).

What it does NOT enforce (see `docs/providers.md` for what covers each):

* UDP, raw and netlink sockets: Landlock has no right for them (seccomp denies the
  families the policy does not need).
* Connecting to a pathname Unix socket outside the policy (seccomp refuses
  `socket(AF_UNIX)` for that reason), and `stat()`/`access()` of any path and listing the
  directories above a grant: names, sizes and existence of files leak. The provider takes
  only a policy that accepts that in words (`visible_names = "accepted"`, else it refuses
  the policy: `_netcheck.landlock_files`).
* Host names: the TCP rules name ports, not hosts (the Python guards name hosts; under a
  namespace provider the host's egress proxy enforces them, `_host/egress/proxy.py`).
* Memory, CPU and processes (see `_host/limits.py`).

Hidden and denied names (`files.hide`, `files.deny`) and the policy's own files inside a
granted directory are kept out of reach by narrowing the grants around them (`_narrow`):
their contents, not their names (see above).

The module has three parts: the pure builder `landlock_setup()`, the probe
`probe_landlock()`, and the thin syscall layer (`landlock_abi()`, `restrict_self()`) that
the worker calls through `_inworker.apply_worker_setup`, which lives in `_landlock_sys.py` so
the worker's start does not pay for this module's imports.
"""

from __future__ import annotations

import functools
import os
import struct
import sysconfig
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from agent_sandbox._landlock_sys import (
    ACCESS_SETS,
    MIN_ABI,
    landlock_abi,
    restrict_self,
)
from agent_sandbox.policies._paths import expand_entry, static_prefix
from agent_sandbox.providers._base import (
    Answer,
    LaunchPlan,
    ProbeResult,
    Provider,
    WorkerSetup,
    WorkerSpec,
    base_env,
    package_folder,
    worker_argv,
)
from agent_sandbox.providers._masks import Masks, find_masks
from agent_sandbox.providers._netcheck import landlock_files, landlock_net, standard_answers

__all__ = [
    "ACCESS_SETS",
    "LandlockProvider",
    "landlock_abi",
    "landlock_setup",
    "probe_landlock",
    "probe_user_tmpfs",
    "restrict_self",
]

#: Above this many ports a TCP right is left unhandled (one rule per port), and reported.
MAX_PORT_RULES = 1024

# NOTE: each entry below is granted read-only because a plain interpreter needs it.
_DEVICES: tuple[tuple[str, str], ...] = (
    ("/dev/null", "dev-rw"),
    ("/dev/random", "dev-ro"),
    ("/dev/urandom", "dev-ro"),
    ("/dev/zero", "dev-ro"),
)
# NOTE: public, read-only time-zone data: `zoneinfo` and local time need it.
_TIME_FILES = ("/etc/localtime", "/usr/share/zoneinfo")
# NOTE: granted only when the policy allows some network: name resolution and CA bundles.
_NET_FILES = (
    "/etc/ca-certificates",
    "/etc/gai.conf",
    "/etc/host.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/protocols",
    "/etc/resolv.conf",
    "/etc/services",
    "/etc/ssl/certs",
    "/usr/share/ca-certificates",
)
# NOTE: granted read+execute only when the policy grants `process-exec`.
_EXEC_DIRS = ("/usr/bin", "/usr/local/bin")
_ANY_HOST = frozenset({"*", "0.0.0.0/0", "::/0", "any"})


# -- the pure builder ---------------------------------------------------------------------


def landlock_setup(
    policy: Any,
    spec: WorkerSpec,
    *,
    view: Mapping[str, str] | None = None,
    private_dirs: Iterable[str] = (),
    masks: Masks | None = None,
    pins: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON-safe `worker_setup["landlock"]` fragment for `policy` and `spec`.

    Paths are as the worker sees them: `view` maps host path prefixes to in-sandbox paths
    when a namespace provider remaps them (the longest matching prefix wins; a path no
    prefix covers is kept as is). The applier skips paths that do not exist in the worker.
    `private_dirs` are in-sandbox directories private to this worker (a namespace provider's
    own tmpfs, such as `/dev/shm` for `multiprocessing` locks): they are granted read-write
    as given. Never pass a host directory other workers share. `pins` (host path -> device
    and inode, or None for absent; `_grants.grant_pins`) become `pins` in the fragment, keyed
    by in-sandbox path: the applier refuses a path whose descriptor is not the pinned object.
    `masks` (from `_masks.find_masks`, Landlock alone) are host paths no rule may reach: the
    grants around them are narrowed (`_narrow`).

    Keys: `min_abi`; `paths`, a sorted list of `[path, access]` with access one of
    `ACCESS_SETS`; `tcp_connect` / `tcp_bind`, sorted port lists, or None when the right is
    left unhandled (too many ports); `scope`, the scoped IPC kinds; `notes`, why anything
    was left unhandled.
    """
    notes: list[str] = []
    rules: dict[str, str] = {}

    def grant(path: str, access: str) -> None:
        inside = _map_view(os.path.normpath(path), view)
        if _rank(access) > _rank(rules.get(inside, "")):
            rules[inside] = access

    python = os.path.realpath(spec.python)
    grant(python, "rx")
    loader = _elf_interpreter(python)
    if loader:
        grant(os.path.realpath(loader), "rx")
    libpython = _libpython()
    if libpython:
        grant(libpython, "ro")
    for root in spec.sys_path:
        grant(os.path.realpath(root), "ro")
    for folder in spec.package_dirs.values():
        grant(folder, "ro")
    grant(os.path.dirname(os.path.realpath(spec.boot_script)), "ro")
    grant("/usr/lib", "ro")
    for device, access in _DEVICES:
        grant(device, access)
    for name in _TIME_FILES:
        grant(name, "ro")

    api_allow = set(_get(policy, "api", "allow", default=()))
    if "process-exec" in api_allow:
        for folder in _EXEC_DIRS:
            grant(folder, "rx")

    rules_net = list(_get(policy, "net", "rules", default=()))
    if any(_field(rule, "action") == "allow" for rule in rules_net):
        for name in _NET_FILES:
            grant(name, "ro")

    for key, access in (("read", "ro"), ("write", "rw")):
        for entry in _get(policy, "files", key, default=()):
            path = _policy_path(entry, spec.scratch)
            if view is None:
                _refuse_kernel_views(path, f"files.{key}", entry, policy)
            grant(path, access)
    grant(spec.scratch, "rw")
    if masks:
        _narrow(rules, masks, policy)
    for inside in private_dirs:
        rules[os.path.normpath(inside)] = "rw"

    connect = _tcp_ports(rules_net, "connect")
    bind = _tcp_ports(rules_net, "bind")
    for kind, ports in (("connect", connect), ("bind", bind)):
        if ports is None:
            notes.append(
                f"TCP {kind} is not filtered by Landlock: the policy allows more than "
                f"{MAX_PORT_RULES} ports"
            )
    fragment: dict[str, Any] = {
        "min_abi": MIN_ABI,
        "paths": [[path, rules[path]] for path in sorted(rules)],
        "tcp_connect": connect,
        "tcp_bind": bind,
        "scope": ["abstract_unix", "signal"],
        "notes": notes,
    }
    if pins:
        fragment["pins"] = {_map_view(path, view): pin for path, pin in sorted(pins.items())}
    return fragment


#: Host hierarchies Landlock alone must never grant: `/proc/<pid>/environ` of the parent and
#: the cgroupfs (a worker that can write it leaves its limits).
_NEVER_ALONE = ("/proc", "/sys")


def _refuse_kernel_views(path: str, key: str, entry: str, policy: Any) -> None:
    """Refuse a policy path that is, contains or lies inside /proc or /sys (Landlock alone)."""
    norm = os.path.normpath(path)
    for bad in _NEVER_ALONE:
        if norm == bad or norm.startswith(bad + "/") or bad.startswith(norm.rstrip("/") + "/"):
            from agent_sandbox._errors import PolicyError

            raise PolicyError(
                f"{entry!r} would grant {bad} to native code under Landlock alone (the parent's "
                f"/proc/<pid>/environ, the cgroupfs); name narrower paths, or use a namespace "
                "provider, whose /proc shows only the sandbox",
                source=_get_source(policy),
                key=key,
                expected="a path outside /proc and /sys",
            )


def _get_source(policy: Any) -> str | None:
    source = policy.get("source") if isinstance(policy, dict) else getattr(policy, "source", None)
    return str(source) if source else None


def _rank(access: str) -> int:
    return {"": 0, "ls": 1, "dev-ro": 2, "ro": 3, "dev-rw": 4, "rx": 5, "rw": 6}[access]


#: Rules above which a narrowed ruleset is refused (each is a descriptor the worker opens).
MAX_NARROWED_RULES = 20_000


def _narrow(rules: dict[str, str], masks: Masks, policy: Any) -> None:
    """Take every masked path out of reach: no rule may sit on it or on a directory above it.

    A directory above a masked path keeps only the right to be listed ("ls"); its other
    entries get its former access one by one, recursively down to the masked path. Landlock
    grants whole hierarchies, so this is the only way to leave one name out. A directory
    split this way allows no new entry at its own level (creating a file needs a right on
    the directory itself); its subdirectories keep their full access.
    """
    for masked in sorted(masks.paths):
        while True:
            above = [r for r, a in rules.items() if a != "ls" and _is_under(masked, r)]
            if not above:
                break
            for root in above:
                access = rules.pop(root)
                if root != masked:
                    _split(rules, root, access, masked, masks, policy)
    if len(rules) > MAX_NARROWED_RULES:
        from agent_sandbox._errors import PolicyError

        raise PolicyError(
            f"keeping the names of [files] hide and deny out of reach under Landlock alone "
            f"takes {len(rules)} rules (more than {MAX_NARROWED_RULES}); grant narrower "
            "paths, or use a namespace provider (bwrap, unshare), which masks them",
            source=_get_source(policy),
            key="files.hide",
            expected="fewer entries beside the hidden names",
        )


def _split(
    rules: dict[str, str], folder: str, access: str, masked: str, masks: Masks, policy: Any
) -> None:
    rules[folder] = "ls"
    for name, _kind in masks.listings.get(folder, ()):
        child = os.path.join(folder, name)
        if child == masked:
            continue
        if _is_under(masked, child):
            _split(rules, child, access, masked, masks, policy)
        elif _rank(access) > _rank(rules.get(child, "")):
            rules[child] = access


def _is_under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def _map_view(path: str, view: Mapping[str, str] | None) -> str:
    if not view:
        return path
    best = ""
    for host in view:
        h = host.rstrip("/") or "/"
        if (path == h or path.startswith(h.rstrip("/") + "/")) and len(h) > len(best):
            best = h
    if not best:
        return path
    inside = view[best] if best in view else view[best + "/"]
    rest = path[len(best) :].lstrip("/")
    return os.path.join(inside, rest) if rest else inside


def _policy_path(entry: str, scratch: str) -> str:
    """The directory (or file) a policy path grants: the part before the first glob,
    unescaped (see `policies/_paths.py`)."""
    home = os.path.expanduser("~")
    return static_prefix(expand_entry(entry, scratch=scratch, home=home))


def _get(policy: Any, section: str, key: str, *, default: Any) -> Any:
    part = policy.get(section, {}) if isinstance(policy, dict) else getattr(policy, section, None)
    if part is None:
        return default
    if isinstance(part, dict):
        return part.get(key, default)
    return getattr(part, key, default)


def _field(rule: Any, key: str) -> Any:
    return rule.get(key) if isinstance(rule, dict) else getattr(rule, key)


def _port_ranges(ports: str) -> list[tuple[int, int]]:
    out = []
    for part in str(ports).split(","):
        lo, _, hi = part.strip().partition("-")
        out.append((int(lo), int(hi) if hi else int(lo)))
    return out


def _tcp_ports(rules: Iterable[Any], direction: str) -> list[int] | None:
    """Ports an allow rule opens for TCP `direction`, minus those a deny-any-host rule closes.

    None when there are more than `MAX_PORT_RULES` (the right is then left unhandled).
    """
    allowed: set[int] = set()
    denied: set[int] = set()
    for rule in rules:
        if _field(rule, "protocol") not in ("tcp", "any"):
            continue
        if _field(rule, "direction") not in (direction, "any"):
            continue
        ranges = _port_ranges(_field(rule, "ports"))
        if _field(rule, "action") == "allow":
            if sum(hi - lo + 1 for lo, hi in ranges) > MAX_PORT_RULES:
                return None
            for lo, hi in ranges:
                allowed.update(range(lo, hi + 1))
        elif str(_field(rule, "host")).strip().lower() in _ANY_HOST:
            for lo, hi in ranges:
                denied.update(range(lo, hi + 1))
    ports = sorted(allowed - denied)
    return ports if len(ports) <= MAX_PORT_RULES else None


@functools.lru_cache(maxsize=8)
def _elf_interpreter(path: str) -> str:
    """The PT_INTERP (ELF loader) of an executable; "" when it has none or is not ELF."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only
                return ""
            endian = "<" if head[5] == 1 else ">"
            (phoff,) = struct.unpack_from(endian + "Q", head, 0x20)
            phentsize, phnum = struct.unpack_from(endian + "HH", head, 0x36)
            fh.seek(phoff)
            table = fh.read(phentsize * phnum)
            for i in range(phnum):
                (p_type,) = struct.unpack_from(endian + "I", table, i * phentsize)
                if p_type == 3:  # PT_INTERP
                    (offset,) = struct.unpack_from(endian + "Q", table, i * phentsize + 8)
                    (size,) = struct.unpack_from(endian + "Q", table, i * phentsize + 32)
                    fh.seek(offset)
                    return fh.read(size).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return ""
    return ""


@functools.lru_cache(maxsize=1)
def _libpython() -> str:
    """The shared libpython this interpreter maps (from its build configuration), or ""."""
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if not libdir or not soname or not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return ""
    return os.path.realpath(os.path.join(str(libdir), str(soname)))


# -- the probe and the provider -----------------------------------------------------------


def probe_landlock() -> ProbeResult:
    """Whether Landlock (ABI >= 4, for the TCP rules) works here; the ABI as the version.
    (The kernel's answer is asked once per process; the test suite's switch, every time.)"""
    from agent_sandbox.providers._test_switch import disabled

    off = disabled("landlock")
    if off:
        return ProbeResult("landlock", False, reason=f"Landlock {off}")
    return _probe_landlock_kernel()


@functools.lru_cache(maxsize=1)
def _probe_landlock_kernel() -> ProbeResult:
    try:
        abi = landlock_abi()
    except OSError as exc:
        import errno

        why = {
            errno.ENOSYS: "the kernel has no Landlock (CONFIG_SECURITY_LANDLOCK is off)",
            errno.EOPNOTSUPP: "Landlock is built in but disabled (add landlock to the lsm= boot "
            "parameter)",
        }.get(exc.errno or 0, f"landlock_create_ruleset failed: {exc}")
        return ProbeResult("landlock", False, reason=why)
    details = {
        "abi": abi,
        "tcp_rules": abi >= 4,
        "scoped_ipc": abi >= 6,
        "boundary": True,
    }
    if abi < MIN_ABI:
        return ProbeResult(
            "landlock",
            False,
            reason=f"Landlock ABI {abi} lacks TCP port rules (ABI {MIN_ABI} needed, Linux 6.7)",
            version=f"ABI {abi}",
            details=details,
        )
    return ProbeResult("landlock", True, version=f"ABI {abi}", details=details)


# The worker's own step (`_inworker` is standard library only), run on a scratch directory.
_USER_TMPFS_TRIAL = (
    "import sys; sys.path.insert(0, sys.argv[1]); import _inworker; "
    "_inworker._mount_scratch(sys.argv[2], 65536, user_ns=True)"
)


@functools.lru_cache(maxsize=1)
def probe_user_tmpfs() -> str:
    """Why a non-root worker cannot mount its scratch tmpfs here ("" when it can): the
    worker's own step (`_inworker._mount_scratch(user_ns=True)`), tried once in a child
    (and remembered across processes while nothing it depends on changed: `_probe_cache`)."""
    import sys

    from agent_sandbox.providers._probe_cache import cached_probe, file_key

    python = os.path.realpath(sys.executable)
    result = cached_probe(
        "user-tmpfs", {"python": file_key(python)}, lambda: _user_tmpfs_trial(python)
    )
    return result.reason


def _user_tmpfs_trial(python: str) -> ProbeResult:
    import shutil
    import subprocess
    import tempfile

    where = tempfile.mkdtemp(prefix="agent-sandbox-probe-")
    try:
        out = subprocess.run(
            [
                *(python, "-I", "-S", "-B", "-c", _USER_TMPFS_TRIAL),
                *(os.path.join(package_folder(), "_worker"), where),
            ],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ProbeResult("user-tmpfs", False, f"the trial did not run: {exc}")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return ProbeResult(
            "user-tmpfs", False, lines[-1] if lines else f"exit status {out.returncode}"
        )
    return ProbeResult("user-tmpfs", True)


class LandlockProvider(Provider):
    """A plain child process that applies Landlock and seccomp to itself before serving."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    #: `[files]`: refused unless the policy accepts visible names (Landlock cannot hide them).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(landlock_net, files=landlock_files)

    name: ClassVar[str] = "landlock"
    strength: ClassVar[int] = 20
    deepest_stack: ClassVar[int | None] = 2  # Landlock, seccomp
    is_boundary: ClassVar[bool] = True

    def probe(self) -> ProbeResult:
        """Landlock ABI 4 or later, and a seccomp filter that can be built (fail closed: without
        it UDP, raw sockets and nested namespaces would stay open)."""
        from agent_sandbox.providers._seccomp import probe_seccomp

        result = probe_landlock()
        if not result.available:
            return result
        if os.geteuid() != 0:
            why = probe_user_tmpfs()
            if why:
                return ProbeResult(
                    self.name,
                    False,
                    reason="run by a non-root user, the landlock worker bounds its scratch "
                    "directory (limits.scratch_mb) with a tmpfs in a user namespace of its "
                    f"own, and that fails here ({why}); enable unprivileged user namespaces "
                    "(user.max_user_namespaces, kernel.unprivileged_userns_clone), run as "
                    "root, or use the bwrap provider",
                    version=result.version,
                    details=result.details,
                )
        seccomp_ok, seccomp_info = probe_seccomp()
        details = {**result.details, "seccomp": seccomp_info}
        if not seccomp_ok:
            return ProbeResult(
                self.name, False, reason=seccomp_info, version=result.version, details=details
            )
        return ProbeResult(self.name, True, version=result.version, details=details)

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        from agent_sandbox.providers._grants import grant_pins
        from agent_sandbox.providers._netcheck import refuse_unenforceable
        from agent_sandbox.providers._seccomp import seccomp_setup

        # Landlock alone filters ports only, and cannot hide names (`landlock_files`).
        refuse_unenforceable(self, policy)
        pins = grant_pins(policy, spec)  # refuses a grant that runs through a link
        setup: dict[str, Any] = {
            "no_new_privs": True,
            "drop_caps": True,
            "landlock": landlock_setup(policy, spec, pins=pins, masks=find_masks(policy, spec)),
        }
        # Landlock has no right for metadata changes: the filter refuses them all (the
        # second layer of `_matrix`'s chmod, chown, utime and xattr cells).
        setup.update(seccomp_setup(policy, metadata=True))
        # NOTE: mounting needs CAP_SYS_ADMIN, which a root-run worker has until step 5 of
        # `_inworker`; a worker run by another user gets it over a mount namespace of its
        # own by entering a user namespace first (the probe checks that works here).
        setup["scratch_tmpfs"] = {
            "path": spec.scratch,
            "bytes": int(getattr(policy.limits, "scratch_mb", 512)) * 1024 * 1024,
        }
        if os.geteuid() != 0:
            setup["scratch_tmpfs"]["user_ns"] = True
        return LaunchPlan(
            provider=self.name,
            argv=worker_argv(spec),
            env=base_env(spec),
            pass_fds=(spec.listen_fd, spec.boot_fd),
            cwd=spec.scratch,
            worker_setup=WorkerSetup(**setup),
            stack=(self.name, "seccomp") if "seccomp" in setup else (self.name,),
            worker_depth=1,  # its keeper, then the worker
            keeper=True,
        )
