"""The Landlock provider: the pure ruleset builder, compared exactly, and the kernel effects."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, ProviderUnavailable
from agent_sandbox._hints import METADATA_REFUSED
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox._host.setup_checks import verify_checks
from agent_sandbox.providers import ProbeResult, WorkerSpec, select_provider
from agent_sandbox.providers._landlock import (
    LandlockProvider,
    _elf_interpreter,
    _libpython,
    landlock_abi,
    landlock_setup,
    probe_landlock,
)

PY = os.path.realpath(sys.executable)
LOADER = os.path.realpath(_elf_interpreter(PY))
LIBPY = _libpython()


def _spec(**changes: Any) -> WorkerSpec:
    fields: dict[str, Any] = {
        "python": PY,
        "boot_script": "/src/agent_sandbox/_worker/boot.py",
        "scratch": "/run/ctl/scratch",
        "control_dir": "/run/ctl",
        "listen_fd": 5,
        "boot_fd": 6,
        "sys_path": ("/opt/py/lib/python3.11", "/opt/py/lib/python3.11/lib-dynload"),
        "package_dirs": {"agent_sandbox": "/src/agent_sandbox", "agent_sandbox.guards": "/src/g"},
        "env": {},
        "prefix": "/opt/py",
        "base_prefix": "/opt/py",
    }
    fields.update(changes)
    return WorkerSpec(**fields)


def _base_paths() -> dict[str, str]:
    paths = {
        PY: "rx",
        LOADER: "rx",
        "/opt/py/lib/python3.11": "ro",
        "/opt/py/lib/python3.11/lib-dynload": "ro",
        "/src/agent_sandbox": "ro",
        "/src/agent_sandbox/_worker": "ro",  # the boot script's folder
        "/src/g": "ro",
        "/usr/lib": "ro",
        "/dev/null": "dev-rw",
        "/dev/random": "dev-ro",
        "/dev/urandom": "dev-ro",
        "/dev/zero": "dev-ro",
        "/etc/localtime": "ro",
        "/usr/share/zoneinfo": "ro",
        "/run/ctl/scratch": "rw",
    }
    if LIBPY:
        paths[LIBPY] = "ro"
    return paths


def _as_rules(paths: dict[str, str]) -> list[list[str]]:
    return [[p, paths[p]] for p in sorted(paths)]


def test_builder_output_for_a_pure_computation_policy_is_exact() -> None:
    """It grants the interpreter's closure, the devices and scratch, and nothing else."""
    setup = landlock_setup(Policy(name="p"), _spec())
    assert setup == {
        "min_abi": 4,
        "paths": _as_rules(_base_paths()),
        "tcp_connect": [],
        "tcp_bind": [],
        "scope": ["abstract_unix", "signal"],
        "notes": [],
    }


def test_builder_adds_policy_paths_globs_and_scratch_aliases() -> None:
    """It grants a glob's directory, maps $SCRATCH, and gives write paths rw."""
    policy = Policy(
        name="p",
        files={
            "read": ["/data/**", "/srv/in/*.csv", "/etc/app.toml"],
            "write": ["$SCRATCH/out", "/srv/out"],
        },
    )
    paths = _base_paths()
    paths.update(
        {
            "/data": "ro",
            "/srv/in": "ro",
            "/etc/app.toml": "ro",
            "/run/ctl/scratch/out": "rw",
            "/srv/out": "rw",
        }
    )
    assert landlock_setup(policy, _spec())["paths"] == _as_rules(paths)


