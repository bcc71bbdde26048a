"""The gvisor provider: the exact OCI bundle and runsc argv, the refusals, and real runs.

The builder tests need no runsc; the real runs skip with the probe's reason where runsc
cannot start a rootless sandbox. Every test that starts a worker closes it, and the
lifecycle test checks that nothing of runsc (its processes, the bundle, the socket
directory) outlives the sandbox.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
import subprocess
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, ProviderUnavailable, Sandbox
from agent_sandbox._errors import WorkerStartError
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers import Provider, get_provider
from agent_sandbox.providers._base import LaunchPlan, ProbeResult, WorkerSpec
from agent_sandbox.providers._netcheck import unenforceable
from agent_sandbox.providers._view import HostLayout
from agent_sandbox.providers.gvisor.bundle import GvisorPlan, bundle_config
from agent_sandbox.providers.gvisor.provider import (
    DCACHE,
    INSTALL_HINT,
    MIN_RELEASE,
    GvisorProvider,
    _trial,
    dentry_cache_size,
    refuse_unservable,
    release_of,
    runsc_argv,
)
from tests.providers.conftest import skip_unless_available

HOST = HostLayout(
    symlinks={"/bin": "usr/bin", "/lib": "usr/lib", "/lib64": "usr/lib64"},
    kinds={"/data/in/secret.csv": "file"},
)
SPEC = WorkerSpec(
    python="/py/bin/python3.11",
    boot_script="/src/agent_sandbox/_worker/boot.py",
    scratch="/tmp/as-1/scratch",
    control_dir="/tmp/as-1",
    listen_fd=3,
    boot_fd=4,
    sys_path=("/py/lib/python3.11",),
    package_dirs={"agent_sandbox": "/src/agent_sandbox"},
    env={"LANG": "C.UTF-8"},
    prefix="/py",
    base_prefix="/py",
)
POLICY = Policy(
    name="t",
    files={"read": ["/data/in"], "write": ["/srv/out"], "deny": ["/data/in/secret.csv"]},
    limits={"memory_mb": 300, "processes": 12, "cpu_seconds": 7, "scratch_mb": 16},
)


def _ro(path: str) -> dict[str, Any]:
    return {"destination": path, "type": "bind", "source": path, "options": ["rbind", "ro"]}


def test_bundle_config_is_exact() -> None:
    """The whole config.json for one policy: the view's mounts in order (optional sources
    only where present), the socket directory last, no capability, the policy's rlimits."""
    config = bundle_config(POLICY, SPEC, HOST, frozenset({"/etc/localtime", "/data/in"}))
    mb = 1024 * 1024
    assert config == {
        "ociVersion": "1.0.0",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": ["/py/bin/python3.11", "-I", "-S", "-B", SPEC.boot_script, "0"],
            "env": [
                "HOME=/tmp/as-1/scratch",
                "LANG=C.UTF-8",
                "MPLCONFIGDIR=/tmp/as-1/scratch/.mpl",
                "OMP_NUM_THREADS=1",
                "OPENBLAS_NUM_THREADS=1",
                "PATH=/usr/bin:/bin",
                "PYTHONDONTWRITEBYTECODE=1",
                "TMPDIR=/tmp/as-1/scratch",
            ],
            "cwd": "/tmp/as-1/scratch",
            "capabilities": {
                "bounding": [],
                "effective": [],
                "inheritable": [],
                "permitted": [],
                "ambient": [],
            },
            "noNewPrivileges": True,
            "rlimits": [
                {"type": "RLIMIT_AS", "soft": 300 * mb, "hard": 300 * mb},
                {"type": "RLIMIT_CORE", "soft": 0, "hard": 0},
                {"type": "RLIMIT_CPU", "soft": 7, "hard": 8},
                {"type": "RLIMIT_FSIZE", "soft": 256 * mb, "hard": 256 * mb},
                {"type": "RLIMIT_NOFILE", "soft": 256, "hard": 256},
                {"type": "RLIMIT_NPROC", "soft": 12, "hard": 12},
            ],
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "sandbox",
        "mounts": [
            _ro("/usr"),
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["mode=0755"]},
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": [f"size={64 * mb}", "mode=1777"],
            },
            _ro("/py"),
            _ro("/src/agent_sandbox"),
            _ro("/etc/localtime"),
            _ro("/data/in"),
            {
                "destination": "/tmp/as-1/scratch",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": [f"size={16 * mb}", "mode=0700"],
            },
            # /srv/out (a write grant, absent here) and /etc/ld.so.cache are left out.
            {
                "destination": "/data/in/secret.csv",
                "type": "bind",
                "source": "/tmp/as-1/gvisor/bundle/empty",
                "options": ["ro"],
            },
            {
                "destination": "/tmp/as-1/uds",
                "type": "bind",
                "source": "/tmp/as-1/uds",
                "options": ["rbind", "rw"],
            },
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "network"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
            ]
        },
    }


