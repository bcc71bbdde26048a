"""A seccomp filter for the worker: deny the kernel surface a Python tool never needs.

What it enforces (kernel, against hostile native code too): the default action is ALLOW,
and each rule of `seccomp_rules(policy)` makes one syscall (or one argument pattern of it)
fail with EPERM:

* socket families the policy does not need: none but AF_INET/AF_INET6 when the policy allows
  some network, and then only SOCK_STREAM unless a rule allows UDP. `socket(AF_UNIX)` is
  denied too: Landlock cannot stop a connect to a host's pathname Unix socket (a container
  runtime's or the system bus's, which uid 0 may own), so no Unix socket can be created;
  `socketpair()`, pipes and the worker's inherited listening socket keep working;
* ptrace and cross-process memory access, io_uring, bpf, perf_event_open, the key
  ring, userfaultfd, kernel modules, kexec, reboot, swap, accounting;
* namespace creation and mount changes: unshare, setns, clone with any CLONE_NEW* flag,
  mount, the new mount API, pivot_root, chroot;
* `clone3` gives ENOSYS (its flags are in memory, out of the filter's reach), so glibc
  falls back to `clone`, whose flags the filter checks;
* TIOCSTI and TIOCLINUX ioctls (pushing keystrokes into a terminal).

A syscall of another ABI (x32, i386) kills the process (libseccomp's bad-arch action).

With `metadata=True` (asked for by the `landlock` provider only) it also refuses every
change of a file's mode, owner, times, extended attributes and inode flags, whatever the
path or descriptor (`metadata_rules`): Landlock has no right for them.

What it does NOT enforce: anything about paths, ports or hosts (Landlock and the namespace
providers do that). `execve` is left to a second, separate program (`exec_rules`): a
launcher such as `bwrap --seccomp FD` must still exec the worker after loading the first.

The exec program: without the `process-exec` grant, `execve` and `execveat` fail with EPERM
once the worker has started (the worker loads it itself, last of its restrictions). That
closes what Landlock's EXECUTE right cannot: handing any readable ELF file to the dynamic
loader (`ld-linux.so /usr/lib/git-core/git`, or a copy written into scratch), which the
kernel maps without an exec check on the file. With the grant, exec stays open and Landlock
decides which files may be executed (see `docs/providers.md` for how precisely that holds).

The filter is built in the PARENT with pyseccomp and exported as raw BPF bytes. The worker
loads those bytes itself with one `prctl` (see `_worker/_inworker.py`), so it never imports
pyseccomp (which cannot find libseccomp under Landlock). `bwrap --seccomp FD` takes the
same bytes.
"""

from __future__ import annotations

import base64
import errno
import functools
import os
import socket
import sys
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

from agent_sandbox._errors import install_hint

__all__ = [
    "DENIED_SYSCALLS",
    "METADATA_SYSCALLS",
    "SeccompRule",
    "build_bpf",
    "exec_rules",
    "exec_setup",
    "grants_exec",
    "metadata_rules",
    "probe_seccomp",
    "seccomp_rules",
    "seccomp_setup",
]


class SeccompRule(NamedTuple):
    """One rule: `syscall` fails with `errno` when every `(arg, op, value, mask)` matches.

    `op` is "eq", "ge" or "masked_eq" (then `(arg & mask) == value`).
    """

    syscall: str
    errno: int
    args: tuple[tuple[int, str, int, int], ...] = ()


#: Syscalls denied outright. Each has a reason; none is needed by a Python tool.
DENIED_SYSCALLS: tuple[str, ...] = (
    "acct",
    "add_key",
    "bpf",  # kernel attack surface; also reads other processes' maps
    "chroot",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "init_module",
    "io_uring_enter",  # io_uring bypasses seccomp for the operations it queues
    "io_uring_register",
    "io_uring_setup",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "open_by_handle_at",  # opens files by handle, around path-based rules
    "open_tree",
    "perf_event_open",
    "pidfd_getfd",
    "pivot_root",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "unshare",
    "userfaultfd",  # stalls the kernel at a chosen point: an exploit primitive
)