def test_builder_never_grants_all_of_etc_tmp_proc_or_sys() -> None:
    """It grants no broad system directory even with network and process-exec granted."""
    policy = Policy(
        name="p",
        api={"allow": ["process-exec"]},
        net={"rules": [{"host": "127.0.0.1", "ports": "8000"}]},
    )
    granted = [p for p, _ in landlock_setup(policy, _spec())["paths"]]
    for broad in ("/", "/etc", "/tmp", "/proc", "/sys", "/dev", "/usr", "/root", "/home"):
        assert broad not in granted
    assert not any(p.startswith(("/proc", "/sys", "/dev/shm")) for p in granted)
    etc = sorted(p for p in granted if p.startswith("/etc/"))
    assert "/etc/hosts" in etc and "/etc/shadow" not in etc and "/etc/passwd" not in etc
    plain = [p for p, _ in landlock_setup(Policy(name="p"), _spec())["paths"]]
    assert [p for p in plain if p.startswith("/etc")] == ["/etc/localtime"]


def test_execute_only_on_the_interpreter_and_its_loader_by_default() -> None:
    """It grants EXECUTE on the interpreter and ld.so only, unless process-exec is granted."""
    rx = {p for p, a in landlock_setup(Policy(name="p"), _spec())["paths"] if a == "rx"}
    assert rx == {PY, LOADER}
    granted = Policy(name="p", api={"allow": ["process-exec"]})
    rx = {p for p, a in landlock_setup(granted, _spec())["paths"] if a == "rx"}
    assert rx == {PY, LOADER, "/usr/bin", "/usr/local/bin"}


def test_tcp_ports_follow_allow_and_deny_rules() -> None:
    """It opens the allowed TCP ports per direction, minus a deny for any host."""
    policy = Policy(
        name="p",
        net={
            "rules": [
                {"host": "127.0.0.1", "ports": "8000-8002"},
                {"host": "10.0.0.0/8", "ports": "9000", "direction": "bind"},
                {"host": "*", "ports": "8001", "action": "deny"},
                {"host": "127.0.0.1", "ports": "53", "protocol": "udp"},
            ]
        },
    )
    setup = landlock_setup(policy, _spec())
    assert (setup["tcp_connect"], setup["tcp_bind"]) == ([8000, 8002], [9000])


def test_a_huge_port_range_leaves_tcp_unhandled_and_says_so() -> None:
    """It leaves TCP connect unfiltered (and notes why) rather than add 65535 rules."""
    policy = Policy(name="p", net={"rules": [{"host": "example.org", "ports": "1-65535"}]})
    setup = landlock_setup(policy, _spec())
    assert setup["tcp_connect"] is None and setup["tcp_bind"] == []
    assert setup["notes"] == [
        "TCP connect is not filtered by Landlock: the policy allows more than 1024 ports"
    ]


def test_view_maps_host_paths_to_in_sandbox_paths() -> None:
    """It rewrites paths through a namespace provider's view (longest prefix wins)."""
    view = {"/run/ctl/scratch": "/scratch", "/opt/py": "/opt/py", "/data": "/mnt/data"}
    policy = Policy(name="p", files={"read": ["/data/sub"]})
    paths = dict(map(tuple, landlock_setup(policy, _spec(), view=view)["paths"]))
    assert paths["/scratch"] == "rw" and "/run/ctl/scratch" not in paths
    assert paths["/mnt/data/sub"] == "ro"


def test_provider_build_carries_landlock_seccomp_and_privilege_drop() -> None:
    """It plans NO_NEW_PRIVS, the capability drop, Landlock and a seccomp program."""
    plan = LandlockProvider().build(Policy(name="p", visible_names="accepted"), _spec())
    assert plan.provider == "landlock" and plan.stack == ("landlock", "seccomp")
    assert plan.argv == (PY, "-I", "-S", "-B", "/src/agent_sandbox/_worker/boot.py", "6")
    assert sorted(plan.worker_setup) == [
        "drop_caps",
        "landlock",
        "no_new_privs",
        "scratch_tmpfs",  # as root and as another user (then in a user namespace)
        "seccomp",
        "seccomp_exec",
    ]
    assert plan.worker_setup["scratch_tmpfs"] == {
        "path": "/run/ctl/scratch",
        "bytes": 512 * 1024 * 1024,
        **({"user_ns": True} if os.geteuid() != 0 else {}),
    }
    assert plan.pass_fds == (5, 6)
    assert plan.worker_setup["seccomp"]["metadata"] is True  # its second layer (_matrix)