def test_runsc_argv_is_exact() -> None:
    assert runsc_argv("/usr/bin/runsc", "/c/state", "/c/bundle", "as-1") == (
        "/usr/bin/runsc",
        "--rootless",
        "--ignore-cgroups",
        "--network=none",
        "--host-uds=create",
        "--platform=ptrace",
        "--dcache=1000",
        "--root",
        "/c/state",
        "run",
        "--bundle",
        "/c/bundle",
        "as-1",
    )


def test_the_pool_does_not_rely_on_checkpoint_and_restore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool's gVisor worker is a sandbox started ahead (`runsc run`), never a restored
    image: `runsc checkpoint` of this runsc fails on the worker's host-connected Unix socket
    (gVisor cannot save a host-backed endpoint) and the worker dies of it."""
    monkeypatch.setattr(GvisorProvider, "probe", lambda self: ProbeResult("gvisor", True))
    plan = GvisorProvider().build(Policy(name="t"), SPEC)
    words = {*plan.argv, *plan.interrupt_argv}
    assert "run" in plan.argv and not words & {"checkpoint", "restore", "--image-path"}


def test_the_dentry_cache_fits_the_hosts_descriptor_limit() -> None:
    """The Sentry's dentry cache is sized to the host's descriptor limit: at a normal user's
    `ulimit -n 1024` the gofer stays below it while pandas is imported (without the bound it
    held 2000 descriptors, and the sandbox answered EMFILE: the listing test as uid 65534)."""
    assert dentry_cache_size(1024) == 64
    assert dentry_cache_size(4096) == 256
    assert dentry_cache_size(1 << 20) == DCACHE
    assert dentry_cache_size(resource.RLIM_INFINITY) == DCACHE
    assert dentry_cache_size(100) == 64


def test_plan_names_gvisor_and_its_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan: stack led by gvisor, the worker's own socket in the control directory,
    the boot pipe as standard input, the cgroups' room for runsc, the container named
    after the control directory (runsc's control socket is host-wide)."""
    monkeypatch.setattr(GvisorProvider, "probe", lambda self: ProbeResult("gvisor", True))
    plan = GvisorProvider().build(Policy(name="t"), SPEC)
    assert isinstance(plan, GvisorPlan)
    assert plan.provider == "gvisor" and plan.stack[0] == "gvisor"
    assert plan.socket_path == "/tmp/as-1/uds/ctl.sock"
    assert plan.worker_setup["listen_path"] == plan.socket_path
    assert plan.worker_setup["no_new_privs"] is True and plan.worker_setup["drop_caps"] is True
    assert plan.stdin_fd == SPEC.boot_fd and plan.pass_fds == ()
    assert plan.argv[-1] == "as-1" and plan.interrupt_launcher
    assert plan.launcher_tasks > 0 and plan.launcher_mb > 0
    assert plan.warm_up  # the first call's faults are paid before the worker is handed out
    assert plan.interrupt_argv[1:] == (
        "--rootless",
        "--root",
        plan.state_dir,
        "kill",
        "as-1",
        "INT",
    )


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("runsc version 0.0~20221219.0\nspec: 1.0.2-dev\n", 20221219),
        ("runsc version release-20240513.0\nspec: 1.1.0\n", 20240513),
        ("runsc version VERSION_MISSING\n", None),
        ("", None),
    ],
)
def test_release_of(version: str, release: int | None) -> None:
    assert release_of(version) == release


