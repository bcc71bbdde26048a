"""The namespace half of a worker template (`_worker/template.py`): each worker's own PID,
mount, network and IPC namespaces.

A template inside a namespace sandbox (`bwrap`, `unshare`; `_host/templates.py` says when)
runs in the sandbox's namespaces and view, keeping only the capabilities it needs to give
each worker namespaces of its own (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SETPCAP), after it has
forbidden new user namespaces for the whole sandbox (`user.max_user_namespaces = 0`, which
stands for bubblewrap's `--disable-userns`). For each request, in the forked child:

1. P (the child, PID 1 of a new PID namespace): sends one byte on the request's
   credential socket, so the host reads its pid (the kernel's credentials) and places it and
   W in the worker's cgroups while W boots (W forks nothing before its handshake). Then new
   mount, network and IPC namespaces, and P forks W at once; W builds its view before
   anything else (P's pages are then written only for this much, and freed by its exec). In
   the new mount namespace the sandbox's root and `/dev` are read-only, and `/tmp`, the
   scratch directory, `/dev/shm` and `/dev/pts` are fresh file systems of its own (no
   sibling shares them; what the view mounts under `/tmp`, the policy's paths there, is
   copied onto the new one); `lo` is up where the provider brings it up for a fresh worker;
   a fresh `/proc` (only the worker's own processes), with `/proc/sys`,
   `/proc/sysrq-trigger`, `/proc/irq` and `/proc/bus` covered read-only. P meanwhile drops
   every capability, sets no-new-privileges, closes every descriptor but 0-2 and execs the
   small C init (`_worker/_nsinit.c`, see `_exec_init`), which reaps until W exits, then
   exits as W did (a signal N as status 128 + N): P keeps no copy of this interpreter (about
   3 MB PSS per worker otherwise). Where that program is missing, P's own Python loop does
   the same. It dies with the template (its parent-death signal, kept across the exec), and
   so does everything in its namespace.
2. W: the worker, which then sets itself up exactly as a fresh worker does, with the plan's
   Landlock (its own domain: signals and abstract sockets scoped to it, no ptrace of a
   process outside it), the seccomp filter and the capability drop, which a fresh `bwrap`
   worker gets from bubblewrap and the host adds to the plan of a forked one.

Step 1 is done in C where _worker/_nsfork.c is built (`_nsfork.fork_worker`): one clone3(2)
(clone(2) on a kernel without it) makes P the template's own child in a new PID namespace,
and P's part runs as system calls (and the interpreter's before-fork hooks, as `os.fork`
runs them), so P writes about 30 pages before its exec instead of about 440 (issue 19: 20
sessions at once; about 1.3 ms of CPU per worker). W comes back to Python and builds its
view. Without that extension, where it can make neither system call (ENOSYS), or in a
template with another thread (the clone's child would wait for that thread's locks), a
short-lived helper forked by the template unshares its children's PID
namespace and forks P, then exits, P passes to the template, its subreaper (see
`_fork_in_pid_namespace`), and P's part runs in Python (`enter_namespaces`); both paths
take the same steps in the same order.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
from typing import Any

__all__ = ["NamespaceSetupFailed", "build_view", "enter_namespaces", "fork", "init_loop", "prepare"]

_PR_SET_CHILD_SUBREAPER = 36

_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_MOVE, _MS_REC, _MS_PRIVATE = 32, 4096, 8192, 1 << 14, 1 << 18
_CAP_NET_ADMIN, _CAP_SYS_ADMIN, _CAP_SETPCAP = 12, 21, 8
#: /proc entries bubblewrap covers read-only (and two more): a fresh /proc mounted for a
#: worker gets the same covers.
_PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus")


class NamespaceSetupFailed(Exception):
    """One step of a forked worker's namespaces failed; the message names it."""


def _check(libc: Any, rc: int, what: str) -> None:
    if rc < 0:
        import ctypes

        err = ctypes.get_errno()
        raise NamespaceSetupFailed(f"{what}: {os.strerror(err)}")


