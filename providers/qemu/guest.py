"""The guest agent of the `qemu` provider: PID 1 of the micro-VM (copied into the image as
`/sb/agent.py`; it never runs on the host).

Boot (`/init` execs it), all before the template is saved: import the worker's modules
ahead, bind the worker's listening socket, fork the worker (which then waits on a pipe for
its boot configuration, so a restored clone runs no fork), find the virtio-serial port
named `sb`, print `SBREADY` on the console, then wait for the host. While no host is
connected the port reads as end-of-file, so it polls (1 ms).

On the host's first two frames (`B` for the agent, `W` for the worker, after a restore) it:

1. reseeds the kernel's RNG with the host's 32 random bytes (RNDADDENTROPY, then
   RNDRESEEDCRNG): clones of one template would otherwise share their RNG state;
2. sets `limits.processes` as `pids.max` of the worker's cgroup (made before the save),
   mounts the policy's read-only 9p shares at their host paths and a size-capped tmpfs as
   the scratch directory; any failure is reported (`E`) and stops the VM, never skipped;
3. passes `W` (unread) down the worker's pipe: the worker takes its own session, the
   policy's environment, a fresh `random` seed, and runs the same `serve()` as every other
   provider on the listening socket;
4. relays: each host connection (`O`) becomes a connection to that socket; bytes go both
   ways in `D` frames, `C` closes one; `S` forwards SIGINT to the worker; when the worker
   ends, `X` carries its wait status and the VM powers off;
5. with `net` in the `B` frame (a policy with `[net]` allow rules): the egress forwarder.
   The guest has no network device, only its loopback (brought up before the save). The
   agent listens on the proxy address there (`127.0.0.1:3128`, which the worker's proxy
   variables name) before the worker is released; each connection accepted becomes a
   channel over the second port (`net`), which the host relay joins to the host's egress
   proxy (`_host/egress/proxy.py`): `O` opens one (channel numbers chosen here, at most
   `MAX_NET_CHANNELS` open), `D` carries bytes, `C` closes. The allowed loopback services
   of the `B` frame (`forwards`: `host = "127.0.0.1" ports = "8765"`) are listened for the
   same way at their own address on the guest's loopback, also before the worker is
   released; their `O` frames name the service (`service_key`), and the host relay joins
   each to that service through the host's proxy, so clients that do not read `HTTP_PROXY`
   (http.client, sockets, database drivers) reach it too. The agent judges nothing: every
   rule is applied, and every refusal recorded, on the host;
6. the limit counters: the worker's cgroup has `pids.max` and `memory.max`; when the
   kernel raises `pids.events` or `memory.events` (POLLPRI), the agent sends an `L` frame
   with the counters (`{"pids_max": n, "oom_kill": n, "max": n}`) before relaying anything
   the worker sent after it; they are read again before a worker connection's close is
   relayed (a killed worker's sockets close after the kernel counted the kill). The host
   takes them as the worker side's word (see `qemu/relay.py`).

Frames: kind (1 byte), channel (4 bytes), length (4 bytes, at most `MAX_FRAME`), payload.
Only the standard library and the worker's own modules are used.

This module is longer than 600 lines because it is copied into the image as one script
(`/sb/agent.py`, PID 1 of the guest): the boot, the set-up, the relay, the egress forwarder
and the limit counters run from it alone, before any of the worker's modules could help.
"""

import json
import os
import select
import socket
import struct
import sys
import time
from typing import Any

__all__ = ["MAX_FRAME", "MAX_NET_CHANNELS", "main", "service_key"]

MAX_FRAME = 1 << 20
#: Open egress channels at once (the host refuses more, as its proxy bounds each route).
MAX_NET_CHANNELS = 64
#: The egress forwarder's address on the guest's loopback (`_egress.PROXY_HOST/PORT`).
NET_ADDRESS = ("127.0.0.1", 3128)
_HEAD = struct.Struct(">BII")
_WORKER_SOCK = "/run/sb-worker.sock"
_RNDADDENTROPY = 0x40085203
_RNDRESEEDCRNG = 0x5207
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_RB_POWER_OFF = 0x4321FEDC
_CGROUP_ROOT = "/sys/fs/cgroup"
_CGROUP = "/sys/fs/cgroup/worker"


