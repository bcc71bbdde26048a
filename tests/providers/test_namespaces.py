"""Effects of the namespace providers (bwrap, unshare, firejail) on hostile native code.

Each provider runs with `stack=False`, so that the namespace layer alone is judged
(Landlock and seccomp, stacked by default, are judged in test_containment.py). The attacks
use libc through ctypes, so the Python guards are not what refuses them; the verdict comes
from effects: a canary must not appear, a listener must receive nothing, a file must not
exist. Each provider is skipped with its probe's reason where it cannot run.
"""

from __future__ import annotations

import ast
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers._base import Provider
from agent_sandbox.providers._bwrap import BwrapProvider
from agent_sandbox.providers._firejail import FirejailProvider
from agent_sandbox.providers._unshare import UnshareProvider

FACTORIES = {
    "bwrap": "BwrapProvider",
    "unshare": "UnshareProvider",
    "firejail": "FirejailProvider",
}

#: libc through ctypes: no Python-level API (and so no guard) is involved.
NATIVE = r"""
import ctypes, os, struct
_libc = ctypes.CDLL(None, use_errno=True)
def _err():
    return -ctypes.get_errno()
def nread(path):
    fd = _libc.open(path.encode(), os.O_RDONLY, 0)
    if fd < 0:
        return _err()
    buf = ctypes.create_string_buffer(65536)
    n = _libc.read(fd, buf, 65536)
    _libc.close(fd)
    return buf.raw[:max(n, 0)].decode("latin-1")
def ncreate(path):
    fd = _libc.open(path.encode(), os.O_WRONLY | os.O_CREAT, 0o644)
    if fd < 0:
        return _err()
    _libc.write(fd, b"x", 1)
    _libc.close(fd)
    return 0
def _addr(port):
    return struct.pack("=H", 2) + struct.pack("!H4s8x", port, b"\x7f\0\0\1")
def nconnect(port):
    s = _libc.socket(2, 1, 0)
    if s < 0:
        return _err()
    a = _addr(port)
    rc = _libc.connect(s, a, len(a))
    e = _err()
    _libc.close(s)
    return 0 if rc == 0 else e
def npids():
    class D(ctypes.Structure):
        _fields_ = [("ino", ctypes.c_uint64), ("off", ctypes.c_int64),
                    ("reclen", ctypes.c_ushort), ("type", ctypes.c_ubyte),
                    ("name", ctypes.c_char * 256)]
    _libc.opendir.restype = ctypes.c_void_p
    _libc.readdir.restype = ctypes.POINTER(D)
    _libc.readdir.argtypes = [ctypes.c_void_p]
    _libc.closedir.argtypes = [ctypes.c_void_p]
    d = _libc.opendir(b"/proc")
    out = []
    while True:
        e = _libc.readdir(d)
        if not e:
            break
        name = e.contents.name.decode()
        if name.isdigit():
            out.append(int(name))
    _libc.closedir(d)
    return sorted(out)
"""


def make(name: str) -> Provider:
    provider: Provider = {
        "bwrap": BwrapProvider,
        "unshare": UnshareProvider,
        "firejail": FirejailProvider,
    }[name](stack=False)
    return provider


