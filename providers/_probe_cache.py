"""The providers' trial probes, remembered across processes.

What it keeps: the answer of a probe that starts a trial process (bwrap's minimal sandbox,
the unshare launcher, the non-root worker's scratch tmpfs), so that a fresh agent process
under `auto` does not pay them again (52-64 ms, and more under load). An answer is kept
only when the trial worked, beside the key it was measured under, in one JSON file:
`$XDG_CACHE_HOME/agent-sandbox/probes.json` (default `~/.cache/agent-sandbox/`).

The key is everything such an answer depends on, and any change means "probe again":

1. the kernel: `uname` (release, version, machine), the boot id, the user-namespace
   sysctls (`user.max_user_namespaces`, `kernel.unprivileged_userns_clone`,
   `kernel.apparmor_restrict_unprivileged_userns`) and the process's user namespace;
2. the user: real and effective uid and gid;
3. the tool: the resolved path, size, mtime, inode and mode of the executable the trial
   runs (bwrap, or the interpreter for the launcher and the tmpfs trial);
4. the package: its version, and the path, size and mtime of the modules that build and
   run the trials (this one included).

What it does not keep, on purpose:

* a failed trial: a remembered "no" could hide a boundary that works now, and `auto` would
  then pick a weaker stack without saying so (never downgrade silently); it is probed again;
* the cheap probes (the Landlock ABI is one system call; seccomp needs its library loaded
  anyway to build the filter).

Several installs of the package (virtual environments, checkouts) share the file: each
answer is filed under its probe's name and a checksum of its key (`bwrap:1a2b3c4d`), so they
do not evict each other's answers; the file keeps the `MAX_ENTRIES` most recently written.

Trust: the file is read only when it is a regular file owned by the effective user and
writable by nobody else, in a directory with the same properties; anything else, or any
content that does not parse into exactly the expected shape, is ignored and the probe runs
(and rewrites the file). It is written to a temporary file (mode 0600) and renamed over the
old one, so a reader never sees half a file. A remembered answer is not a security
boundary: the launch itself makes the boundary, so a wrong "yes" makes the worker's start
fail (closed), never weaker.

`AGENT_SANDBOX_PROBE_CACHE=off` (or `0`, `no`, `false`) bypasses the file: every process
probes, and nothing is written. `agent-sandbox doctor` always probes afresh.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from agent_sandbox.providers._base import ProbeResult, package_folder

__all__ = ["cache_dir", "cached_probe", "enabled", "entry_name", "file_key", "probe_afresh"]

#: The format of the file; another number is ignored (re-probed, then rewritten).
FORMAT = 1
#: The answers the file keeps (installs, users' kernels, tools): the oldest written go first.
MAX_ENTRIES = 32
#: The environment variable that bypasses the file.
ENV = "AGENT_SANDBOX_PROBE_CACHE"
_OFF = frozenset({"0", "off", "no", "false"})
_SYSCTLS = (
    "/proc/sys/user/max_user_namespaces",
    "/proc/sys/kernel/unprivileged_userns_clone",
    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
    "/proc/sys/kernel/random/boot_id",
)
#: The modules whose code decides a trial's answer (`providers/` is the folder of this one,
#: the others are under `agent_sandbox/`).
_SOURCES = (
    "providers/_probe_cache.py",
    "providers/_base.py",
    "providers/_bwrap.py",
    "providers/_unshare.py",
    "_worker/_ns_launch.py",
    "providers/_landlock.py",
    "_landlock_sys.py",
    "_worker/_inworker.py",
    "providers/_view.py",
)
_afresh = False


def enabled() -> bool:
    """Whether answers are read from and written to the file in this process."""
    return not _afresh and os.environ.get(ENV, "").strip().lower() not in _OFF


def probe_afresh() -> None:
    """Bypass the file for the rest of this process (`agent-sandbox doctor`)."""
    global _afresh
    _afresh = True


def cache_dir() -> str:
    """`$XDG_CACHE_HOME/agent-sandbox` (default `~/.cache/agent-sandbox`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "agent-sandbox")


