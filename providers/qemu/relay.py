"""The host side of one `qemu` worker: starts QEMU, restores the guest, relays the channel.

Run as `python -I -S -B qemu/relay.py CONFIG-JSON` by `QemuProvider.launch`, in the worker's
process group: this process is what the parent sees as "the worker" (its exit status is
the guest worker's), and QEMU is its only child. Standard library only.

1. It asks to be killed when its parent thread ends, and QEMU to be killed when it ends
   (PR_SET_PDEATHSIG); SIGTERM kills QEMU by pid, then exits. SIGINT (the parent's
   interrupt of a running cell) is sent on as an `S` frame once the guest has its boot.
2. It starts QEMU from the template (`-incoming defer`, then over QMP: the `x-ignore-shared`
   capability and `migrate-incoming fd:N` on the saved state, which it opened itself), or
   boots the image cold when there is no template.
3. It reads the boot configuration from the inherited pipe (as every worker does), and sends
   the guest agent's part (32 fresh random bytes, the shares, the scratch size) as the `B`
   frame, then the worker's (the boot configuration and its own environment, the plan's)
   as the `W` frame.
4. It relays: each connection accepted on the inherited listening socket (the parent's
   `ctl.sock`) becomes a channel over the virtio-serial port; `D`/`C` frames carry bytes
   and closes. What the guest sends is decoded here, and only here, into frames of at most
   `MAX_FRAME` bytes on channels this side opened; anything else ends the session.
5. When the guest reports the worker's end (`X`) or QEMU exits, it exits with that status.
6. With `net` in the configuration (a policy with `[net]` allow rules), before anything else
   it listens on a Unix socket in the run directory and hands that listening socket to the
   parent over the inherited egress channel (as a namespace worker hands over its loopback
   listener): the parent's egress proxy (`_host/egress/proxy.py`) accepts on it and applies
   the policy. Each channel the guest opens on the second port (`net`, at most
   `MAX_NET_CHANNELS` at once) becomes one connection to that socket. The policy's allowed
   loopback services (`forwards`, the parent's `loopback_forwards`) get a listening socket
   each, named after the service (`fwd-127.0.0.1-8765.sock`), handed over with the first;
   the parent's proxy judges each connection on them as a `CONNECT` to that service (its
   rules and bounds, its refusals recorded) before joining it. A guest channel whose `O`
   frame names one of them (`service_key`) is joined to its socket; one naming anything
   else is refused (closed, a line in the log). Nothing else the guest sends there is
   interpreted here beyond the frames.
7. The guest's limit counters (`L` frames: refused forks, memory-limit and OOM-kill counts
   of the worker's cgroup in the guest) are checked for shape and written, as they are,
   to `guest-limits.json` in the run directory before anything the guest sends after them
   is relayed; the parent reads them after each call (`_host/limit_report.GuestLimits`).
   They are the worker side's word: the parent says so in each denial it makes of them.
"""

import json
import os
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time

__all__ = ["MAX_FRAME", "MAX_NET_CHANNELS", "QMP", "main", "service_key"]

MAX_FRAME = 1 << 20
MAX_NET_CHANNELS = 64
_LIMIT_KEYS = ("pids_max", "memory_max", "memory_oom_kill")
_HEAD = struct.Struct(">BII")
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38


def _pdeathsig() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _confine(config: dict) -> str:  # type: ignore[type-arg]
    """Landlock this process and QEMU (inherited across exec): only the paths the plan lists,
    no TCP, no abstract Unix sockets or signals outside. Returns "" or why it was skipped."""
    rules = config.get("landlock")
    if not rules:
        return "no rules"
    import ctypes
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sb_landlock", config["landlock_module"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.landlock_abi() < 1:
        return "no Landlock"
    if ctypes.CDLL(None).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise RuntimeError("PR_SET_NO_NEW_PRIVS failed")
    module.restrict_self(
        {
            "paths": [tuple(r) for r in rules],
            "tcp_connect": [],
            "tcp_bind": [],
            "scope": ["abstract_unix", "signal"],
            "min_abi": 1,
        }
    )
    return ""


