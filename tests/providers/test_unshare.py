"""The unshare provider: the exact launcher configuration, and effects of real runs.

The real runs use `UnshareProvider(stack=False)` so that the namespace layer alone is judged
(Landlock and seccomp, stacked by default, are judged in test_containment.py); one test
checks the default stack. Every test that starts a worker closes it.
"""

from __future__ import annotations

import dataclasses
import marshal
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, ProviderUnavailable
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers._base import WorkerSpec
from agent_sandbox.providers._unshare import (
    LAUNCHER,
    UnshareProvider,
    launcher_argv,
    launcher_config,
    unshare_argv,
)
from agent_sandbox.providers._view import HostLayout
from tests.providers.conftest import require_landlock_and_seccomp

HOST = HostLayout(
    symlinks={"/bin": "usr/bin", "/lib": "usr/lib", "/lib64": "usr/lib64", "/sbin": "usr/sbin"},
    kinds={"/data/in/secret.csv": "file"},
)
SPEC = WorkerSpec(
    python="/opt/venv/bin/python",
    boot_script="/src/agent_sandbox/_worker/boot.py",
    scratch="/tmp/as-1/scratch",
    control_dir="/tmp/as-1",
    listen_fd=3,
    boot_fd=4,
    sys_path=(
        "/py/lib/python3.11",
        "/py/lib/python3.11/lib-dynload",
        "/opt/venv/lib/python3.11/site-packages",
    ),
    package_dirs={
        "agent_sandbox": "/src/agent_sandbox",
        "agent_sandbox.guards": "/src/guards",
        "agent_sandbox.policies": "/src/policies",
        "agent_sandbox.providers": "/src/providers",
    },
    env={},
    prefix="/opt/venv",
    base_prefix="/py",
)
POLICY = Policy(
    name="t",
    files={
        "read": ["/data/in/*.csv", "/usr/share/dict"],
        "write": ["$SCRATCH/out", "/srv/out"],
        "deny": ["/data/in/secret.csv", "/srv/out/*.key"],
    },
)
BOOT = ["/src/agent_sandbox/_worker/boot.py", 4]
MOUNTS = [
    ["ro", "/usr", "/usr"],
    ["symlink", "/bin", "usr/bin"],
    ["symlink", "/lib", "usr/lib"],
    ["symlink", "/lib64", "usr/lib64"],
    ["symlink", "/sbin", "usr/sbin"],
    ["dev", "/dev", ""],
    ["proc", "/proc", ""],
    ["tmpfs", "/tmp", ""],
    ["ro", "/py", "/py"],
    ["ro", "/opt/venv", "/opt/venv"],
    ["ro", "/src/agent_sandbox", "/src/agent_sandbox"],
    ["ro", "/src/guards", "/src/guards"],
    ["ro", "/src/policies", "/src/policies"],
    ["ro", "/src/providers", "/src/providers"],
    ["ro-try", "/etc/ld.so.cache", "/etc/ld.so.cache"],
    ["ro-try", "/etc/localtime", "/etc/localtime"],
    ["ro-try", "/data/in", "/data/in"],
    ["rw-try", "/srv/out", "/srv/out"],
    ["scratch", "/tmp/as-1/scratch", str(512 * 1024 * 1024)],  # limits.scratch_mb
    ["mask-file", "/data/in/secret.csv", ""],
]


# -- the pure builder ----------------------------------------------------------------------


def test_launcher_config_is_exact_for_a_policy_with_paths() -> None:
    """It builds the whole view: system first, then binds shallow-first, then masks."""
    assert launcher_config(POLICY, SPEC, HOST) == {
        "root": "/tmp/as-1/nsroot",
        "mounts": MOUNTS,
        "tmpfs_bytes": 67108864,
        "net": "none",
        "hostname": "sandbox",
        "cwd": "/tmp/as-1/scratch",
        "boot": BOOT,
    }


def test_argv_runs_the_launcher_isolated_with_the_config() -> None:
    """It imports the stdlib launcher under `-I -S -B`, the configuration as one argument."""
    argv = unshare_argv(POLICY, SPEC, HOST)
    assert argv[:5] == ("/opt/venv/bin/python", "-I", "-S", "-B", "-c")
    assert argv[5] == (
        f"import sys; sys.path.insert(0, {os.path.dirname(LAUNCHER)!r}); import _ns_launch; "
        "del sys.path[0]; _ns_launch.main()"
    )
    assert marshal.loads(bytes.fromhex(argv[6])) == launcher_config(POLICY, SPEC, HOST)
    assert len(argv) == 7


