"""Ownership is proven, not guessed: a sweep removes only what an owner proven dead left.

An owner is proven dead when the sweeper takes its lock (`_host/guardian.py`); a name whose
lock is held, missing here or planted is never touched, from any pid namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host import guardian
from agent_sandbox._host.lifecycle import owner_tag
from agent_sandbox._host.limits import hierarchy_bases
from agent_sandbox._tools.leftovers import agent_cgroups

ROOT = str(Path(__file__).resolve().parents[2])


def _tree(path: Path) -> None:
    (path / "scratch" / "deep").mkdir(parents=True)
    (path / "scratch" / "deep" / "f").write_text("x")


def test_sweep_removes_a_dead_owners_things_and_keeps_a_live_or_unprovable_ones(
    tmp_path: Path,
) -> None:
    """It removes the directories and lock of an owner whose lock it takes, and keeps those
    of an owner holding its lock and of one with no lock file to check."""
    dead, fd = guardian.hold_owner_lock(str(tmp_path))
    os.close(fd)  # the owner ended: nothing holds its lock any more
    live, live_fd = guardian.hold_owner_lock(str(tmp_path))
    unprovable = "0123456789abcdef"
    for tag in (dead, live, unprovable):
        _tree(tmp_path / f"agent-sandbox-{tag}-x")
    (tmp_path / "agent-sandbox-12345.678-x").mkdir()  # an old-style, pid-named one
    lines: list[str] = []
    try:
        assert guardian.sweep([], str(tmp_path), log=lines.append) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [
                f"agent-sandbox-{live}-x",
                f"agent-sandbox-{live}.lock",
                f"agent-sandbox-{unprovable}-x",
                "agent-sandbox-12345.678-x",
            ]
        )
        assert lines == []
    finally:
        os.close(live_fd)


def test_sweep_skips_planted_lookalikes_with_one_line_each(tmp_path: Path) -> None:
    """It denies a planted lookalike: a symlink named like a control directory (its
    target kept), a lock file that is a symlink or a directory, and (as root) a directory
    of another uid are never followed nor removed; each is skipped with one log line."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_text("keep")
    work = tmp_path / "tmp"
    work.mkdir()
    # A provably dead owner whose "directory" is a symlink to somewhere else.
    dead, fd = guardian.hold_owner_lock(str(work))
    os.close(fd)
    (work / f"agent-sandbox-{dead}-x").symlink_to(keep)
    # A lock that is a symlink to a file this uid may lock.
    linked = "1" * 16
    (keep / "lockable").write_text("")
    (work / f"agent-sandbox-{linked}.lock").symlink_to(keep / "lockable")
    _tree(work / f"agent-sandbox-{linked}-x")
    # A "lock" that is a directory full of files.
    full = "2" * 16
    (work / f"agent-sandbox-{full}.lock").mkdir()
    for i in range(50):
        (work / f"agent-sandbox-{full}.lock" / f"f{i}").write_text("x")
    _tree(work / f"agent-sandbox-{full}-x")
    expected = 3
    if os.geteuid() == 0:
        other, ofd = guardian.hold_owner_lock(str(work))
        os.close(ofd)
        _tree(work / f"agent-sandbox-{other}-x")
        os.chown(work / f"agent-sandbox-{other}-x", 65534, 65534)
        expected = 4
    before = sorted(p.name for p in work.iterdir())
    lines: list[str] = []
    cleaned = guardian.sweep([], str(work), log=lines.append)
    after = sorted(p.name for p in work.iterdir())
    assert (keep / "precious").read_text() == "keep"  # the symlink was not followed
    assert f"agent-sandbox-{dead}-x" in after
    assert f"agent-sandbox-{linked}-x" in after and f"agent-sandbox-{full}-x" in after
    assert len(lines) == expected, lines
    assert any(f"agent-sandbox-{dead}-x" in line and "planted" in line for line in lines)
    assert any(f"agent-sandbox-{linked}.lock" in line for line in lines)
    assert any(f"agent-sandbox-{full}.lock" in line and "planted" in line for line in lines)
    if os.geteuid() == 0:
        assert any(f"agent-sandbox-{other}-x" in line for line in lines)
        assert f"agent-sandbox-{other}-x" in after
    assert cleaned == 0  # no real directory of this uid named an owner it could prove dead
    assert set(after) <= set(before)


def test_tag_of_pid_reads_a_live_agents_token_from_its_lock() -> None:
    """It finds this agent's owner token from the lock file it holds open."""
    tag = owner_tag()
    assert guardian.tag_of_pid(os.getpid()) == tag


# -- from a private pid namespace ---------------------------------------------------------------