def test_provider_build_refuses_a_policy_that_does_not_accept_visible_names() -> None:
    """It builds no plan for a policy without `visible_names = "accepted"` (Landlock cannot
    hide names), whoever calls it (`auto` does, for a policy that named no provider)."""
    with pytest.raises(ProviderUnavailable, match=r"\[files\]: Landlock cannot hide") as info:
        LandlockProvider().build(Policy(name="p"), _spec())
    assert 'visible_names = "accepted"' in str(info.value)


def test_verify_checks_refuses_a_worker_whose_report_lacks_a_restriction() -> None:
    """It names each restriction the worker's handshake does not confirm."""
    setup = {"no_new_privs": True, "drop_caps": True, "landlock": {"x": 1}, "seccomp": {"bpf": ""}}
    good = {
        "no_new_privs": 1,
        "threads": 1,
        "cap_eff": "0" * 16,
        "landlock": {"enforced": True},
        "seccomp": 2,
    }
    assert verify_checks(setup, good) == []
    bad = {"no_new_privs": 0, "threads": 2, "cap_eff": "000001fffeffffff", "seccomp": 0}
    assert verify_checks(setup, bad) == [
        "NO_NEW_PRIVS is not set",
        "it was not single-threaded when it restricted itself",
        "it kept capabilities (CapEff 000001fffeffffff)",
        "Landlock is not enforced",
        "seccomp mode is 0, not a filter",
    ]


def test_the_parent_and_the_worker_name_the_same_kernel_steps() -> None:
    """It keeps the host's copy of the `worker_setup` keys that ask for a kernel step equal
    to the worker's (the host imports nothing of the worker side, so it holds its own)."""
    from agent_sandbox._host import setup_checks
    from agent_sandbox._worker import _inworker

    assert setup_checks._KERNEL_KEYS == _inworker._KERNEL_KEYS
    assert setup_checks._SECCOMP_MODE_FILTER == _inworker._SECCOMP_MODE_FILTER


def test_explicit_landlock_that_cannot_run_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """It raises ProviderUnavailable naming the reason, never a silent downgrade."""
    monkeypatch.setattr(
        LandlockProvider, "probe", lambda self: ProbeResult("landlock", False, reason="no ABI 4")
    )
    with pytest.raises(ProviderUnavailable, match="no ABI 4"):
        select_provider("landlock")