_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REMOUNT = 1, 2, 4, 4096, 32
_MS_REC, _MS_PRIVATE = 1 << 14, 1 << 18


def _mask(masks: list, run_dir: str) -> None:  # type: ignore[type-arg]
    """Cover each masked path (a name the policy hides or denies inside a shared directory)
    with an empty, unreadable file or directory, in a mount namespace of this process that
    QEMU inherits; a non-root relay takes a user namespace of its own for it. Raises on any
    failure: QEMU never starts with a masked name reachable."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise RuntimeError(f"cannot mask the shares ({what}: {os.strerror(err)})")

    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        check(libc.unshare(_CLONE_NEWNS), "unshare")
    else:
        check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare")
        with open("/proc/self/setgroups", "w") as fh:
            fh.write("deny")
        with open("/proc/self/uid_map", "w") as fh:
            fh.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as fh:
            fh.write(f"{gid} {gid} 1")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    empty_file = os.path.join(run_dir, "masked-file")
    empty_dir = os.path.join(run_dir, "masked-dir")
    os.close(os.open(empty_file, os.O_CREAT | os.O_WRONLY, 0))
    os.makedirs(empty_dir, mode=0, exist_ok=True)
    for path, kind in masks:
        source = empty_dir if kind == "dir" else empty_file
        check(libc.mount(source.encode(), path.encode(), None, _MS_BIND, None), f"bind {path}")
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        check(libc.mount(None, path.encode(), None, flags, None), f"read-only {path}")


def _hand_over_egress_listener(path: str, channel_fd: int, forwards: list) -> None:  # type: ignore[type-arg]
    """Listen on `path`, and on each forwarded service's path, and send the listening
    sockets to the parent (its egress proxy accepts on them, matching each forward's by
    its name against its own list); keep no copy."""
    channel = socket.socket(fileno=channel_fd)
    listeners: list[socket.socket] = []
    try:
        for where in [path, *(str(f[2]) for f in forwards)]:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listeners.append(listener)
            listener.bind(where)
            listener.listen(128)
        socket.send_fds(channel, [b"egress"], [sock.fileno() for sock in listeners])
    finally:
        for sock in listeners:
            sock.close()
        channel.close()


def _write_limits(path: str, payload: bytes) -> None:
    """Check an `L` frame's shape (small counters, known names) and store it for the parent."""
    try:
        counts = json.loads(payload[:512])
    except ValueError:
        raise RuntimeError("the guest sent a malformed limit report") from None
    if not isinstance(counts, dict) or not all(
        key in _LIMIT_KEYS and type(value) is int and 0 <= value < 1 << 62
        for key, value in counts.items()
    ):
        raise RuntimeError("the guest sent a malformed limit report")
    tmp = path + ".tmp"
    # Never through a link or into a FIFO left at the temporary name (the run directory is
    # QEMU's too); the rename replaces whatever is at `path` without following it.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    with os.fdopen(fd, "w") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RuntimeError("the limit report's temporary file is not a regular file")
        json.dump(counts, fh)
    os.replace(tmp, path)


def _connect(path: str, deadline: float, qemu: "subprocess.Popen[bytes]") -> socket.socket:
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if qemu.poll() is not None:
                raise RuntimeError(
                    f"QEMU exited ({qemu.returncode}) before {path} appeared"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"QEMU did not open {path} in time") from None
            time.sleep(0.002)