# NOTE: libseccomp 2.5.4 does not know these names; they are denied by number, which is the
# same on x86_64 and aarch64 (the unified table from 424 on).
_RAW_X86_64 = {
    "statmount": 457,
    "listmount": 458,
    "open_tree_attr": 467,
    "setxattrat": 463,
    "removexattrat": 466,
    "file_setattr": 469,
}
_RAW_ALWAYS = ("statmount", "listmount", "open_tree_attr")

#: Calls that change a file's metadata (mode, owner, times, extended attributes, inode
#: flags). Landlock has no access right for any of them, so under the `landlock` provider
#: alone a file the worker's user owns outside `files.write` could be changed: the
#: `landlock` provider refuses them all (`metadata_rules`). Path-based ones cannot be
#: judged by a filter; descriptor-based ones need a descriptor Landlock judged, but one
#: opened read-only is enough (`fchmod` on a read-granted file), and `fchownat` and
#: `utimensat` take an `O_PATH` descriptor, which Landlock does not check at all.
METADATA_SYSCALLS: tuple[str, ...] = (
    "chmod",
    "chown",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "fchown",
    "fchownat",
    "fremovexattr",
    "fsetxattr",
    "futimesat",
    "lchown",
    "lremovexattr",
    "lsetxattr",
    "removexattr",
    "setxattr",
    "utime",
    "utimensat",
    "utimes",
)
_FS_IOC_SETFLAGS = (0x40086602, 0x40046602)  # and FS_IOC32_SETFLAGS: chattr
_FS_IOC_FSSETXATTR = 0x401C5820

_CLONE_NEW_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
_AF_MAX = 46
_SOCK_TYPE_MASK = 0xF
_SOCK_TYPES = (2, 3, 4, 5, 6, 10)  # DGRAM, RAW, RDM, SEQPACKET, DCCP, PACKET


def _allowed_families(policy: Any) -> tuple[set[int], bool]:
    """(families the policy needs, whether UDP is needed)."""
    rules = _net_rules(policy)
    allows = [r for r in rules if _field(r, "action") == "allow"]
    families: set[int] = set()
    if allows:
        families |= {int(socket.AF_INET), int(socket.AF_INET6)}
    udp = any(_field(r, "protocol") in ("udp", "any") for r in allows)
    return families, udp


def _net_rules(policy: Any) -> list[Any]:
    net = policy.get("net", {}) if isinstance(policy, dict) else getattr(policy, "net", None)
    if net is None:
        return []
    rules = net.get("rules", ()) if isinstance(net, dict) else getattr(net, "rules", ())
    return list(rules)


def _field(rule: Any, key: str) -> Any:
    return rule.get(key) if isinstance(rule, dict) else getattr(rule, key)


def metadata_rules() -> list[SeccompRule]:
    """Every metadata change refused (the `landlock` provider's second layer; see
    `METADATA_SYSCALLS`): the calls, the raw-numbered newer ones, and the inode-flag ioctls."""
    eperm = errno.EPERM
    rules = [SeccompRule(name, eperm) for name in METADATA_SYSCALLS]
    rules += [SeccompRule(name, eperm) for name in ("file_setattr", "removexattrat", "setxattrat")]
    rules += [
        SeccompRule("ioctl", eperm, ((1, "eq", op, 0),))
        for op in (*_FS_IOC_SETFLAGS, _FS_IOC_FSSETXATTR)
    ]
    return rules


