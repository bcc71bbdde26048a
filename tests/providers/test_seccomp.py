"""The seccomp filter: the rule table checked without applying anything, then in the kernel."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox.providers._seccomp import (
    DENIED_SYSCALLS,
    SeccompRule,
    build_bpf,
    describe,
    exec_rules,
    exec_setup,
    probe_seccomp,
    seccomp_rules,
)

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET = 1, 2, 10, 16, 17
SOCK_STREAM, SOCK_DGRAM = 1, 2
EPERM = errno.EPERM

TCP_POLICY = Policy(name="p", net={"rules": [{"host": "127.0.0.1", "ports": "8000"}]})
UDP_POLICY = Policy(
    name="p", net={"rules": [{"host": "127.0.0.1", "ports": "53", "protocol": "udp"}]}
)


def _denied_families(rules: list[SeccompRule]) -> set[int]:
    return {
        r.args[0][2]
        for r in rules
        if r.syscall == "socket" and len(r.args) == 1 and r.args[0][1] == "eq"
    }


def test_rule_table_denies_the_kernel_attack_surface() -> None:
    """It denies io_uring, ptrace, bpf, keyrings, userfaultfd and namespace/mount calls."""
    names = {r.syscall for r in seccomp_rules(Policy(name="p")) if not r.args}
    for syscall in (
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "ptrace",
        "process_vm_readv",
        "bpf",
        "perf_event_open",
        "keyctl",
        "add_key",
        "request_key",
        "userfaultfd",
        "unshare",
        "setns",
        "mount",
        "pivot_root",
        "chroot",
        "open_by_handle_at",
    ):
        assert syscall in names, syscall
    assert set(DENIED_SYSCALLS) <= names


def test_clone_with_any_namespace_flag_is_denied_one_rule_per_flag() -> None:
    """It adds one masked rule per CLONE_NEW* flag (a single mask would need all of them)."""
    clone = [r for r in seccomp_rules(Policy(name="p")) if r.syscall == "clone"]
    flags = sorted(r.args[0][2] for r in clone)
    assert flags == [0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000]
    assert all(r.args[0][1] == "masked_eq" and r.args[0][2] == r.args[0][3] for r in clone)
    assert SeccompRule("clone3", errno.ENOSYS) in seccomp_rules(Policy(name="p"))


def test_socket_families_follow_the_policy() -> None:
    """It allows no family without network, AF_INET/6 with a rule, and UDP only by rule."""
    plain = seccomp_rules(Policy(name="p"))
    assert {AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET} <= _denied_families(plain)
    tcp = seccomp_rules(TCP_POLICY)
    assert AF_INET not in _denied_families(tcp) and AF_NETLINK in _denied_families(tcp)
    assert AF_UNIX in _denied_families(tcp)
    dgram = SeccompRule("socket", EPERM, ((0, "eq", AF_INET, 0), (1, "masked_eq", 2, 0xF)))
    assert dgram in tcp
    assert dgram not in seccomp_rules(UDP_POLICY)


def test_bpf_program_is_deterministic_raw_bpf() -> None:
    """It exports whole 8-byte BPF instructions, the same bytes for the same policy."""
    ok, why = probe_seccomp()
    if not ok:
        pytest.skip(why)
    bpf = build_bpf(Policy(name="p"))
    assert len(bpf) % 8 == 0 and len(bpf) > 8 * len(DENIED_SYSCALLS)
    assert bpf == build_bpf(Policy(name="p"))
    assert bpf != build_bpf(TCP_POLICY)


_PROBE = r"""
import base64, ctypes, json, os, sys, threading
from agent_sandbox._worker import _inworker
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return 0 if rc >= 0 else ctypes.get_errno()
_inworker._prctl(38, 1)
_inworker._load_seccomp(base64.b64decode(sys.argv[1]))
out = {
    "socket_inet": call(41, 2, 1, 0), "socket_inet_udp": call(41, 2, 2, 0),
    "socket_netlink": call(41, 16, 3, 0), "socket_packet": call(41, 17, 3, 0),
    "socket_unix": call(41, 1, 1, 0),
    "socketpair_unix": call(53, 1, 1, 0, ctypes.addressof(ctypes.create_string_buffer(8))),
    "unshare_user": call(272, 0x10000000), "ptrace": call(101, 0, 0, 0, 0),
    "io_uring_setup": call(425, 1, 0), "bpf": call(321, 0, 0, 0),
    "keyctl": call(250, 0, 0), "userfaultfd": call(323, 0),
}
t = threading.Thread(target=lambda: None); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitpid(pid, 0)[1] >> 8
out["thread"] = True
print(json.dumps(out))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="seccomp is Linux only")
def test_filter_denies_in_the_kernel_and_leaves_fork_and_threads(tmp_path: Path) -> None:
    """It makes each denied call fail with EPERM in a real process; fork and threads still work."""
    ok, why = probe_seccomp()
    if not ok:
        pytest.skip(why)
    import base64
    import os

    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    bpf = base64.b64encode(build_bpf(TCP_POLICY)).decode()
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, bpf], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    assert out.pop("socket_inet") == 0 and out.pop("socketpair_unix") == 0
    assert out.pop("fork") == 7 and out.pop("thread") is True
    assert out == {
        "socket_unix": EPERM,
        "socket_inet_udp": EPERM,
        "socket_netlink": EPERM,
        "socket_packet": EPERM,
        "unshare_user": EPERM,
        "ptrace": EPERM,
        "io_uring_setup": EPERM,
        "bpf": EPERM,
        "keyctl": EPERM,
        "userfaultfd": EPERM,
    }


