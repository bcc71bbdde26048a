"""Resource limits in every provider: per-worker cgroups, limit denials, worker replacement."""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._denial import RULES
from agent_sandbox._host.cgroups import hierarchies
from agent_sandbox._host.intake.builder import ResultBuilder
from agent_sandbox._host.limit_report import REPLACING_RULES, record_limit_hits
from agent_sandbox._host.limits import WorkerCgroups, cgroup_support
from agent_sandbox._host.result import RunError

from .conftest import skip_unless_available

SUPPORT = cgroup_support()
needs_cgroups = pytest.mark.skipif(
    not (SUPPORT["memory"] or SUPPORT["processes"] or SUPPORT["kill"]),
    reason="the parent cannot create cgroups here",
)


@pytest.fixture
def groups() -> Iterator[WorkerCgroups]:
    """Real groups for one test (64 MB, 8 processes), ended and removed afterwards."""
    made = WorkerCgroups.create(
        f"w-test{os.getpid()}-{next(_COUNT)}", {"memory_mb": 64, "processes": 8}
    )
    assert made is not None
    try:
        yield made
    finally:
        made.kill()
        made.remove()


_COUNT = itertools.count()


def _members(groups: WorkerCgroups) -> dict[str, list[str]]:
    return {p: Path(p, "cgroup.procs").read_text().split() for p in set(groups.dirs.values())}


class _FakeGroups:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def new_events(self) -> list[str]:
        out, self.events = self.events, []
        return out

    def memory_peak(self) -> int | None:
        return None


def test_every_limit_rule_is_in_the_catalogue() -> None:
    """It only emits rule names documented in RULES."""
    assert set(RULES) >= REPLACING_RULES


def test_worker_limit_error_becomes_a_denial_and_replaces_the_worker() -> None:
    """It turns a limit error the worker reported into a denial naming the setting."""
    builder = ResultBuilder()
    builder.error = RunError(kind="limit", type="OSError", message="EFBIG", rule="limits.file-size")
    policy = Policy(name="p", limits={"file_size_mb": 3})
    assert record_limit_hits(builder, None, policy) is True
    [denial] = builder.denials
    assert (denial.rule, denial.target, denial.hint) == (
        "limits.file-size",
        "file_size_mb",
        "[[grant]]\nlimits.file_size_mb = 6",
    )


def test_an_oom_kill_is_reported_as_memory_not_as_a_crash() -> None:
    """It reports a worker killed by its memory cgroup as limits.memory."""
    builder = ResultBuilder()
    builder.error = RunError(kind="crashed", type="WorkerCrashed", message="SIGKILL")
    assert record_limit_hits(builder, _FakeGroups(["memory"]), Policy(name="p")) is True  # type: ignore[arg-type]
    assert builder.error is not None and builder.error.rule == "limits.memory"
    assert [d.rule for d in builder.denials] == ["limits.memory"]


class _PeakGroups(_FakeGroups):
    def __init__(self, events: list[str], peak: int | None) -> None:
        super().__init__(events)
        self.peak = peak

    def memory_peak(self) -> int | None:
        return self.peak


def test_a_memory_hit_hint_comes_from_what_was_measured() -> None:
    """It builds the memory hint from the cgroup's peak and the allocation the worker said
    failed, not from doubling, and says where the figures came from."""
    builder = ResultBuilder()
    builder.error = RunError(kind="limit", type="MemoryError", message="", rule="limits.memory")
    builder.memory_report = {"peak": 100 << 20, "asked": 2000 << 20}
    policy = Policy(name="p", limits={"memory_mb": 200})
    assert record_limit_hits(builder, _PeakGroups([], 90 << 20), policy) is True  # type: ignore[arg-type]
    [denial] = builder.denials
    # (100 + 2000) MiB and a quarter: 2625 -> 2688, the next multiple of 64.
    assert denial.hint == "[[grant]]\nlimits.memory_mb = 2688"
    assert "peaked at 90 MiB (measured by the host" in denial.detail
    assert "asked for 2000 MiB" in denial.detail