def seccomp_rules(policy: Any, *, metadata: bool = False) -> list[SeccompRule]:
    """The whole rule table for `policy` (pure: nothing is built or applied); with
    `metadata`, `metadata_rules()` too (the `landlock` provider asks for them)."""
    eperm = errno.EPERM
    rules = [SeccompRule(name, eperm) for name in DENIED_SYSCALLS]
    rules += [SeccompRule(name, eperm) for name in _RAW_ALWAYS]
    if metadata:
        rules += metadata_rules()
    rules += [SeccompRule("clone", eperm, ((0, "masked_eq", f, f),)) for f in _CLONE_NEW_FLAGS]
    rules.append(SeccompRule("clone3", errno.ENOSYS))
    rules += [SeccompRule("ioctl", eperm, ((1, "eq", op, 0),)) for op in (_TIOCSTI, _TIOCLINUX)]
    families, udp = _allowed_families(policy)
    for family in range(_AF_MAX):
        if family not in families:
            rules.append(SeccompRule("socket", eperm, ((0, "eq", family, 0),)))
    rules.append(SeccompRule("socket", eperm, ((0, "ge", _AF_MAX, 0),)))
    if not udp:
        for family in sorted(families):
            for kind in _SOCK_TYPES:
                rules.append(
                    SeccompRule(
                        "socket",
                        eperm,
                        ((0, "eq", family, 0), (1, "masked_eq", kind, _SOCK_TYPE_MASK)),
                    )
                )
    return rules


def build_bpf(policy: Any, *, metadata: bool = False) -> bytes:
    """The rule table compiled to a raw BPF program (for prctl or `bwrap --seccomp FD`)."""
    return _compile(tuple(seccomp_rules(policy, metadata=metadata)))


#: The libraries pyseccomp looks up when it is imported, by the sonames the dynamic loader
#: resolves (a soname that does not load falls back to `ctypes.util.find_library`).
_SONAMES = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}
_IMPORT_LOCK = threading.Lock()


def _pyseccomp() -> Any:
    """pyseccomp, imported without `ctypes.util.find_library` starting `ldconfig -p` twice
    (two processes: 20-40 ms of an agent process's first launch plan). It gets the same
    libraries: a soname loads from where the dynamic loader finds it, which is what
    `ldconfig -p` lists; any other name, or a soname that does not load, asks the real
    `find_library`."""
    loaded = sys.modules.get("pyseccomp")
    if loaded is not None:
        return loaded
    import ctypes
    import ctypes.util

    with _IMPORT_LOCK:
        real = ctypes.util.find_library

        def find_library(name: str) -> str | None:
            soname = _SONAMES.get(name)
            if soname is not None:
                try:
                    ctypes.CDLL(soname)
                except OSError:
                    pass
                else:
                    return soname
            return real(name)

        ctypes.util.find_library = find_library
        try:
            import pyseccomp
        finally:
            ctypes.util.find_library = real
    return pyseccomp