def test_worker_cannot_create_a_user_namespace_or_udp_socket(
    kernel_provider: str, arena: Any, hostile: Any, make_policy: Any
) -> None:
    """It denies unshare(CLONE_NEWUSER) and UDP from hostile code inside the worker."""
    code = "print(_libc.unshare(0x10000000), _err(), _libc.socket(2, 2, 0), _err())"
    result = hostile(kernel_provider, make_policy(arena), code)
    rc_unshare, err_unshare, rc_udp, _ = (int(x) for x in result.stdout.split())
    assert rc_unshare == -1 and err_unshare == -EPERM
    assert rc_udp == -1


def test_exec_program_refuses_execve_and_execveat_without_a_process_grant() -> None:
    """The exec program denies execve and execveat unless `process-exec` is granted; a grant
    of one function (`subprocess.run`) lifts the Python guard only and keeps it."""
    assert describe(exec_rules(Policy(name="p"))) == ["execve -> EPERM", "execveat -> EPERM"]
    by_function = Policy(name="p", api={"allow": ["subprocess.run"]})
    assert "seccomp_exec" in exec_setup(by_function)
    granted = Policy(name="p", api={"allow": ["process-exec"]})
    assert exec_rules(granted) == [] and exec_setup(granted) == {}


def test_metadata_rules_only_when_asked_and_exactly_these() -> None:
    """It adds the metadata refusals (the landlock provider's second layer) only with
    `metadata=True`, and then exactly: every path, *at and descriptor form, the newer
    *xattrat and file_setattr calls, and the inode-flag ioctls."""
    from agent_sandbox.providers._seccomp import METADATA_SYSCALLS, metadata_rules

    plain = seccomp_rules(Policy(name="p"))
    meta = seccomp_rules(Policy(name="p"), metadata=True)
    assert [r for r in meta if r not in plain] == metadata_rules()
    assert not {r.syscall for r in plain} & set(METADATA_SYSCALLS)
    assert set(METADATA_SYSCALLS) == {
        "chmod", "fchmod", "fchmodat", "fchmodat2",
        "chown", "lchown", "fchown", "fchownat",
        "utime", "utimes", "futimesat", "utimensat",
        "setxattr", "lsetxattr", "fsetxattr",
        "removexattr", "lremovexattr", "fremovexattr",
    }  # fmt: skip
    assert metadata_rules()[len(METADATA_SYSCALLS) :] == [
        SeccompRule("file_setattr", EPERM),
        SeccompRule("removexattrat", EPERM),
        SeccompRule("setxattrat", EPERM),
        SeccompRule("ioctl", EPERM, ((1, "eq", 0x40086602, 0),)),
        SeccompRule("ioctl", EPERM, ((1, "eq", 0x40046602, 0),)),
        SeccompRule("ioctl", EPERM, ((1, "eq", 0x401C5820, 0),)),
    ]


def test_only_the_landlock_provider_asks_for_the_metadata_rules(tmp_path: Path) -> None:
    """It puts the metadata rules in the landlock worker's filter (and says so to the guard);
    the namespace providers bind read-only instead and keep metadata in the grants open."""
    from agent_sandbox.providers._seccomp import seccomp_setup

    policy = Policy(name="p")
    assert seccomp_setup(policy, metadata=True)["seccomp"]["metadata"] is True
    assert "metadata" not in seccomp_setup(policy)["seccomp"]
    assert seccomp_setup(policy, metadata=True)["seccomp"]["rules"] == len(
        seccomp_rules(policy, metadata=True)
    )


_META_PROBE = r"""
import base64, ctypes, json, os, sys
from agent_sandbox._worker import _inworker
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    conv = [a if isinstance(a, bytes) else ctypes.c_long(a) for a in args]
    rc = libc.syscall(ctypes.c_long(nr), *conv)
    return 0 if rc >= 0 else ctypes.get_errno()
path = sys.argv[2].encode()
ro = os.open(path, os.O_RDONLY)
opath = os.open(path, os.O_PATH)
_inworker._prctl(38, 1)
_inworker._load_seccomp(base64.b64decode(sys.argv[1]))
st = os.stat(path)
out = {
    "chmod": call(90, path, 0o600), "fchmod_read_fd": call(91, ro, 0o600),
    "fchmodat2_opath": call(452, opath, b"", 0o600, 0x1000),
    "fchownat_opath": call(260, opath, b"", st.st_uid, st.st_gid, 0x1000),
    "utimensat_null_path": call(280, ro, 0, 0, 0),
    "utimensat_opath": call(280, opath, b"", 0, 0x1000),
    "fsetxattr_read_fd": call(190, ro, b"user.x", b"1", 1, 0),
    "setxattrat": call(463, -100, path, 0, 0, 0, 0),
    "ioctl_setflags": call(16, ro, 0x40086602, 0),
    "read": len(os.read(ro, 4)),
}
print(json.dumps(out))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="seccomp is Linux only")
def test_metadata_filter_denies_every_form_in_the_kernel(tmp_path: Path) -> None:
    """It denies chmod by path, fchmod through a read-only descriptor, fchmodat2, fchownat
    and utimensat on an O_PATH descriptor (which Landlock never checks), futimens, fsetxattr,
    setxattrat and chattr's ioctl, with EPERM; reading the descriptor still works."""
    ok, why = probe_seccomp()
    if not ok:
        pytest.skip(why)
    import base64
    import os

    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    target = tmp_path / "f"
    target.write_text("data")
    target.chmod(0o644)
    bpf = base64.b64encode(build_bpf(Policy(name="p"), metadata=True)).decode()
    proc = subprocess.run(
        [sys.executable, "-c", _META_PROBE, bpf, str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    assert out.pop("read") == 4  # the probe ran, with a working descriptor
    assert out == dict.fromkeys(out, EPERM), out
    assert len(out) == 9
    assert target.stat().st_mode & 0o777 == 0o644
