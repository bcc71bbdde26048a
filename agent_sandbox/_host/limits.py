"""Resource limits for every provider: per-worker cgroups made by the parent, and the report.

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
(`memory.oom_control` oom_kill, `pids.events` max); a new event, a worker killed by the
memory cgroup, or a limit error the worker reported becomes a `limits.<name>` denial in
the result, and the worker is replaced.

What it does NOT enforce: anything on a host where the parent cannot write the cgroupfs
(no cgroup, or not delegated): then only the rlimits and the wall-clock timeout hold, and
`doctor` says so. A worker that can write the cgroupfs can leave its groups: the kernel
providers never expose it (Landlock grants no `/sys`; bwrap does not mount it), the
`subprocess` provider does not hide it.

This module is longer than 600 lines because it came whole from `providers/_limits.py`
(files move apart from behaviour changes); the limits report is to be cut from the groups.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import signal
import stat
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
    "REPLACING_RULES",
    "GuestLimits",
    "WorkerCgroups",
    "cgroup_support",
    "hierarchy_bases",
    "limit_denial_rule",
    "record_limit_hits",
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


#: Limit rules after which the worker is replaced (its state is suspect or exhausted).
REPLACING_RULES = frozenset(
    {
        "limits.cpu",
        "limits.file-size",
        "limits.memory",
        "limits.open-files",
        "limits.output",
        "limits.processes",
        "limits.scratch",
    }
)
_REPORTED_BY_WORKER = frozenset({"limits.output"})
_SETTINGS = {
    "limits.cpu": "cpu_seconds",
    "limits.file-size": "file_size_mb",
    "limits.memory": "memory_mb",
    "limits.open-files": "open_files",
    "limits.output": "output_bytes",
    "limits.processes": "processes",
    "limits.scratch": "scratch_mb",
}


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


class _ScratchOver(Exception):
    """Raised by `scratch_over`'s walk once the total passes the limit."""


def scratch_over(path: str, limit_bytes: int, *, max_entries: int = 200_000) -> bool:
    """Whether the host directory `path` holds more than `limit_bytes` (allocated blocks),
    walking it without following links; a tree of more than `max_entries` entries counts as
    over. The bound where scratch is a host directory (the `subprocess` and `firejail`
    providers): checked after every call, so one call
    can overshoot until RLIMIT_FSIZE or the disk stops it."""
    try:
        with os.scandir(path) as listing:
            if next(listing, None) is None:
                return False  # empty (the usual case after a call): nothing to add up
    except OSError:
        return False  # not listable: the walk below would skip it as well
    from agent_sandbox.providers._walk import TooManyEntries, walk_capped

    total = 0

    def visit(entry: os.DirEntry[str], is_dir: bool) -> bool:
        nonlocal total
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return False
        total += st.st_blocks * 512
        if total > limit_bytes:
            raise _ScratchOver
        return is_dir

    try:
        walk_capped(path, visit, max_entries)
    except (TooManyEntries, _ScratchOver):
        return True
    return False


#: The most of a guest's limit report the host reads (a few counters).
REPORT_BYTES = 4096