@functools.lru_cache(maxsize=64)
def _compile(rules: tuple[SeccompRule, ...]) -> bytes:
    sc = _pyseccomp()

    ops = {"eq": sc.EQ, "ge": sc.GE, "masked_eq": sc.MASKED_EQ}
    filt = sc.SyscallFilter(sc.ALLOW)
    for rule in rules:
        args = []
        for index, op, value, mask in rule.args:
            if op == "masked_eq":
                args.append(sc.Arg(index, ops[op], mask, value))
            else:
                args.append(sc.Arg(index, ops[op], value))
        target: str | int = rule.syscall
        if rule.syscall in _RAW_X86_64:
            if sc.resolve_syscall(sc.system_arch(), rule.syscall) >= 0:
                target = rule.syscall
            elif os.uname().machine in ("x86_64", "aarch64"):
                target = _RAW_X86_64[rule.syscall]
            else:
                continue
        filt.add_rule(sc.ERRNO(rule.errno), target, *args)
    read_fd, write_fd = os.pipe()
    try:
        with os.fdopen(write_fd, "wb", closefd=True) as sink:
            filt.export_bpf(sink)
        return _read_all(read_fd)
    finally:
        os.close(read_fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def seccomp_setup(policy: Any, *, metadata: bool = False) -> dict[str, Any]:
    """The `worker_setup` fragment: `{"seccomp": {"bpf": <base64>, "rules": n}}`, plus the
    exec program of `exec_setup` when the policy grants no `process-exec`. With `metadata`
    the filter refuses every metadata change too, and the fragment says so
    (`"metadata": true`: the Python guard then explains the refusal as `files.metadata`)."""
    bpf = build_bpf(policy, metadata=metadata)
    count = len(seccomp_rules(policy, metadata=metadata))
    fragment: dict[str, Any] = {"bpf": base64.b64encode(bpf).decode(), "rules": count}
    if metadata:
        fragment["metadata"] = True
    return {"seccomp": fragment, **exec_setup(policy)}


def grants_exec(policy: Any) -> bool:
    """Whether the policy grants the `process-exec` category (a kernel-level process grant).

    A rule naming one function (`subprocess.run`) lifts the Python guard only.
    """
    api = policy.get("api", {}) if isinstance(policy, dict) else getattr(policy, "api", None)
    if api is None:
        return False
    allow = api.get("allow", ()) if isinstance(api, dict) else getattr(api, "allow", ())
    return "process-exec" in allow


def exec_rules(policy: Any) -> list[SeccompRule]:
    """The exec program: `execve` and `execveat` refused unless `process-exec` is granted."""
    if grants_exec(policy):
        return []
    return [SeccompRule("execve", errno.EPERM), SeccompRule("execveat", errno.EPERM)]


def exec_setup(policy: Any) -> dict[str, Any]:
    """`{"seccomp_exec": {"bpf": <base64>, "rules": 2}}`, or {} when the policy grants exec.

    The worker loads it after every other restriction, so its own start (and a launcher's
    exec of the interpreter) is not affected.
    """
    rules = exec_rules(policy)
    if not rules:
        return {}
    bpf = _compile(tuple(rules))
    return {"seccomp_exec": {"bpf": base64.b64encode(bpf).decode(), "rules": len(rules)}}


def describe(rules: Iterable[SeccompRule]) -> list[str]:
    """One readable line per rule (for docs and `doctor`)."""
    out = []
    for rule in rules:
        conds = " and ".join(
            f"arg{i} & {mask:#x} == {value:#x}" if op == "masked_eq" else f"arg{i} {op} {value}"
            for i, op, value, mask in rule.args
        )
        out.append(
            f"{rule.syscall}{' if ' + conds if conds else ''} -> {errno.errorcode[rule.errno]}"
        )
    return out


def probe_seccomp() -> tuple[bool, str]:
    """(whether a filter can be built here, the libseccomp version or the reason not).
    (The library's answer is found once per process; the test suite's switch, every time.)"""
    from agent_sandbox.providers._test_switch import disabled

    off = disabled("seccomp")
    if off:
        return False, f"seccomp {off}"
    return _probe_seccomp_library()


@functools.lru_cache(maxsize=1)
def _probe_seccomp_library() -> tuple[bool, str]:
    try:
        sc = _pyseccomp()
        build_bpf({})
        version = getattr(sc, "_libseccomp", None)
        ver = ""
        if version is not None and hasattr(version, "seccomp_version"):
            import ctypes

            class _V(ctypes.Structure):
                _fields_ = [
                    ("major", ctypes.c_uint),
                    ("minor", ctypes.c_uint),
                    ("micro", ctypes.c_uint),
                ]

            version.seccomp_version.restype = ctypes.POINTER(_V)
            v = version.seccomp_version().contents
            ver = f"libseccomp {v.major}.{v.minor}.{v.micro}"
        return True, ver
    except Exception as exc:  # any failure means "not here", with the reason
        return (
            False,
            f"cannot build a seccomp filter ({type(exc).__name__}: {exc}); "
            f"install the `seccomp` extra ({install_hint('seccomp')}) and libseccomp2",
        )
