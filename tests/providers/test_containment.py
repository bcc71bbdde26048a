"""The containment matrix: hostile native code against every kernel provider.

Each attack uses ctypes (or a raw `posix`/`_posixsubprocess` entry point) so the Python
guards are not what stops it; the verdict comes from effects only: a canary must not
appear in the output, a listener must receive no connection, a file must not exist. The
control test at the end shows the same attacks succeed without a kernel boundary, so a
pass here is not an artefact of the harness.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox._host.limits import cgroup_support
from tests.providers.conftest import (
    KERNEL_PROVIDERS,
    QEMU_MEMORY_MB,
    hostile_policy,
    skip_unless_available,
)


@pytest.fixture(params=(*KERNEL_PROVIDERS, "qemu"))
def kernel_provider(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel provider in turn, and `qemu` with the session's one image and template
    (`qemu_cache`); skipped with the probe's reason where one cannot run here."""
    name = str(request.param)
    if name == "qemu":
        monkeypatch.setenv("XDG_CACHE_HOME", request.getfixturevalue("qemu_cache"))
    skip_unless_available(name)
    return name


@pytest.fixture
def make_policy(kernel_provider: str) -> Any:
    """The hostile policy; under qemu without host write paths (the VM's only writable
    place is its own scratch: a grant outside it is refused at construction) and with a
    memory limit the session's template can hold (a smaller limit is the guest's memory
    cgroup in the same template; a larger one would boot a template of its own)."""
    if kernel_provider != "qemu":
        return hostile_policy

    def vm_policy(arena: dict[str, Path], **overrides: Any) -> Any:
        files = {"write": [], **overrides.pop("files", {})}
        limits = {"memory_mb": QEMU_MEMORY_MB, **overrides.pop("limits", {})}
        limits["memory_mb"] = min(int(limits["memory_mb"]), QEMU_MEMORY_MB)
        return hostile_policy(arena, files=files, limits=limits, **overrides)

    return vm_policy


def _under_qemu(
    request: pytest.FixtureRequest, provider: str, reason: str, *, gap: bool = False
) -> None:
    """Where the VM serves a test differently: a gap is a strict xfail with the reason
    (documented in docs/providers.md, qemu); anything else skips, naming where it is tested."""
    if provider != "qemu":
        return
    if gap:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason))
    else:
        pytest.skip(reason)


def _under_gvisor(
    request: pytest.FixtureRequest, provider: str, reason: str, *, gap: bool = False
) -> None:
    """Where gVisor serves a test differently: a gap is a strict xfail (an AssertionError)
    with the reason (documented in docs/providers.md, gvisor); anything else skips."""
    if provider != "gvisor":
        return
    if gap:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason))
    else:
        pytest.skip(reason)


def _output(result: Any) -> str:
    return f"{result.stdout}\n{result.stderr}\n{result.value!r}\n{result.error!r}"


def _refused(result: Any) -> int:
    """The errno the kernel refused the attack's one native call with: the call ran to its
    end (the attack was made, `result.error` is None) and got -errno, not data or 0."""
    assert result.error is None, _output(result)  # the attack ran; only the kernel refused it
    lines = result.stdout.strip().splitlines()
    assert lines, _output(result)  # the attack reported its outcome
    outcome = ast.literal_eval(lines[-1])
    if isinstance(outcome, tuple):  # ("socket" | "connect", -errno)
        outcome = outcome[1]
    assert isinstance(outcome, int) and outcome < 0, _output(result)
    return -outcome


def _reported(result: Any, count: int) -> list[str]:
    """The `count` lines an attack printed after each of its steps: the code ran to its end
    (`result.error` is None), so an attack that never ran (a refused import, a changed
    signature, a typo) fails here instead of passing as "blocked"."""
    assert result.error is None, _output(result)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == count, _output(result)
    return lines