class QMP:
    """A minimal QMP client (one command at a time, events skipped)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buf = b""
        self.deadline = deadline
        self._line()  # greeting
        self.cmd("qmp_capabilities")

    def _line(self) -> dict:  # type: ignore[type-arg]
        while b"\n" not in self.buf:
            self.sock.settimeout(max(0.01, self.deadline - time.monotonic()))
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError("QMP closed")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def cmd(self, name: str, **args: object) -> object:
        self.sock.sendall(json.dumps({"execute": name, "arguments": args}).encode() + b"\n")
        while True:
            reply = self._line()
            if "error" in reply:
                raise RuntimeError(f"QMP {name}: {reply['error'].get('desc', reply)}")
            if "return" in reply:
                return reply["return"]


def _send(sock: socket.socket, kind: bytes, chan: int = 0, payload: bytes = b"") -> None:
    sock.sendall(_HEAD.pack(kind[0], chan, len(payload)) + payload)


def _read_boot(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _exit_with(status: int) -> None:
    """Exit as the guest worker did (a signal as a signal, so the parent words it the same)."""
    sys.stdout.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP have no handler to reset (their default is the only one)
        os.kill(os.getpid(), sig)
        time.sleep(1)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 70)


_T0 = time.monotonic()
_TRACE = False


def _trace(what: str) -> None:
    """With `trace` in the configuration: one timing line per start-up step in the log."""
    if _TRACE:
        sys.stderr.write(f"agent-sandbox qemu: {what} at {time.monotonic() - _T0:.3f} s\n")
        sys.stderr.flush()


def main() -> None:
    global _TRACE
    config = json.loads(sys.argv[1])
    _TRACE = bool(config.get("trace"))
    _pdeathsig()
    deadline = time.monotonic() + float(config["start_timeout"])
    state_fd = -1
    pass_fds: tuple[int, ...] = ()
    argv = list(config["qemu_argv"])
    if config.get("state"):
        state_fd = os.open(config["state"], os.O_RDONLY)
        pass_fds = (state_fd,)
    net = config.get("net")
    if net:
        _hand_over_egress_listener(
            net["socket"], int(net["egress_fd"]), list(net.get("forwards") or [])
        )
        _trace("egress listener handed over")
    if config.get("masks"):
        _mask(config["masks"], os.path.dirname(config["port"]))
        _trace(f"{len(config['masks'])} masks mounted")
    skipped = _confine(config)
    _trace(f"landlock {'skipped: ' + skipped if skipped else 'applied'}")
    qemu = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        pass_fds=pass_fds,
        preexec_fn=_pdeathsig,
        close_fds=True,
    )

    def stop(_sig: int = 0, _frame: object = None) -> None:
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
        os._exit(143 if _sig else 70)

    signal.signal(signal.SIGTERM, stop)
    # The parent's interrupt (SIGINT to this process) becomes an `S` frame: the guest agent
    # signals the worker's process group, KeyboardInterrupt in the running cell.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if state_fd >= 0:
            qmp = QMP(_connect(config["qmp"], deadline, qemu), deadline)
            qmp.cmd(
                "migrate-set-capabilities",
                capabilities=[{"capability": "x-ignore-shared", "state": True}],
            )
            qmp.cmd("migrate-incoming", uri=f"fd:{state_fd}")
            os.close(state_fd)
            _trace("migrate-incoming sent")
        port = _connect(config["port"], deadline, qemu)
        net_port = _connect(config["net_port"], deadline, qemu) if net else None
        _trace("port connected")
        raw_boot = _read_boot(int(config["boot_fd"]))
        boot = json.loads(raw_boot)
        egress = (boot.get("worker_setup") or {}).get("egress")
        if egress:
            # The proxy's listener is this relay's (step 6), not the guest worker's: the
            # worker keeps only the address (its guards let a connect to it through).
            egress["fd"] = -1
            raw_boot = json.dumps(boot).encode()
        setup = {
            "entropy": os.urandom(32).hex(),
            "shares": config["shares"],
            "scratch": boot["scratch"],
            "scratch_mb": config["scratch_mb"],
            "processes": config.get("processes", 0),
            "memory_mb": config.get("memory_mb", 0),
            "net": bool(net),
            # The allowed loopback services the guest listens for (step 6).
            "forwards": [[f[0], f[1]] for f in (net or {}).get("forwards") or []],
        }
        env = json.dumps(dict(os.environ)).encode()
        _send(port, b"B", 0, json.dumps(setup).encode())
        # The worker's part, which the guest agent passes on unread.
        _send(port, b"W", 0, b'{"boot": ' + raw_boot + b', "env": ' + env + b"}")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGINT, lambda _sig, _frame: None)
        _trace("boot sent")
        status = _relay(
            port,
            socket.socket(fileno=int(config["listen_fd"])),
            qemu,
            wake_r,
            net_port,
            net["socket"] if net else "",
            os.path.join(os.path.dirname(config["port"]), "guest-limits.json"),
            list((net or {}).get("forwards") or []),
        )
    except Exception as exc:
        sys.stderr.write(f"agent-sandbox qemu: {exc}\n")
        if qemu.poll() is not None:  # QEMU ended first: that is what broke the relay
            _qemu_ended(qemu, os.path.join(os.path.dirname(config["port"]), "guest-limits.json"))
        stop()
        return
    if qemu.poll() is None:
        try:
            qemu.wait(2.0)
        except subprocess.TimeoutExpired:
            qemu.kill()
            qemu.wait()
    _exit_with(status)


def service_key(host: str, port: int) -> str:
    """How the guest's `O` frame names a forwarded service (`qemu/guest.py`'s twin)."""
    return f"{host}:{int(port)}"


class _Net:
    """Step 6: the guest's egress channels, each a connection to the egress listener, or,
    for a channel naming a forwarded loopback service, to that service's listener."""

    def __init__(
        self,
        port: socket.socket,
        path: str,
        sel: selectors.BaseSelector,
        forwards: list | None = None,  # type: ignore[type-arg]
    ) -> None:
        self.port = port
        self.path = path
        self.sel = sel
        self.conns: dict[int, socket.socket] = {}
        self.buf = b""
        #: Channels refused for naming a service not forwarded (the log says the first 10).
        self.refused = 0
        #: What an `O` frame may name (b"" is the proxy) -> the socket it is joined to.
        self.services: dict[bytes, str] = {b"": path}
        for host, number, where in forwards or ():
            self.services[service_key(str(host), int(number)).encode("ascii")] = str(where)

    def from_guest(self) -> None:
        data = self.port.recv(262144)
        if not data:
            raise RuntimeError("the guest's net port closed")
        self.buf += data
        while len(self.buf) >= _HEAD.size:
            kind, chan, size = _HEAD.unpack_from(self.buf)
            if size > MAX_FRAME:
                raise RuntimeError("the guest sent an oversized frame on the net port")
            if len(self.buf) < _HEAD.size + size:
                break
            payload = self.buf[_HEAD.size : _HEAD.size + size]
            self.buf = self.buf[_HEAD.size + size :]
            if kind == ord("O"):
                target = self.services.get(payload)
                if target is None:
                    # Not a service of this policy's list (the guest agent only names
                    # those): refused here, never connected anywhere; the first few said.
                    self.refused += 1
                    if self.refused <= 10:
                        sys.stderr.write(
                            "agent-sandbox qemu: the guest asked for a service that is not "
                            f"forwarded ({payload[:80]!r}): refused\n"
                        )
                    _send(self.port, b"C", chan)
                    continue
                if chan in self.conns or len(self.conns) >= MAX_NET_CHANNELS:
                    _send(self.port, b"C", chan)
                    continue
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    conn.connect(target)
                except OSError:
                    conn.close()
                    _send(self.port, b"C", chan)
                    continue
                self.conns[chan] = conn
                self.sel.register(conn, selectors.EVENT_READ, ("net", chan))
            elif kind == ord("D") and chan in self.conns:
                try:
                    self.conns[chan].sendall(payload)
                except OSError:
                    self.close(chan)
                    _send(self.port, b"C", chan)
            elif kind == ord("C"):
                self.close(chan)
            elif kind not in (ord("D"),):
                raise RuntimeError(f"the guest sent an unknown net frame kind {kind}")

    def from_proxy(self, chan: int) -> None:
        conn = self.conns[chan]
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if data:
            _send(self.port, b"D", chan, data)
        else:
            self.close(chan)
            _send(self.port, b"C", chan)

    def close(self, chan: int) -> None:
        conn = self.conns.pop(chan, None)
        if conn is not None:
            self.sel.unregister(conn)
            conn.close()


