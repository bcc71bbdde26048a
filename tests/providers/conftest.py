"""Fixtures for provider tests: probes that skip with the reason, hostile code helpers.

`KERNEL_PROVIDERS` lists the providers the containment matrix runs against; each one is
skipped with its probe's reason where this machine cannot run it. Hostile snippets use
ctypes (`NATIVE`, prepended to the code) so that the Python guards are not what stops them:
only the kernel boundary can.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox.providers import get_provider

#: Kernel providers the containment matrix runs against (strongest last).
KERNEL_PROVIDERS: tuple[str, ...] = ("landlock", "unshare", "bwrap", "firejail", "gvisor")
#: What tests that open connections use where the product refuses the cloud metadata
#: address (169.254.169.254): a documentation address no rule names, refused the same way
#: (a literal no rule names; a name that resolves to a non-global address), so a test
#: whose containment regressed sends nothing to a real metadata service. The metadata
#: address's own classification is pinned by the pure rule tests (test_egress.py).
METADATA_STAND_IN = "192.0.2.254"

#: Native helpers for hostile code: libc through ctypes, no Python-level API involved.
NATIVE = r"""
import ctypes, os, struct
_libc = ctypes.CDLL(None, use_errno=True)
def _err():
    return -ctypes.get_errno()
def nopen(path, flags=os.O_RDONLY, mode=0o644):
    fd = _libc.open(path.encode(), flags, mode)
    return fd if fd >= 0 else _err()
def nread(path):
    fd = nopen(path)
    if fd < 0:
        return fd
    buf = ctypes.create_string_buffer(65536)
    n = _libc.read(fd, buf, 65536)
    _libc.close(fd)
    return buf.raw[:max(n, 0)].decode("latin-1")
