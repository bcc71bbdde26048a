"""The `unshare` provider's launcher: builds the namespaces and the mount view, then the worker.

Run as `python -I -S -B -c <import and call main()> <config>` (standard library only: it
runs before and outside the package; imported rather than run as a script, so that its
bytecode cache is used). The configuration comes from `_unshare.launcher_config` (a pure
function), encoded by `marshal` as hex, because importing `json` (and `re` with it) would
cost more than the rest of the launcher; this file only applies it. Modules are chosen for
start-up cost too (`_signal` rather than `signal`, which imports `enum`). Three processes, in order:

1. L (this process, started by the parent): asks for SIGKILL when its parent dies, creates
   a user and a PID namespace (`unshare(CLONE_NEWUSER | CLONE_NEWPID)`), maps uid and gid 0
   to itself (the parent's uid; no other uid exists inside), forks B, waits for it and exits
   with the worker's status (a signal is re-raised, so the parent sees `-SIGXCPU` etc.).
2. B (PID 1 of the new PID namespace, root inside the user namespace only):
   a. SIGKILL when L dies (and thus when the parent dies: the namespace dies with B);
   b. new mount, network, IPC, UTS and cgroup namespaces;
   c. makes every mount private, mounts a tmpfs as the new root and builds the view in the
      configuration's order; read-only binds (and every mount below them) are remounted
      read-only, and every bind gets nosuid (and nodev, except the device nodes);
   d. remounts the new root read-only, `pivot_root`s into it and detaches the old root;
   e. sets the host name, brings `lo` up only for a policy with network rules (the
      egress proxy listens there), forbids nested
      user namespaces (`user.max_user_namespaces = 0` in this namespace);
   f. drops every capability for good: bounding set, securebits (no root privilege on
      exec, locked), ambient set, no-new-privileges, then its own sets;
   g. lets C go (or forks it) and reaps every process of the namespace until C exits,
      then reports C's status to L through a pipe and exits (which kills anything left in
      the namespace).
3. C, for a worker (`boot` in the configuration): forked by B right after step 2b, it
   becomes the worker in this interpreter rather than exec'ing a second one (about 10 ms
   saved), and imports the worker's modules while B still builds the view. It waits for
   B's `go` (sent after step 2f), then drops its own privileges the same way, starts a new
   session (no controlling terminal to push input into), enters the working directory and
   serves. Without `boot` (the probe), B forks C after step 2f and C `execve`s `argv`.
   For a worker template (`template` in the configuration), C keeps CAP_SYS_ADMIN,
   CAP_NET_ADMIN and CAP_SETPCAP (`TEMPLATE_KEEP`): it runs no user code, and gives each
   worker it forks namespaces of its own (`_worker/nstemplate.py`), every one of which drops
   them before it serves.

What it does not do: seccomp and Landlock (the worker applies them to itself when the plan
stacks them), rlimits (the worker's own set-up), and any uid change: the worker is uid 0
mapped to the parent's uid, without capabilities; the view is the boundary.
"""

from __future__ import annotations

import _frozen_importlib_external as _bootstrap_external  # always loaded; no importlib.util
import _signal  # type: ignore[import-not-found]  # no enum import, unlike `signal`
import ctypes
import marshal
import os
import sys

TYPE_CHECKING = False  # (not `typing`'s: importing typing costs the launcher ~7 ms, re with it)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["TEMPLATE_KEEP", "main"]

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# NOROOT, NO_SETUID_FIXUP and NO_CAP_AMBIENT_RAISE, each locked, and KEEP_CAPS_LOCKED
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
SYS_PIVOT_ROOT = 155  # x86_64
SIGHUP, SIGINT, SIGKILL, SIGTERM = 1, 2, 9, 15
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# statvfs flag -> mount flag, for the flags a user namespace may not clear on remount.
_LOCKED = (
    (os.ST_RDONLY, MS_RDONLY),
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class SetupFailed(Exception):
    """One set-up step failed; the message names it."""


def check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise SetupFailed(f"{what}: {os.strerror(err)}")
    return rc


def prctl(option: int, arg: int = 0) -> int:
    return int(libc.prctl(option, arg, 0, 0, 0))


def mount(
    src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    check(
        libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)),
        f"mount {src or fstype} on {dst}",
    )


def write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def locked_flags(path: str) -> int:
    have = os.statvfs(path).f_flag
    return sum(ms for st, ms in _LOCKED if have & st)


def submounts(path: str) -> list[str]:
    """Mount points strictly below `path` in this mount namespace."""
    out = []
    prefix = path.rstrip("/") + "/"
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(prefix):
                out.append(point)
    return out