def file_key(path: str) -> list[Any]:
    """What identifies an executable or a source file: resolved path, size, mtime, inode,
    mode (the setuid bit included); `None` parts when it cannot be read."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return [real, None]
    return [real, st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode]


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _common_key() -> dict[str, Any]:
    uname = os.uname()
    try:
        userns = os.readlink("/proc/self/ns/user")
    except OSError:
        userns = None
    return {
        "kernel": [uname.sysname, uname.release, uname.version, uname.machine],
        "sysctl": {path: _read(path) for path in _SYSCTLS},
        "userns": userns,
        "user": [os.getuid(), os.geteuid(), os.getgid(), os.getegid()],
        "python": [sys.version, *file_key(sys.executable)],
        # The package's `__init__.py` holds its version; the modules hold the trials.
        "package": [
            file_key(getattr(sys.modules.get("agent_sandbox"), "__file__", None) or "?"),
            *(file_key(_source(name)) for name in _SOURCES),
        ],
    }


def _source(name: str) -> str:
    """Where a module of `_SOURCES` is on disk (the providers' folder is mapped apart)."""
    if name.startswith("providers/"):
        return os.path.join(os.path.dirname(os.path.realpath(__file__)), name[len("providers/") :])
    return os.path.join(package_folder(), name)


def _trusted(st: os.stat_result, kind: int) -> bool:
    return (
        stat.S_IFMT(st.st_mode) == kind
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _load(path: str) -> dict[str, Any]:
    """The file's entries, or {} when it is missing, untrusted or malformed."""
    try:
        if not _trusted(os.stat(os.path.dirname(path)), stat.S_IFDIR):
            return {}
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        if not _trusted(os.fstat(fd), stat.S_IFREG):
            return {}
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = json.loads(fh.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _decode(name: str, entry: Any, key: Mapping[str, Any]) -> ProbeResult | None:
    """The remembered answer when `entry` has exactly the expected shape and key."""
    if not isinstance(entry, dict) or set(entry) != {"key", "result"}:
        return None
    if entry["key"] != key:
        return None
    result = entry["result"]
    if not isinstance(result, dict) or set(result) != {"version", "details"}:
        return None
    version, details = result["version"], result["details"]
    if not isinstance(version, str) or not isinstance(details, dict):
        return None
    if not all(isinstance(k, str) and isinstance(v, (str, bool)) for k, v in details.items()):
        return None
    return ProbeResult(name, True, version=version, details=details)


def entry_name(name: str, key: Mapping[str, Any]) -> str:
    """Where the answer of probe `name` under `key` is filed: `name:<crc32 of the key>`.

    Only an index: the entry's key is compared in full before its answer is used (a
    collision costs a probe, never a wrong answer)."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return f"{name}:{zlib.crc32(text.encode()):08x}"


def _store(path: str, name: str, key: Mapping[str, Any], result: ProbeResult) -> None:
    """Add one answer to the file: a new file (0600, `O_EXCL`, a random name) renamed over
    the old one, so a link planted at the file's path is replaced, never written through;
    only in a folder of this user's that no one else can write."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _trusted(os.stat(directory), stat.S_IFDIR):
            return  # a folder others can write: nothing of ours is written there
        entries = _load(path)
        filed = entry_name(name, key)
        entries.pop(filed, None)  # re-filed last: the newest
        entries[filed] = {
            "key": key,
            "result": {"version": result.version, "details": dict(result.details)},
        }
        for old in list(entries)[: max(0, len(entries) - MAX_ENTRIES)]:
            del entries[old]
        fd, tmp = tempfile.mkstemp(prefix=".probes-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as fh:  # mkstemp makes it 0600
                json.dump({"format": FORMAT, "entries": entries}, fh)  # in writing order
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except (OSError, TypeError, ValueError):
        pass  # a cache that cannot be written only costs the next process a probe


def cached_probe(name: str, tool: Mapping[str, Any], run: Callable[[], ProbeResult]) -> ProbeResult:
    """The answer remembered for probe `name` under the current key (`tool` adds what the
    trial runs), or `run()`'s, remembered when the trial worked and its details are plain."""
    if not enabled():
        return run()
    key = json.loads(json.dumps({**_common_key(), "tool": tool}))  # as it reads back
    path = os.path.join(cache_dir(), "probes.json")
    remembered = _decode(name, _load(path).get(entry_name(name, key)), key)
    if remembered is not None:
        return remembered
    result = run()
    if result.available and result.name == name and not result.reason:
        _store(path, name, key, result)
    return result