def _console(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _preload() -> None:
    """Map agent_sandbox's packages (as `_worker.boot` does) and import the worker ahead."""
    import types

    with open("/sb/trees.json") as fh:
        trees = json.load(fh)
    roots = sorted({os.path.dirname(trees.pop(dist)) for dist in ("h11", "wrapt")})
    sys.path[:] = [p for p in sys.path if p] + roots
    for name in sorted(trees, key=len):
        module = types.ModuleType(name)
        module.__path__ = [trees[name]]
        module.__package__ = name
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    import ctypes  # noqa: F401
    import fcntl  # noqa: F401
    import random  # noqa: F401

    import agent_sandbox._worker._inworker
    import agent_sandbox._worker.server
    import agent_sandbox._worker.setup
    import agent_sandbox._worker.template
    import agent_sandbox.guards._code_budget
    import agent_sandbox.guards._install
    import agent_sandbox.guards._state  # noqa: F401
    from agent_sandbox.guards import _patch

    _patch._function_wrapper_type()


def _find_port(name: str = "sb", wait: float = 10.0) -> str:
    end = time.monotonic() + wait
    while True:
        try:
            for entry in os.listdir("/sys/class/virtio-ports"):
                with open(f"/sys/class/virtio-ports/{entry}/name") as fh:
                    if fh.read().strip() == name:
                        return "/dev/" + entry
        except OSError:
            pass
        if time.monotonic() > end:
            raise SystemExit(f"sb-agent: no virtio port named {name!r}")
        time.sleep(0.01)


class Port:
    """The virtio-serial port: framed reads and writes."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.buf = b""
        #: Frames read but not yet handled (the host may send more right behind `B`).
        self.pending: list[tuple[int, int, bytes]] = []

    def send(self, kind: bytes, chan: int = 0, payload: bytes = b"") -> None:
        data = _HEAD.pack(kind[0], chan, len(payload)) + payload
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def read_some(self) -> bool:
        """One read; False when no host is connected (the port reads as end-of-file)."""
        data = os.read(self.fd, 262144)
        if not data:
            return False
        self.buf += data
        return True

    def frames(self) -> list[tuple[int, int, bytes]]:
        out, self.pending = self.pending, []
        while len(self.buf) >= _HEAD.size:
            kind, chan, size = _HEAD.unpack_from(self.buf)
            if size > MAX_FRAME:
                raise SystemExit("sb-agent: oversized frame from the host")
            if len(self.buf) < _HEAD.size + size:
                break
            out.append((kind, chan, self.buf[_HEAD.size : _HEAD.size + size]))
            self.buf = self.buf[_HEAD.size + size :]
        return out


def _loopback_up() -> str:
    """Bring the guest's `lo` up (the egress forwarder listens there); returns "" or why not."""
    import fcntl

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            req = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, req))[1]
            fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))
    except OSError as exc:
        return str(exc)
    return ""


def service_key(host: str, port: int) -> str:
    """How an `O` frame names a forwarded loopback service (the host relay's own list has
    the same keys: `qemu/relay.py`)."""
    return f"{host}:{int(port)}"