def _fake_runsc(tmp_path: Path, version: str) -> str:
    exe = tmp_path / "runsc"
    exe.write_text(f"#!/bin/sh\necho 'runsc version {version}'\n")
    exe.chmod(0o755)
    return str(exe)


def test_it_refuses_a_too_old_runsc(tmp_path: Path) -> None:
    """A runsc older than MIN_RELEASE is unavailable, with one line naming the version."""
    provider = GvisorProvider(runsc=_fake_runsc(tmp_path, "release-20200101.0"))
    result = _trial(provider.runsc)
    assert not result.available
    assert f"runsc 20200101 is older than {MIN_RELEASE}" in result.reason
    assert "\n" not in result.reason


def test_a_missing_runsc_names_the_install_command() -> None:
    provider = GvisorProvider(runsc="/nonexistent/agent-sandbox-test/runsc")
    with pytest.raises(ProviderUnavailable) as info:
        provider.require()
    assert "runsc" in str(info.value) and INSTALL_HINT in str(info.value)


@pytest.mark.parametrize("kind", ["socket", "fifo"])
def test_it_refuses_a_grant_gvisor_cannot_serve(tmp_path: Path, kind: str) -> None:
    """A read grant of a socket or a FIFO refuses the policy at build, naming the path."""
    target = tmp_path / "special"
    if kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(target))
    else:
        os.mkfifo(target)
    try:
        policy = Policy(name="t", files={"read": [str(target)]})
        with pytest.raises(ProviderUnavailable) as info:
            refuse_unservable(policy, SPEC)
        word = "a socket" if kind == "socket" else "a FIFO"
        assert f"files.read {str(target)!r} is {word}" in str(info.value)
    finally:
        if kind == "socket":
            server.close()


def test_net_rules_under_gvisor_are_those_of_bwrap_and_unknown_providers_refuse_all() -> None:
    """gvisor refuses what the egress proxy cannot serve (UDP off loopback, a listener for
    outside peers), as bwrap does; a provider name the table does not know refuses every
    rule (never fails open)."""
    tcp = Policy(name="t", net={"rules": [{"host": "api.example.com", "ports": 443}]})
    udp = Policy(
        name="t", net={"rules": [{"host": "198.51.100.7", "ports": 53, "protocol": "udp"}]}
    )
    gvisor, bwrap = get_provider("gvisor"), get_provider("bwrap")
    assert unenforceable(gvisor, tcp) == []
    assert [i for i, _why, _alt in unenforceable(gvisor, udp)] == [0]
    assert unenforceable(gvisor, udp) == unenforceable(bwrap, udp)

    class Unanswered(Provider):
        name = "no-such-provider"

    assert [i for i, _why, _alt in unenforceable(Unanswered(), tcp)] == [0]
    assert unenforceable(get_provider("subprocess"), tcp) == []


def test_a_networked_plan_relays_to_the_hosts_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GvisorProvider, "probe", lambda self: ProbeResult("gvisor", True))
    spec = dataclasses.replace(SPEC, egress_fd=9)
    rules = [{"host": "api.example.com", "ports": 443}, {"host": "localhost", "ports": 8765}]
    policy = Policy(name="t", net={"rules": rules})
    plan = GvisorProvider().build(policy, spec)
    assert plan.stack[-1] == "egress-proxy" and plan.egress_fd == 9
    assert plan.worker_setup["egress"]["fd"] == -1  # nothing to send from inside
    assert plan.worker_setup["egress_relay"] == {
        "host": "127.0.0.1",
        "port": 3128,
        "socket": "/tmp/as-1/uds/egress.sock",
        # The allowed loopback service: a listener inside, relayed to a socket of its own.
        "forwards": [["127.0.0.1", 8765, "/tmp/as-1/uds/fwd-127.0.0.1-8765.sock"]],
    }
    assert "--host-uds=all" in plan.argv
    assert "HTTPS_PROXY=http://127.0.0.1:3128" in plan.config["process"]["env"]


