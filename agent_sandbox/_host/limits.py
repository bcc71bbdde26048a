"""Resource limits for every provider: per-worker cgroups made by the parent.

What it enforces, on top of the rlimits the worker applies to itself
(`_worker.setup.apply_rlimits`: CPU, address space, file size, open files, no core):

* memory: a cgroup v1 `memory` group per worker (`memory.limit_in_bytes` and the memsw
  limit at `limits.memory_mb`), or `memory.max` on a unified (v2) host that delegates the
  controller. It bounds the worker and every child together, which an rlimit cannot.
* processes: a cgroup v1 `pids` group (`pids.max`), or `pids.max` on v2; `RLIMIT_NPROC` is
  no bound for uid 0, which the kernel exempts.
* CPU share: a cgroup v1 `cpu` group (`cpu.cfs_quota_us` over a 100 ms period), or
  `cpu.max` on v2, at `limits.cpu_cores`: the worker and every process it starts together
  get at most that many cores, however many of them spin (`RLIMIT_CPU` bounds each
  process's total CPU time only).
* a certain end: a cgroup v2 group per worker, whose `cgroup.kill` ends the worker and every
  descendant, including setsid and double-forked ones a process-group kill misses.

How a hit is reported: after every call the parent reads the groups' event counters
(`memory.oom_control` oom_kill, `pids.events` max, `WorkerCgroups.new_events`);
`limit_report.record_limit_hits` turns a new event, a worker killed by the memory cgroup, or
a limit error the worker reported into a `limits.<name>` denial in the result, and the
worker is replaced.

What it does NOT enforce: anything on a host where the parent cannot write the cgroupfs
(no cgroup, or not delegated): then only the rlimits and the wall-clock timeout hold, and
`doctor` says so. A worker that can write the cgroupfs can leave its groups: the kernel
providers never expose it (Landlock grants no `/sys`; bwrap does not mount it), the
`subprocess` provider does not hide it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from agent_sandbox._host.cgroups import (
    hierarchies,
    hierarchy_bases,
    read_or_empty,
    unified_controllers,
)

__all__ = [
    "WorkerCgroups",
    "cgroup_support",
    "hierarchy_bases",
    "limit_denial_rule",
    "start_cgroups",
]

_MB = 1024 * 1024
_PREFIX = "agent-sandbox-"
#: The CPU quota's period (microseconds): `limits.cpu_cores` of it per period.
_CPU_PERIOD = 100_000


def cgroup_support() -> dict[str, Any]:
    """What this machine offers for per-worker limits (for `doctor` and the tests)."""
    hs = hierarchies()
    unified = hs.get("unified")
    delegated = unified_controllers(unified) if unified else set()
    return {
        "memory": "memory-v1" in hs or "memory" in delegated,
        "processes": "pids-v1" in hs or "pids" in delegated,
        "cpu": "cpu-v1" in hs or "cpu" in delegated,
        "kill": unified is not None,
        "hierarchies": {k: h.base for k, h in sorted(hs.items())},
    }


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _counter_bytes(text: bytes, key: str) -> int:
    needle = key.encode() + b" "
    for line in text.splitlines():
        if line.startswith(needle):
            value = line[len(needle) :].strip()
            return int(value) if value.isdigit() else 0
    return 0


def _counter(text: str, key: str) -> int:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


# The arguments are the `cgroup.procs` files, `--`, then the command to exec.
_JOIN_SCRIPT = (
    'while [ "$1" != -- ]; do echo $$ > "$1" || '
    '{ echo "agent-sandbox: could not join the cgroup $1" >&2; exit 125; }; shift; done; '
    'shift; exec "$@"'
)


class WorkerCgroups:
    """The cgroups of one worker: created before launch, joined right after, removed at end.

    `create()` returns None when the parent cannot make any group here. Every method
    tolerates a group that disappeared.
    """

    def __init__(self, dirs: Mapping[str, str]) -> None:
        self.dirs = dict(dirs)
        self._final: dict[str, int] | None = None
        self._fds: dict[str, int] = {}
        #: The event counters' paths by group key, joined once (`new_events`).
        self._event_paths: dict[str, str] = {}
        self._seen = self.events()
        with _LIVE_LOCK:
            _LIVE.add(self)

    @classmethod
    def create(
        cls, worker_id: str, limits: Any, *, extra_processes: int = 0, extra_mb: int = 0
    ) -> WorkerCgroups | None:
        """Make the groups for one worker with `limits` (a `LimitsPolicy` or its dict);
        `extra_*` is room for a launcher inside the groups (its own tasks and memory)."""
        memory_mb = int(_limit(limits, "memory_mb", 2048)) + extra_mb
        processes = int(_limit(limits, "processes", 64)) + extra_processes
        quota = max(1000, int(float(_limit(limits, "cpu_cores", 1.0)) * _CPU_PERIOD))
        from agent_sandbox._host import lifecycle

        # Named for this agent's owner token (`_host/guardian.py`): a sweeper removes it
        # only once it has proven the owner dead by taking the owner's lock.
        name = f"{_PREFIX}{lifecycle.owner_tag()}-{worker_id}"
        dirs: dict[str, str] = {}
        hs = hierarchies()
        try:
            unified = hs.get("unified")
            if unified is not None:
                path = os.path.join(unified.base, name)
                os.mkdir(path, 0o755)
                dirs["unified"] = path
                delegated = unified_controllers(unified)
                if "memory" in delegated:
                    _write(os.path.join(path, "memory.max"), str(memory_mb * _MB))
                    with contextlib.suppress(OSError):
                        _write(os.path.join(path, "memory.swap.max"), "0")
                    dirs["memory-v2"] = path
                if "pids" in delegated:
                    _write(os.path.join(path, "pids.max"), str(processes))
                    dirs["pids-v2"] = path
                if "cpu" in delegated:
                    _write(os.path.join(path, "cpu.max"), f"{quota} {_CPU_PERIOD}")
                    dirs["cpu-v2"] = path
            memory = hs.get("memory-v1")
            if memory is not None and "memory-v2" not in dirs:
                path = os.path.join(memory.base, name)
                os.mkdir(path, 0o755)
                dirs["memory-v1"] = path
                _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_mb * _MB))
                with contextlib.suppress(OSError):  # absent without swap accounting
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_mb * _MB))
            pids = hs.get("pids-v1")
            if pids is not None and "pids-v2" not in dirs:
                path = os.path.join(pids.base, name)
                os.mkdir(path, 0o755)
                dirs["pids-v1"] = path
                _write(os.path.join(path, "pids.max"), str(processes))
            cpu = hs.get("cpu-v1")
            if cpu is not None and "cpu-v2" not in dirs:
                path = os.path.join(cpu.base, name)
                os.mkdir(path, 0o755)
                dirs["cpu-v1"] = path
                _write(os.path.join(path, "cpu.cfs_period_us"), str(_CPU_PERIOD))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        except OSError:
            WorkerCgroups(dirs).remove(timeout=0)
            raise
        return cls(dirs) if dirs else None

    # -- membership -------------------------------------------------------------------------

    def attach(self, pid: int) -> None:
        """Move `pid` into every group (its later children follow it)."""
        for path in sorted(set(self.dirs.values())):
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def joining_argv(self, argv: Sequence[str]) -> tuple[str, ...]:
        """`argv` behind a shell that joins every group, then execs `argv`.

        For a launcher whose process tree is not known in advance (firejail forks helpers
        of its own), so the parent cannot attach it without racing its forks: joined before
        the exec, every process of the sandbox is born inside the groups. It costs the
        start one cgroup migration on its critical path (an RCU grace period here, about
        15 ms), since forks wait for a migration in progress. A group that cannot be joined
        stops the start (exit 125, the reason in the worker log).
        """
        files = sorted({os.path.join(path, "cgroup.procs") for path in self.dirs.values()})
        return ("/bin/sh", "-c", _JOIN_SCRIPT, "agent-sandbox-join", *files, "--", *argv)

    def attach_at_depth(
        self, root: int, depth: int, timeout: float, alive: Callable[[], bool]
    ) -> int | None:
        """Attach the first process found `depth` levels below `root`; return its pid.

        For launchers with a known shape (bwrap and unshare: two processes above the
        worker). The worker forks nothing before its handshake, so attaching it while it
        boots covers everything it will start, and the migration overlaps its start-up
        instead of blocking the launcher's forks. The launcher's own processes stay
        outside: they only wait and reap. None when no such process appeared in time (or
        the launcher died); `attach_tree` after the handshake then places it.
        """
        deadline = time.monotonic() + timeout
        while alive() and time.monotonic() < deadline:
            for pid, level in _descendants(root):
                if level == depth:
                    with contextlib.suppress(ProcessLookupError):  # a transient process
                        self.attach(pid)
                        return pid
            time.sleep(0.0005)
        return None

    def attach_tree(self, root: int, min_depth: int = 0) -> int:
        """Move every process of the tree at `min_depth` or deeper into every group.

        Processes already in a group are skipped (one read per group), so after
        `attach_at_depth` this is a cheap check that nothing was left out. Returns how many
        moves it made.
        """
        members = {
            path: set(read_or_empty(os.path.join(path, "cgroup.procs")).split())
            for path in self.dirs.values()
        }
        tree = [(root, 0), *_descendants(root)]
        moved = 0
        for path, inside in sorted(members.items()):
            for pid, level in tree:
                if level < min_depth or str(pid) in inside:
                    continue
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    _write(os.path.join(path, "cgroup.procs"), str(pid))
                    moved += 1
        return moved

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in set(self.dirs.values()):
            for word in read_or_empty(os.path.join(path, "cgroup.procs")).split():
                out.add(int(word))
        return sorted(out)

    # -- events -----------------------------------------------------------------------------

    def events(self) -> dict[str, int]:
        """Counters of limit hits so far: `memory` (OOM kills), `processes` (fork refusals).

        After `kill()` the counters are the ones read just before the groups were emptied.
        """
        if self._final is not None:
            return dict(self._final)
        out = {"memory": 0, "processes": 0, "cpu_usec": 0}
        if "unified" in self.dirs:
            text = read_or_empty(os.path.join(self.dirs["unified"], "cpu.stat"))
            out["cpu_usec"] = _counter(text, "usage_usec")
        if "memory-v1" in self.dirs:
            text = read_or_empty(os.path.join(self.dirs["memory-v1"], "memory.oom_control"))
            out["memory"] = _counter(text, "oom_kill")
        if "memory-v2" in self.dirs:
            text = read_or_empty(os.path.join(self.dirs["memory-v2"], "memory.events"))
            out["memory"] = _counter(text, "oom_kill")
        peak = self._memory_peak()
        if peak is not None:
            out["memory_peak"] = peak
        for key in ("pids-v1", "pids-v2"):
            if key in self.dirs:
                out["processes"] = _counter(
                    read_or_empty(os.path.join(self.dirs[key], "pids.events")), "max"
                )
        for key in ("cpu-v1", "cpu-v2"):
            if key in self.dirs:
                out["cpu_throttled"] = _counter(
                    read_or_empty(os.path.join(self.dirs[key], "cpu.stat")), "nr_throttled"
                )
        return out

    def _memory_peak(self) -> int | None:
        """The most memory the group has held (bytes): v2 `memory.peak` (Linux 5.19 and
        later), v1 `memory.max_usage_in_bytes`; None where neither can be read."""
        for key, file in (("memory-v2", "memory.peak"), ("memory-v1", "memory.max_usage_in_bytes")):
            if key in self.dirs:
                text = read_or_empty(os.path.join(self.dirs[key], file)).strip()
                if text.isdigit():
                    return int(text)
        return None

    def memory_peak(self) -> int | None:
        """The worker's peak memory in bytes as its memory cgroup counted it (the worker's
        whole life, launcher included); None without a memory group that reports it. After
        `kill()`, the figure read just before the groups were emptied."""
        if self._final is not None:
            return self._final.get("memory_peak")
        return self._memory_peak()

    def new_events(self) -> list[str]:
        """The limit names hit since the last call of this method (`memory`, `processes`).

        Run after every call, so it reads only the two counters it compares, through
        descriptors opened once (`pread` at offset 0 makes the kernel render the file
        afresh): no `cpu.stat`, no open and close per call.
        """
        if self._final is not None:
            now = self._final
        else:
            now = {"memory": 0, "processes": 0}
            for key, file, counter, name in _EVENT_FILES:
                path = self._event_paths.get(key)
                if path is None:
                    if key not in self.dirs:
                        continue
                    path = self._event_paths[key] = os.path.join(self.dirs[key], file)
                now[name] = _counter_bytes(self._pread(path), counter)
        seen = self._seen
        hit = [name for name in _EVENT_NAMES if now.get(name, 0) > seen.get(name, 0)]
        if hit or any(now.get(name, 0) != seen.get(name, 0) for name in _EVENT_NAMES):
            self._seen = {**seen, **{name: now.get(name, 0) for name in _EVENT_NAMES}}
        return hit

    def _pread(self, path: str) -> bytes:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return b""
            self._fds[path] = fd
        try:
            return os.pread(fd, 4096, 0)
        except OSError:
            return b""

    def _close_fds(self) -> None:
        fds, self._fds = getattr(self, "_fds", {}), {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self._close_fds()

    def cpu_seconds(self) -> float:
        """CPU time used by every process of the worker so far (v2 `cpu.stat`; 0 without)."""
        return self.events().get("cpu_usec", 0) / 1e6

    # -- end --------------------------------------------------------------------------------

    def kill(self) -> None:
        """Kill every process in the groups (cgroup.kill on v2, else SIGKILL each pid)."""
        if self._final is None:
            self._final = self.events()
            self._close_fds()
        unified = self.dirs.get("unified")
        if unified is not None:
            with contextlib.suppress(OSError):
                _write(os.path.join(unified, "cgroup.kill"), "1")
        for pause in _KILL_PAUSES:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                if pid <= 0:
                    continue  # a member this pid namespace cannot see: never kill(0)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(pause)

    def remove(self, *, timeout: float = 2.0) -> bool:
        """Remove the groups (they must be empty: call `kill()` first); True when all went."""
        self._close_fds()
        deadline = time.monotonic() + timeout
        left = sorted(set(self.dirs.values()), key=len, reverse=True)
        while left:
            remaining = []
            for path in left:
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    remaining.append(path)
            left = remaining
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if not left:
            with _LIVE_LOCK:
                _LIVE.discard(self)
        return not left


#: `kill()`'s pauses between its reads of the groups' members: killed processes leave the
#: groups within a millisecond or two, so it looks again after 0.5 ms, then less often; 50
#: reads over 0.24 s in all before it gives up (it slept 5 ms before every look again, which
#: every stateless call's end paid once: a fresh process's first result waited for it).
_KILL_PAUSES = (0.0005, 0.001, 0.002, 0.004) + (0.005,) * 46

_LIVE: weakref.WeakSet[WorkerCgroups] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _remove_left_over() -> None:
    """At exit, end and remove the groups of workers discarded in the background."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for groups in live:
        with contextlib.suppress(OSError):
            groups.kill()
            groups.remove(timeout=1.0)