def test_a_policy_with_network_rules_gets_lo_up_for_the_proxy() -> None:
    """It brings `lo` up (the egress proxy listens there) only for a policy with rules."""
    loop = Policy(name="t", net={"rules": [{"host": "127.0.0.1", "ports": 8000}]})
    assert launcher_config(loop, SPEC, HOST)["net"] == "proxy"
    assert launcher_config(Policy(name="t"), SPEC, HOST)["net"] == "none"


def test_a_policy_with_a_remote_host_gets_the_egress_proxy() -> None:
    """It serves a remote host through the host's egress proxy (channel, variables, port)."""
    policy = Policy(name="t", net={"rules": [{"host": "example.org", "ports": 443}]})
    plan = UnshareProvider().build(policy, dataclasses.replace(SPEC, egress_fd=7))
    assert plan.worker_setup["egress"] == {
        "fd": 7,
        "host": "127.0.0.1",
        "port": 3128,
        "forwards": [],
    }
    assert 7 in plan.pass_fds and plan.env["ALL_PROXY"] == "http://127.0.0.1:3128"
    assert plan.stack[-1] == "egress-proxy"
    if "landlock" in plan.worker_setup:
        assert plan.worker_setup["landlock"]["tcp_connect"] == [443, 3128]


def test_refuses_a_rule_the_proxy_cannot_serve_naming_it() -> None:
    """It refuses UDP and a listener for outside peers, naming each rule."""
    policy = Policy(
        name="t",
        net={
            "rules": [
                {"host": "example.org", "ports": 53, "protocol": "any"},
                {"host": "0.0.0.0/0", "ports": 8080, "direction": "bind"},
            ]
        },
    )
    with pytest.raises(
        ProviderUnavailable,
        match=r'rules\[0\] host = "example\.org" ports = "53" protocol = "any": UDP.*rules\[1\] host = "0\.0\.0\.0/0" ports = "8080" direction = "bind"',
    ):
        UnshareProvider().build(policy, dataclasses.replace(SPEC, egress_fd=7))


# -- real runs (the namespace effects are in test_namespaces.py) ---------------------


def _require() -> None:
    probe = UnshareProvider().probe()
    if not probe.available:
        pytest.skip(f"unshare unavailable here: {probe.reason}")


def _danger_policy(**files: Any) -> Policy:
    with warnings.catch_warnings():
        # The warning that native-code opens the Python layer is the point of this policy.
        warnings.simplefilter("ignore", UserWarning)
        return Policy(
            name="danger-unshare-test",
            imports={"allow": ["*"]},
            api={"allow": ["native-code", "process-control", "introspection", "deserialization"]},
            code={"enabled": False},
            files=files,
            limits={"wall_seconds": 20},
        )


def test_default_stack_adds_landlock_and_seccomp(tmp_path: Path) -> None:
    """It stacks Landlock and seccomp (applied by the worker) where both work here."""
    _require()
    require_landlock_and_seccomp()
    w = WorkerProcess.start(Policy(name="t"), UnshareProvider())
    try:
        checks = w.hello.get("checks", {})
        assert w.plan is not None and w.plan.stack == ("unshare", "landlock", "seccomp")
        assert checks["cap_eff"] == "0" * 16 and checks["no_new_privs"] == 1
        assert checks["seccomp"] == 2
        assert checks["landlock"]["enforced"] is True
        assert w.run("2 + 3").value == 5
    finally:
        w.close()


def test_loopback_policy_reaches_its_own_ports_but_not_the_hosts(tmp_path: Path) -> None:
    """It denies the host's loopback even when the policy allows loopback (own `lo` only)."""
    _require()
    policy = _danger_policy().model_copy(
        update={
            "net": Policy(name="t", net={"rules": [{"host": "127.0.0.1", "direction": "any"}]}).net
        }
    )
    code = textwrap.dedent("""
        import ctypes, struct
        libc = ctypes.CDLL(None, use_errno=True)
        def addr(port):
            return struct.pack("=H", 2) + struct.pack("!H4s8x", port, b"\\x7f\\0\\0\\1")
        srv = libc.socket(2, 1, 0)
        a = addr(0)
        print("listen", libc.bind(srv, a, len(a)), libc.listen(srv, 1))
        buf = ctypes.create_string_buffer(16)
        n = ctypes.c_uint32(16)
        libc.getsockname(srv, buf, ctypes.byref(n))
        c = libc.socket(2, 1, 0)
        a = addr(struct.unpack("!H", buf.raw[2:4])[0])
        print("own", libc.connect(c, a, len(a)))
        h = libc.socket(2, 1, 0)
        a = addr(PORT)
        print("host", libc.connect(h, a, len(a)))
    """)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        w = WorkerProcess.start(policy, UnshareProvider(stack=False))
        try:
            result = w.run(code.replace("PORT", str(listener.getsockname()[1])))
        finally:
            w.close()
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.error is None, result.error
    assert "listen 0 0" in result.stdout and "own 0" in result.stdout, result.stdout
    assert "host -1" in result.stdout