def test_a_forward_socket_the_host_did_not_list_is_refused(tmp_path: Path) -> None:
    """The parent takes a Unix forward listener only for a service on its own list, matched
    by the socket's name; any other is refused and nothing is kept."""
    import socket

    from agent_sandbox._host.egress.handoff import EgressError, receive_listeners

    def offer(names: list[str]) -> tuple[Any, Any]:
        socks = []
        for name in names:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(tmp_path / name))
            sock.listen(1)
            socks.append(sock)
        ours, theirs = socket.socketpair()
        socket.send_fds(theirs, [b"egress"], [s.fileno() for s in socks])
        for sock in socks:
            sock.close()
        theirs.close()
        return ours, lambda: [os.unlink(tmp_path / n) for n in names]

    listed = [("127.0.0.1", 8765)]
    channel, clean = offer(["egress.sock", "fwd-127.0.0.1-8765.sock"])
    listener, extra = receive_listeners(channel, 1.0, listed)
    assert list(extra) == listed
    for sock in (listener, *extra.values(), channel):
        sock.close()
    clean()
    for other in ("fwd-127.0.0.1-22.sock", "fwd-nonsense.sock", "elsewhere.sock"):
        channel, clean = offer(["egress.sock", other])
        with pytest.raises(EgressError, match="not forwarded"):
            receive_listeners(channel, 1.0, listed)
        channel.close()
        clean()


# -- real runs ---------------------------------------------------------------------------


@pytest.fixture
def gvisor() -> GvisorProvider:
    skip_unless_available("gvisor")
    return GvisorProvider()


def _policy(tmp_path: Path, **extra: Any) -> Policy:
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    (ro / "data.txt").write_text("readable\n")
    (tmp_path / "outside.txt").write_text("canary-outside\n")
    data: dict[str, Any] = {
        "name": "danger-gvisor-test",
        "provider": "gvisor",
        "imports": {"allow": ["*"]},
        "api": {"allow": ["native-code", "process-control", "introspection"]},
        "code": {"enabled": False},
        "files": {"read": [str(ro)], "write": [str(rw)]},
        "limits": {"wall_seconds": 30, "processes": 8, "scratch_mb": 4},
        **extra,
    }
    return Policy.model_validate(data)


PROBE = textwrap.dedent(
    """
    import ctypes, os, platform
    libc = ctypes.CDLL(None, use_errno=True)
    def err(rc):
        return 0 if rc >= 0 else ctypes.get_errno()
    out = {}
    out["release"] = platform.release()
    out["ro_read"] = open(RO + "/data.txt").read()
    fd = libc.open((RO + "/new").encode(), os.O_WRONLY | os.O_CREAT, 0o644)
    out["ro_write"] = err(fd)
    fd = libc.open((OUT).encode(), os.O_RDONLY)
    out["outside"] = err(fd)
    out["passwd"] = err(libc.open(b"/etc/passwd", os.O_RDONLY))
    open(RW + "/w.txt", "w").write("written")
    out["landlock"] = ctypes.get_errno() if libc.syscall(444, 0, 0, 1) < 0 else "present"
    out["scratch_bytes"] = os.statvfs(".").f_blocks * os.statvfs(".").f_frsize
    out
    """
)


def test_a_worker_runs_behind_gvisor(tmp_path: Path, gvisor: GvisorProvider) -> None:
    """It denies reads outside the grants and writes to a read grant, below Python: the
    worker sees gVisor's kernel, a root of only what the view mounts, no capability."""
    policy = _policy(tmp_path)
    code = (
        f"RO = {str(tmp_path / 'ro')!r}; RW = {str(tmp_path / 'rw')!r}; "
        f"OUT = {str(tmp_path / 'outside.txt')!r}\n" + PROBE
    )
    worker = WorkerProcess.start(policy, gvisor)
    try:
        result = worker.run(code, timeout=30)
        checks = worker.hello["checks"]
    finally:
        worker.discard()
    assert result.error is None, result.error
    assert result.provider == "gvisor" and result.stack[0] == "gvisor"
    assert checks["cap_eff"] == "0" * 16 and checks["no_new_privs"] == 1
    out = result.value
    assert out["release"] == "4.4.0"  # gVisor's kernel, not the host's
    assert out["passwd"] == 2  # ENOENT: /etc/passwd is not in the view
    assert out["ro_read"] == "readable\n"
    assert out["ro_write"] == 30  # EROFS
    assert out["outside"] == 2  # ENOENT: the test's directory is not in the view
    assert out["landlock"] == 38  # ENOSYS: gVisor has no Landlock
    assert out["scratch_bytes"] == 4 * 1024 * 1024
    assert (tmp_path / "rw" / "w.txt").read_text() == "written"