def _relay(
    port: socket.socket,
    listener: socket.socket,
    qemu: "subprocess.Popen[bytes]",
    wake: int,
    net_port: socket.socket | None = None,
    egress_path: str = "",
    limits_path: str = "",
    forwards: list | None = None,  # type: ignore[type-arg]
) -> int:
    """Steps 4 to 7: returns the guest worker's wait status."""
    sel = selectors.DefaultSelector()
    sel.register(port, selectors.EVENT_READ, "port")
    net = _Net(net_port, egress_path, sel, forwards) if net_port is not None else None
    if net_port is not None:
        sel.register(net_port, selectors.EVENT_READ, "net")
    sel.register(wake, selectors.EVENT_READ, "signal")
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ, "listener")
    conns: dict[int, socket.socket] = {}
    next_chan = 1
    buf = b""
    while True:
        for key, _ev in sel.select(0.1):
            if key.data == "net":
                assert net is not None
                net.from_guest()
            elif isinstance(key.data, tuple):
                assert net is not None
                if key.data[1] in net.conns:
                    net.from_proxy(key.data[1])
            elif key.data == "signal":
                if signal.SIGINT in os.read(wake, 64):
                    _send(port, b"S")
            elif key.data == "listener":
                try:
                    client, _addr = listener.accept()
                except BlockingIOError:
                    continue
                client.setblocking(True)
                chan = next_chan
                next_chan += 1
                _trace(f"connection {chan}")
                conns[chan] = client
                sel.register(client, selectors.EVENT_READ, chan)
                _send(port, b"O", chan)
            elif key.data == "port":
                data = port.recv(262144)
                if not data:
                    qemu.wait()
                    _qemu_ended(qemu, limits_path)
                    return (qemu.returncode or 0) << 8 if qemu.returncode >= 0 else -qemu.returncode
                buf += data
                while len(buf) >= _HEAD.size:
                    kind, chan, size = _HEAD.unpack_from(buf)
                    if size > MAX_FRAME:
                        raise RuntimeError("the guest sent an oversized frame")
                    if len(buf) < _HEAD.size + size:
                        break
                    payload = buf[_HEAD.size : _HEAD.size + size]
                    buf = buf[_HEAD.size + size :]
                    if kind == ord("D") and chan in conns:
                        try:
                            conns[chan].sendall(payload)
                        except OSError:
                            pass
                    elif kind == ord("C") and chan in conns:
                        client = conns.pop(chan)
                        sel.unregister(client)
                        client.close()
                    elif kind == ord("X"):
                        return _status(payload)
                    elif kind == ord("L"):
                        _write_limits(limits_path, payload)
                    elif kind == ord("E"):
                        raise RuntimeError(payload[:4096].decode("utf-8", "replace"))
                    elif kind == ord("R"):
                        _trace(f"guest set up, worker released (guest clock: {payload[:300]!r})")
                    elif kind in (ord("D"), ord("C")):
                        pass
                    else:
                        raise RuntimeError(f"the guest sent an unknown frame kind {kind}")
            else:
                chan = int(key.data)
                client = conns[chan]
                try:
                    data = client.recv(65536)
                except OSError:
                    data = b""
                if data:
                    _send(port, b"D", chan, data)
                else:
                    sel.unregister(client)
                    client.close()
                    del conns[chan]
                    _send(port, b"C", chan)
        if qemu.poll() is not None:
            _qemu_ended(qemu, limits_path)
            code = qemu.returncode
            return (code & 0xFF) << 8 if code >= 0 else -code


def _qemu_ended(qemu: "subprocess.Popen[bytes]", limits_path: str) -> None:
    """QEMU ended before the guest reported the worker's end: say so to the parent in
    `qemu-ended.json` in the run directory (which the guest cannot write), so a killed VM
    is named as one and not as a worker that closed its connection."""
    if not limits_path or qemu.returncode is None:
        return
    path = os.path.join(os.path.dirname(limits_path), "qemu-ended.json")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w") as fh:
        json.dump({"returncode": qemu.returncode}, fh)


def _status(payload: bytes) -> int:
    try:
        value = int(payload[:16])
    except ValueError:
        raise RuntimeError("the guest sent a malformed exit status") from None
    return value & 0xFFFF


if __name__ == "__main__":
    main()
