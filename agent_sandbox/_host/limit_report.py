"""The limits report of a call: every limit hit becomes a `limits.<name>` denial.

After every call the parent turns into denials (`record_limit_hits`): new events of the
worker's cgroups (`limits.WorkerCgroups.new_events`: an OOM kill, a refused fork), a host
scratch directory over `limits.scratch_mb` (`scratch_over`), the counters a VM's guest agent
or a gVisor worker reported (`GuestLimits`, the worker side's word), and a limit error the
worker reported itself. A hit of a rule in `REPLACING_RULES` replaces the worker.
"""

from __future__ import annotations

import json
import os
from typing import Any

from agent_sandbox._host.hostfile import read_regular
from agent_sandbox._host.limits import WorkerCgroups, limit_denial_rule

__all__ = [
    "REPLACING_RULES",
    "GuestLimits",
    "guest_ram_written_mb",
    "record_limit_hits",
    "scratch_over",
]

_MB = 1024 * 1024


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
    when it is a regular file, at most REPORT_BYTES (`hostfile.read_regular`); None for
    anything else."""
    try:
        return json.loads(read_regular(path, REPORT_BYTES))
    except (OSError, ValueError):
        return None


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