def test_launcher_relays_the_workers_death_signal() -> None:
    """It reports a worker killed by a signal as that signal (limits rely on -SIGXCPU)."""
    _require()
    w = WorkerProcess.start(_danger_policy(), UnshareProvider(stack=False))
    try:
        result = w.run("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.kill(libc.getpid(), 24)")
        assert result.error is not None
        assert w.proc is not None and w.proc.wait(10) == -24
    finally:
        w.close()


# -- process C: imports early, runs only after the view is complete ------------------------

# A stand-in for `_worker/boot.py` with the same three stages. `load` and `import_worker`
# run as soon as C exists (before the view); `run` only after B's go. `run` records what
# the worker would start with.
_FAKE_BOOT = r"""
import ctypes, os, sys
def load(fd):
    marker, outside = os.read(fd, 4096).decode().split("\n")
    return {"marker": marker, "outside": outside}
def import_worker(boot):
    pass
def run(boot):
    libc = ctypes.CDLL(None)
    status = open("/proc/self/status").read()
    caps = [l.split()[1] for l in status.splitlines() if l.startswith(("CapEff", "CapBnd"))]
    host_root = os.path.exists(boot["outside"])
    with open(boot["marker"], "w") as out:
        out.write(f"{libc.prctl(27, 0, 0, 0, 0)} {' '.join(caps)} {os.getsid(0) == os.getpid()} "
                  f"{os.getcwd()} {host_root}")
    os._exit(0)
"""


def _run_fake_worker(tmp_path: Path, mounts: list[list[str]]) -> tuple[int, str, Path]:
    shared = tmp_path / "shared"
    shared.mkdir()
    # In the view at the same path, like the real boot script: C may load it only after B
    # pivoted into the view (a loaded machine), where the rest of tmp_path is gone.
    boot_script = shared / "fake_boot.py"
    boot_script.write_text(_FAKE_BOOT)
    marker = shared / "ran"
    outside = tmp_path / "outside.txt"  # on the host, not in the view
    outside.write_text("host only")
    read_end, write_end = os.pipe()
    os.write(write_end, f"{marker}\n{outside}".encode())
    os.close(write_end)
    config = {
        "root": str(tmp_path / "nsroot"),
        "mounts": [
            ["ro", "/usr", "/usr"],
            *(["symlink", p, t] for p, t in sorted(HOST.symlinks.items())),
            ["ro", sys.base_prefix, sys.base_prefix],
            ["dev", "/dev", ""],
            ["proc", "/proc", ""],
            ["tmpfs", "/tmp", ""],
            *mounts,
            ["rw", str(shared), str(shared)],
        ],
        "tmpfs_bytes": 1024 * 1024,
        "net": "none",
        "hostname": "sandbox",
        "cwd": str(shared),
        "boot": [str(boot_script), read_end],
    }
    argv = launcher_argv(os.path.realpath(sys.executable), config)
    try:
        proc = subprocess.run(
            argv, pass_fds=(read_end,), capture_output=True, text=True, timeout=30
        )
    finally:
        os.close(read_end)
    return proc.returncode, proc.stderr, marker


def test_worker_runs_only_inside_the_finished_view_without_privileges(tmp_path: Path) -> None:
    """It starts the worker after the view, in its own session, with locked securebits and
    no capability (C drops them itself, like B)."""
    _require()
    code, err, marker = _run_fake_worker(tmp_path, [])
    assert code == 0, err
    securebits, cap_eff, cap_bnd, own_session, cwd, host_root = marker.read_text().split()
    assert int(securebits) == 0xEF  # NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE, locked
    assert cap_eff == cap_bnd == "0" * 16
    assert own_session == "True" and cwd == str(marker.parent)
    assert host_root == "False"  # it saw the view, not the host


def test_worker_never_runs_when_the_view_fails(tmp_path: Path) -> None:
    """It never runs the worker (only its imports happened) when B cannot build the view."""
    _require()
    code, err, marker = _run_fake_worker(tmp_path, [["ro", "/data/missing", "/no/such/source"]])
    assert code != 0
    assert "set-up failed" in err and "/no/such/source" in err
    assert not marker.exists()