class Net:
    """The egress forwarder: the guest loopback's proxy address and each forwarded loopback
    service's address, relayed over the `net` port."""

    def __init__(self, port: "Port", listener: socket.socket) -> None:
        self.port = port
        #: listening fd -> (socket, what its `O` frames name: b"" for the proxy)
        self.listeners: dict[int, tuple[socket.socket, bytes]] = {
            listener.fileno(): (listener, b"")
        }
        self.conns: dict[int, socket.socket] = {}
        self.by_fd: dict[int, int] = {}
        self.next_chan = 1

    def listen_for(self, forwards: list) -> None:  # type: ignore[type-arg]
        """Listen on each allowed loopback address:port of the `B` frame (before the worker
        is released). One the guest cannot bind (no IPv6) is left out, as under bwrap."""
        for host, port in forwards:
            family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((str(host), int(port)))
                sock.listen(128)
            except OSError:
                sock.close()
                continue
            sock.setblocking(False)
            key = service_key(str(host), int(port)).encode("ascii")
            self.listeners[sock.fileno()] = (sock, key)

    def accept(self, fd: int, poller: "select.poll") -> None:
        listener, key = self.listeners[fd]
        try:
            sock, _addr = listener.accept()
        except OSError:
            return
        if len(self.conns) >= MAX_NET_CHANNELS:
            sock.close()
            return
        sock.setblocking(True)
        chan = self.next_chan
        self.next_chan += 1
        self.conns[chan] = sock
        self.by_fd[sock.fileno()] = chan
        poller.register(sock.fileno(), select.POLLIN)
        self.port.send(b"O", chan, key)

    def drop(self, chan: int, poller: "select.poll") -> None:
        sock = self.conns.pop(chan, None)
        if sock is not None:
            self.by_fd.pop(sock.fileno(), None)
            poller.unregister(sock.fileno())
            sock.close()

    def from_host(self, poller: "select.poll") -> None:
        if not self.port.read_some():
            time.sleep(0.001)  # no host on the port (yet): it reads as end-of-file
            return
        for kind, chan, payload in self.port.frames():
            if kind == ord("D") and chan in self.conns:
                try:
                    self.conns[chan].sendall(payload)
                except OSError:
                    self.drop(chan, poller)
                    self.port.send(b"C", chan)
            elif kind == ord("C"):
                self.drop(chan, poller)

    def from_guest(self, fd: int, poller: "select.poll") -> None:
        chan = self.by_fd.get(fd, -1)
        sock = self.conns.get(chan)
        if sock is None:
            return
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if data:
            self.port.send(b"D", chan, data)
        else:
            self.drop(chan, poller)
            self.port.send(b"C", chan)


def _reseed(entropy: bytes) -> None:
    import fcntl

    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        info = struct.pack("ii", len(entropy) * 8, len(entropy)) + entropy
        fcntl.ioctl(fd, _RNDADDENTROPY, info)
        fcntl.ioctl(fd, _RNDRESEEDCRNG)
    finally:
        os.close(fd)


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str, flags: int, options: str) -> None:
    import ctypes

    os.makedirs(target, exist_ok=True)
    libc = _libc()
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, options.encode()):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} {source} on {target}: {os.strerror(err)}")


def _worker_cgroup(child: int) -> str:
    """Before the save: a cgroup v2 group holding the worker (and all it will fork), with
    the pids and memory controllers on; returns why it could not be made, or ""."""
    try:
        _mount("cgroup2", _CGROUP_ROOT, "cgroup2", _MS_NOSUID | _MS_NODEV, "")
        with open(os.path.join(_CGROUP_ROOT, "cgroup.subtree_control"), "w") as fh:
            fh.write("+pids +memory")
        os.makedirs(_CGROUP, exist_ok=True)
        with open(os.path.join(_CGROUP, "cgroup.procs"), "w") as fh:
            fh.write(str(child))
    except OSError as exc:
        return str(exc)
    return ""


class Limits:
    """The worker cgroup's event counters (`pids.events` max, `memory.events` max and
    oom_kill), watched with POLLPRI (the kernel's file-modified event)."""

    def __init__(self) -> None:
        self.fds: dict[int, str] = {}
        self.sent: dict[str, int] = {}
        for name in ("pids.events", "memory.events"):
            try:
                self.fds[os.open(os.path.join(_CGROUP, name), os.O_RDONLY)] = name
            except OSError:
                continue
        self.counts()  # the counters so far (none) and the files' event marks

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fd, name in self.fds.items():
            os.lseek(fd, 0, os.SEEK_SET)
            for line in os.read(fd, 4096).decode().splitlines():
                key, _, value = line.partition(" ")
                if name == "pids.events" and key == "max":
                    out["pids_max"] = int(value)
                elif name == "memory.events" and key in ("max", "oom_kill"):
                    out["memory_" + key] = int(value)
        return out

    def report(self, port: "Port") -> None:
        now = self.counts()
        if now != self.sent:
            self.sent = now
            port.send(b"L", 0, json.dumps(now).encode())