def test_blocks_native_read_of_a_tmp_canary_outside_scratch(
    kernel_provider: str, arena: dict[str, Path], canary: str, hostile: Any, make_policy: Any
) -> None:
    """It denies a ctypes read of a canary file in /tmp outside scratch and the policy."""
    result = hostile(
        kernel_provider, make_policy(arena), f"print(repr(nread({str(arena['outside'])!r})))"
    )
    assert canary not in _output(result)
    assert _refused(result) in (13, 2), _output(result)  # EACCES, or not in the worker's view


def test_allows_native_read_inside_the_policy(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It allows a ctypes read of a file under `files.read` (the rules are not all-deny)."""
    result = hostile(
        kernel_provider, make_policy(arena), f"print(nread({str(arena['ro'] / 'data.txt')!r}))"
    )
    assert "readable data" in result.stdout


def test_blocks_reading_etc_shadow(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It denies a ctypes read of /etc/shadow (root owns it, so permissions do not stop root)."""
    if not os.access("/etc/shadow", os.R_OK):
        pytest.skip("not root: permissions, not the sandbox, keep /etc/shadow unreadable")
    first = Path("/etc/shadow").read_text().split(":", 1)[0] + ":"
    result = hostile(kernel_provider, make_policy(arena), "print(repr(nread('/etc/shadow')))")
    assert first not in result.stdout
    assert _refused(result) in (13, 2), _output(result)


def test_blocks_reading_a_host_processs_environ(
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
    environ_canary: tuple[int, str],
) -> None:
    """It denies reading /proc/<pid>/environ of a host process, where the host's secrets
    live (a process started with a canary in its environment; the control test below reads
    the same canary without a kernel boundary)."""
    pid, value = environ_canary
    result = hostile(
        kernel_provider, make_policy(arena), f"print(repr(nread('/proc/{pid}/environ')))"
    )
    assert value not in _output(result)
    # EACCES (Landlock), ENOENT (the pid is not in the worker's pid namespace or VM).
    assert _refused(result) in (13, 2), _output(result)


def test_blocks_writing_into_a_read_only_directory(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It denies a ctypes write into a directory the policy declares read-only."""
    target = arena["ro"] / "planted.py"
    result = hostile(kernel_provider, make_policy(arena), f"print(nwrite({str(target)!r}))")
    assert not target.exists()
    assert _refused(result) in (13, 30, 2), _output(result)  # EACCES, EROFS, not in the view


def test_blocks_writing_outside_the_policy(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It denies a ctypes write into /tmp outside scratch and the policy's write paths."""
    target = arena["root"] / "planted.txt"
    result = hostile(kernel_provider, make_policy(arena), f"print(nwrite({str(target)!r}))")
    assert not target.exists()
    if kernel_provider in ("qemu", "gvisor"):
        # What stops it is the VM or gVisor's own kernel: the path's folder exists only in the
        # sandbox's own file system (the guest's, or gVisor's in-memory one around the
        # mounts), so the write may land there; the host's file system never sees it.
        assert result.error is None and result.stdout.split()[-1:] == ["0"], _output(result)
    else:
        assert _refused(result) in (13, 30, 2), _output(result)


def test_allows_writing_scratch_and_policy_write_paths(
    request: pytest.FixtureRequest,
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
) -> None:
    """It allows writes into scratch and into `files.write` (the rules are not all-deny)."""
    _under_qemu(
        request,
        kernel_provider,
        "qemu serves no host write path (refused at "
        "construction: test_what_the_vm_cannot_serve_is_refused_at_construction)",
    )
    target = arena["rw"] / "ok.txt"
    code = f"print(nwrite('in-scratch.txt'), nwrite({str(target)!r}))"
    result = hostile(kernel_provider, make_policy(arena), code)
    assert result.stdout.split() == ["0", "0"], _output(result)
    assert target.read_bytes() == b"pwned"


def test_blocks_ctypes_tcp_connect(
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
    tcp_listener: Any,
    is_received: Any,
) -> None:
    """It denies a ctypes TCP connect to a loopback listener when the policy has no network."""
    sock, port = tcp_listener
    result = hostile(kernel_provider, make_policy(arena), f"print(nconnect_tcp({port}))")
    assert not is_received(sock)
    # EACCES/EPERM (Landlock, seccomp), ECONNREFUSED (the namespace's own loopback),
    # ENETUNREACH (no interface at all).
    assert _refused(result) in (13, 1, 111, 101), _output(result)


def test_blocks_another_processes_abstract_unix_socket(
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
    abstract_listener: Any,
    is_received: Any,
) -> None:
    """It denies connecting to an abstract Unix socket another process listens on."""
    sock, name = abstract_listener
    result = hostile(kernel_provider, make_policy(arena), f"print(nconnect_abstract({name!r}))")
    assert not is_received(sock)
    # EPERM (seccomp, Landlock's scoping), ECONNREFUSED (another network namespace's names).
    assert _refused(result) in (1, 13, 111), _output(result)


def test_blocks_posix_system(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It denies `posix.system` and libc `system` (no exec of /bin/sh) without process-exec."""
    markers = [arena["rw"] / "posix-system-ran", arena["rw"] / "libc-system-ran"]
    code = f"""
import posix
try:
    print(posix.system('echo ran > {markers[0]}'))
except Exception as exc:
    print('refused', type(exc).__name__)
print(_libc.system(b'echo ran > {markers[1]}'))
"""
    result = hostile(kernel_provider, make_policy(arena), code)
    assert [m.exists() for m in markers] == [False, False], _output(result)
    # Both calls were made, and each failed: a refusal, or a nonzero status (the shell
    # could not run).
    posix_line, libc_line = _reported(result, 2)
    assert posix_line.startswith("refused ") or int(posix_line) != 0, _output(result)
    assert int(libc_line) != 0, _output(result)


def test_blocks_ctypes_execve(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It denies a ctypes execv of /bin/sh in a forked child."""
    marker = arena["rw"] / "execve-ran"
    code = f"""
pid = os.fork()
if pid == 0:
    argv = (ctypes.c_char_p * 4)(b"sh", b"-c", b"echo ran > {marker}", None)
    _libc.execv(b"/bin/sh", argv)
    os._exit(42)
print(os.waitpid(pid, 0)[1] >> 8)
"""
    result = hostile(kernel_provider, make_policy(arena), code)
    assert not marker.exists(), _output(result)
    assert result.stdout.strip() == "42", _output(result)


#: `_posixsubprocess.fork_exec` called directly (the C entry point under subprocess), so no
#: Python-level wrapper of subprocess is involved. The arguments follow CPython 3.11.
_FORK_EXEC = """
import _posixsubprocess
r, w = os.pipe()
try:
    pid = _posixsubprocess.fork_exec(
        [b"/bin/sh", b"-c", b"echo ran > {marker}"], [b"/bin/sh"], True, (w,), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
    os.close(w)
    print("child", os.waitpid(pid, 0)[1] >> 8, os.read(r, 200))
except OSError as exc:
    print("refused", exc.errno)
"""


def test_blocks_posixsubprocess_fork_exec(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It denies `_posixsubprocess.fork_exec` (what subprocess uses) of /bin/sh."""
    marker = arena["rw"] / "fork-exec-ran"
    result = hostile(kernel_provider, make_policy(arena), _FORK_EXEC.format(marker=marker))
    assert not marker.exists(), _output(result)
    # The call was made: refused with an errno, or its child failed to run the shell.
    (line,) = _reported(result, 1)
    assert line.startswith(("refused ", "child ")), _output(result)
    assert not line.startswith("child 0 "), _output(result)


def test_bounded_fork_bomb_ends_within_the_limit(
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
) -> None:
    """It ends a fork bomb at `limits.processes`, reports it, and leaves no process behind.

    Under qemu the guest's pids cgroup ends it; the guest agent's count is the denial's
    source, which says it is the worker side's word (unverified). Under gvisor gVisor's
    kernel ends it at RLIMIT_NPROC; the worker's count of the sandbox's processes where the
    call ends is the denial's source, also the worker side's word."""
    if kernel_provider != "qemu" and not cgroup_support()["processes"]:
        pytest.skip("no pids cgroup here: RLIMIT_NPROC does not bound uid 0")
    code = """
import time
pids = []
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        _libc.prctl(15, b"forkbomb-child", 0, 0, 0)  # PR_SET_NAME: findable from the host
        time.sleep(60)
        os._exit(0)
    pids.append(pid)
pids
"""
    result = hostile(kernel_provider, make_policy(arena, limits={"processes": 8}), code)
    pids = result.value or []
    assert 0 < len(pids) <= 8
    assert "limits.processes" in [d.rule for d in result.denials]
    if kernel_provider == "qemu":
        [denial] = [d for d in result.denials if d.rule == "limits.processes"]
        assert "guest agent reported" in denial.detail and "unverified" in denial.detail
    # The worker was replaced and its whole cgroup killed: none of the children remain.
    # Found by name: inside a PID namespace the pids above are not the host's.
    alive = [pid for pid in _pids_named("forkbomb-child") if _not_zombie(pid)]
    assert alive == [], alive
    assert subprocess.run(["true"], check=False).returncode == 0  # the machine still forks


def _pids_named(comm: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/comm").read_text().strip() == comm:
                out.append(int(entry))
        except OSError:
            continue
    return out


def _not_zombie(pid: int) -> bool:
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False


def test_memory_balloon_ends_within_the_limit(
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
) -> None:
    """It stops a memory balloon spread over children at `limits.memory` and reports it.

    Under qemu two bounds hold: the host's memory cgroup around QEMU (the guest's RAM as
    QEMU holds it, plus QEMU itself: a hit there ends the VM and is the host's own fact) and
    the guest's memory cgroup (a hit there is the guest agent's report, which the denial
    marks as the worker side's word, with what the host measured of the guest's RAM).
    Under gvisor the host's memory cgroup holds the sandbox's memory (the Sentry's memory
    file) and the Sentry's own at `memory_mb + LAUNCHER_MB`; a hit is the host's OOM kill."""
    if kernel_provider != "qemu" and not cgroup_support()["memory"]:
        pytest.skip("no memory cgroup here: only RLIMIT_AS bounds each process alone")
    code = """
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        try:
            # 128 MB each: under RLIMIT_AS (256 MB per process), over the cgroup's 256 MB
            # for any two at once, which they are while holding it (even on a loaded machine).
            hold = [bytearray(16 * 1024 * 1024) for _ in range(8)]
            import time; time.sleep(3)
        finally:
            os._exit(0)
    kids.append(pid)
[os.waitpid(pid, 0)[1] for pid in kids]
"""
    result = hostile(kernel_provider, make_policy(arena, limits={"memory_mb": 256}), code)
    assert "limits.memory" in [d.rule for d in result.denials], _output(result)
    assert 9 in (result.value or [9]) or result.error is not None  # a child was OOM-killed
    if kernel_provider == "qemu":
        [denial] = [d for d in result.denials if d.rule == "limits.memory"]
        if "guest agent" in denial.detail:
            assert "worker side's word" in denial.detail, denial.detail


def test_in_process_memory_balloon_is_a_limit_denial(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It stops an in-process balloon at `limits.memory` and replaces the worker."""
    code = "hold = []\nwhile True:\n    hold.append(bytearray(32 * 1024 * 1024))"
    result = hostile(kernel_provider, make_policy(arena, limits={"memory_mb": 256}), code)
    assert result.error is not None and result.error.rule == "limits.memory"
    assert "limits.memory" in [d.rule for d in result.denials]


def test_native_attacks_reach_the_host_without_a_kernel_boundary(
    arena: dict[str, Path],
    canary: str,
    hostile: Any,
    make_policy: Any,
    environ_canary: tuple[int, str],
) -> None:
    """Control: the same helpers do read the canary under `subprocess` (no kernel boundary)."""
    policy = make_policy(arena, no_kernel_boundary="accepted")  # the explicit opt-out
    result = hostile("subprocess", policy, f"print(nread({str(arena['outside'])!r}))")
    assert canary in result.stdout
    pid, value = environ_canary
    result = hostile("subprocess", policy, f"print(repr(nread('/proc/{pid}/environ')))")
    assert value in result.stdout
    target = arena["ro"] / "planted.py"
    hostile("subprocess", policy, f"nwrite({str(target)!r})")
    assert target.exists()
    marker = arena["rw"] / "fork-exec-ran"
    hostile("subprocess", policy, _FORK_EXEC.format(marker=marker))
    assert marker.exists()
    hostile("subprocess", policy, f"_libc.system(b'echo ran > {arena['rw']}/sys')")
    assert (arena["rw"] / "sys").exists()


# -- what Landlock alone cannot filter (documented in docs/providers.md) ------------------


def test_blocks_connecting_to_a_host_pathname_unix_socket(
    request: pytest.FixtureRequest,
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
    is_received: Any,
) -> None:
    """It denies connecting to a Unix socket a host process listens on outside the policy.

    Landlock has no right for this; under Landlock alone seccomp refuses `socket(AF_UNIX)`.
    """
    import socket

    path = str(arena["root"] / "host.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.setblocking(False)
    try:
        result = hostile(kernel_provider, make_policy(arena), f"print(nconnect_unix({path!r}))")
        assert not is_received(listener)
    finally:
        listener.close()
    # EPERM/EACCES (seccomp, Landlock), ENOENT (not in the view), ECONNREFUSED (another
    # kernel's socket of that name: gVisor, the VM).
    assert _refused(result) in (1, 13, 2, 111), _output(result)


def test_hides_the_existence_of_files_outside_the_policy(
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
) -> None:
    """It hides whether a file outside the policy exists (stat reveals names and sizes):
    every provider's view leaves the file out, but Landlock's (it does not restrict stat),
    so the landlock provider refuses a policy that does not accept visible names and runs
    no code under it; under one that does, the file's existence is visible by that choice."""
    from agent_sandbox import SandboxError

    target = str(arena["outside"]).encode()
    code = f"print('EXISTS' if _libc.access({target!r}, 0) == 0 else 'absent')"
    strict = make_policy(arena, visible_names="")
    if kernel_provider == "landlock":
        # Through `worker serve` the host hears only the status; the pod's log says why
        # (tests/remote/test_inpod.py).
        refused = r'visible_names = "accepted"|refused the bind \(HTTP 422\)'
        with pytest.raises(SandboxError, match=refused):
            hostile(kernel_provider, strict, code)
        chose = hostile(kernel_provider, make_policy(arena, visible_names="accepted"), code)
        assert _reported(chose, 1) == ["EXISTS"], _output(chose)
        return
    result = hostile(kernel_provider, strict, code)
    assert _reported(result, 1) == ["absent"], _output(result)


def test_udp_reaches_only_what_a_udp_rule_names(
    request: pytest.FixtureRequest,
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
) -> None:
    """It keeps a datagram from a host port that the policy's one UDP rule does not name.

    Landlock has no UDP rights (a UDP grant would open every port), so under Landlock alone
    the rule refuses the policy at construction instead."""
    import socket

    from agent_sandbox import ProviderUnavailable

    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.setblocking(False)
    port = sink.getsockname()[1]
    allowed = 1 if port != 1 else 2
    rule = {"host": "127.0.0.1", "ports": str(allowed), "protocol": "udp"}
    try:
        if kernel_provider == "landlock":
            with pytest.raises(ProviderUnavailable, match="Landlock does not filter UDP"):
                hostile(kernel_provider, make_policy(arena, net={"rules": [rule]}), "1")
            return
        hostile(kernel_provider, make_policy(arena, net={"rules": [rule]}), f"nsend_udp({port})")
        with pytest.raises(BlockingIOError):
            sink.recv(64)
    finally:
        sink.close()


# -- issue 13: no program runs without a process grant -----------------------------------

#: Runs `argv` in a forked child with a raw libc execv, so no Python-level API is involved;
#: prints the child's exit status (42: the exec was refused).
_EXECV = """
def nexecv(argv):
    pid = os.fork()
    if pid == 0:
        arr = (ctypes.c_char_p * (len(argv) + 1))(*[a.encode() for a in argv], None)
        _libc.execv(argv[0].encode(), arr)
        os._exit(42)
    return os.waitpid(pid, 0)[1] >> 8
"""
_LOADER = "/lib64/ld-linux-x86-64.so.2"


@pytest.mark.parametrize("where", ["system", "scratch-copy"])
def test_the_loader_cannot_run_a_program_without_a_process_grant(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any, where: str
) -> None:
    """It refuses `ld-linux.so <program>` (the loader maps a readable ELF without an exec
    check on it) for a system program and for a copy written into scratch."""
    if not os.path.exists(_LOADER):
        pytest.skip(f"no {_LOADER} here")
    marker = arena["rw"] / f"loader-ran-{where}"
    program = "'/usr/bin/touch'"
    if where == "scratch-copy":
        program = "_copy('/usr/bin/touch')"
    code = (
        _EXECV
        + """
def _copy(src):
    fin, fout = nopen(src), nopen('touch-copy', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o755)
    buf = ctypes.create_string_buffer(1 << 16)
    while (n := _libc.read(fin, buf, 1 << 16)) > 0:
        _libc.write(fout, buf, n)
    _libc.close(fin), _libc.close(fout)
    return os.getcwd() + '/touch-copy'
"""
        + f"print(nexecv([{_LOADER!r}, {program}, {str(marker)!r}]))"
    )
    result = hostile(kernel_provider, make_policy(arena), code)
    assert result.error is None, _output(result)
    assert not marker.exists(), _output(result)
    assert result.stdout.strip() == "42", _output(result)


def test_a_process_grant_lets_a_granted_program_run(
    request: pytest.FixtureRequest,
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
) -> None:
    """With `process-exec` granted, a program in `/usr/bin` runs (the exec filter is off)."""
    _under_qemu(
        request,
        kernel_provider,
        "the guest image holds no host programs, only the "
        "interpreter: a process grant has nothing to run",
    )
    marker = arena["rw"] / "granted-ran"
    policy = make_policy(
        arena, api={"allow": ["native-code", "process-control", "introspection", "process-exec"]}
    )
    # NOTE: mkdir, not touch: touch sets the new file's times (futimens), a metadata change
    # the landlock provider refuses everywhere (`_seccomp.metadata_rules`).
    result = hostile(
        kernel_provider, policy, _EXECV + f"print(nexecv(['/usr/bin/mkdir', {str(marker)!r}]))"
    )
    assert result.stdout.strip() == "0", _output(result)
    assert marker.exists()


# -- issue 13: hidden and denied names, and the policy file, are kept by the kernel -------


def test_hidden_and_denied_names_inside_granted_directories_stay_unread(
    request: pytest.FixtureRequest,
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
) -> None:
    """It keeps `.env` (files.hide) and a `files.deny` glob match inside a granted directory
    from native reads, in a read path and in a write path, and leaves their siblings usable."""
    _under_qemu(
        request,
        kernel_provider,
        "qemu serves no host write path; its masks are "
        "tested in test_qemu.py::test_hidden_and_denied_names_inside_a_shared_directory_stay_unread",
    )
    secrets = {
        arena["ro"] / ".env": "hide-ro-" + os.urandom(6).hex(),
        arena["rw"] / "sub" / ".env": "hide-rw-" + os.urandom(6).hex(),
        arena["ro"] / "private" / "q3.csv": "deny-glob-" + os.urandom(6).hex(),
        arena["rw"] / "keys" / "prod.pem": "hide-pem-" + os.urandom(6).hex(),
    }
    for path, text in secrets.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    (arena["ro"] / "private" / "notes.txt").write_text("sibling of a denied file\n")
    (arena["rw"] / "other").mkdir()
    policy = make_policy(arena, files={"deny": [f"{arena['ro']}/private/*.csv"]})
    reads = "\n".join(f"print(repr(nread({str(p)!r})))" for p in secrets)
    code = (
        reads
        + f"\nprint(repr(nread({str(arena['ro'] / 'private' / 'notes.txt')!r})))"
        + f"\nprint(nwrite({str(arena['rw'] / 'other' / 'fresh.txt')!r}))"
    )
    result = hostile(kernel_provider, policy, code)
    assert result.error is None, _output(result)
    for text in secrets.values():
        assert text not in _output(result)
    assert "sibling of a denied file" in result.stdout, _output(result)
    assert (arena["rw"] / "other" / "fresh.txt").read_bytes() == b"pwned"


def _policy_files(arena: dict[str, Path], make_policy: Any) -> tuple[Any, Path, Path]:
    """A hostile policy loaded from `rw/child.toml`, which extends `rw/base.toml`."""
    import warnings

    from agent_sandbox import load_policy

    base = arena["rw"] / "base.toml"
    base.write_text(make_policy(arena).to_toml())
    child = arena["rw"] / "child.toml"
    child.write_text('extends = "base.toml"\nname = "danger-hostile-child"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return load_policy(child), child, base


@pytest.mark.parametrize("mode", ["enforce", "learn"])
def test_the_policy_files_cannot_be_rewritten_from_inside(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any, mode: str
) -> None:
    """It keeps the policy file and the file it extends from native writes (and renames
    over them), in enforce and in learn mode, even inside a directory the policy writes."""
    policy, child, base = _policy_files(arena, make_policy)
    if mode == "learn":
        import warnings

        from agent_sandbox._tools.learn.observe import learning_envelope

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            policy = learning_envelope(policy, provider=kernel_provider)
    before = {p: p.read_bytes() for p in (child, base)}
    code = "\n".join(
        f"print(nwrite({str(p)!r}, b'provider = \"subprocess\"\\n'))" for p in (child, base)
    )
    code += f"\nnwrite({str(arena['rw'] / 'evil.toml')!r})"
    code += f"\nprint(_libc.rename({str(arena['rw'] / 'evil.toml')!r}.encode(), {str(child)!r}.encode()))"
    result = hostile(kernel_provider, policy, code)
    assert result.error is None, _output(result)
    assert {p: p.read_bytes() for p in (child, base)} == before, _output(result)


# -- issue 13: CPU is bounded per sandbox --------------------------------------------------

_SPIN = """
import time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pass
        os._exit(0)
    kids.append(pid)
t0 = time.monotonic()
for pid in kids:
    os.waitpid(pid, 0)
used = os.times()
(used.children_user + used.children_system, time.monotonic() - t0)
"""


def test_four_spinning_processes_share_the_sandboxs_cpu_quota(
    request: pytest.FixtureRequest,
    kernel_provider: str,
    arena: dict[str, Path],
    make_policy: Any,
    native: str,
) -> None:
    """It holds 4 spinning processes to `limits.cpu_cores` together: the worker's cgroup is
    throttled, and their CPU time stays within the quota of the wall time they ran."""
    _under_qemu(
        request,
        kernel_provider,
        "the quota holds QEMU as a whole, its restore "
        "included (at 0.05 core the start outlasts its timeout), and the guest's clock cannot "
        "measure host CPU",
    )
    _under_gvisor(
        request,
        kernel_provider,
        "the quota holds runsc as a whole (the host's cpu cgroup), and the CPU time the "
        "code reads is the Sentry's own accounting, not the host's",
    )
    from agent_sandbox import Sandbox

    if not cgroup_support().get("cpu"):
        pytest.skip("no cpu cgroup controller the parent can use here")
    # A twentieth of a core: far below what 4 spinners take even on this busy machine.
    policy = make_policy(arena, limits={"cpu_cores": 0.05})
    with Sandbox(policy, provider=kernel_provider, warm=0) as sb:
        session = sb.session("spin")
        result = session.run(native + _SPIN)
        worker = session.worker
        assert worker is not None and worker.cgroups is not None
        throttled = worker.cgroups.events().get("cpu_throttled", 0)
    assert result.error is None, _output(result)
    cpu, wall = result.value
    assert throttled > 0
    # 0.05 core over `wall` seconds, plus a period of slack for each process.
    assert cpu <= 0.05 * wall + 0.1, (cpu, wall)


# -- issue 13: disk is bounded -------------------------------------------------------------

_FILL = """
import errno
written, err = 0, 0
chunk = b"x" * (1 << 20)
for i in range(64):
    fd = nopen(f"fill-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    if fd < 0:
        err = -fd
        break
    n = _libc.write(fd, chunk, len(chunk))
    _libc.close(fd)
    if n < 0:
        err = ctypes.get_errno()
        break
    written += n
    if n < len(chunk):
        break
print("written", written, "errno", err)
"""


def _scratch_gap(request: pytest.FixtureRequest, provider: str) -> None:
    if provider == "firejail":
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                raises=AssertionError,
                reason="firejail cannot size a tmpfs: its scratch is a host directory, "
                "checked after each call only",
            )
        )


def test_a_call_cannot_write_more_than_scratch_mb(
    request: pytest.FixtureRequest,
    kernel_provider: str,
    arena: dict[str, Path],
    hostile: Any,
    make_policy: Any,
) -> None:
    """It stops native writes into scratch at `limits.scratch_mb` within the call (ENOSPC)."""
    _scratch_gap(request, kernel_provider)
    policy = make_policy(arena, limits={"scratch_mb": 8, "memory_mb": 512})
    result = hostile(kernel_provider, policy, _FILL)
    words = result.stdout.split()
    assert words[:1] == ["written"], _output(result)
    assert int(words[1]) <= 8 * 1024 * 1024, _output(result)


def test_filling_scratch_is_a_limits_denial(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, make_policy: Any
) -> None:
    """It reports a scratch directory filled past `limits.scratch_mb` as `limits.scratch`,
    with the setting that would allow it (from the host's own check where scratch is a
    host directory)."""
    policy = make_policy(arena, limits={"scratch_mb": 8, "memory_mb": 512})
    code = _FILL + "\nwith open('last', 'wb') as fh:\n    fh.write(b'y' * (16 << 20))\n"
    result = hostile(kernel_provider, policy, code)
    denial = next((d for d in result.denials if d.rule == "limits.scratch"), None)
    assert denial is not None, _output(result)
    assert "scratch_mb" in denial.hint


@pytest.mark.parametrize("provider", ["subprocess", "landlock", "unshare", "bwrap", "firejail"])
def test_fd_level_output_never_grows_a_host_file(
    provider: str, arena: dict[str, Path], make_policy: Any, native: str
) -> None:
    """It keeps what native code writes straight to descriptors 1 and 2 (not through
    `print`) in a sealed 1 MiB memory file: 8 MiB written leave no host file larger."""
    from agent_sandbox import Sandbox
    from agent_sandbox._host.launch import LOG_BYTES
    from agent_sandbox.providers import get_provider

    probe = get_provider(provider).probe()
    if not probe.available:
        pytest.skip(f"{provider} unavailable here: {probe.reason}")
    code = "for fd in (1, 2):\n    for _ in range(4):\n        os.write(fd, b'z' * (1 << 20))\n"
    opt_out = {"no_kernel_boundary": "accepted"} if provider == "subprocess" else {}
    with Sandbox(make_policy(arena, **opt_out), provider=provider, warm=0) as sb:
        session = sb.session("fd")
        session.run(native + "import os\n" + code)
        worker = session.worker
        assert worker is not None and worker._log is not None
        sizes = [
            os.lstat(os.path.join(root, name)).st_blocks * 512
            for root, _dirs, names in os.walk(worker.control_dir)
            for name in names
        ]
        log_size = os.fstat(worker._log.fileno()).st_size
    assert max(sizes, default=0) < LOG_BYTES, sizes
    assert log_size == LOG_BYTES