def _mount(
    libc: Any, src: str | None, dst: str, fstype: str | None, flags: int, data: str = ""
) -> None:
    rc = libc.mount(
        src.encode() if src else None,
        dst.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    _check(libc, rc, f"mount {fstype or src or ''} on {dst}")


def _set_caps(libc: Any, mask: int) -> None:
    """Keep exactly `mask` as effective and permitted capabilities (none inheritable)."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (ctypes.c_uint32 * 6)(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0, mask >> 32, mask >> 32, 0)
    _check(libc, libc.capset(header, data), "capset")


def lock_template(libc: Any) -> None:
    """At the start of a template inside a namespace sandbox: no process of the sandbox may
    create a user namespace again (bubblewrap's `--disable-userns`), then keep only the
    capabilities the forked workers' set-up needs."""
    path = "/proc/sys/user/max_user_namespaces"
    with open(path, "rb") as fh:
        already = fh.read().strip() == b"0"  # (the `unshare` launcher's init did it)
    if not already:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    _set_caps(libc, (1 << _CAP_SYS_ADMIN) | (1 << _CAP_NET_ADMIN) | (1 << _CAP_SETPCAP))


def _status_code(status: int) -> int:
    """A child's wait status as an exit code (a signal N becomes 128 + N, as launchers do)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def _tmpfs(libc: Any, path: str, size: int, mode: str, flags: int) -> None:
    _mount(libc, "tmpfs", path, "tmpfs", flags, f"size={size},mode={mode}")


def _unescape(field: str) -> str:
    """A mount point as /proc/self/mountinfo writes it (space, tab, newline, backslash
    as octal escapes)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts_on(path: str) -> list[str]:
    """The mount points whose parent is the mount at `path` (the last one mounted there)."""
    rows = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            rows.append((fields[0], fields[1], _unescape(fields[4])))
    at = [mount_id for mount_id, _parent, point in rows if point == path]
    if not at:
        return []
    return [point for _mount_id, parent, point in rows if parent == at[-1] and point != path]


def _fresh_tmp(libc: Any, size: int, template_scratch: str) -> None:
    """`/tmp`: a fresh tmpfs of this worker's own, with the view's mounts under `/tmp` (the
    policy's paths there, their masks) carried onto it; the template's scratch stays below.

    The mounts are copied to a stash (a tmpfs on `/dev/shm`, which gets a fresh one of its
    own right after), then moved from there, so each keeps its flags and its own submounts."""
    moved = [m for m in _mounts_on("/tmp") if m != template_scratch]
    flags = _MS_NOSUID | _MS_NODEV
    stash = "/dev/shm"
    if moved:
        _tmpfs(libc, stash, 1 << 20, "0700", flags)
        for n, point in enumerate(moved):
            is_dir = os.path.isdir(point)
            held = f"{stash}/{n}"
            if is_dir:
                os.mkdir(held)
            else:
                os.close(os.open(held, os.O_CREAT | os.O_WRONLY, 0o600))
            # A copy, not a move: for an unprivileged user bubblewrap's mounts reach this
            # mount namespace locked (it belongs to a nested user namespace), and a locked
            # mount cannot be moved; a recursive bind copies it, its flags and submounts.
            _mount(libc, point, held, None, _MS_BIND | _MS_REC)
            moved[n] = point + ("/" if is_dir else "")
    _tmpfs(libc, "/tmp", size, "1777", flags)
    for n, entry in enumerate(moved):
        point = entry.rstrip("/")
        if entry.endswith("/"):
            os.makedirs(point, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(point), 0o755, exist_ok=True)
            os.close(os.open(point, os.O_CREAT | os.O_WRONLY, 0o644))
        _mount(libc, f"{stash}/{n}", point, None, _MS_MOVE)
    if moved:
        _check(libc, libc.umount2(stash.encode(), 2), "detach the stash")  # MNT_DETACH


def _loopback_up() -> None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        req = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh14x", fcntl.ioctl(sock, 0x8913, req))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sh14x", b"lo", flags | 1))  # SIOCSIFFLAGS


def enter_namespaces(ns: dict[str, Any], cred_fd: int, libc: Any) -> None:
    """Step 1 of the namespace part of the module docstring; returns in the worker (W)."""
    cred = socket.socket(fileno=cred_fd)
    cred.send(b"p")  # the host reads this process's pid and places it in its cgroups
    cred.close()
    _check(
        libc,
        libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC),
        "unshare",
    )
    # W is forked now, in the new namespaces, and builds its view itself (it holds the
    # template's capabilities until its own set-up drops them, and is in the new PID
    # namespace, whose `/proc` it mounts); P execs its init at once. P's pages are then
    # written only for this much and freed by the exec, rather than written once more after
    # W's fork (every page of P is shared with W again) and kept by W (issue 19: memory per
    # session, and the CPU of the copy-on-write faults in a burst). A failed step ends W,
    # and with it P, with status 70 and the step named in the log. The init is opened
    # first: W's fresh `/tmp` can hide its path for a moment (see `_exec_init`).
    init_fd = _open_init()
    worker = os.fork()
    if worker == 0:
        if init_fd >= 0:
            os.close(init_fd)
        build_view(ns, libc)
        return  # W
    _set_caps(libc, 0)
    _exec_init(libc, init_fd, worker)  # returns only where the C init cannot run
    init_loop(worker)