def _read_report(path: str) -> Any:
    """The JSON of a limit report in the VM's run directory, which QEMU (the guest's side)
    can write: opened without following a link and without blocking on a FIFO, read only
    when it is a regular file, at most REPORT_BYTES; None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return json.loads(os.read(fd, REPORT_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class GuestLimits:
    """The limit counters a VM's guest agent reported (`LaunchPlan.limit_reports`, written
    by the host relay): refused forks of the guest's pids cgroup, memory-limit and OOM-kill
    counts of its memory cgroup; or a gVisor worker's (`source="gvisor"`): the calls that
    ended with the sandbox at `limits.processes`. They come from inside the VM or the
    sandbox, the worker's side of the boundary, so the host cannot take them as facts: each
    hit says it was reported by that side and is unverified. For a VM's memory the host adds
    what it measures itself: how much of the guest's RAM QEMU holds as private (written)
    pages since the restore, which a real hit of `limits.memory_mb` cannot be below (the
    worker's charge at the template's save aside); a report the measurement contradicts
    says so."""

    #: The worker's memory already in the template when it was saved (not private pages).
    TEMPLATE_SLACK_MB = 64

    def __init__(self, path: str, launcher_pid: int, source: str = "qemu") -> None:
        self.path = path
        self.launcher_pid = launcher_pid
        #: Who writes the report: "qemu" (the guest agent, through the host relay) or
        #: "gvisor" (the worker itself, in its socket directory: `_worker/server.py`).
        self.source = source
        self._seen: dict[str, int] = {}
        self._stamp = 0

    def new_hits(self, policy: Any) -> list[tuple[str, str]]:
        """(rule, why) for each counter grown since the last call of this method."""
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except OSError:
            return []
        if stamp == self._stamp:
            return []
        self._stamp = stamp
        now = _read_report(self.path)
        if not isinstance(now, dict):
            return []
        grown = {
            key: int(value) - self._seen.get(key, 0)
            for key, value in now.items()
            if isinstance(value, int) and value > self._seen.get(key, 0)
        }
        self._seen.update({k: int(v) for k, v in now.items() if isinstance(v, int)})
        hits: list[tuple[str, str]] = []
        if self.source == "gvisor":
            if grown.get("pids_at_limit"):
                hits.append(
                    (
                        "limits.processes",
                        "the worker counted as many processes in the gVisor sandbox as "
                        f"`processes = {policy.limits.processes}` at the end of the call "
                        "(gVisor's kernel refuses a fork past it, RLIMIT_NPROC, with EAGAIN); "
                        "the host cannot see the sandbox's processes, so this is the worker "
                        "side's word (unverified)",
                    )
                )
            return hits
        if grown.get("pids_max"):
            hits.append(
                (
                    "limits.processes",
                    f"the guest agent reported {grown['pids_max']} fork(s) refused at "
                    f"`processes = {policy.limits.processes}` by the VM's pids cgroup; the "
                    "host cannot see the guest's processes, so this is the worker side's "
                    "word (unverified)",
                )
            )
        if grown.get("memory_oom_kill") or grown.get("memory_max"):
            what = (
                f"{grown['memory_oom_kill']} process(es) killed by the VM's memory cgroup"
                if grown.get("memory_oom_kill")
                else "allocations held at the VM's memory cgroup limit"
            )
            hits.append(
                ("limits.memory", f"the guest agent reported {what}; " + self._measured(policy))
            )
        return hits

    def _measured(self, policy: Any) -> str:
        limit = int(policy.limits.memory_mb)
        written = guest_ram_written_mb(self.launcher_pid)
        if written is None:
            return (
                "the host could not measure the guest's RAM, so this is the worker side's "
                "word (unverified)"
            )
        if written + self.TEMPLATE_SLACK_MB < limit:
            return (
                f"the host measured only {written} MiB of the guest's RAM written since its "
                f"restore, less than `memory_mb = {limit}`: the report is not borne out "
                "(the worker side's word, unverified)"
            )
        return (
            f"the host measured {written} MiB of the guest's RAM written since its restore "
            f"(QEMU's private pages), consistent with `memory_mb = {limit}`; the hit itself "
            "is the worker side's word"
        )


def guest_ram_written_mb(launcher_pid: int) -> int | None:
    """The private (written) pages of the guest-RAM mapping of the QEMU below
    `launcher_pid`, in MiB; None when it cannot be read."""
    try:
        with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as fh:
            children = [int(p) for p in fh.read().split()]
        for pid in children:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            ram = None
            for arg in argv:
                if b"mem-path=" in arg:
                    ram = arg.split(b"mem-path=", 1)[1].split(b",", 1)[0]
            if ram is None:
                continue
            total_kib, inside = 0, False
            with open(f"/proc/{pid}/smaps", "rb") as fh:
                for line in fh:
                    if not line.split(None, 1)[0].endswith(b":"):  # a mapping's first line
                        inside = line.rstrip().endswith(b" " + ram)
                    elif inside and line.startswith((b"Private_Dirty:", b"Private_Clean:")):
                        total_kib += int(line.split()[1])
            return total_kib // 1024
    except (OSError, ValueError):
        return None
    return None


def _memory_hint(builder: Any, cgroups: WorkerCgroups | None, limit_mb: int) -> tuple[str, str]:
    """(hint, what was measured) for a `limits.memory` hit: the host's own cgroup peak,
    else the peak the worker reported with its MemoryError, and the allocation it says
    failed (`agent_sandbox._hints.memory_hint`)."""
    from agent_sandbox._hints import memory_hint

    report = getattr(builder, "memory_report", None) or {}
    return memory_hint(
        limit_mb,
        measured_peak=cgroups.memory_peak() if cgroups is not None else None,
        worker_peak=report.get("peak"),
        asked=report.get("asked"),
    )


def record_limit_hits(
    builder: Any,
    cgroups: WorkerCgroups | None,
    policy: Any,
    *,
    scratch: str = "",
    guest: GuestLimits | None = None,
    scratch_in_memory: int | None = None,
) -> bool:
    """Turn every limit hit of the call into a `limits.<name>` denial in `builder`.

    Sources: new cgroup events (an OOM kill, a refused fork), a host `scratch` directory over
    `limits.scratch_mb` (`scratch_over`), and a limit error the worker reported
    (MemoryError, EFBIG, ENOSPC, EMFILE, EAGAIN). A worker killed by the memory cgroup is
    reported as `limits.memory`, not as a crash; when its scratch is a tmpfs whose files
    held half of `memory_mb` or more (`scratch_in_memory`, bytes), the denial says the
    files filled it. Returns True when the worker must be replaced.
    """
    hits: list[str] = []
    why: dict[str, str] = {}
    if cgroups is not None:
        hits += [limit_denial_rule(event)[0] for event in cgroups.new_events()]
    if guest is not None:
        for rule, reason in guest.new_hits(policy):
            if rule not in hits:
                hits.append(rule)
                why[rule] = reason
    if scratch and scratch_over(scratch, int(policy.limits.scratch_mb) * _MB):
        hits.append("limits.scratch")
    memory = int(policy.limits.memory_mb)
    if (
        "limits.memory" in hits
        and "limits.memory" not in why
        and scratch_in_memory is not None
        and scratch_in_memory * 2 >= memory * _MB
    ):
        why["limits.memory"] = (
            f"the call went over `memory_mb = {memory}`, and {scratch_in_memory // _MB} MB "
            "of it were files in the scratch directory: scratch is a tmpfs here, so files "
            "written to it are held in memory (not on disk) and count toward memory_mb; "
            "write less to scratch or raise memory_mb"
        )
    error = builder.error
    if error is not None and error.kind == "limit" and error.rule in REPLACING_RULES:
        hits.append(error.rule)
    # A limit the worker enforced itself and reported as a denial (output: also when the
    # code caught the refusal and finished).
    hits += [d.rule for d in builder.denials if d.rule in _REPORTED_BY_WORKER]
    if not hits:
        return False  # the usual call: nothing to record
    from agent_sandbox._denial import Denial
    from agent_sandbox._hints import grant_hint
    from agent_sandbox._host.result import RunError

    have = {d.rule for d in builder.denials}
    limits = policy.limits
    for rule in dict.fromkeys(hits):
        if rule in have:
            continue
        setting = _SETTINGS[rule]
        value = getattr(limits, setting)
        hint = grant_hint({f"limits.{setting}": value * 2})
        over = f"the call went over `{setting} = {value}`"
        if rule == "limits.memory":
            hint, measured = _memory_hint(builder, cgroups, memory)
            over = f"{over}; {measured}"
        denial = Denial(
            rule=rule,
            action="use",
            target=setting,
            policy=policy.name,
            detail=(
                f"{why[rule]}; the worker is replaced and its variables are lost"
                if rule in why
                else f"{over}; the worker is replaced and its variables are lost"
            ),
            hint=hint,
        )
        builder.add_denial(denial)
        # A call that completed keeps its value; the denial says what was hit.
        if error is not None and error.kind in ("crashed", "exception"):
            builder.error = RunError(
                kind="limit",
                type="LimitExceeded",
                message=denial.message(),
                traceback=error.traceback if error is not None else "",
                rule=rule,
            )
            error = builder.error
    return any(rule in REPLACING_RULES for rule in hits)