def nwrite(path, data=b"pwned"):
    fd = nopen(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    if fd < 0:
        return fd
    _libc.write(fd, data, len(data))
    _libc.close(fd)
    return 0
def nconnect_tcp(port, host=b"\x7f\x00\x00\x01"):
    s = _libc.socket(2, 1, 0)
    if s < 0:
        return ("socket", _err())
    addr = struct.pack("!HH4s8x", 2, port, host)
    addr = struct.pack("=H", 2) + addr[2:]
    rc = _libc.connect(s, addr, len(addr))
    e = _err()
    _libc.close(s)
    return ("connect", 0 if rc == 0 else e)
def nconnect_abstract(name):
    s = _libc.socket(1, 1, 0)
    if s < 0:
        return ("socket", _err())
    path = b"\0" + name.encode()
    addr = struct.pack("=H", 1) + path
    rc = _libc.connect(s, addr, len(addr))
    e = _err()
    _libc.close(s)
    return ("connect", 0 if rc == 0 else e)
def nconnect_unix(path):
    s = _libc.socket(1, 1, 0)
    if s < 0:
        return ("socket", _err())
    addr = struct.pack("=H", 1) + path.encode() + b"\0"
    rc = _libc.connect(s, addr, len(addr))
    e = _err()
    _libc.close(s)
    return ("connect", 0 if rc == 0 else e)
def nsend_udp(port, data=b"leak", host=b"\x7f\x00\x00\x01"):
    s = _libc.socket(2, 2, 0)
    if s < 0:
        return ("socket", _err())
    addr = struct.pack("=H", 2) + struct.pack("!H4s8x", port, host)
    rc = _libc.sendto(s, data, len(data), 0, addr, len(addr))
    e = _err()
    _libc.close(s)
    return ("sendto", rc if rc >= 0 else e)
"""


def require_landlock_and_seccomp() -> None:
    """Skip (a failure where CI requires them) unless Landlock and seccomp both work here:
    a test of the default stack then asserts both are in it, never `if` they are."""
    from agent_sandbox.providers._landlock import probe_landlock
    from agent_sandbox.providers._seccomp import probe_seccomp

    landlock = probe_landlock()
    if not landlock.available:
        pytest.skip(f"landlock unavailable here: {landlock.reason}")
    seccomp, why = probe_seccomp()
    if not seccomp:
        pytest.skip(f"seccomp unavailable here: {why}")


def accepted_for(provider: str) -> dict[str, str]:
    """The words a policy must say for `provider` to take it: the opt-out from a kernel
    boundary (`subprocess`), the acceptance of visible names (`landlock`, which cannot hide
    them; its refusal without it is measured in test_operation_matrix.py), nothing else."""
    if provider == "subprocess":
        return {"no_kernel_boundary": "accepted"}
    if provider == "landlock":
        return {"visible_names": "accepted"}
    return {}


def skip_unless_available(name: str) -> None:
    """Skip the test with the provider's probe reason when it cannot run here."""
    try:
        result = get_provider(name).probe()
    except Exception as exc:  # an unknown provider name: not registered on this branch
        pytest.skip(f"provider {name!r} unavailable: {exc}")
    if not result.available:
        pytest.skip(f"provider {name!r} unavailable here: {result.reason}")


@pytest.fixture(params=KERNEL_PROVIDERS)
def kernel_provider(request: pytest.FixtureRequest) -> str:
    """Each kernel provider in turn (skipped with its probe's reason)."""
    name = str(request.param)
    skip_unless_available(name)
    return name


#: The policy memory limit of the one qemu template the tests share (a policy asking for
#: another size would boot and save a template of its own).
QEMU_MEMORY_MB = 512


@pytest.fixture(scope="session")
def qemu_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A cache directory holding the qemu guest image and one template of `QEMU_MEMORY_MB`,
    built once per test session (skip with the reason where QEMU, busybox-static or the
    Debian kernel package is missing). Tests point `XDG_CACHE_HOME` at it."""
    from agent_sandbox.providers.qemu.image import (
        ImageError,
        build_image,
        install_hint,
        locate_kernel_deb,
        missing_tools,
    )
    from agent_sandbox.providers.qemu.provider import TemplateError, ensure_template, guest_ram_mb

    missing = missing_tools()
    if missing:
        pytest.skip(f"qemu provider: missing tools: {install_hint(missing)}")
    try:
        locate_kernel_deb()
    except ImageError as exc:
        pytest.skip(f"qemu provider: {exc}")
    cache = str(tmp_path_factory.mktemp("qemu-cache"))
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = cache
    try:
        image = build_image()
        ensure_template(image, guest_ram_mb(QEMU_MEMORY_MB))
    except (ImageError, TemplateError) as exc:
        pytest.fail(f"the qemu image or template could not be built: {exc}")
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old
    return cache


@pytest.fixture(scope="session")
def canary() -> str:
    return "canary-" + secrets.token_hex(8)


@pytest.fixture
def arena(tmp_path: Path, canary: str) -> dict[str, Path]:
    """Host paths for one test: a read-only dir, a writable dir, a canary outside both.

    The directories are mode 0777 so that a denial cannot come from file permissions
    (the tests run as root, which bypasses them anyway).
    """
    ro = tmp_path / "ro"
    rw = tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    for d in (ro, rw, tmp_path):
        d.chmod(0o777)
    (ro / "data.txt").write_text("readable data\n")
    outside = tmp_path / "outside-canary.txt"
    outside.write_text(canary + "\n")
    outside.chmod(0o666)
    return {"ro": ro, "rw": rw, "outside": outside, "root": tmp_path}


def hostile_policy(arena: dict[str, Path], **overrides: Any) -> Policy:
    """A policy that opens the Python layer (ctypes, fork) so only the kernel can refuse.

    It says `visible_names = "accepted"` unless the caller sets the key (`visible_names=""`):
    the landlock provider takes no policy without it (Landlock cannot hide names; its
    refusal, and what hides names elsewhere, are measured in test_operation_matrix.py and
    `test_hides_the_existence_of_files_outside_the_policy`), what these tests measure under
    it is what it holds of everything else, and no other provider reads the key."""
    data: dict[str, Any] = {
        "name": "danger-hostile-test",
        "imports": {"allow": ["*"]},
        # NOTE: the exec entry points are allowed one by one so the Python guard steps aside;
        # the `process-exec` category (which would widen the kernel rules) stays off.
        "api": {
            "allow": [
                "native-code",
                "process-control",
                "introspection",
                "_posixsubprocess.fork_exec",
                "os.system",
                "posix.system",
            ]
        },
        "code": {"enabled": False},
        "files": {"read": [str(arena["ro"])], "write": [str(arena["rw"])]},
        "limits": {"wall_seconds": 20, "memory_mb": 512, "processes": 16},
        "visible_names": "accepted",
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    with warnings.catch_warnings():
        # The warning that native-code opens the Python layer is the point of this policy.
        warnings.simplefilter("ignore", UserWarning)
        return Policy(**data)


@pytest.fixture
def environ_canary() -> Iterator[tuple[int, str]]:
    """A host process with a secret in its environment (as the agent's own process has),
    and the secret. The canary is really there: this fixture reads it back first."""
    value = "environ-canary-" + os.urandom(8).hex()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "AGENT_SANDBOX_TEST_CANARY": value},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"  # it runs
        assert value.encode() in Path(f"/proc/{proc.pid}/environ").read_bytes()
        yield proc.pid, value
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()


@pytest.fixture
def tcp_listener() -> Iterator[tuple[socket.socket, int]]:
    """A loopback TCP listener; the test asserts it received no connection."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    try:
        yield sock, sock.getsockname()[1]
    finally:
        sock.close()


@pytest.fixture
def abstract_listener() -> Iterator[tuple[socket.socket, str]]:
    """An abstract Unix socket another process listens on."""
    name = "agent-sandbox-test-" + secrets.token_hex(6)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    sock.listen(8)
    sock.setblocking(False)
    try:
        yield sock, name
    finally:
        sock.close()


def received_connection(sock: socket.socket) -> bool:
    """Whether a non-blocking listener has a pending connection."""
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def run_hostile(provider: str, policy: Policy, code: str) -> Any:
    """Run `NATIVE + code` once under `provider` and return the result."""
    with Sandbox(policy, provider=provider, warm=0) as sb:
        return sb.run(NATIVE + code)


@pytest.fixture
def hostile() -> Any:
    return run_hostile


@pytest.fixture
def native() -> str:
    """The native helpers (`NATIVE`), for a test that runs its own sandbox."""
    return NATIVE


@pytest.fixture
def is_received() -> Any:
    return received_connection


@pytest.fixture
def make_policy() -> Any:
    return hostile_policy


def own_pid() -> int:
    return os.getpid()