def test_non_root_landlock_without_user_namespaces_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It refuses landlock for a non-root user where the scratch tmpfs cannot be mounted
    (limits.scratch_mb would go unenforced), naming the setting and the alternatives."""
    from agent_sandbox.providers import _landlock

    monkeypatch.setattr(_landlock.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(_landlock, "probe_landlock", lambda: ProbeResult("landlock", True))
    monkeypatch.setattr(_landlock, "probe_user_tmpfs", lambda: "unshare: Operation not permitted")
    result = LandlockProvider().probe()
    assert not result.available
    for words in ("limits.scratch_mb", "Operation not permitted", "root", "bwrap"):
        assert words in result.reason, result.reason


def test_setup_refuses_a_process_that_already_has_a_thread(tmp_path: Path) -> None:
    """It refuses to restrict a process with a second thread (that thread would stay free)."""
    # The thread waits for ever (not a fixed sleep: an import slower than the sleep, as for
    # a user who cannot write the checkout's bytecode caches, would let it end first).
    code = (
        "import threading\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "from agent_sandbox._worker._inworker import apply_worker_setup\n"
        "apply_worker_setup({'no_new_privs': True})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "2 threads" in proc.stderr


# -- kernel effects ----------------------------------------------------------------------


@pytest.fixture
def landlock() -> ProbeResult:
    result = probe_landlock()
    if not result.available:
        pytest.skip(f"landlock unavailable here: {result.reason}")
    return result


def test_handshake_reports_what_the_kernel_enforces(landlock: ProbeResult) -> None:
    """It reports NoNewPrivs, an empty CapEff, the Landlock ABI and seccomp filter mode."""
    worker = WorkerProcess.start(Policy(name="p", visible_names="accepted"), LandlockProvider())
    try:
        checks = worker.hello["checks"]
    finally:
        worker.close()
    assert checks["no_new_privs"] == 1 and checks["threads"] == 1
    assert checks["cap_eff"] == "0" * 16
    assert checks["landlock"]["enforced"] is True
    assert checks["landlock"]["abi"] == landlock.details["abi"]
    assert checks["seccomp"] == 2


def test_tcp_bind_only_to_the_policys_port_and_no_connect(
    landlock: ProbeResult, arena: Any, hostile: Any, make_policy: Any, is_received: Any
) -> None:
    """ctypes may listen on the port a `host = "*"` bind rule opens, not on the next one, and
    connects nowhere (a connect rule would be port-only here, so it is refused at build:
    tests/providers/test_enforceable.py)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        allowed = probe.getsockname()[1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        other = probe.getsockname()[1]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    policy = make_policy(
        arena, net={"rules": [{"host": "*", "ports": str(allowed), "direction": "bind"}]}
    )
    code = (
        "def nbind(port):\n"
        "    s = _libc.socket(2, 1, 0)\n"
        "    a = struct.pack('=H', 2) + struct.pack('!H4s8x', port, bytes([127, 0, 0, 1]))\n"
        "    r = _libc.bind(s, a, len(a))\n"
        "    return r if r == 0 else _err()\n"
        f"print(nbind({allowed}), nbind({other}), "
        f"nconnect_tcp({listener.getsockname()[1]}))"
    )
    try:
        result = hostile("landlock", policy, code)
        assert result.error is None, result.error
        bound, refused, connect = result.stdout.strip().split(" ", 2)
        assert bound == "0" and refused == "-13", result.stdout
        assert "-13" in connect and not is_received(listener), result.stdout
    finally:
        listener.close()


def test_blocks_signalling_a_process_outside_the_sandbox(
    landlock: ProbeResult, arena: Any, hostile: Any, make_policy: Any
) -> None:
    """It denies kill() of a host process (Landlock signal scope, ABI 6)."""
    if landlock.details["abi"] < 6:
        pytest.skip("Landlock ABI < 6: signals are not scoped")
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = f"print(_libc.kill({victim.pid}, {int(signal.SIGKILL)}), _err())"
        hostile("landlock", make_policy(arena), code)
        time.sleep(0.05)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_denies_root_capability_tricks(
    landlock: ProbeResult, arena: Any, hostile: Any, make_policy: Any
) -> None:
    """It denies mknod of a block device in scratch, chroot and a raw packet socket."""
    node = arena["rw"] / "sda"
    code = f"""
import stat
print(_libc.mknod({str(node).encode()!r}, stat.S_IFBLK | 0o600, os.makedev(8, 0)), _err())
print(_libc.chroot(b"/"), _err())
print(_libc.socket(17, 3, 0), _err())
"""
    result = hostile("landlock", make_policy(arena), code)
    assert not node.exists()
    lines = [line.split()[0] for line in result.stdout.splitlines()]
    assert lines == ["-1", "-1", "-1"], result.stdout


def test_doctor_reports_providers_abi_and_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    """It lists every provider with its availability or reason, and the Landlock ABI."""
    from agent_sandbox._tools.cli import main
    from agent_sandbox._tools.cli_doctor import collect

    report = collect()
    names = {p["name"] for p in report["providers"]}
    assert {"subprocess", "landlock"} <= names
    assert all(p["available"] or p["reason"] for p in report["providers"])
    probe = probe_landlock()
    assert report["landlock"]["abi"] == probe.details.get("abi", 0)
    status = main(["doctor", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["landlock"] == report["landlock"]
    assert status == (
        0 if any(p["available"] for p in report["providers"] if p["name"] != "subprocess") else 1
    )


def test_landlock_without_a_seccomp_filter_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """It refuses to run Landlock alone when the seccomp filter cannot be built (fail closed)."""
    from agent_sandbox.providers import _seccomp

    if not probe_landlock().available:
        pytest.skip(probe_landlock().reason)
    monkeypatch.setattr(_seccomp, "probe_seccomp", lambda: (False, "no libseccomp here"))
    result = LandlockProvider().probe()
    assert not result.available and result.reason == "no libseccomp here"


def test_private_dirs_of_a_namespace_provider_are_writable_as_given() -> None:
    """It grants a namespace provider's private tmpfs (e.g. /dev/shm) read-write, unmapped."""
    view = {"/run/ctl/scratch": "/scratch"}
    paths = dict(
        map(
            tuple,
            landlock_setup(Policy(name="p"), _spec(), view=view, private_dirs=["/dev/shm"])[
                "paths"
            ],
        )
    )
    assert paths["/dev/shm"] == "rw"
    assert "/dev/shm" not in dict(map(tuple, landlock_setup(Policy(name="p"), _spec())["paths"]))


@pytest.mark.parametrize("entry", ["/", "/proc", "/proc/self/environ", "/sys/fs/cgroup", "/s*"])
def test_a_policy_path_reaching_proc_or_sys_is_refused_under_landlock_alone(entry: str) -> None:
    """It refuses a read grant that would include /proc or /sys (the parent's environ)."""
    from agent_sandbox import PolicyError

    with pytest.raises(PolicyError, match="Landlock alone"):
        landlock_setup(Policy(name="p", files={"read": [entry]}), _spec())
    inside = landlock_setup(Policy(name="p", files={"read": [entry]}), _spec(), view={})
    assert inside["paths"]  # a namespace provider's own /proc is its business


def test_blocks_opening_device_nodes_beyond_null_zero_and_random(
    landlock: ProbeResult, arena: Any, hostile: Any, make_policy: Any
) -> None:
    """It denies opening /dev/full, /dev/tty and /dev/kmsg for writing (only /dev/null is)."""
    code = (
        "print([nopen(d, os.O_WRONLY) < 0 for d in ('/dev/full', '/dev/tty', '/dev/kmsg')],"
        " nopen('/dev/null', os.O_WRONLY) >= 0)"
    )
    result = hostile("landlock", make_policy(arena), code)
    assert result.stdout.strip() == "[True, True, True] True", result.stdout


def test_doctor_says_whether_landlock_denials_reach_results_here() -> None:
    """It reports whether Landlock's denial records are readable (audit on, ABI 7) and why
    not, asking the kernel only: a second probe sees the same audit state."""
    from agent_sandbox._host.denial_log import probe_denial_logging

    first = probe_denial_logging(landlock_abi())
    assert first["works"] is bool(first["audit_enabled"]) and first["reason"]
    assert probe_denial_logging(landlock_abi())["audit_enabled"] == first["audit_enabled"]
    assert probe_denial_logging(6)["reason"] == "Landlock ABI 6 < 7"


_METADATA_CODE = r"""
import json, os, shutil, stat, sys, tarfile, io
out = {}
with open("a.txt", "w") as fh:
    fh.write("x")
def t(name, f):
    try:
        f()
        out[name] = "ok"
    except PermissionError as exc:
        out[name] = "PermissionError"
t("copyfile", lambda: shutil.copyfile("a.txt", "b.txt"))
t("copy", lambda: shutil.copy("a.txt", "c.txt"))
t("copy2", lambda: shutil.copy2("a.txt", "d.txt"))
t("chmod", lambda: os.chmod("a.txt", 0o600))
t("utime", lambda: os.utime("a.txt", ns=(1_000_000_000, 2_000_000_000)))
out["mode"] = oct(stat.S_IMODE(os.stat("a.txt").st_mode))
out["mtime"] = os.stat("a.txt").st_mtime_ns
# Refused still: a setuid bit, a link out of scratch to a read-granted file, a descriptor.
t("setuid", lambda: os.chmod("a.txt", 0o4755))
os.symlink(sys.executable, "link")
t("link-out", lambda: os.chmod("link", 0o777))
fd = os.open("a.txt", os.O_RDONLY)
t("fchmod", lambda: os.fchmod(fd, 0o644))
def tar(mode, extra):
    buf = io.BytesIO()
    info = tarfile.TarInfo("a.txt")
    info.size, info.mode, info.mtime = 1, mode, 12345
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.addfile(info, io.BytesIO(b"x"))
    buf.seek(0)
    folder = "x%o" % mode
    with tarfile.open(fileobj=buf) as tf:
        tf.extractall(folder, **extra)
    st = os.stat(folder + "/a.txt")
    return oct(stat.S_IMODE(st.st_mode)), int(st.st_mtime)
# (`filter` exists from 3.11.4; Debian's 3.11.2 extracts without it)
data = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
out["tar"] = tar(0o640, data)
out["tar-setuid"] = tar(0o4755, trusted)
print(json.dumps(out))
"""


def test_metadata_changes_in_scratch_are_made_by_the_host_and_refused_elsewhere(
    landlock: ProbeResult,
) -> None:
    """It lets chmod, utime, shutil.copy and copy2 and tarfile's extraction set modes and
    times in scratch under the landlock provider (the host makes them beneath its own
    descriptor of scratch: the worker's seccomp filter refuses them), and refuses, as
    `files.metadata` with the host's hint, a setuid bit, a link out of scratch to a
    read-granted file and a descriptor's fchmod; a setuid mode tarfile swallowed is the
    user's refusal (its file lacks the archive's mode)."""
    from agent_sandbox import Sandbox

    policy = Policy(
        name="p",
        provider="landlock",
        visible_names="accepted",
        imports={"allow": ["json", "os", "shutil", "stat", "sys", "tarfile", "io"]},
    )
    with Sandbox(policy, warm=0) as sandbox:
        result = sandbox.run(_METADATA_CODE)
    assert result.error is None, result.error
    out = json.loads(result.stdout)
    assert out == {
        "copyfile": "ok",
        "copy": "ok",
        "copy2": "ok",
        "chmod": "ok",
        "utime": "ok",
        "mode": "0o600",
        "mtime": 2_000_000_000,
        "setuid": "PermissionError",
        "link-out": "PermissionError",
        "fchmod": "PermissionError",
        "tar": ["0o640", 12345],
        "tar-setuid": out["tar-setuid"],
    }
    # (tarfile goes on past the refused chmod without setting the times either)
    assert out["tar-setuid"][0] != "0o4755"
    meta = [d for d in result.denials if d.rule == "files.metadata"]
    assert {d.action for d in meta} >= {"chmod", "fchmod"}
    assert all(d.hint == METADATA_REFUSED for d in meta), meta
    [setuid] = [d for d in meta if d.target == "a.txt"]
    assert "setuid" in setuid.detail, setuid
    [fchmod] = [d for d in meta if d.action == "fchmod"]
    assert "Landlock" in fchmod.detail and "unverified" not in fchmod.detail, fchmod
    # The link leads to a file outside the write grants: refused as a write, before any
    # question of metadata.
    [link] = [d for d in result.denials if d.rule == "files.write"]
    assert "requested as 'link'" in link.detail, link
    # tarfile swallowed its refused chmod and extracted without the archive's mode: what the
    # code got changed, so it is the user's, not internal.
    tar = [d for d in meta if "x4755" in d.target]
    assert tar and not any(d.internal for d in tar), meta
    assert not [d for d in result.internal_denials() if d.rule == "files.metadata"]
