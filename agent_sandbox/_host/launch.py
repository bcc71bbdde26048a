"""What a worker starts from, as the host prepares it: interpreter, import roots, folders, log.

Shared by a direct start (`agent_sandbox._host.startup`), a worker template
(`agent_sandbox._host.templates`) and the boundary's dry build of a launch plan
(`agent_sandbox._host.boundary`):

* `BOOT_SCRIPT`: the worker's entry point (`agent_sandbox/_worker/boot.py`), run by path
  with `python -I -S -B`;
* `worker_python()`: the interpreter; `import_roots()`: the worker's `sys.path`;
  `package_dirs()`: where each `agent_sandbox` package lives (its bytecode refreshed once);
* `worker_env()`: the environment a policy passes;
* `bounded_log()`: the memory file, of `LOG_BYTES`, that takes the worker's descriptors 1
  and 2.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import functools
import importlib.util
import os
import stat
import sys
import sysconfig
from collections.abc import Mapping
from typing import IO

from agent_sandbox._errors import WorkerStartError
from agent_sandbox.policies import Policy

__all__ = [
    "BOOT_SCRIPT",
    "LOG_BYTES",
    "bounded_log",
    "import_roots",
    "package_dirs",
    "refresh_bytecode",
    "worker_env",
    "worker_python",
]


BOOT_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "_worker", "boot.py"
)
_PACKAGES = (
    "agent_sandbox",
    "agent_sandbox.guards",
    "agent_sandbox.policies",
    "agent_sandbox.providers",
)


def package_dirs() -> dict[str, str]:
    """Where each `agent_sandbox` package lives on disk (works for editable installs too).

    Also makes sure, once per parent process, that the bytecode caches of those folders are
    current (see `refresh_bytecode`), and those of the folders this process imports the
    packages from when they differ (a strict editable install's tree of links) and this
    process writes no bytecode itself (`PYTHONDONTWRITEBYTECODE`).
    """
    out = {}
    imported: set[str] = set()
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise WorkerStartError(f"cannot locate the package {name}")
        # The folder of its `__init__.py` after links: a strict editable install reaches the
        # sources through a tree of per-file links (build/__editable__*), which the worker's
        # view and its Landlock rules must not depend on.
        if spec.origin:
            out[name] = os.path.dirname(os.path.realpath(spec.origin))
            imported.add(os.path.dirname(os.path.abspath(spec.origin)))
        else:
            out[name] = os.path.realpath(next(iter(spec.submodule_search_locations)))
        imported.update(os.path.abspath(path) for path in spec.submodule_search_locations)
    if not sys.dont_write_bytecode:
        # This process's importer keeps the caches of what it imports current itself.
        imported.clear()
    refresh_bytecode(tuple(sorted({*out.values(), *imported})))
    return out


@functools.cache
def refresh_bytecode(folders: tuple[str, ...]) -> None:
    """Compile the stale or missing `__pycache__` entries of the package folders.

    Workers run with `-B` and read-only views of these folders, so they never write
    bytecode; most of their modules are never imported by the parent, so nothing else
    writes it either. Without this, every worker compiles those modules from source at
    start-up (`benchmarks/bench_providers.py` times both). The same holds for the parent's
    own modules when it imports them through a tree of links (a strict editable install)
    and does not write bytecode (`PYTHONDONTWRITEBYTECODE`): each agent process compiled
    about fifty modules. A folder the parent cannot write is left as it is (an installed
    wheel has its bytecode from the installer).

    A current entry costs a `stat` and a 16-byte read through a raw descriptor (no
    `compileall`, whose imports cost more than the check, nor a buffered file object, which
    cost more than the read); only a stale or missing one is compiled.
    """
    for folder in folders:
        _refresh_folder(folder, 2)


def _refresh_folder(folder: str, levels: int) -> None:
    """Refresh one folder's caches (and those of its sub-folders, `levels` deep).

    A folder whose sources are as they were at its last refresh (their names, modification
    times and sizes: one `stat` each) is not checked file by file: `__pycache__` keeps a
    stamp of them, written after a refresh that left every entry current. A cache removed
    or changed behind the stamp's back costs a worker a compile from source, never a stale
    module (the importer checks every entry against its source).
    """
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    sources: list[os.DirEntry[str]] = []
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.name.endswith(".py") and entry.is_file():
                sources.append(entry)
            elif (
                levels > 0
                and entry.name != "__pycache__"
                and not entry.name.startswith(".")
                and entry.is_dir(follow_symlinks=False)
            ):
                _refresh_folder(entry.path, levels - 1)
    if not sources:
        return
    try:
        marks = sorted(f"{e.name}\0{e.stat().st_mtime_ns}\0{e.stat().st_size}" for e in sources)
    except OSError:
        marks = []
    tag = sys.implementation.cache_tag or "none"
    stamp_file = os.path.join(folder, "__pycache__", f"agent-sandbox-fresh.{tag}.stamp")
    stamp = "\n".join([importlib.util.MAGIC_NUMBER.hex(), *marks]).encode()
    if marks and _read_small(stamp_file, len(stamp) + 1) == stamp:
        return
    current = True
    for entry in sources:
        try:
            current = _refresh_file(entry.path) and current
        except OSError:
            current = False
    if marks and current:
        _write_stamp(stamp_file, stamp)


def _read_small(path: str, limit: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return b""
    try:
        return os.read(fd, limit)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _write_stamp(path: str, data: bytes) -> None:
    """Write the stamp through a private temporary file renamed into place (never a
    partial stamp); a folder this process cannot write keeps none."""
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError:
        return
    try:
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)


def _refresh_file(source: str) -> bool:
    """Compile `source` (timestamp-checked, unoptimised, as a worker reads it) unless its
    cached bytecode is current for its modification time and size; whether it is now."""
    cached = importlib.util.cache_from_source(source, optimization="")
    st = os.stat(source)
    try:
        fd = os.open(cached, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        head = b""
    else:
        try:
            head = os.read(fd, 16)
        finally:
            os.close(fd)
    if (
        len(head) == 16
        and head[:4] == importlib.util.MAGIC_NUMBER
        and (
            int.from_bytes(head[4:8], "little") != 0  # hash-based: checked by the importer
            or (
                int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF
            )
        )
    ):
        return True
    import py_compile

    try:
        py_compile.compile(
            source,
            cfile=cached,
            doraise=True,
            optimize=0,
            invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP,
        )
    except (py_compile.PyCompileError, ValueError, OSError):
        return False
    return True


def import_roots() -> tuple[str, ...]:
    """The worker's `sys.path`: the standard library, this environment's site-packages, then
    the other import roots the parent uses (a user site, `PYTHONPATH` entries).

    The parent's current directory (`''`) is never passed: it is where a planted module
    would shadow a real one. Nor is a directory every user can write (`/tmp`, when the
    parent's script lives there): the same planting risk, and binding it would show the
    worker everyone's temporary files. No `.pth` file is processed in the worker, so
    nothing in site-packages runs at start-up.
    """
    paths = sysconfig.get_paths()
    dynload = [p for p in sys.path if os.path.basename(p) == "lib-dynload"]
    roots = [
        paths["stdlib"],
        *(dynload or [os.path.join(paths["stdlib"], "lib-dynload")]),
        paths["purelib"],
        paths["platlib"],
    ]
    cwd = os.getcwd()
    for entry in sys.path:
        if entry and os.path.isabs(entry) and entry != cwd and not _shared_or_missing(entry):
            roots.append(entry)
    seen: dict[str, None] = {}
    for root in roots:
        seen.setdefault(os.path.realpath(root), None)
    return tuple(seen)


def _shared_or_missing(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return True
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_IWOTH)


def worker_env(policy: Policy, host: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: only host variables the policy passes, plus its `set` values."""
    env = {}
    patterns = policy.env.passthrough
    for name, value in host.items():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            env[name] = value
    env.update(policy.env.set)
    return env


#: The size of a worker's log: what it writes to descriptors 1 and 2 (native code writing
#: there directly, a crash's traceback) goes to memory the host bounds, never to its disk.
LOG_BYTES = 1024 * 1024
_F_ADD_SEALS = 1033
_F_SEAL_SHRINK = 0x0002
_F_SEAL_GROW = 0x0004


def bounded_log() -> IO[bytes]:
    """A memfd of `LOG_BYTES`, sealed so it can neither grow nor shrink: a write past its
    end fails (EPERM) instead of filling the host's disk, whatever the worker does with
    its descriptors. The worker shares the file offset with the parent, which reads the
    tail just before it (`WorkerProcess.log_tail`)."""
    fd = os.memfd_create("agent-sandbox-worker-log", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, LOG_BYTES)
        fcntl.fcntl(fd, _F_ADD_SEALS, _F_SEAL_GROW | _F_SEAL_SHRINK)
        return os.fdopen(fd, "r+b", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def worker_python() -> str:
    """The interpreter workers run: this one (resolved unless that would leave a venv)."""
    return os.path.realpath(sys.executable) if _venv_safe() else sys.executable


def _venv_safe() -> bool:
    """Whether resolving sys.executable keeps the environment (it does not inside a venv)."""
    return sys.prefix == sys.base_prefix
