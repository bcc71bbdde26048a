"""The operation matrix (`providers/_matrix.py`) measured under every kernel provider.

One worker per provider and grant kind runs every operation natively (ctypes; the Python
guards never see the calls), and reports each outcome: `ok` or the errno. A cell the
matrix allows must be `ok` (a rename across file systems may be `EXDEV`: the bind of a
grant and the scratch tmpfs are two file systems); a cell it refuses must not be. Where a
provider does not hold a cell, `_matrix.GAPS` names it and the cell is a strict xfail. Where
a provider leaves a cell open only by the policy's choice (`_matrix.VISIBLE`: `landlock`,
names), the worker runs a policy that makes that choice and the cell must be `ok`, and a
policy that does not is refused at construction (one test per kind).
qemu is not run here (one VM boot per grant kind; its file view is the host directory
shared read-only or not at all: tests/providers/test_qemu.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import PolicyError, ProviderUnavailable, Sandbox
from agent_sandbox._host.boundary import _dry_spec, resolve_boundary
from agent_sandbox.providers._auto import AutoProvider
from agent_sandbox.providers._landlock import LandlockProvider
from agent_sandbox.providers._matrix import (
    EXPECTED,
    GAPS,
    KINDS,
    NARROWED,
    OPERATIONS,
    VISIBLE,
    GapOpen,
    render_markdown,
)
from tests.providers.conftest import KERNEL_PROVIDERS, hostile_policy, skip_unless_available

PROBE = r"""
import ctypes, errno, json, os, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
T = {target!r}
S = os.getcwd()
if T.startswith("$SCRATCH"):
    T = S + T[len("$SCRATCH"):]
def P(name):
    return (T + "/" + name).encode()
OPS = {ops!r}
if {scratch!r}:
    os.mkdir(T)
    for op in OPS:
        # NOTE: made with its mode rather than chmod-ed: the landlock provider refuses chmod.
        fd = os.open(os.path.join(T, op), os.O_WRONLY | os.O_CREAT, 0o755)
        os.write(fd, b"#!/bin/sh\nexit 7\n" if op == "exec" else b"data\n")
        os.close(fd)
    libc.setxattr(P("removexattr"), b"user.mx", b"1", 1, 0)
def err():
    e = ctypes.get_errno()
    return errno.errorcode.get(e, str(e))
def res(rc):
    return "ok" if rc >= 0 else err()
out = {{}}
fd = libc.open(P("open-read"), os.O_RDONLY)
if fd >= 0:
    buf = ctypes.create_string_buffer(64)
    n = libc.read(fd, buf, 64)
    out["open-read"] = "ok" if n > 0 and buf.raw.startswith(b"data") else "empty"
    libc.close(fd)
else:
    out["open-read"] = err()