def _limit(limits: Any, key: str, default: float) -> Any:
    if isinstance(limits, Mapping):
        return limits.get(key, default)
    return getattr(limits, key, default)


def _descendants(pid: int) -> Iterator[tuple[int, int]]:
    """Every current descendant of `pid`, with its depth below it (children are 1)."""
    stack = [(pid, 0)]
    while stack:
        current, level = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            for word in read_or_empty(f"/proc/{current}/task/{tid}/children").split():
                child = (int(word), level + 1)
                yield child
                stack.append(child)


#: The files `new_events` reads: (group key, file, counter, event name); a later row for the
#: same event wins, as in `events()`.
_EVENT_FILES = (
    ("memory-v1", "memory.oom_control", "oom_kill", "memory"),
    ("memory-v2", "memory.events", "oom_kill", "memory"),
    ("pids-v1", "pids.events", "max", "processes"),
    ("pids-v2", "pids.events", "max", "processes"),
)

#: The limit name a cgroup event maps to, and the policy setting that raises it.
_EVENT_RULES = {
    "memory": ("limits.memory", "memory_mb"),
    "processes": ("limits.processes", "processes"),
}


_EVENT_NAMES = tuple(sorted(_EVENT_RULES))


def limit_denial_rule(event: str) -> tuple[str, str]:
    """(rule, policy setting) for a cgroup event name (`memory`, `processes`)."""
    return _EVENT_RULES[event]


def start_cgroups(
    worker_id: str,
    policy: Any,
    worker_depth: int | None,
    *,
    launcher_tasks: int = 0,
    launcher_mb: int = 0,
) -> WorkerCgroups | None:
    """Create the worker's groups before launch (None when the machine offers none).

    A launcher that joins the groups itself (`worker_depth` None: firejail) gets two
    processes of slack in `pids.max`, since its own processes count too; a launcher of
    known shape stays outside the groups (see `WorkerCgroups.attach_at_depth`).
    """
    from agent_sandbox._errors import WorkerStartError

    extra = (2 if worker_depth is None else 0) + launcher_tasks
    try:
        return WorkerCgroups.create(
            worker_id, policy.limits, extra_processes=extra, extra_mb=launcher_mb
        )
    except OSError as exc:
        raise WorkerStartError(f"could not create the worker's cgroups ({exc})") from None