def remount(path: str, extra: int) -> None:
    mount(None, path, None, MS_REMOUNT | MS_BIND | locked_flags(path) | extra)


def make_point(target: str, like_dir: bool) -> None:
    if like_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))


def bind(src: str, target: str, readonly: bool, device: bool = False) -> None:
    make_point(target, os.path.isdir(src))
    mount(src, target, None, MS_BIND | MS_REC)
    extra = MS_NOSUID | (0 if device else MS_NODEV) | (MS_RDONLY if readonly else 0)
    for point in [target, *submounts(target)]:
        remount(point, extra)


def tmpfs(target: str, size: int, mode: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    os.makedirs(target, exist_ok=True)
    mount("tmpfs", target, "tmpfs", flags, f"size={size},mode={mode}")


def build_view(cfg: dict[str, Any]) -> None:
    """Step 2c-2d: the new root, in the configuration's order, then pivot into it."""
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    tmpfs(root, 1024 * 1024, "0755")
    for kind, dst, src in cfg["mounts"]:
        target = root + dst
        if kind in ("ro", "rw", "ro-try", "rw-try"):
            if kind.endswith("-try") and not os.path.exists(src):
                continue
            bind(src, target, readonly=kind.startswith("ro"))
        elif kind == "symlink":
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(src, target)
        elif kind == "tmpfs":
            tmpfs(target, cfg["tmpfs_bytes"], "1777")
        elif kind == "scratch":
            tmpfs(target, int(src), "0700")
        elif kind == "proc":
            os.makedirs(target, exist_ok=True)
            mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif kind == "dev":
            tmpfs(target, 64 * 1024, "0755", MS_NOSUID | MS_NOEXEC)
            for name in _DEVICES:
                if os.path.exists("/dev/" + name):
                    bind("/dev/" + name, f"{target}/{name}", readonly=False, device=True)
            for name, link in (
                ("fd", "/proc/self/fd"),
                ("stdin", "/proc/self/fd/0"),
                ("stdout", "/proc/self/fd/1"),
                ("stderr", "/proc/self/fd/2"),
            ):
                os.symlink(link, f"{target}/{name}")
            tmpfs(target + "/shm", cfg["tmpfs_bytes"], "1777", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            remount(target, MS_RDONLY)
        elif kind == "mask-dir":
            tmpfs(target, 4096, "0000")
            remount(target, MS_RDONLY)
        elif kind == "mask-file":
            bind("/dev/null", target, readonly=True, device=True)
        else:
            raise SetupFailed(f"unknown mount kind {kind!r}")
    remount(root, MS_RDONLY)
    os.chdir(root)
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def loopback_up() -> None:
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        req = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh14x", fcntl.ioctl(sock, 0x8913, req))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sh14x", b"lo", flags | 1))  # SIOCSIFFLAGS


def loopback_up_aside() -> int:
    """Fork a child (still privileged in this namespace) that brings `lo` up and exits;
    return its pid. The caller waits for it before the worker may run, so the worker never
    sees the namespace without its loopback, and the child is gone before any privilege
    is dropped."""
    pid = os.fork()
    if pid == 0:
        try:
            loopback_up()
        except BaseException as exc:
            try:
                os.write(2, f"agent-sandbox unshare: bring lo up: {exc}\n".encode())
            except OSError:
                pass
            os._exit(1)
        os._exit(0)
    return pid


#: What a worker template keeps (`template` in the configuration; `_worker/template.py`):
#: CAP_SETPCAP (8), CAP_NET_ADMIN (12), CAP_SYS_ADMIN (21), to give each forked worker
#: namespaces of its own; every worker drops them before it serves.
TEMPLATE_KEEP = (1 << 8) | (1 << 12) | (1 << 21)