fd = libc.open(P("open-write"), os.O_WRONLY)
out["open-write"] = res(fd)
fd >= 0 and libc.close(fd)
fd = libc.open(P("new"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
out["create"] = res(fd)
fd >= 0 and libc.close(fd)
fd = libc.open(T.encode(), os.O_RDONLY | os.O_DIRECTORY)
if fd >= 0:
    names = os.listdir(fd)
    out["list"] = "ok" if "open-read" in names else "empty"
    os.close(fd)
else:
    out["list"] = err()
buf = ctypes.create_string_buffer(256)
rc = libc.syscall(262, -100, P("stat"), buf, 0)  # newfstatat (x86-64)
out["stat"] = res(rc)
uid, gid = struct.unpack_from("=II", buf.raw, 28) if rc == 0 else (os.getuid(), os.getgid())
out["unlink"] = res(libc.unlink(P("unlink")))
fd = libc.open((S + "/mx-src").encode(), os.O_WRONLY | os.O_CREAT, 0o644)
fd >= 0 and libc.close(fd)
out["rename-in"] = res(libc.rename((S + "/mx-src").encode(), P("in")))
out["rename-out"] = res(libc.rename(P("rename-out"), (S + "/mx-out").encode()))
out["hard-link"] = res(libc.link(P("hard-link"), P("hl")))
out["symlink"] = res(libc.symlink(b"/etc/hostname", P("sl")))
out["chmod"] = res(libc.chmod(P("chmod"), 0o600))
if rc != 0:
    buf2 = ctypes.create_string_buffer(256)
    if libc.syscall(262, -100, P("chown"), buf2, 0) == 0:
        uid, gid = struct.unpack_from("=II", buf2.raw, 28)
out["chown"] = res(libc.chown(P("chown"), uid, gid))
out["utime"] = res(libc.utimensat(-100, P("utime"), None, 0))
out["setxattr"] = res(libc.setxattr(P("setxattr"), b"user.mx", b"1", 1, 0))
out["removexattr"] = res(libc.removexattr(P("removexattr"), b"user.mx"))
out["truncate"] = res(libc.truncate(P("truncate"), 0))
fifo = res(libc.mkfifo(P("fifo"), 0o600))
nod = res(libc.mknod(P("nod"), 0o100600, 0))
out["mkfifo"] = fifo if fifo != "ok" else nod
s = libc.socket(1, 1, 0)
if s < 0:
    out["bind-unix"] = "socket " + err()
else:
    addr = struct.pack("=H", 1) + P("sock") + b"\0"
    out["bind-unix"] = res(libc.bind(s, addr, len(addr)))
    libc.close(s)
pid = os.fork()
if pid == 0:
    argv = (ctypes.c_char_p * 2)(P("exec"), None)
    envp = (ctypes.c_char_p * 1)(None)
    libc.execve(P("exec"), argv, envp)
    os._exit(100 + ctypes.get_errno() % 100)
_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
out["exec"] = "ok" if code == 7 else errno.errorcode.get(code - 100, f"exit {{code}}")
fd = libc.open(P("mmap-exec"), os.O_RDONLY)
if fd >= 0:
    addr = libc.mmap(None, 4096, 5, 2, fd, 0)
    out["mmap-exec"] = "ok" if addr not in (None, 2**64 - 1) else err()
    libc.close(fd)
else:
    out["mmap-exec"] = err()
print(json.dumps(out))
"""


def _populate(folder: Path) -> None:
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    for op in OPERATIONS:
        path = folder / op
        path.write_text("#!/bin/sh\nexit 7\n" if op == "exec" else "data\n")
        path.chmod(0o755 if op == "exec" else 0o666)
    try:
        os.setxattr(folder / "removexattr", "user.mx", b"1")
    except OSError:
        pass  # a file system without user xattrs: the cell reports that


def _layout(tmp_path: Path, kind: str) -> tuple[str, dict[str, Any]]:
    """The target directory of `kind` and the policy's `[files]`."""
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    if kind == "read":
        _populate(ro / "t")
        return str(ro / "t"), {"read": [str(ro)], "write": []}
    if kind == "write":
        _populate(rw / "t")
        return str(rw / "t"), {"read": [], "write": [str(rw)]}
    if kind == "scratch":
        return "$SCRATCH/t", {"read": [], "write": []}
    if kind == "hidden":
        _populate(rw / ".hid-t")
        hide = [".env", "*.pem", "id_rsa*", ".hid-*"]
        return str(rw / ".hid-t"), {"read": [], "write": [str(rw)], "hide": hide}
    if kind == "deny":
        _populate(rw / "denied")
        return str(rw / "denied"), {"read": [], "write": [str(rw)], "deny": [str(rw / "denied")]}
    _populate(tmp_path / "none")
    return str(tmp_path / "none"), {"read": [], "write": []}


def _measure(provider: str, kind: str, tmp_path: Path) -> dict[str, str]:
    target, files = _layout(tmp_path, kind)
    for d in ("ro", "rw"):
        (tmp_path / d).mkdir(exist_ok=True)
        (tmp_path / d).chmod(0o777)
    arena = {"ro": tmp_path / "ro", "rw": tmp_path / "rw", "root": tmp_path}
    # The choice `VISIBLE` needs (landlock takes no policy without it: measured below); no
    # other provider reads it.
    policy = hostile_policy(arena, provider=provider, files=files, visible_names="accepted")
    with Sandbox(policy, warm=0) as sandbox:
        result = sandbox.run(
            PROBE.format(target=target, ops=list(OPERATIONS), scratch=target.startswith("$SCRATCH"))
        )
    assert result.error is None, result.error
    got: dict[str, str] = json.loads(result.stdout)
    assert set(got) == set(OPERATIONS)
    return got


_CROSS_FS_OK = {"rename-in", "rename-out"}
_MEASURED: dict[tuple[str, str], dict[str, str]] = {}


def _measured(provider: str, kind: str, factory: pytest.TempPathFactory) -> dict[str, str]:
    """One worker per provider and kind measures every operation; each cell reads it."""
    key = (provider, kind)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(provider, kind, factory.mktemp(f"mx-{provider}-{kind}"))
    return _MEASURED[key]


def _cells() -> list[Any]:
    cells = []
    for provider in KERNEL_PROVIDERS:
        for kind in KINDS:
            for op in OPERATIONS:
                why = GAPS.get((provider, kind, op))
                marks = [pytest.mark.xfail(strict=True, raises=GapOpen, reason=why)] if why else []
                cells.append(pytest.param(provider, kind, op, marks=marks))
    return cells


@pytest.mark.parametrize(("provider", "kind", "op"), _cells())
def test_each_grant_kind_means_the_same_under_each_provider(
    provider: str, kind: str, op: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """It denies native code every operation the grant kind does not allow, and allows the
    ones it does, under each kernel provider (the Python layer is not involved). A cell a
    provider does not hold (`GAPS`) is a strict xfail raising `GapOpen`; a cell a provider
    refuses on purpose (`NARROWED`) must be refused; a cell open by the policy's choice
    (`VISIBLE`, under a policy that makes it) must be allowed."""
    skip_unless_available(provider)
    got = _measured(provider, kind, tmp_path_factory)
    outcome = got[op]
    cell = (provider, kind, op)
    allowed = (EXPECTED[kind][op] and cell not in NARROWED) or cell in VISIBLE
    done = outcome == "ok" or (allowed and op in _CROSS_FS_OK and outcome == "EXDEV")
    if allowed != done:
        raise GapOpen(f"{provider} {kind} {op}: {outcome} (all: {got})")
    if not allowed:
        # What stopped it: an errno, or a listing that came back without the names (a mask).
        # ENOTSUP: gVisor keeps no user xattrs on a host directory (the call did nothing).
        stopped = ("EACCES", "EPERM", "ENOENT", "EXDEV", "EROFS", "ENOTSUP", "socket EPERM")
        stopped += ("empty",)
        assert outcome in stopped, got


@pytest.mark.parametrize("kind", KINDS)
def test_landlock_refuses_each_kinds_policy_that_does_not_accept_visible_names(
    kind: str, tmp_path: Path
) -> None:
    """It refuses, when the policy or the sandbox is built, a policy of each grant kind that
    does not say `visible_names = "accepted"` under the landlock provider (named in the
    policy, named over it, or the only candidate `auto` has), naming the key and the
    providers that hide names; `auto` takes Landlock alone for the same policy with it."""
    assert {k for (p, k, _op) in VISIBLE if p == "landlock"} <= set(KINDS)
    _target, files = _layout(tmp_path, kind)
    arena = {"ro": tmp_path / "ro", "rw": tmp_path / "rw", "root": tmp_path}
    fixes = r'provider = "auto", "bwrap" or "unshare" .*visible_names = "accepted"'
    with pytest.raises(PolicyError, match=r"Landlock cannot hide that a file exists"):
        hostile_policy(arena, provider="landlock", files=files, visible_names="")
    policy = hostile_policy(arena, files=files, visible_names="")  # "auto", not accepted
    with pytest.raises(PolicyError, match=fixes):
        Sandbox(policy, provider="landlock", warm=0)
    with pytest.raises(PolicyError, match="visible_names"):
        resolve_boundary(policy, "landlock")
    skip_unless_available("landlock")
    only_landlock = AutoProvider((LandlockProvider(),), stronger=())
    with pytest.raises(ProviderUnavailable, match=r"landlock: .*visible_names = \"accepted\""):
        only_landlock.build(policy, _dry_spec(policy))
    accepted = policy.model_copy(update={"visible_names": "accepted"})
    assert only_landlock.build(accepted, _dry_spec(accepted)).stack[0] == "landlock"


def test_the_docs_show_the_matrix_from_the_code() -> None:
    """It keeps docs/policies.md's matrix the one `render_markdown()` makes."""
    doc = (Path(__file__).parents[2] / "docs" / "policies.md").read_text()
    assert render_markdown() in doc


_DESCRIPTOR_PROBE = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
F = {target!r}.encode()
def res(rc):
    return "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
ro = libc.open(F, os.O_RDONLY)
opath = libc.open(F, os.O_PATH)
buf = ctypes.create_string_buffer(8)
out = {{
    "read": libc.read(ro, buf, 4),
    "fchmod_read_fd": res(libc.fchmod(ro, 0o600)),
    "fchownat_opath": res(libc.syscall(ctypes.c_long(260), opath, b"", os.getuid(), os.getgid(), 0x1000)),
    "futimens_read_fd": res(libc.syscall(ctypes.c_long(280), ro, None, None, 0)),
    "fsetxattr_read_fd": res(libc.fsetxattr(ro, b"user.mx", b"1", 1, 0)),
}}
print(json.dumps(out))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 syscall numbers")
def test_landlock_denies_metadata_changes_through_descriptors_of_a_read_grant(
    tmp_path: Path,
) -> None:
    """It denies native code, under the landlock provider, changing a read-granted file's
    mode, owner, times or attributes through a descriptor opened read-only (which Landlock
    allows) or an O_PATH descriptor (which Landlock never checks): the seccomp filter's
    metadata rules refuse them with EPERM."""
    skip_unless_available("landlock")
    for d in ("ro", "rw"):
        (tmp_path / d).mkdir()
        (tmp_path / d).chmod(0o777)
    target = tmp_path / "ro" / "f"
    target.write_text("data")
    target.chmod(0o644)
    before = target.stat()
    arena = {"ro": tmp_path / "ro", "rw": tmp_path / "rw", "root": tmp_path}
    policy = hostile_policy(arena, provider="landlock")
    with Sandbox(policy, warm=0) as sandbox:
        result = sandbox.run(_DESCRIPTOR_PROBE.format(target=str(target)))
    assert result.error is None, result.error
    got = json.loads(result.stdout)
    assert got.pop("read") == 4  # the descriptor was open and readable: the attack ran
    assert got == dict.fromkeys(got, "EPERM"), got
    after = target.stat()
    assert (after.st_mode, after.st_mtime_ns) == (before.st_mode, before.st_mtime_ns)