def test_an_oom_kill_hint_says_the_need_cannot_be_known() -> None:
    """It says, for a worker killed at the limit, the peak it measured and that the doubled
    limit it proposes is a guess."""
    builder = ResultBuilder()
    builder.error = RunError(kind="crashed", type="WorkerCrashed", message="SIGKILL")
    groups = _PeakGroups(["memory"], 2048 << 20)
    assert record_limit_hits(builder, groups, Policy(name="p")) is True  # type: ignore[arg-type]
    [denial] = builder.denials
    assert denial.hint == "[[grant]]\nlimits.memory_mb = 4096"
    assert "peaked at 2048 MiB" in denial.detail and "a guess" in denial.detail


@needs_cgroups
def test_a_memory_cgroup_reports_its_peak(groups: WorkerCgroups) -> None:
    """It reads the group's peak (`memory.peak` or `memory.max_usage_in_bytes`), and keeps
    it once the group is killed."""
    if not SUPPORT["memory"]:
        pytest.skip("no memory cgroup here")
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        groups.attach(proc.pid)
        peak = groups.memory_peak()
        assert peak is not None and peak >= 0
        groups.kill()
        proc.wait(5)
        after = groups.memory_peak()
        assert after is not None and after >= peak
    finally:
        proc.kill()
        proc.wait(5)


def test_a_completed_call_keeps_its_value_and_gets_the_denial() -> None:
    """It lists a swallowed limit hit (a refused fork) without inventing an error."""
    builder = ResultBuilder()
    assert record_limit_hits(builder, _FakeGroups(["processes"]), Policy(name="p")) is True  # type: ignore[arg-type]
    assert builder.error is None and [d.rule for d in builder.denials] == ["limits.processes"]


def test_no_hit_no_denial() -> None:
    """It adds nothing for a call that stayed within its limits."""
    builder = ResultBuilder()
    assert record_limit_hits(builder, _FakeGroups([]), Policy(name="p")) is False  # type: ignore[arg-type]
    assert builder.denials == []


