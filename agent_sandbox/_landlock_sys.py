"""The Landlock syscall layer: three syscalls through ctypes, nothing else.

Imported by the worker (through `_inworker.apply_worker_setup`) and by the parent's probe.
Standard library only, and light: it must not slow the worker's start (no `subprocess`, no
`sysconfig`). The pure rule builder and the provider live in `_landlock.py`.

What it enforces: exactly the fragment it is given, on the calling thread and its future
children, with every right the running kernel's ABI knows handled (a right of a newer ABI
is simply not handled; `min_abi` refuses a kernel too old for the rules that matter).
What it does not do: choose the rules, or work around a missing ABI silently.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["ACCESS_SETS", "MIN_ABI", "landlock_abi", "restrict_self"]

# -- kernel constants (include/uapi/linux/landlock.h) -------------------------------------

_SYS_CREATE_RULESET = 444  # the same number on every architecture (generic syscall table)
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_RULE_NET_PORT = 2

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6
#: landlock_restrict_self flags (ABI 7): log the denials of programs the worker runs too
#: (the default logs the calling process's own until it runs another program). The
#: kernel writes them only while its audit is on (`_host/denial_log.py`).
RESTRICT_SELF_LOG_NEW_EXEC_ON = 1 << 1

#: The filesystem rights each ABI knows; a right the kernel does not know is not handled.
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}
_FS_ALL = (1 << 16) - 1  # ABI 5 and later
#: Rights a rule on a file (not a directory) may carry; anything else gives EINVAL.
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV

#: Named access sets used in the setup fragment (the wire form stays readable).
ACCESS_SETS: Mapping[str, int] = {
    "ro": FS_READ_FILE | FS_READ_DIR,
    "rx": FS_READ_FILE | FS_READ_DIR | FS_EXECUTE,
    # NOTE: MAKE_CHAR/MAKE_BLOCK stay off (root holds CAP_MKNOD until the caps are dropped)
    # and so does IOCTL_DEV; REFER is on so renames between scratch subfolders work.
    "rw": _FS_ALL & ~(FS_EXECUTE | FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_IOCTL_DEV),
    "dev-rw": FS_READ_FILE | FS_WRITE_FILE,
    "dev-ro": FS_READ_FILE,
    # A directory listed but nothing read below it: the parent of a masked name, whose
    # other entries are granted one by one (`_landlock._narrow`).
    "ls": FS_READ_DIR,
}

#: The lowest ABI the provider accepts: below 4 the TCP rules would silently not apply.
MIN_ABI = 4

# -- the syscall layer (thin; ctypes imported lazily) -------------------------------------


_SYSCALL: Any = None


def _syscall() -> Any:
    global _SYSCALL
    if _SYSCALL is None:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        _SYSCALL = fn
    return _SYSCALL


_STRUCTS: Any = None


def _structs() -> Any:
    """The three argument structures of the Landlock syscalls (ctypes classes, made once)."""
    global _STRUCTS
    if _STRUCTS is None:
        import ctypes

        class RulesetAttr(ctypes.Structure):
            _fields_ = [
                ("fs", ctypes.c_uint64),
                ("net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64),
            ]

        class PathBeneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

        class NetPort(ctypes.Structure):
            _fields_ = [("allowed", ctypes.c_uint64), ("port", ctypes.c_uint64)]

        _STRUCTS = (RulesetAttr, PathBeneath, NetPort)
    return _STRUCTS


def warm_up() -> None:
    """Make the syscall function and the structures now (a worker template calls this, so
    that each forked worker does not build them in its own memory). Holds no state of any
    one process: the structures are types, the function the C library's `syscall`."""
    _syscall()
    _structs()


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; raises OSError (ENOSYS, EOPNOTSUPP) without it."""
    import ctypes

    rc = _syscall()(
        ctypes.c_long(_SYS_CREATE_RULESET),
        ctypes.c_void_p(None),
        ctypes.c_size_t(0),
        ctypes.c_uint32(_CREATE_RULESET_VERSION),
    )
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset(version): {os.strerror(err)}")
    return int(rc)


def restrict_self(setup: Mapping[str, Any]) -> dict[str, Any]:
    """Apply a `landlock_setup()` fragment to the calling thread (and its future children).

    The caller must already have set NO_NEW_PRIVS and must be single-threaded. Raises
    OSError when the kernel refuses any step (fail closed: the worker must not serve).
    Returns what was enforced: the ABI, the handled rights, the rules added and the paths
    skipped because they do not exist here.
    """
    import ctypes

    syscall = _syscall()
    abi = landlock_abi()
    if abi < int(setup.get("min_abi", MIN_ABI)):
        raise OSError(0, f"Landlock ABI {abi} is below the required {setup.get('min_abi')}")

    RulesetAttr, PathBeneath, NetPort = _structs()

    def check(rc: int, what: str) -> int:
        if rc < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
        return rc

    handled_fs = _FS_BY_ABI.get(abi, _FS_ALL)
    handled_net = 0
    if abi >= 4:
        if setup.get("tcp_connect") is not None:
            handled_net |= NET_CONNECT_TCP
        if setup.get("tcp_bind") is not None:
            handled_net |= NET_BIND_TCP
    scoped = 0
    if abi >= 6:
        names = set(setup.get("scope", ()))
        scoped = (SCOPE_ABSTRACT_UNIX if "abstract_unix" in names else 0) | (
            SCOPE_SIGNAL if "signal" in names else 0
        )
    attr = RulesetAttr(handled_fs, handled_net, scoped)
    size = ctypes.sizeof(RulesetAttr) if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = check(
        syscall(
            ctypes.c_long(_SYS_CREATE_RULESET),
            ctypes.byref(attr),
            ctypes.c_size_t(size),
            ctypes.c_uint32(0),
        ),
        "landlock_create_ruleset",
    )
    added = 0
    skipped: list[str] = []
    pins = setup.get("pins") or {}
    try:
        for path, access in setup.get("paths", ()):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                skipped.append(path)
                continue
            try:
                if path in pins:
                    _check_pin(fd, path, pins[path])
                rights = ACCESS_SETS[access] & handled_fs
                if not _is_dir(fd):
                    rights &= _FILE_RIGHTS
                rule = PathBeneath(rights, fd)
                check(
                    syscall(
                        ctypes.c_long(_SYS_ADD_RULE),
                        ctypes.c_int(ruleset),
                        ctypes.c_int(_RULE_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    ),
                    f"landlock_add_rule({path!r})",
                )
                added += 1
            finally:
                os.close(fd)
        for right, key in ((NET_CONNECT_TCP, "tcp_connect"), (NET_BIND_TCP, "tcp_bind")):
            if not handled_net & right:
                continue
            for port in setup.get(key) or ():
                net = NetPort(right, int(port))
                check(
                    syscall(
                        ctypes.c_long(_SYS_ADD_RULE),
                        ctypes.c_int(ruleset),
                        ctypes.c_int(_RULE_NET_PORT),
                        ctypes.byref(net),
                        ctypes.c_uint32(0),
                    ),
                    f"landlock_add_rule(port {port})",
                )
                added += 1
        log_flags = RESTRICT_SELF_LOG_NEW_EXEC_ON if abi >= 7 else 0
        check(
            syscall(
                ctypes.c_long(_SYS_RESTRICT_SELF),
                ctypes.c_int(ruleset),
                ctypes.c_uint32(log_flags),
            ),
            "landlock_restrict_self",
        )
    finally:
        os.close(ruleset)
    return {
        "abi": abi,
        "enforced": True,
        "handled_fs": handled_fs,
        "handled_net": handled_net,
        "scoped": scoped,
        "rules": added,
        "skipped": skipped,
        "log_flags": log_flags,
    }


def _check_pin(fd: int, path: str, pin: Any) -> None:
    """The descriptor about to be granted must be the object the parent pinned (see
    `providers/_grants.py`): a link planted since the check would otherwise be followed."""
    info = os.fstat(fd)
    if pin is None or [info.st_dev, info.st_ino] != list(pin):
        raise OSError(
            0,
            f"{path} is not the object the policy check pinned (a link planted or a "
            "directory swapped between the check and the start); not granting it",
        )


def _is_dir(fd: int) -> bool:
    import stat

    return stat.S_ISDIR(os.fstat(fd).st_mode)