def drop_privileges(keep: int = 0) -> None:
    """Step 2f: nothing can give a process of this namespace a capability again (but the
    `keep` mask, for a worker template, which runs no user code)."""
    cap = 0
    while cap < 64:
        if not keep >> cap & 1 and prctl(PR_CAPBSET_DROP, cap) != 0:
            break
        cap += 1
    check(prctl(PR_SET_SECUREBITS, SECUREBITS), "securebits")
    check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "clear the ambient set")
    check(prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    low, high = keep & 0xFFFFFFFF, keep >> 32
    data = (ctypes.c_uint32 * 6)(low, low, 0, high, high, 0)
    check(libc.capset(header, data), "capset")


def init(cfg: dict[str, Any], report: int) -> None:
    """Process B: set up, start the worker, reap until it exits, report its status."""
    prctl(PR_SET_PDEATHSIG, SIGKILL)
    check(
        libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP),
        "unshare",
    )
    early = fork_worker_early(cfg, report) if "boot" in cfg else None
    # `lo` comes up in a child of its own while the view is built: the ioctl waits for the
    # kernel's network lock, which the teardown of an earlier worker's namespace may hold
    # for tens of milliseconds (benchmarks/bench_egress.py, the start with the proxy). It
    # is forked after the worker, so the host's first look at this depth (`attach_at_depth`
    # in _host/limits.py) finds the worker, not this helper.
    lo = loopback_up_aside() if cfg["net"] in ("loopback", "proxy") else None
    build_view(cfg)
    name = cfg["hostname"].encode()
    check(libc.sethostname(name, len(name)), "sethostname")
    if lo is not None:
        _, status = os.waitpid(lo, 0)
        if status != 0:
            raise SetupFailed(f"could not bring the loopback interface up (status {status})")
    write_file("/proc/sys/user/max_user_namespaces", "0")
    drop_privileges()
    if early is not None:
        worker, go = early
        os.write(go, b"g")  # the view is complete and the namespace locked down
        os.close(go)
    else:
        worker = os.fork()
        if worker == 0:
            try:
                os.close(report)
                os.setsid()
                os.chdir(cfg["cwd"])
                os.execve(cfg["argv"][0], cfg["argv"], os.environ)
            except BaseException as exc:
                os.write(2, f"agent-sandbox unshare: exec failed: {exc}\n".encode())
            os._exit(127)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == worker:
            os.write(report, str(status).encode())
            os._exit(0)


def fork_worker_early(cfg: dict[str, Any], report: int) -> tuple[int, int]:
    """Fork C as soon as the namespaces exist; return its pid and the write end of `go`.

    C loads the worker's entry point (`_worker/boot.py`, from its bytecode cache) in this
    interpreter, which already runs isolated (`-I -S -B`) with the worker's environment,
    and imports the worker's modules while B builds the view (the second core works). Then
    it waits for B's `go`: only once the view is complete, pivoted into and the namespace
    locked down does C drop its own privileges for good (as B did), start its session and
    run the worker. If B fails, `go` closes empty and C exits without running anything.
    """
    boot_script, boot_fd = cfg["boot"]
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid != 0:
        os.close(go_read)
        return pid, go_write
    try:
        os.close(report)
        os.close(go_write)
        loader = _bootstrap_external.SourceFileLoader("agent_sandbox_worker_boot", boot_script)
        entry = type(sys)(loader.name)
        entry.__file__ = boot_script
        loader.exec_module(entry)
        boot = entry.load(boot_fd)
        entry.import_worker(boot)
        if os.read(go_read, 1) != b"g":
            os._exit(1)  # B failed and said why
        os.close(go_read)
        drop_privileges(TEMPLATE_KEEP if cfg.get("template") else 0)
        os.setsid()
        os.chdir(cfg["cwd"])
        entry.run(boot)  # serves until told to stop; leaves through os._exit
    except BaseException as exc:
        os.write(2, f"agent-sandbox unshare: starting the worker failed: {exc!r}\n".encode())
    os._exit(127)


def relay(status: int) -> None:
    """Exit L the way the worker exited."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (SIGKILL, _signal.SIGSTOP):  # (their handlers cannot be set)
            _signal.signal(sig, _signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main() -> None:
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    prctl(PR_SET_PDEATHSIG, SIGKILL)
    if os.getppid() == 1:
        os._exit(1)  # the parent is already gone
    os.makedirs(cfg["root"], exist_ok=True)
    uid, gid = os.getuid(), os.getgid()  # before unshare: unmapped ids read as 65534
    try:
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWPID), "unshare user and pid namespaces")
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1\n")
        write_file("/proc/self/gid_map", f"0 {gid} 1\n")
    except (SetupFailed, OSError) as exc:
        os.write(2, f"agent-sandbox unshare: {exc}\n".encode())
        os._exit(1)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        try:
            init(cfg, write_end)
        except BaseException as exc:
            os.write(2, f"agent-sandbox unshare: set-up failed: {exc}\n".encode())
        os._exit(1)
    os.close(write_end)
    for sig in (SIGHUP, SIGINT, SIGTERM):
        _signal.signal(sig, _signal.SIG_DFL)
    _, own = os.waitpid(child, 0)
    data = os.read(read_end, 64)
    relay(int(data) if data else own)