def _open_init() -> int:
    """The C init, opened (close-on-exec) for P's exec; -1 without it."""
    if not _init_program:
        return -1
    try:
        return os.open(_init_program, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def init_loop(worker: int) -> None:
    """P's own loop where the C init cannot run: reap until W exits, then exit as it did.
    P keeps no descriptor but 0-2 (the template's control socket among them), as the C
    init does, and ends with status 70 and a line on stderr on anything unexpected (SIGINT
    among them), as the C init does: never through the template's own exit path."""
    try:
        signal.set_wakeup_fd(-1)
        os.closerange(3, 1 << 16)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == worker:
                os._exit(_status_code(status))
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            os.write(2, f"agent-sandbox worker init: {exc!r}\n".encode())
        os._exit(70)


def build_view(ns: dict[str, Any], libc: Any) -> None:
    """W, in the new mount, network and IPC namespaces, before anything else: its own file
    systems and `/proc`, the shared ones read-only, `lo` up."""
    nosuid_nodev = _MS_NOSUID | _MS_NODEV
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    scratch = str(ns["scratch"])
    tmpfs_bytes = int(ns["tmpfs_bytes"])
    # Fresh file systems of this worker's own, then the shared ones read-only.
    _fresh_tmp(libc, tmpfs_bytes, str(ns["template_scratch"]))
    os.makedirs(os.path.dirname(scratch), 0o755, exist_ok=True)
    os.mkdir(scratch, 0o700)
    _tmpfs(libc, scratch, int(ns["scratch_bytes"]), "0700", nosuid_nodev)
    if os.path.isdir("/dev/shm"):
        _tmpfs(libc, "/dev/shm", tmpfs_bytes, "1777", nosuid_nodev | _MS_NOEXEC)
    if os.path.isdir("/dev/pts"):
        _mount(
            libc,
            "devpts",
            "/dev/pts",
            "devpts",
            _MS_NOSUID | _MS_NOEXEC,
            "newinstance,ptmxmode=0666,mode=620",
        )
    for path in ("/dev", "/"):
        _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | nosuid_nodev)
    if ns.get("loopback", True):
        _loopback_up()
    _mount(libc, "proc", "/proc", "proc", nosuid_nodev | _MS_NOEXEC)
    for name in _PROC_COVERS:
        path = "/proc/" + name
        if os.path.exists(path):
            _mount(libc, path, path, None, _MS_BIND | _MS_REC)
            flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | nosuid_nodev | _MS_NOEXEC
            _mount(libc, None, path, None, flags)


_PR_SET_NO_NEW_PRIVS = 38
#: The C init (_worker/_nsinit.c) inside the view, found by `prepare` ("" without it).
_init_program = ""


#: The C fork of a worker (_worker/_nsfork.c), found by `prepare` (None without it).
_nsfork: Any = None
#: The version of _worker/_nsfork.c this module expects (an older build is not used).
_NSFORK_VERSION = 4


def _load_nsfork() -> Any:
    try:
        from agent_sandbox._worker import _nsfork as module
    except ImportError:
        return None
    return module if getattr(module, "VERSION", 0) == _NSFORK_VERSION else None


def _find_init_program() -> str:
    # Beside this module (`_worker/`, under the package folder the worker was given).
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_nsinit")
    return path if os.access(path, os.X_OK) else ""