@pytest.fixture(params=sorted(FACTORIES))
def provider_name(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    probe = make(name).probe()
    if not probe.available:
        pytest.skip(f"{name} unavailable here: {probe.reason}")
    return name


def danger_policy(ro: Path, rw: Path, **extra: Any) -> Policy:
    with warnings.catch_warnings():
        # The warning that native-code opens the Python layer is the point of this policy.
        warnings.simplefilter("ignore", UserWarning)
        return Policy(
            name="danger-namespace-test",
            imports={"allow": ["*"]},
            api={"allow": ["native-code", "process-control", "introspection", "deserialization"]},
            code={"enabled": False},
            files={"read": [str(ro)], "write": [str(rw)]},
            limits={"wall_seconds": 20},
            **extra,
        )


@pytest.fixture
def arena(tmp_path: Path) -> dict[str, Path]:
    """A read-only and a writable policy directory and a canary outside both (mode 0777/0644,
    so a denial cannot come from file permissions; root bypasses them anyway)."""
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    for d in (tmp_path, ro, rw):
        d.chmod(0o777)
    canary = tmp_path / "canary.txt"
    canary.write_text("canary-" + secrets.token_hex(8))
    canary.chmod(0o644)
    return {"ro": ro, "rw": rw, "canary": canary, "root": tmp_path}


@pytest.fixture
def worker(provider_name: str, arena: dict[str, Path]) -> Iterator[WorkerProcess]:
    w = WorkerProcess.start(danger_policy(arena["ro"], arena["rw"]), make(provider_name))
    try:
        yield w
    finally:
        w.close()


def run(w: WorkerProcess, code: str) -> str:
    result = w.run(NATIVE + textwrap.dedent(code))
    assert result.error is None, result.error  # the attack ran; only the kernel refused it
    return result.stdout


def test_worker_has_no_capabilities_and_no_new_privs(worker: WorkerProcess) -> None:
    """It denies every capability (effective, permitted, bounding) and sets NoNewPrivs."""
    out = run(worker, "print(nread('/proc/self/status'))")
    status = dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)
    for key in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
        assert status[key].strip() == "0" * 16, key
    assert status["NoNewPrivs"].strip() == "1"


def test_worker_sees_only_its_own_processes(worker: WorkerProcess) -> None:
    """It denies a view of the host's processes: /proc is the new PID namespace's."""
    pids = eval(run(worker, "print(npids())"))
    assert 1 in pids and len(pids) <= 4, pids
    assert max(pids) < 100, pids  # host pids are far larger; these are the namespace's own