def test_it_denies_a_fork_past_the_process_limit(tmp_path: Path, gvisor: GvisorProvider) -> None:
    """It denies fork past `limits.processes` (RLIMIT_NPROC, enforced by gVisor's kernel):
    the attack ran (some forks succeeded) and the kernel stopped it with EAGAIN."""
    policy = _policy(tmp_path)
    code = textwrap.dedent(
        """
        import os, time, errno
        kids, stop = [], None
        for _ in range(40):
            try:
                pid = os.fork()
            except OSError as exc:
                stop = exc.errno
                break
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            kids.append(pid)
        for pid in kids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        (len(kids), stop)
        """
    )
    worker = WorkerProcess.start(policy, gvisor)
    try:
        result = worker.run(code, timeout=30)
    finally:
        worker.discard()
    assert result.error is None, result.error
    forked, stop = result.value
    assert 0 < forked < 8
    assert stop == 11  # EAGAIN


def test_a_start_failing_inside_the_sandbox_names_the_cause(
    tmp_path: Path, gvisor: GvisorProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that cannot start inside gVisor fails the start with its cause, and
    leaves no control directory behind."""
    real_build = GvisorProvider.build

    def broken(self: GvisorProvider, policy: Any, spec: WorkerSpec) -> GvisorPlan:
        plan = real_build(self, policy, spec)
        process = dict(plan.config["process"])
        process["args"] = [spec.python, "-I", "-S", "-c", "raise SystemExit('boom-inside')"]
        return dataclasses.replace(plan, config={**plan.config, "process": process})

    monkeypatch.setattr(GvisorProvider, "build", broken)
    before = set(_own_dirs())
    with pytest.raises(WorkerStartError) as info:
        WorkerProcess.start(_policy(tmp_path), gvisor, start_timeout=30)
    assert "exited early" in str(info.value)
    assert "boom-inside" in info.value.log_tail
    assert set(_own_dirs()) - before == set()


def _own_dirs() -> list[str]:
    """This process's worker control directories (other test processes may run at once)."""
    from agent_sandbox._host import lifecycle

    prefix = os.path.basename(lifecycle.control_dir_prefix())
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)]


def test_an_interrupt_reaches_the_cell_and_keeps_the_session(gvisor: GvisorProvider) -> None:
    """The interrupt reaches the running cell as KeyboardInterrupt (through `runsc kill`),
    and the session's variables stay."""
    import threading

    policy = Policy(name="t", provider="gvisor", imports={"allow": ["time"]})
    with Sandbox(policy, warm=0) as sandbox:
        session = sandbox.session("a")
        assert session.run("x = 41").ok
        started = threading.Event()
        sent: list[bool] = []

        def interrupt() -> None:
            started.wait(30)
            sent.append(session.interrupt())

        thread = threading.Thread(target=interrupt)
        thread.start()
        result = session.run(
            "import time\nprint('spinning', flush=True)\nwhile True: time.sleep(0.01)",
            on_event=lambda kind, data: started.set() if kind == "stdout" else None,
        )
        thread.join()
        assert sent == [True]
        assert result.error is not None and result.error.type == "KeyboardInterrupt"
        assert session.run("x + 1").value == 42