def _setup(msg: dict, cgroup_error: str) -> None:  # type: ignore[type-arg]
    """Steps 1 and 2 (and the worker's process limit)."""
    _reseed(bytes.fromhex(msg["entropy"]))
    processes = msg.get("processes")
    if processes:
        if cgroup_error:
            raise OSError(f"no pids cgroup for limits.processes: {cgroup_error}")
        with open(os.path.join(_CGROUP, "pids.max"), "w") as fh:
            fh.write(str(int(processes)))
    memory_mb = msg.get("memory_mb")
    if memory_mb:
        if cgroup_error:
            raise OSError(f"no memory cgroup for limits.memory: {cgroup_error}")
        with open(os.path.join(_CGROUP, "memory.max"), "w") as fh:
            fh.write(str(int(memory_mb) << 20))
    for tag, path in msg.get("shares", []):
        _mount(
            tag,
            path,
            "9p",
            _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
            "trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro",
        )
    _mount(
        "scratch",
        str(msg["scratch"]),
        "tmpfs",
        _MS_NOSUID | _MS_NODEV,
        f"size={int(msg['scratch_mb'])}m,mode=0700",
    )


def _fork_worker(listener: socket.socket) -> tuple[int, int]:
    """Fork the worker before the snapshot; returns (its pid, the pipe its boot goes down).

    The child waits for its part of the host's `B` frame (the boot configuration and the
    environment), so that a restored clone starts serving without a fork of its own."""
    boot_r, boot_w = os.pipe()
    child = os.fork()
    if child:
        os.close(boot_r)
        return child, boot_w
    os.close(boot_w)
    chunks = []
    while True:
        chunk = os.read(boot_r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(boot_r)
    _worker(b"".join(chunks), listener)
    os._exit(70)


def _worker(payload: bytes, listener: socket.socket) -> None:
    """Step 3, in the forked child, once the agent has set the guest up; never returns."""
    try:
        if not payload:
            raise RuntimeError("the guest set-up failed")
        msg = json.loads(payload)
        boot, env = msg["boot"], msg["env"]
        for name, folder in boot.get("package_dirs", {}).items():
            mapped = sys.modules.get(name)
            if mapped is None or list(getattr(mapped, "__path__", [])) != [folder]:
                raise RuntimeError(
                    f"the image's {name} is not the host's {folder} "
                    "(rebuild: agent-sandbox qemu build)"
                )
        os.setsid()
        os.environ.clear()
        os.environ.update({k: v for k, v in env.items() if k != "AGENT_SANDBOX_OWNER"})
        os.chdir(boot["scratch"])
        import random

        from agent_sandbox._worker.template import _renew_secrets

        # Fresh per clone (the kernel RNG was reseeded by the agent): `random`, the
        # `multiprocessing` key and tempfile's names. The str hash secret and the address
        # layout stay the template's (see the docs: they cannot be renewed in place).
        random.seed()
        _renew_secrets()
        tempfile = sys.modules.get("tempfile")
        if tempfile is not None:
            tempfile._name_sequence = None  # type: ignore[attr-defined]
        sys.path[:] = list(boot["sys_path"])
        boot["listen_fd"] = listener.fileno()
        from agent_sandbox._worker.server import serve

        serve(boot)
    except BaseException as exc:
        sys.stderr.write(f"sb-agent: worker failed: {exc!r}\n")
        sys.stderr.flush()
    os._exit(70)


def _relay(port: Port, child: int, net: "Net | None", limits: "Limits | None") -> int:
    """Steps 4 to 6; returns the worker's wait status."""
    conns: dict[int, socket.socket] = {}
    by_fd: dict[int, int] = {}
    poller = select.poll()
    poller.register(port.fd, select.POLLIN)
    if net is not None:
        poller.register(net.port.fd, select.POLLIN)
        for fd in net.listeners:
            poller.register(fd, select.POLLIN)
    if limits is not None:
        for fd in limits.fds:
            poller.register(fd, select.POLLPRI)
    status: int | None = None
    while status is None:
        events = poller.poll(0 if port.pending else 50)
        if port.pending and not any(fd == port.fd for fd, _ev in events):
            events.append((port.fd, 0))
        if limits is not None and any(fd in limits.fds for fd, _ev in events):
            # Before relaying what the worker sent after the kernel counted the hit.
            limits.report(port)
        for fd, _ev in events:
            if fd == port.fd:
                if not port.pending and not port.read_some():
                    time.sleep(0.001)
                    continue
                for kind, chan, payload in port.frames():
                    if kind == ord("O"):
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        try:
                            sock.connect(_WORKER_SOCK)
                        except OSError:
                            sock.close()
                            port.send(b"C", chan)
                            continue
                        conns[chan] = sock
                        by_fd[sock.fileno()] = chan
                        poller.register(sock.fileno(), select.POLLIN)
                    elif kind == ord("D") and chan in conns:
                        try:
                            conns[chan].sendall(payload)
                        except OSError:
                            pass
                    elif kind == ord("C") and chan in conns:
                        sock = conns.pop(chan)
                        by_fd.pop(sock.fileno(), None)
                        poller.unregister(sock.fileno())
                        sock.close()
                    elif kind == ord("S"):
                        import signal

                        try:
                            os.killpg(child, signal.SIGINT)
                        except OSError:
                            pass
            elif fd in by_fd:
                chan = by_fd[fd]
                sock2 = conns[chan]
                try:
                    data = sock2.recv(65536)
                except OSError:
                    data = b""
                if data:
                    port.send(b"D", chan, data)
                else:
                    if limits is not None:
                        # A worker the memory cgroup killed closes its connections after
                        # the kernel counted the kill: the count goes first, so the host
                        # names the limit rather than a crash.
                        limits.report(port)
                    port.send(b"C", chan)
                    conns.pop(chan, None)
                    by_fd.pop(fd, None)
                    poller.unregister(fd)
                    sock2.close()
            elif net is not None:
                if fd == net.port.fd:
                    net.from_host(poller)
                elif fd in net.listeners:
                    net.accept(fd, poller)
                else:
                    net.from_guest(fd, poller)
        while True:  # PID 1 reaps every orphan; the worker's status ends the session
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == child:
                status = st
    if limits is not None:
        limits.report(port)  # an OOM kill that ended the worker
    for sock in conns.values():
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                port.send(b"D", by_fd.get(sock.fileno(), 0), data)
        except OSError:
            pass
    return status


def _power_off() -> None:
    try:
        libc = _libc()
        libc.sync()
        libc.reboot(_RB_POWER_OFF)
    finally:
        os._exit(0)


def main() -> None:
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(_WORKER_SOCK)
    listener.listen(16)
    child, boot_w = _fork_worker(listener)
    listener.close()
    cgroup_error = _worker_cgroup(child)
    loopback_error = _loopback_up()
    port = Port(_find_port())
    net_port = Port(_find_port("net"))
    _console("SBREADY")
    frames: list[tuple[int, int, bytes]] = []
    while len(frames) < 2:
        if not port.read_some():
            time.sleep(0.001)
            continue
        frames += port.frames()
    (kind, _chan, payload), (kind2, _chan2, worker_part) = frames[:2]
    port.pending = frames[2:]
    if kind != ord("B") or kind2 != ord("W"):
        _console("sb-agent: the host's first frames are not B and W")
        _power_off()
    steps = [("boot received", time.monotonic())]
    net: Net | None = None
    limits: Limits | None = None
    try:
        msg = json.loads(payload)
        _setup(msg, cgroup_error)
        if not cgroup_error:
            limits = Limits()
        if msg.get("net"):
            if loopback_error:
                raise OSError(f"the guest's loopback is down: {loopback_error}")
            net_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            net_listener.bind(NET_ADDRESS)
            net_listener.listen(128)
            net_listener.setblocking(False)
            net = Net(net_port, net_listener)
            net.listen_for(msg.get("forwards") or [])
        steps.append(("reseeded and mounted", time.monotonic()))
    except Exception as exc:
        port.send(b"E", 0, f"guest set-up failed: {exc}".encode()[:4096])
        _power_off()
    view = memoryview(worker_part)
    while view:
        view = view[os.write(boot_w, view) :]
    os.close(boot_w)
    steps.append(("worker released", time.monotonic()))
    # The guest's own clock, for the relay's trace: each step since the boot frame arrived.
    base = steps[0][1]
    port.send(b"R", 0, json.dumps([[what, round(t - base, 4)] for what, t in steps]).encode())
    status = _relay(port, child, net, limits)
    port.send(b"X", 0, str(status).encode())
    _power_off()


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:
        _console(f"sb-agent: {exc!r}")
        _power_off()