def test_host_loopback_listener_receives_nothing(worker: WorkerProcess) -> None:
    """It denies a ctypes TCP connect to a listener on the host's loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        out = run(worker, f"print('rc', nconnect({listener.getsockname()[1]}))")
        with pytest.raises(BlockingIOError):
            listener.accept()
    # The connect was made and refused (-errno), not skipped.
    assert out.split()[:1] == ["rc"] and int(out.split()[1]) < 0, out


def test_blocks_reading_files_outside_the_view(
    worker: WorkerProcess, arena: dict[str, Path]
) -> None:
    """It denies a ctypes read of a canary outside the policy, and of /etc/shadow."""
    canary = arena["canary"].read_text()
    # As a normal user the host cannot read /etc/shadow either: only the canary then measures.
    readable = os.access("/etc/shadow", os.R_OK)
    shadow_head = Path("/etc/shadow").read_text().split(":", 1)[0] + ":" if readable else "\0"
    out = run(
        worker, f"print(repr(nread({str(arena['canary'])!r})))\nprint(repr(nread('/etc/shadow')))"
    )
    assert canary not in out
    assert shadow_head not in out
    # Both reads were made and got nothing: a refusal (-errno), or an empty stand-in.
    outcomes = [ast.literal_eval(line) for line in out.splitlines()]
    assert len(outcomes) == 2 and all(o == "" or (type(o) is int and o < 0) for o in outcomes), out


def test_blocks_writes_outside_scratch_and_write_paths(
    worker: WorkerProcess, arena: dict[str, Path]
) -> None:
    """It denies ctypes writes into a read-only policy dir, /usr and the interpreter prefix."""
    marker = "planted-" + secrets.token_hex(4)
    denied = [arena["ro"] / marker, Path("/usr") / marker, Path(sys.base_prefix) / marker]
    allowed = [arena["rw"] / marker, Path(worker.scratch) / marker]
    out = run(worker, f"for p in {[str(p) for p in denied + allowed]!r}:\n    print(ncreate(p))")
    assert out.split()[-2:] == ["0", "0"]  # the writable places stay writable
    for path in denied:
        assert not path.exists(), path
    # Under bwrap and unshare scratch is a tmpfs of the sandbox's own (`limits.scratch_mb`):
    # the write succeeded (the "0" above) but never reaches the host's disk.
    assert allowed[0].exists(), allowed[0]
    assert allowed[1].exists() == (worker.plan is not None and worker.plan.provider == "firejail")


def test_blocks_remount_and_nested_user_namespaces(
    worker: WorkerProcess, arena: dict[str, Path]
) -> None:
    """It denies remounting a read-only bind writable and creating a nested user namespace."""
    out = run(
        worker,
        f"""
        print("remount", _libc.mount(None, {str(arena["ro"]).encode()!r}, None, 32 | 4096, None))
        print("userns", _libc.unshare(0x10000000))
        print("write", ncreate({str(arena["ro"] / "after-remount")!r}))
        """,
    )
    assert "remount -1" in out
    assert "userns -1" in out
    assert not (arena["ro"] / "after-remount").exists()


def test_dies_with_its_parent(provider_name: str) -> None:
    """It denies the worker outliving its parent: killing the parent ends the sandbox."""
    script = textwrap.dedent(f"""
        import time
        from agent_sandbox import Policy
        from agent_sandbox._host.process import WorkerProcess
        from agent_sandbox.providers._{provider_name} import {FACTORIES[provider_name]} as P
        w = WorkerProcess.start(Policy(name="t"), P(stack=False))
        print(w.scratch, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    scratch = ""
    try:
        assert parent.stdout is not None
        scratch = parent.stdout.readline().strip()
        assert scratch and pids_with_tmpdir(scratch), "the worker should be running"
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while pids_with_tmpdir(scratch) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pids_with_tmpdir(scratch)
    finally:
        parent.kill()
        parent.wait(10)
        for pid in pids_with_tmpdir(scratch) if scratch else []:
            os.kill(pid, signal.SIGKILL)
        if scratch:
            subprocess.run(["rm", "-rf", os.path.dirname(scratch)], check=False)


def test_worker_outlives_the_thread_that_started_it(provider_name: str) -> None:
    """It keeps a session's worker alive after the (pool) thread that started it ended: the
    parent-death signal follows the forking thread, not the process."""
    with Sandbox(Policy(name="t"), provider=provider_name, warm=0) as sb:
        session = sb.session("s")
        first: list[Any] = []
        starter = threading.Thread(target=lambda: first.append(session.run("x = 41")))
        starter.start()
        starter.join(60)
        assert first and first[0].ok
        time.sleep(0.3)  # the signal, if any, arrives at once
        after = session.run("x + 1")
        assert after.value == 42 and not after.state_lost


def pids_with_tmpdir(scratch: str) -> list[int]:
    """Host processes whose environment points TMPDIR at this worker's scratch directory."""
    needle = f"TMPDIR={scratch}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_blocks_reading_denied_paths_inside_a_readable_directory(
    provider_name: str, arena: dict[str, Path]
) -> None:
    """It denies a ctypes read of a `files.deny` file and directory inside a read path."""
    token = "canary-" + secrets.token_hex(8)
    (arena["ro"] / "secret").mkdir()
    (arena["ro"] / "secret" / "key.txt").write_text(token)
    (arena["ro"] / "hidden.txt").write_text(token)
    (arena["ro"] / "visible.txt").write_text("visible")
    deny = [str(arena["ro"] / "secret"), str(arena["ro"] / "hidden.txt")]
    policy = danger_policy(arena["ro"], arena["rw"])
    policy = policy.model_copy(
        update={"files": policy.files.model_copy(update={"deny": tuple(deny)})}
    )
    w = WorkerProcess.start(policy, make(provider_name))
    try:
        out = run(
            w,
            f"""
            for name in ("secret/key.txt", "hidden.txt", "visible.txt"):
                print(name, repr(nread({str(arena["ro"])!r} + "/" + name)))
            """,
        )
    finally:
        w.close()
    assert token not in out
    assert "'visible'" in out  # the rest of the directory stays readable


def test_wall_timeout_leaves_no_process_behind(provider_name: str, arena: dict[str, Path]) -> None:
    """It ends a worker spinning past its wall time, and nothing of its sandbox remains."""
    policy = danger_policy(arena["ro"], arena["rw"])
    policy = policy.model_copy(
        update={"limits": policy.limits.model_copy(update={"wall_seconds": 1.0})}
    )
    w = WorkerProcess.start(policy, make(provider_name))
    scratch = w.scratch
    try:
        assert pids_with_tmpdir(scratch)
        result = w.run("while True:\n    pass")
        assert result.error is not None and result.error.rule == "limits.timeout"
    finally:
        w.close()
    deadline = time.monotonic() + 5
    while pids_with_tmpdir(scratch) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids_with_tmpdir(scratch)