def test_egress_goes_through_the_hosts_proxy(gvisor: GvisorProvider) -> None:
    """It denies a connection the rules do not name (a net.connect denial recorded by the
    host's proxy) and a direct connection past the proxy (no route: only the Sentry's
    loopback), and serves the one a rule names, through the proxy and directly (the allowed
    loopback service is forwarded)."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    policy = Policy(
        name="danger-gvisor-net",
        provider="gvisor",
        imports={"allow": ["*"]},
        api={"allow": ["native-code"]},
        code={"enabled": False},
        net={"rules": [{"host": "127.0.0.1", "ports": str(port)}]},
    )
    fetch = "import urllib.request\nurllib.request.urlopen({!r}, timeout=10).read()"
    direct = textwrap.dedent(
        """
        import ctypes, struct
        libc = ctypes.CDLL(None, use_errno=True)
        s = libc.socket(2, 1, 0)
        addr = struct.pack("=H", 2) + struct.pack("!H4s8x", {}, bytes([127, 0, 0, 1]))
        rc = libc.connect(s, addr, len(addr))
        (rc, ctypes.get_errno())
        """
    )
    other = 9 if port != 9 else 7  # a loopback port no rule names
    try:
        with Sandbox(policy, warm=0) as sandbox:
            ok = sandbox.run(fetch.format(f"http://127.0.0.1:{port}/"))
            refused = sandbox.run(fetch.format("http://192.0.2.1:80/"))
            bypass = sandbox.run(direct.format(other))
            forwarded = sandbox.run(direct.format(port))
    finally:
        server.close()
    assert ok.error is None and ok.stack[-1] == "egress-proxy"
    assert "ok" in str(ok.value)
    assert refused.error is not None
    assert "net.connect" in [d.rule for d in refused.denials]
    assert bypass.error is None, bypass.error
    assert bypass.value[0] == -1 and bypass.value[1] == 111  # ECONNREFUSED: the Sentry's lo
    # The allowed service, reached without the proxy: the relay's listener inside.
    assert forwarded.error is None and forwarded.value[0] == 0, forwarded


def _runsc_processes(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if marker.encode() in cmd:
            out.append(int(pid))
    return out


def test_nothing_of_runsc_outlives_the_sandbox(tmp_path: Path, gvisor: GvisorProvider) -> None:
    """After the sandbox closes: no runsc, gofer or Sentry process of its workers, no
    control directory (bundle, state, socket directory), and no cgroup (runsc made one
    named after the container in every hierarchy, and left it, until `--ignore-cgroups`)."""
    from agent_sandbox._host import lifecycle
    from agent_sandbox._tools.leftovers import agent_cgroups

    tag = lifecycle.owner_tag()
    groups_before = set(agent_cgroups(tag))
    # Pools other tests of this process left open keep their own directories.
    dirs_before = set(_own_dirs())
    policy = _policy(tmp_path)
    with Sandbox(policy) as sandbox:
        result = sandbox.run("1 + 1")
        assert result.value == 2 and result.provider == "gvisor"
        session = sandbox.session("s")
        assert session.run("2 + 2").value == 4
        dirs = set(_own_dirs()) - dirs_before
        assert dirs, "the sandbox's workers have control directories while it is open"
    for name in dirs:
        assert not os.path.exists(os.path.join(tempfile.gettempdir(), name))
        assert _runsc_processes(name) == []
    assert set(_own_dirs()) - dirs_before == set()
    assert set(agent_cgroups(tag)) - groups_before == set()


def test_the_socket_pin_refuses_a_planted_link(tmp_path: Path) -> None:
    """It denies a worker that plants a link at its socket's name (the directory is shared
    writable with the sandbox): the parent opens the name with O_NOFOLLOW, so the start
    fails naming the cause, and nothing connects to the host socket the link points at."""
    target = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(target))
    server.listen(1)
    server.setblocking(False)
    link = tmp_path / "ctl.sock"
    link.symlink_to(target)

    class Alive:
        pid = -1

        def poll(self) -> None:
            return None

    from agent_sandbox._host.startup import pin_socket

    worker = WorkerProcess()
    worker.proc = Alive()  # type: ignore[assignment]
    worker._reaped = True  # nothing to signal: only the pin is under test
    try:
        with pytest.raises(WorkerStartError) as info:
            pin_socket(worker, str(link), deadline=0.0)
        assert "the worker's socket path is not a socket" in str(info.value)
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection reached the host socket
    finally:
        server.close()


def test_setup_and_ci_install_runsc() -> None:
    """scripts/setup.sh and .ci/run install runsc where apt-get exists."""
    root = Path(__file__).resolve().parents[2]
    for script in (root / "scripts" / "setup.sh", root / ".ci" / "run"):
        text = script.read_text()
        assert "need+=(runsc)" in text or "install -y -qq --no-install-recommends runsc" in text
        assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


# -- chosen on purpose: min_boundary, auto, doctor ----------------------------------------


def test_a_provider_below_min_boundary_is_refused() -> None:
    """A policy naming bwrap while asking for a user-space kernel is refused at
    construction, naming the providers that meet it."""
    from agent_sandbox import PolicyError

    with pytest.raises(PolicyError) as info:
        Policy(name="t", provider="bwrap", min_boundary="user-space-kernel")
    assert 'below min_boundary = "user-space-kernel"' in str(info.value)
    assert "gvisor, qemu" in str(info.value)
    Policy(name="t", provider="gvisor", min_boundary="user-space-kernel")
    with pytest.raises(PolicyError):
        Policy(name="t", provider="gvisor", min_boundary="virtual-machine")


def test_min_boundary_default_keeps_fingerprints() -> None:
    assert (
        Policy(name="t").fingerprint() == Policy(name="t", min_boundary="host-kernel").fingerprint()
    )
    assert (
        Policy(name="t").fingerprint()
        != Policy(name="t", min_boundary="user-space-kernel").fingerprint()
    )


class _Stub(Provider):
    def __init__(self, name: str, available: bool) -> None:
        self.stub_name = name
        self.available = available

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.stub_name

    def probe(self) -> ProbeResult:
        return ProbeResult(self.stub_name, self.available, "" if self.available else "absent")

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        return LaunchPlan(self.stub_name, ("x",), {}, (), "/", stack=(self.stub_name,))


def test_auto_takes_the_fastest_provider_meeting_min_boundary() -> None:
    """auto: gvisor when it works, qemu when only it does, an error naming both when none
    does; never a namespace sandbox for a policy that asks for a user-space kernel."""
    from agent_sandbox.providers import AutoProvider

    policy = Policy(name="t", min_boundary="user-space-kernel")
    both = AutoProvider(stronger=(_Stub("gvisor", True), _Stub("qemu", True)))
    assert both.build(policy, SPEC).provider == "gvisor"
    only_vm = AutoProvider(stronger=(_Stub("gvisor", False), _Stub("qemu", True)))
    assert only_vm.build(policy, SPEC).provider == "qemu"
    vm_policy = Policy(name="t", min_boundary="virtual-machine")
    assert both.build(vm_policy, SPEC).provider == "qemu"
    none = AutoProvider(stronger=(_Stub("gvisor", False), _Stub("qemu", False)))
    with pytest.raises(ProviderUnavailable) as info:
        none.build(policy, SPEC)
    assert 'min_boundary = "user-space-kernel"' in str(info.value)
    assert "gvisor: absent" in str(info.value) and "qemu: absent" in str(info.value)


def test_a_sandbox_asking_for_a_user_space_kernel_gets_gvisor(gvisor: GvisorProvider) -> None:
    with Sandbox(Policy(name="t", min_boundary="user-space-kernel"), warm=0) as sandbox:
        result = sandbox.run("1 + 1")
    assert result.value == 2
    assert result.provider == "gvisor" and result.stack[0] == "gvisor"


def test_doctor_reports_gvisor(monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor: runsc's release and platform where it works; the install command where not."""
    from agent_sandbox._tools import cli_doctor

    providers = [
        {
            "name": "gvisor",
            "available": True,
            "version": "runsc version 0.0~20221219.0",
            "reason": "",
            "details": {"platform": "ptrace", "release": 20221219},
        }
    ]
    ok = cli_doctor._gvisor(providers)
    assert ok["available"] and ok["release"] == 20221219 and ok["platform"] == "ptrace"
    assert "install" not in ok
    providers[0].update(available=False, reason="the `runsc` executable (gVisor) is not on PATH")
    missing = cli_doctor._gvisor(providers)
    assert not missing["available"] and missing["install"] == INSTALL_HINT