@needs_cgroups
def test_cgroups_are_created_joined_killed_and_removed() -> None:
    """It kills every member, including a setsid grandchild, and removes the groups."""
    groups = WorkerCgroups.create("w-test" + str(os.getpid()), {"memory_mb": 64, "processes": 8})
    assert groups is not None
    proc = subprocess.Popen(["sh", "-c", "setsid sleep 60 & sleep 60"], start_new_session=True)
    try:
        groups.attach(proc.pid)
        deadline = time.monotonic() + 5
        while len(groups.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        members = groups.pids()
        assert proc.pid in members
        groups.kill()
        proc.wait(5)
        assert groups.pids() == []
        assert groups.remove() is True
        assert not any(os.path.exists(d) for d in groups.dirs.values())
        assert not any(Path(f"/proc/{pid}").exists() and _running(pid) for pid in members)
    finally:
        proc.kill()
        groups.kill()
        groups.remove()


def test_kill_looks_again_within_a_millisecond_and_gives_up_as_late_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It reads the groups again 0.5 ms after a kill (killed members leave within a
    millisecond or two; a fixed 5 ms pause was paid by every stateless call's end), and
    still tries for about a quarter of a second before it gives up."""
    from agent_sandbox._host import limits as _limits

    sleeps: list[float] = []
    monkeypatch.setattr(_limits.time, "sleep", sleeps.append)
    killed: list[int] = []
    monkeypatch.setattr(_limits.os, "kill", lambda pid, sig: killed.append(pid))

    class _Dying(WorkerCgroups):
        reads = 0

        def pids(self) -> list[int]:
            self.reads += 1
            return [4242] if self.reads == 1 else []

    dying = _Dying({})
    dying._final = {}
    dying.kill()
    assert (killed, sleeps) == ([4242], [0.0005])

    class _Stuck(WorkerCgroups):
        def pids(self) -> list[int]:
            return [4242]

    sleeps.clear()
    stuck = _Stuck({})
    stuck._final = {}
    stuck.kill()
    assert len(sleeps) == 50 and 0.23 <= sum(sleeps) <= 0.25
    assert sleeps == sorted(sleeps) and max(sleeps) == 0.005


@needs_cgroups
def test_a_launcher_joins_its_groups_before_it_forks(groups: WorkerCgroups) -> None:
    """It puts a launcher and the children it forks at once in the groups, with no attach."""
    launcher = ["sh", "-c", "setsid sleep 60 & echo $!; exec sleep 60"]
    proc = subprocess.Popen(
        groups.joining_argv(launcher), start_new_session=True, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        for path, members in _members(groups).items():
            assert {str(proc.pid), str(grandchild)} <= set(members), path
        assert groups.attach_tree(proc.pid) == 0  # nothing was left out
    finally:
        groups.kill()
        proc.wait(5)


@needs_cgroups
def test_the_worker_below_a_launcher_is_placed_and_the_launcher_is_not(
    groups: WorkerCgroups,
) -> None:
    """It attaches the process at the worker's depth (bwrap, unshare: 2) and only that."""
    # sh -> sh -> sleep: the same shape as bwrap -> init -> worker.
    proc = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60; true'; true"], start_new_session=True)
    try:
        worker = groups.attach_at_depth(proc.pid, 2, 10, lambda: proc.poll() is None)
        assert worker is not None and worker != proc.pid
        assert set(map(tuple, _members(groups).values())) == {(str(worker),)}
        assert groups.attach_tree(proc.pid, min_depth=2) == 0  # nothing left out
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(5)


@needs_cgroups
def test_a_group_that_cannot_be_joined_stops_the_launch(groups: WorkerCgroups) -> None:
    """It never runs the launcher outside its groups: exit 125 and the reason on stderr."""
    argv = groups.joining_argv(["sh", "-c", "echo ran"])
    gone = os.path.dirname(argv[4])  # the first group the launcher joins
    os.rmdir(gone)
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 125
    assert "ran" not in proc.stdout
    assert f"could not join the cgroup {gone}/cgroup.procs" in proc.stderr


def _running(pid: int) -> bool:
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False


@needs_cgroups
def test_a_detached_grandchild_does_not_outlive_its_worker() -> None:
    """It ends a double-forked, setsid process the worker left behind (a plain child worker:
    `landlock`, so the grandchild's pid is a host pid the test can follow)."""
    policy = Policy(
        name="danger-p",
        provider="landlock",
        visible_names="accepted",
        imports={"allow": ["*"]},
        api={"allow": ["process-control"]},
        code={"enabled": False},
    )
    code = """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode()); time.sleep(60); os._exit(0)
    os._exit(0)
int(os.read(r, 32))
"""
    with Sandbox(policy, warm=0) as sb:
        result = sb.run(code)
        worker_id = result.worker_id
    grandchild = int(result.value)
    time.sleep(0.05)
    assert not _running(grandchild)
    for base in SUPPORT["hierarchies"].values():
        assert not [n for n in os.listdir(base) if n.endswith(f"-{worker_id}")]


def test_file_size_limit_is_a_denial_and_the_worker_is_replaced() -> None:
    """It reports limits.file-size and starts the next session call in a fresh worker."""
    policy = Policy(name="p", imports={"allow": ["os"]}, limits={"file_size_mb": 1})
    with Sandbox(policy, warm=0) as sb, sb.session("s") as session:
        first = session.run("x = 1\nopen('big', 'wb').write(b'x' * 2_000_000)")
        assert "limits.file-size" in [d.rule for d in first.denials]
        second = session.run("1 + 1")
        assert second.value == 2 and second.state_lost


def test_open_files_limit_is_a_denial() -> None:
    """It reports limits.open-files when the code runs out of descriptors."""
    policy = Policy(name="p", limits={"open_files": 16})
    with Sandbox(policy, warm=0) as sb:
        result = sb.run("fs = [open('f%d' % i, 'w') for i in range(40)]")
    assert "limits.open-files" in [d.rule for d in result.denials]


def test_cpu_limit_is_a_denial() -> None:
    """It ends a busy loop at limits.cpu_seconds and reports limits.cpu."""
    policy = Policy(
        name="p", code={"enabled": False}, limits={"cpu_seconds": 1, "wall_seconds": 20}
    )
    with Sandbox(policy, warm=0) as sb:
        result = sb.run("while True:\n    pass")
    assert result.error is not None and result.error.rule == "limits.cpu"
    assert "limits.cpu" in [d.rule for d in result.denials]


@pytest.mark.skipif(not SUPPORT["kill"], reason="no cgroup v2 group for CPU accounting here")
def test_cpu_limit_holds_when_the_code_ignores_sigxcpu() -> None:
    """It reports limits.cpu, not a crash, when the hard limit's SIGKILL ends the worker."""
    policy = Policy(
        name="danger-p",
        imports={"allow": ["*"]},
        api={"allow": ["process-control"]},
        code={"enabled": False},
        limits={"cpu_seconds": 1, "wall_seconds": 20},
    )
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    with Sandbox(policy, warm=0) as sb:
        result = sb.run(code)
    assert result.error is not None and result.error.rule == "limits.cpu", result.error


def test_memory_limit_holds_for_every_provider(
    kernel_provider: str, arena: Any, hostile: Any, make_policy: Any
) -> None:
    """It reports limits.memory for an in-process balloon under each kernel provider."""
    code = "hold = []\nwhile True:\n    hold.append(bytearray(16 * 1024 * 1024))"
    result = hostile(kernel_provider, make_policy(arena, limits={"memory_mb": 200}), code)
    assert "limits.memory" in [d.rule for d in result.denials]


_HYBRID_MOUNTS = """\
35 30 0:30 / {root}/memory rw,relatime shared:12 - cgroup cgroup rw,memory
36 30 0:31 / {root}/pids rw,relatime shared:13 - cgroup cgroup rw,pids
37 30 0:32 / {root}/unified rw,relatime shared:14 - cgroup2 cgroup2 rw
38 30 0:33 / {root}/cpu rw,relatime shared:15 - cgroup cgroup rw,cpu
"""
_HYBRID_OWN = "8:pids:/\n4:memory:/job/a\n1:cpu:/\n0::/\n"
_V2_MOUNTS = "29 23 0:26 / {root}/v2 rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
_V2_OWN = "0::/user.slice/app\n"


def test_hierarchies_are_found_on_hybrid_and_pure_v2_hosts(tmp_path: Path) -> None:
    """It finds v1 memory/pids/cpu plus the v2 tree on a hybrid host, and the v2 tree on a v2
    host."""
    for sub in ("memory/job/a", "pids", "unified", "cpu", "v2/user.slice/app"):
        (tmp_path / sub).mkdir(parents=True)
    hybrid = hierarchies(_HYBRID_MOUNTS.format(root=tmp_path), _HYBRID_OWN)
    assert {k: h.base for k, h in hybrid.items()} == {
        "memory-v1": f"{tmp_path}/memory/job/a",
        "pids-v1": f"{tmp_path}/pids/",
        "cpu-v1": f"{tmp_path}/cpu/",
        "unified": f"{tmp_path}/unified/",
    }
    pure = hierarchies(_V2_MOUNTS.format(root=tmp_path), _V2_OWN)
    assert {k: h.base for k, h in pure.items()} == {"unified": f"{tmp_path}/v2/user.slice/app"}
    (tmp_path / "pids").chmod(0o555)
    if os.getuid() != 0:  # root may write anyway; the filter is os.access
        assert "pids-v1" not in hierarchies(_HYBRID_MOUNTS.format(root=tmp_path), _HYBRID_OWN)


def test_output_limit_is_a_denial_and_the_worker_is_replaced() -> None:
    """It reports limits.output and starts the next session call in a fresh worker, also
    when the code caught the refusal and finished."""
    policy = Policy(name="p", limits={"output_bytes": 10_000})
    flood = (
        "x = 1\ntry:\n    while True:\n        print('y' * 1000)\nexcept Exception:\n    pass\n42"
    )
    with Sandbox(policy, warm=0) as sb, sb.session("s") as session:
        first = session.run(flood)
        assert "limits.output" in [d.rule for d in first.denials]
        assert first.value == 42  # the call completed; the denial says what was hit
        second = session.run("1 + 1")
        assert second.value == 2 and second.state_lost
        assert second.worker_id != first.worker_id


def test_pure_v2_groups_carry_memory_processes_and_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It puts memory.max, swap 0 and pids.max in one v2 group on a pure v2 host, reads its
    events, and ends it with cgroup.kill. (A fake cgroupfs: this host is hybrid, so the
    kernel side of this path is not exercised here.)"""
    from agent_sandbox._host import limits as _limits

    base = tmp_path / "v2" / "user.slice" / "app"
    base.mkdir(parents=True)
    (base / "cgroup.subtree_control").write_text("cpu memory pids\n")
    pure = hierarchies(_V2_MOUNTS.format(root=tmp_path), _V2_OWN)
    monkeypatch.setattr(_limits, "hierarchies", lambda: pure)
    written: list[tuple[str, str]] = []

    def write(path: str, value: str) -> None:  # a cgroupfs makes its files on mkdir
        written.append((os.path.relpath(path, base), value))
        Path(path).write_text(value)

    monkeypatch.setattr(_limits, "_write", write)
    groups = WorkerCgroups.create("w-v2", {"memory_mb": 64, "processes": 8})
    assert groups is not None
    name = os.path.basename(groups.dirs["unified"])
    assert groups.dirs == {
        k: str(base / name) for k in ("unified", "memory-v2", "pids-v2", "cpu-v2")
    }
    assert written == [
        (f"{name}/memory.max", str(64 * 1024 * 1024)),
        (f"{name}/memory.swap.max", "0"),
        (f"{name}/pids.max", "8"),
        (f"{name}/cpu.max", "100000 100000"),  # the default: one core
    ]
    argv = groups.joining_argv(["worker"])
    assert argv[4:] == (str(base / name / "cgroup.procs"), "--", "worker")  # joined once
    group = base / name
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (group / "pids.events").write_text("max 2\n")
    (group / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    assert groups.new_events() == ["memory", "processes"]
    assert groups.new_events() == []  # only what is new since the last look
    assert groups.cpu_seconds() == 1.5
    (group / "cgroup.procs").write_text("")
    groups.kill()
    assert (f"{name}/cgroup.kill", "1") in written
    _limits._LIVE.discard(groups)  # not a real group: nothing to remove at exit


ALL_PROVIDERS = ("subprocess", "landlock", "unshare", "bwrap", "firejail", "gvisor")


@pytest.mark.parametrize("ignore_sigxcpu", [False, True], ids=["plain", "sigxcpu-ignored"])
@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_cpu_limit_is_named_under_every_provider(
    request: pytest.FixtureRequest, provider: str, ignore_sigxcpu: bool
) -> None:
    """It reports limits.cpu (never a crash or an exit status) when a busy loop uses up
    limits.cpu_seconds, under each provider and the subprocess opt-out, whether the code
    lets SIGXCPU end it or ignores it (then the hard limit's SIGKILL does)."""
    skip_unless_available(provider)
    if ignore_sigxcpu and not SUPPORT["kill"]:
        pytest.skip("no cgroup v2 group for CPU accounting here")
    policy = Policy(
        name="danger-cpu",
        imports={"allow": ["*"]},
        api={"allow": ["process-control"]},
        code={"enabled": False},
        limits={"cpu_seconds": 1, "wall_seconds": 30},
        no_kernel_boundary="accepted",  # read only under "subprocess"
        visible_names="accepted",  # read only under "landlock"
    )
    code = "while True:\n    pass"
    if ignore_sigxcpu:
        code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" + code
    with Sandbox(policy, provider=provider, warm=0) as sb:
        result = sb.run(code)
    assert result.error is not None and result.error.rule == "limits.cpu", result.error
    assert "limits.cpu" in [d.rule for d in result.denials]
    assert "exit status" not in result.error.message


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_a_killed_worker_is_reported_with_its_signal_under_every_provider(provider: str) -> None:
    """It reports a worker killed by SIGKILL as "killed by SIGKILL" under each provider
    (a launcher relays the signal; it does not turn it into an exit status)."""
    skip_unless_available(provider)
    policy = Policy(
        name="p",
        imports={"allow": ["os", "signal"]},
        api={"allow": ["process-control"]},
        limits={"wall_seconds": 30},
        no_kernel_boundary="accepted",  # read only under "subprocess"
        visible_names="accepted",  # read only under "landlock"
    )
    with Sandbox(policy, provider=provider, warm=0) as sb:
        result = sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.error is not None and result.error.type == "WorkerCrashed", result.error
    assert "killed by SIGKILL" in result.error.message, result.error