def _pidns_argv() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed")
    argv = [unshare, "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        argv[1:1] = ["--user", "--map-root-user"]
    probe = subprocess.run([*argv, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no private pid namespace here: {probe.stderr.decode().strip()}")
    return argv


SWEEPER = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from agent_sandbox._host import guardian
    agent, tempdir, *bases = sys.argv[2:]
    print("agent-visible", os.path.exists(f"/proc/{agent}"), flush=True)
    print("cleaned", guardian.sweep(bases, tempdir, log=lambda l: print("log", l)), flush=True)
    """
)


def _sweep_in_pidns(tempdir: str, bases: list[str]) -> str:
    argv = [*_pidns_argv(), sys.executable, "-I", "-c", SWEEPER, ROOT, str(os.getpid()), tempdir]
    done = subprocess.run([*argv, *bases], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # The attack ran as the issue describes it: this agent's pid is not visible in there.
    assert "agent-visible False" in done.stdout, done.stdout
    return done.stdout


@pytest.fixture
def live(policy: Policy) -> Iterator[Sandbox]:
    sb = Sandbox(policy, warm=0)
    try:
        yield sb
    finally:
        sb.close()


def test_a_sweep_from_a_private_pid_namespace_leaves_a_live_agent_alone(live: Sandbox) -> None:
    """It denies a sweeper that cannot see this agent's pid (its own pid namespace) the
    agent's worker, control directory and cgroups: they are alive because their lock is."""
    session = live.session("kept")
    assert session.run("kept = 41").ok
    worker = session.worker
    assert worker is not None
    groups = agent_cgroups(owner_tag())
    out = _sweep_in_pidns(tempfile.gettempdir(), hierarchy_bases())
    assert worker.alive() and os.path.isdir(worker.control_dir)
    assert agent_cgroups(owner_tag()) == groups
    result = session.run("kept + 1")
    assert result.value == 42 and not result.state_lost
    assert "cleaned" in out


PLANT = textwrap.dedent(
    """
    import os, subprocess, sys
    sys.path.insert(0, sys.argv[1])
    from agent_sandbox._host import guardian
    tempdir, base, live = sys.argv[2:]
    tag, fd = guardian.hold_owner_lock(tempdir)
    os.mkdir(os.path.join(tempdir, f"agent-sandbox-{tag}-dead"))
    group = os.path.join(base, f"agent-sandbox-{tag}-w")
    os.mkdir(group)
    # The old, pid-named kind, named by a pid that a live agent has now.
    old = os.path.join(base, f"agent-sandbox-{live}-w")
    os.mkdir(old)
    procs = []
    for where in (group, old):
        p = subprocess.Popen(
            ["sleep", "300"],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(os.path.join(where, "cgroup.procs"), "w") as fh:
            fh.write(str(p.pid))
        procs.append(p.pid)
    print(tag, *procs, flush=True)
    os._exit(0)  # no clean-up: its lock goes with it, its sleeps stay
    """
)


def test_a_dead_owners_leftovers_go_and_pid_named_ones_are_not_judged(
    live: Sandbox, tmp_path: Path
) -> None:
    """It ends a dead owner's group and removes its directory, from a private pid
    namespace; a group named by the dead owner's pid (which another agent may now have) is
    not judged by it, and this live agent's worker keeps its state."""
    bases = hierarchy_bases()
    if not bases:
        pytest.skip("no writable cgroup hierarchy here")
    session = live.session("kept")
    assert session.run("kept = 1").ok
    worker = session.worker
    assert worker is not None
    tempdir = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-I", "-c", PLANT, ROOT, tempdir, bases[0], str(os.getpid())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    tag, in_group, in_old = done.stdout.split()
    old_group = os.path.join(bases[0], f"agent-sandbox-{os.getpid()}-w")
    try:
        assert os.path.exists(f"/proc/{in_group}")
        out = _sweep_in_pidns(tempdir, bases)
        assert "cleaned 1" in out, out
        assert not os.path.exists(os.path.join(tempdir, f"agent-sandbox-{tag}-dead"))
        group = os.path.join(bases[0], f"agent-sandbox-{tag}-w")
        if os.path.exists(os.path.join(group, "cgroup.kill")):
            # cgroup.kill reaches members in every pid namespace.
            assert not os.path.exists(group)
            assert _gone(int(in_group))
        else:
            # No cgroup.kill (v1): the members are pids the sweeper cannot see (listed as
            # 0 there), so it signals none, and says it could not remove the group.
            assert not _gone(int(in_group), wait=False)
            assert f"could not remove the group {group}" in out, out
            # The lock file stays for a sweeper that can see them: this one ends them by
            # pidfd, member by member.
            assert os.path.exists(guardian.lock_path(tempdir, tag))
            assert guardian.sweep(bases, tempdir) == 1
            assert not os.path.exists(group)
            assert _gone(int(in_group))
        assert not os.path.exists(guardian.lock_path(tempdir, tag))
        assert not _gone(int(in_old), wait=False)  # a pid-named group is never judged
        assert worker.alive()
        result = session.run("kept")
        assert result.value == 1 and not result.state_lost
    finally:
        for pid in (in_group, in_old):
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
        for path in (old_group, os.path.join(bases[0], f"agent-sandbox-{tag}-w")):
            for _ in range(200):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    threading_wait(0.01)


def threading_wait(seconds: float) -> None:
    import threading

    threading.Event().wait(seconds)


def _gone(pid: int, *, wait: bool = True) -> bool:
    """Whether `pid` ended (gone, or a zombie waiting for its reaper); waits for it to
    end (bounded) unless `wait` is False."""
    for _ in range(500 if wait else 1):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        if wait:
            threading_wait(0.01)
    return False