def _exec_init(libc: Any, init_fd: int, worker: int) -> None:
    """P, once W is forked and P holds no capability: become the C init (_worker/_nsinit.c),
    which reaps, relays W's status and handles signals as the loop after this call does,
    without a copy of the template's interpreter. No-new-privileges first, so the exec
    cannot give P back any capability (P is root in its user namespace for `root`); every
    descriptor but 0-2 is closed (P needs none of the plan's) but `init_fd`, the init opened
    before W's fork and executed by that descriptor (close-on-exec): W shares P's mount
    namespace and mounts its fresh `/tmp` there, which hides a path under /tmp (a checkout
    there) until W has carried the view's mounts back. Returns when it cannot run (not
    built, or the exec is refused): the Python loop then serves."""
    if init_fd < 0:
        return
    _check(libc, libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")
    os.closerange(3, init_fd)
    os.closerange(init_fd + 1, 1 << 16)
    with contextlib.suppress(OSError):
        os.execve(init_fd, [_init_program, str(worker)], {})
    os.close(init_fd)


def _threads() -> int:
    """This process's threads, as the kernel counts them (native threads included: a
    library's thread pool is no `threading.Thread`)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _raw_fork(libc: Any) -> int:
    """fork(2) through the C library, without Python's own work around it (`os.fork` runs
    the at-fork hooks of `threading`, `random` and others in the child: about 0.3-0.5 ms
    here, mostly copy-on-write faults, on the template's critical path for a helper that
    only unshares and forks). Only for a single-threaded process (a template always is) and
    a child that does not need fresh interpreter state (no threads, no random numbers)
    before it execs, exits, or makes the process that does with `os.fork`."""
    if _threads() > 1:
        return os.fork()  # (never in a template: another thread's state would be copied)
    pid = int(libc.fork())
    if pid < 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"fork: {os.strerror(err)}")
    return pid


def _fork_in_pid_namespace(libc: Any) -> int:
    """Fork a child that is PID 1 of a new PID namespace: its pid here in the template
    (where it is this process's child), 0 in the child.

    A short-lived helper forked by the template unshares its children's PID namespace and
    forks the child, then exits; the child passes to the template, its subreaper. (The
    template does not unshare for itself and go back with `setns`: where bubblewrap runs
    the sandbox in a user namespace nested below the one that owns the sandbox's PID
    namespace, as for an unprivileged user, the template's capabilities do not reach that
    namespace, and `setns` to it is refused.) The child goes on only once the template has
    reaped the helper (it closes a pipe the child waits on): its parent-death signal, armed
    next, would fire at the helper's exit.

    Both forks are `_raw_fork`s: neither the helper nor P runs user code or needs fresh
    Python state, and the worker W, which P forks with `os.fork`, gets it all."""
    pid_r, pid_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        helper = _raw_fork(libc)
    except OSError:
        for fd in (pid_r, pid_w, go_r, go_w):
            os.close(fd)
        raise
    if helper == 0:
        child = -1
        try:
            os.close(pid_r)
            _check(libc, libc.unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")
            child = _raw_fork(libc)
            if child > 0:
                os.write(pid_w, child.to_bytes(4, "little"))
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                os.write(2, f"agent-sandbox template: no worker init forked: {exc!r}\n".encode())
            os._exit(73)
        if child > 0:
            os._exit(0)
        os.close(pid_w)
        os.close(go_w)
        while os.read(go_r, 1):
            pass  # (EOF: the helper is gone and reaped)
        os.close(go_r)
        return 0
    os.close(pid_w)
    os.close(go_r)
    try:
        data = b""
        while len(data) < 4:
            chunk = os.read(pid_r, 4 - len(data))
            if not chunk:
                break
            data += chunk
        _pid, status = os.waitpid(helper, 0)
    finally:
        os.close(pid_r)
        os.close(go_w)  # the child (if any) goes on: it is this process's child now
    if len(data) != 4 or _status_code(status) != 0:
        raise NamespaceSetupFailed("the helper forked no worker init")
    return int.from_bytes(data, "little")


def prepare(libc: Any) -> None:
    """At the start of a template inside a namespace sandbox: find the C init and the C
    fork, lock the sandbox (`lock_template`) and become the subreaper of the helpers'
    children (without _worker/_nsfork.c a worker's init is forked by a short-lived helper,
    `_fork_in_pid_namespace`, and then becomes this process's child)."""
    global _init_program, _nsfork
    _init_program = _find_init_program()
    _nsfork = _load_nsfork()
    lock_template(libc)
    _check(libc, libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "be a subreaper")


def fork(libc: Any, log_fd: int, cred_fd: int) -> tuple[str, int]:
    """Fork one worker's init (P) in a new PID namespace: ("template", P's pid) here; in
    the C fork's W ("worker", 0) and its P where no init can run ("init", W's pid); in the
    helper's P ("child", 0), which then does P's part in Python (`enter_namespaces`)."""
    global _nsfork
    if _nsfork is not None and _threads() == 1:
        try:
            role, pid = _nsfork.fork_worker(log_fd, cred_fd, _init_program)
            return str(role), int(pid)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            _nsfork = None  # no clone it can make here: the helper from now on
    pid = _fork_in_pid_namespace(libc)
    return ("template", pid) if pid else ("child", 0)
