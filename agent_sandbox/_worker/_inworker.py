"""The worker's own kernel set-up: what a provider's `worker_setup` asks it to apply.

Called by `_worker.setup.prepare` before any user code runs and before any thread exists.
The order is fixed, and every step fails closed (an exception ends the worker before it
serves, and the parent reports a start error with the worker's log):

1. Check that the process has exactly one thread (`/proc/self/task`): Landlock and
   seccomp apply to the calling thread only on this kernel, so an earlier thread would stay
   unrestricted.
2. Set NO_NEW_PRIVS (no set-uid or file-capability gain across exec; Landlock and seccomp
   need it for an unprivileged process, and a root test run would not notice its absence).
3. Empty the capability bounding set and the ambient set (an exec can regain nothing).
4. Apply Landlock (`_landlock_sys.restrict_self`).
5. Clear the effective, permitted and inheritable capabilities: uid 0 keeps owning its
   files, but loses CAP_DAC_OVERRIDE, CAP_SYS_ADMIN, CAP_NET_RAW, CAP_MKNOD, ...
6. Load the seccomp BPF program the parent built (`_seccomp.build_bpf`), then the exec
   program (`_seccomp.exec_setup`: execve and execveat refused without a process grant).
7. Report what holds, read back from the kernel: NoNewPrivs, CapEff, the Landlock ABI and
   the seccomp mode. The parent refuses a worker whose report does not match its plan.

What it does NOT do: choose the rules (the pure builders do) or limit resources (rlimits
are applied just before this by `_worker.setup.apply_rlimits`; cgroups by the parent).
Standard library only; `ctypes` is imported here, never pyseccomp.
"""

from __future__ import annotations

import binascii  # (base64's codec itself: `base64` adds struct and 0.5 ms to the start)
import os
from collections.abc import Mapping

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["apply_worker_setup", "kernel_status", "open_egress_listener"]

_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_PR_GET_SECCOMP = 21
_PR_SET_SECCOMP = 22
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECCOMP_MODE_FILTER = 2
_CAP_VERSION_3 = 0x20080522


#: The `worker_setup` keys that ask for a kernel step (`_host/setup_checks.py` holds the same
#: tuple for the parent's comparison; tests/providers/test_landlock.py keeps the two equal).
_KERNEL_KEYS = (
    "no_new_privs",
    "drop_caps",
    "landlock",
    "seccomp",
    "seccomp_exec",
    "scratch_tmpfs",
)
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 1 << 14, 1 << 18


class SetupError(RuntimeError):
    """A kernel restriction could not be applied; the worker must not serve."""


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


_STRUCTS: Any = None


def _structs() -> Any:
    """The capability header and data, and the seccomp program (ctypes classes, made once)."""
    global _STRUCTS
    if _STRUCTS is None:
        import ctypes

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [
                ("effective", ctypes.c_uint32),
                ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32),
            ]

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        _STRUCTS = (Header, Data, SockFprog)
    return _STRUCTS


def warm_up() -> None:
    """Make the C library handle and the structures now, and read this process's kernel
    status a few times (reads only): a worker template calls this so that each forked
    worker neither builds them nor first runs that code in its own memory."""
    _libc()
    _structs()
    for _ in range(10):
        kernel_status()


def _prctl(option: int, arg2: int = 0, arg3: Any = 0) -> int:
    import ctypes

    libc = _libc()
    libc.prctl.restype = ctypes.c_int
    arg = arg3 if not isinstance(arg3, int) else ctypes.c_ulong(arg3)
    rc = int(
        libc.prctl(
            ctypes.c_int(option), ctypes.c_ulong(arg2), arg, ctypes.c_ulong(0), ctypes.c_ulong(0)
        )
    )
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")
    return rc


def _caps(op: str, eff: int = 0, prm: int = 0, inh: int = 0) -> int:
    """capget (returns CapEff as a 64-bit mask) or capset (sets all three sets)."""
    import ctypes

    Header, Data, _fprog = _structs()
    header = Header(_CAP_VERSION_3, 0)
    data = (Data * 2)()
    libc = _libc()
    if op == "get":
        rc = libc.capget(ctypes.byref(header), data)
    else:
        for i in range(2):
            data[i].effective = (eff >> (32 * i)) & 0xFFFFFFFF
            data[i].permitted = (prm >> (32 * i)) & 0xFFFFFFFF
            data[i].inheritable = (inh >> (32 * i)) & 0xFFFFFFFF
        rc = libc.capset(ctypes.byref(header), data)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cap{op}: {os.strerror(err)}")
    return int(data[0].effective) | (int(data[1].effective) << 32)


def _drop_bounding_set() -> int:
    """Drop every capability from the bounding set; return how many were dropped."""
    dropped = 0
    for cap in range(64):
        try:
            _prctl(_PR_CAPBSET_DROP, cap)
        except OSError as exc:
            import errno

            if exc.errno == errno.EINVAL:  # past the last capability the kernel knows
                break
            if exc.errno == errno.EPERM and _caps("get") == 0:
                break  # an unprivileged process: nothing to drop, exec gains nothing (NNP)
            raise
        dropped += 1
    try:
        _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass  # kernels before 4.3 have no ambient set
    return dropped


def _load_seccomp(bpf: bytes) -> None:
    import ctypes

    if not bpf or len(bpf) % 8:
        raise SetupError(f"the seccomp program has a bad size ({len(bpf)} bytes)")

    SockFprog = _structs()[2]
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog))


def _mount_scratch(path: str, size: int, *, user_ns: bool = False) -> None:
    """Mount a tmpfs of `size` bytes over `path` in a new mount namespace of this process
    (it ends with the worker's last process: nothing to clean up on the host), and move
    into it. Needs CAP_SYS_ADMIN, so it runs before the capabilities are dropped; seccomp
    and Landlock forbid unmounting it afterwards.

    `user_ns` (a worker run by a non-root user): first enter a user namespace of its own,
    its uid and gid mapped to themselves (files keep their owners), which gives the
    capability over the new mount namespace only; steps 3 and 5 drop it like root's."""
    import ctypes

    libc = _libc()

    def check(rc: int, what: str) -> None:
        if rc < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    if user_ns:
        uid, gid = os.geteuid(), os.getegid()
        check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1\n")):
            _write_proc(name, text)
        _write_proc("gid_map", f"{gid} {gid} 1\n")
    else:
        check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    options = f"size={size},mode=0700".encode()
    check(
        libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options),
        f"mount a tmpfs on {path}",
    )
    os.chdir(path)


def _write_proc(name: str, text: str) -> None:
    fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def open_egress_listener(setup: Mapping[str, Any]) -> int:
    """Listen on the egress proxy's address inside this network namespace, hand the
    listening socket to the host over the inherited channel, keep no copy; return the port.

    Runs before the restrictions (Landlock would refuse the bind) and before any user code;
    from then on only the host accepts on it (`_host/egress/proxy.py`).
    """
    import socket

    channel = socket.socket(fileno=int(setup["fd"]))
    listeners: list[socket.socket] = []
    try:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listeners.append(listener)
        listener.bind((str(setup["host"]), int(setup["port"])))
        listener.listen(128)
        # Allowed loopback services (`_host/egress/handoff.loopback_forwards`): a listener
        # at the same address here, handed to the host, which forwards what it accepts. An address
        # this namespace cannot bind (no IPv6) is left out; the host matches the rest.
        for host, port in setup.get("forwards", ()):
            family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
            forward = socket.socket(family, socket.SOCK_STREAM)
            try:
                forward.bind((str(host), int(port)))
                forward.listen(128)
            except OSError:
                forward.close()
                continue
            listeners.append(forward)
        socket.send_fds(channel, [b"egress"], [s.fileno() for s in listeners])
    finally:
        for sock in listeners:
            sock.close()
        channel.close()
    return int(setup["port"])


def start_egress_relay(relay: Mapping[str, Any]) -> int:
    """gVisor: listen on the proxy address on the sandbox's loopback and fork a relay that
    carries each connection to the host's end of the proxy route (a Unix socket in the
    shared socket directory); return the port.

    Runs before the restrictions and before any user code, while the worker has one thread.
    The relay is a process of the sandbox's own (it counts in `limits.processes`); what it
    relays is judged by the host's proxy, so nothing it does is trusted.
    """
    import socket

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((str(relay["host"]), int(relay["port"])))
    listener.listen(128)
    routes = [(listener, str(relay["socket"]))]
    # Allowed loopback services (`_host/egress/handoff.loopback_forwards`): a listener at the same
    # address on the sandbox's loopback, each relayed to its own socket of the host's,
    # where the host's proxy judges and forwards what it accepts. An address the Sentry's
    # network stack cannot bind is left out, as under bwrap.
    for host, port, path in relay.get("forwards", ()):
        family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
        forward = socket.socket(family, socket.SOCK_STREAM)
        try:
            forward.bind((str(host), int(port)))
            forward.listen(128)
        except OSError:
            forward.close()
            continue
        routes.append((forward, str(path)))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the relay child, inside the sandbox
        try:
            _relay_loop(routes)
        finally:
            os._exit(0)
    for sock, _path in routes:
        sock.close()
    return int(relay["port"])


def _relay_loop(routes: list[tuple[Any, str]]) -> None:  # pragma: no cover - inside the sandbox
    import selectors
    import socket
    import threading

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                try:
                    sock.shutdown(how)
                except OSError:
                    pass

    def carry(client: socket.socket, upstream: socket.socket) -> None:
        back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        back.start()
        pump(client, upstream)
        back.join()
        client.close()
        upstream.close()

    selector = selectors.DefaultSelector()
    for listener, path in routes:
        selector.register(listener, selectors.EVENT_READ, path)
    while True:
        for key, _events in selector.select():
            try:
                client, _addr = key.fileobj.accept()  # type: ignore[union-attr]
            except OSError:
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(key.data)
            except OSError:
                client.close()
                upstream.close()
                continue
            threading.Thread(target=carry, args=(client, upstream), daemon=True).start()


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def kernel_status() -> dict[str, Any]:
    """What the kernel says about this process (no /proc needed): NNP, CapEff, seccomp."""
    return {
        "no_new_privs": _prctl(_PR_GET_NO_NEW_PRIVS),
        "cap_eff": f"{_caps('get'):016x}",
        "seccomp": _prctl(_PR_GET_SECCOMP),
    }


def apply_worker_setup(setup: Mapping[str, Any]) -> dict[str, Any]:
    """Apply `setup` (a launch plan's `worker_setup`) to this process; return the checks.

    Keys understood: `no_new_privs`, `drop_caps`, `landlock` (a `landlock_setup()`
    fragment), `seccomp` and `seccomp_exec` (each `{"bpf": base64}`). Unknown keys are
    ignored (they belong to the provider's launcher). Raises SetupError or OSError when any
    step fails.
    """
    checks: dict[str, Any] = {}
    # 0. The policy's grants are the objects the parent pinned (see `_grants.py`).
    pins = setup.get("pins")
    if pins:
        check_pins(pins)
        checks["pins"] = len(pins)
    wants_kernel = any(k in setup for k in _KERNEL_KEYS)
    if not wants_kernel:
        return checks
    # 1. One thread only.
    threads = _thread_count()
    if threads != 1:
        raise SetupError(
            f"the worker has {threads} threads before its restrictions; "
            "they would stay unrestricted"
        )
    checks["threads"] = threads
    # 1b. A scratch directory of bounded size, in a mount namespace of the worker's own (and,
    #     for a non-root worker, a user namespace of its own that owns it).
    scratch = setup.get("scratch_tmpfs")
    if scratch:
        _mount_scratch(
            str(scratch["path"]), int(scratch["bytes"]), user_ns=bool(scratch.get("user_ns"))
        )
        checks["scratch_tmpfs"] = int(scratch["bytes"])
    # 2. NO_NEW_PRIVS (always when anything kernel-side is asked: Landlock/seccomp need it).
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    # 3. Bounding and ambient sets.
    if setup.get("drop_caps"):
        checks["caps_dropped"] = _drop_bounding_set()
    # 4. Landlock.
    landlock = setup.get("landlock")
    if landlock:
        from agent_sandbox._landlock_sys import restrict_self

        checks["landlock"] = restrict_self(landlock)
    # 5. Effective/permitted/inheritable capabilities.
    if setup.get("drop_caps"):
        _caps("set", 0, 0, 0)
    # 6. seccomp.
    seccomp = setup.get("seccomp")
    if seccomp:
        _load_seccomp(binascii.a2b_base64(seccomp["bpf"]))
    no_exec = setup.get("seccomp_exec")
    if no_exec:
        _load_seccomp(binascii.a2b_base64(no_exec["bpf"]))
        checks["exec_denied"] = True
    # 7. Read back.
    checks.update(kernel_status())
    if checks["no_new_privs"] != 1:
        raise SetupError("NO_NEW_PRIVS did not stick")
    if setup.get("drop_caps") and checks["cap_eff"] != "0" * 16:
        raise SetupError(f"capabilities remain after the drop (CapEff {checks['cap_eff']})")
    if (seccomp or no_exec) and checks["seccomp"] != _SECCOMP_MODE_FILTER:
        raise SetupError(f"seccomp mode is {checks['seccomp']}, not filter")
    return checks


def check_pins(pins: Mapping[str, Any]) -> None:
    """Each granted path, as this process sees it, must be the object the parent pinned
    (device, inode), or still absent when it was absent (see `providers/_grants.py`).

    Raises SetupError naming the path otherwise: the worker must not serve.
    """
    for path, pin in pins.items():
        try:
            info = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            if pin is None:
                continue
            raise SetupError(
                f"the granted path {path} is missing; it existed at the check"
            ) from None
        if pin is None or [info.st_dev, info.st_ino] != list(pin):
            raise SetupError(
                f"the granted path {path} is not the object the policy check pinned (a link "
                "planted or a directory swapped between the check and the start); start the "
                "worker again, and see which tool can write there"
            )
