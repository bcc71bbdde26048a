"""Files the host writes never follow the worker: a link, a FIFO or a hard link planted at
the operator's refusal log is refused (nothing written through it), and a log where a
worker can write is refused whatever is there."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest

from agent_sandbox import Denial, Policy, RunResult
from agent_sandbox._host import guardian, oplog
from agent_sandbox._host.hostfile import (
    HostFileRefused,
    create_new,
    open_append,
    worker_writable,
)


def _result() -> RunResult:
    return RunResult(
        denials=(Denial("net.connect", "connect", "198.51.100.7:80", "p"),), policy="p"
    )


@pytest.fixture
def log_to(caplog: pytest.LogCaptureFixture) -> object:
    def use(path: Path) -> None:
        oplog.log_refusals(path)

    yield use
    oplog.log_refusals(None)


@pytest.mark.parametrize("plant", ["symlink", "dangling-symlink", "hardlink", "fifo", "dir-link"])
def test_a_link_planted_at_the_refusal_log_is_not_written_through(
    tmp_path: Path, plant: str, log_to: object, caplog: pytest.LogCaptureFixture
) -> None:
    """It denies redirecting the host's log write: a symlink, a dangling symlink, a hard
    link, a FIFO, or a linked directory at the log's path; the victim file is unchanged
    and the host neither blocks nor writes."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = tmp_path / "refusals.jsonl"
    if plant == "symlink":
        log.symlink_to(victim)
    elif plant == "dangling-symlink":
        log.symlink_to(tmp_path / "created-by-the-host")
    elif plant == "hardlink":
        os.link(victim, log)
    elif plant == "fifo":
        os.mkfifo(log)
    else:
        (tmp_path / "real").mkdir()
        (tmp_path / "linked").symlink_to(tmp_path / "real")
        log = tmp_path / "linked" / "refusals.jsonl"
        (tmp_path / "real" / "refusals.jsonl").symlink_to(victim)
    log_to(log)  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="agent_sandbox"):
        oplog.write(_result())
    assert victim.read_text() == "precious\n"  # the attack ran and changed nothing
    assert not (tmp_path / "created-by-the-host").exists()
    assert "could not write the refusal log" in caplog.text


def test_the_refusal_log_is_written_where_no_worker_writes(tmp_path: Path, log_to: object) -> None:
    """The control case: a plain path gets the JSON line."""
    log = tmp_path / "refusals.jsonl"
    log_to(log)  # type: ignore[operator]
    oplog.write(_result())
    assert '"rule": "net.connect"' in log.read_text()


def test_a_log_where_a_worker_can_write_is_refused(tmp_path: Path) -> None:
    """It denies a host file in a worker-writable place: under the policy's write grants
    or any worker's control directory (its scratch), whatever the file is."""
    policy = Policy(name="w", files={"write": [str(tmp_path / "shared")]})
    (tmp_path / "shared").mkdir()
    with pytest.raises(HostFileRefused, match="where a worker can write"):
        open_append(str(tmp_path / "shared" / "log"), writable=worker_writable(policy))
    control = tempfile.mkdtemp(prefix=guardian.DIR_PREFIX + "test-")
    try:
        with pytest.raises(HostFileRefused, match="where a worker can write"):
            open_append(os.path.join(control, "scratch", "log"), writable=worker_writable(None))
        assert os.listdir(control) == []
    finally:
        os.rmdir(control)
    fd = open_append(str(tmp_path / "fine"), writable=worker_writable(policy))
    os.close(fd)


def _plant(folder: Path, name: str, plant: str, victim: Path) -> None:
    target = folder / name
    if plant == "symlink":
        target.symlink_to(victim)
    elif plant == "dangling-symlink":
        target.symlink_to(folder / "created-by-the-host")
    elif plant == "hardlink":
        os.link(victim, target)
    elif plant == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("planted\n")


@pytest.mark.parametrize("plant", ["symlink", "dangling-symlink", "hardlink", "fifo", "file"])
def test_create_new_never_writes_through_what_is_planted(tmp_path: Path, plant: str) -> None:
    """It denies redirecting a control file the host creates (`hostfile.create_new`): a
    symlink, a dangling one, a hard link, a FIFO or a file at the name is refused, the
    victim unchanged, nothing created through the link, the host not blocked."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    folder = tmp_path / "control"
    folder.mkdir()
    _plant(folder, "template.log", plant, victim)
    with pytest.raises(HostFileRefused, match="already exists"):
        create_new(str(folder), "template.log")
    assert victim.read_text() == "precious\n"
    assert not (folder / "created-by-the-host").exists()


def test_create_new_walks_the_directory_without_following_a_link(tmp_path: Path) -> None:
    """It denies a control directory swapped for a link: the walk refuses it (ELOOP)."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "control").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        create_new(str(tmp_path / "control"), "x")
    fd = create_new(str(tmp_path / "elsewhere"), "x")  # the control case: a plain directory
    os.close(fd)
    assert (tmp_path / "elsewhere" / "x").exists()


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_link_planted_at_the_template_log_is_not_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: str
) -> None:
    """It denies redirecting a worker template's log: with a link (or FIFO) already at
    `template.log` in its control directory, the template's start fails naming the file
    and the victim is unchanged (no template process is left)."""
    from agent_sandbox._host import templates
    from agent_sandbox.providers import get_provider

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    made: list[str] = []

    def mkdtemp(prefix: str = "") -> str:
        folder = tmp_path / f"{prefix}planted"
        folder.mkdir()
        _plant(folder, "template.log", plant, victim)
        made.append(str(folder))
        return str(folder)

    monkeypatch.setattr(templates.tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(HostFileRefused, match=r"template\.log"):
        templates.WorkerTemplate.start(Policy(name="t"), get_provider("subprocess"), timeout=10)
    assert made and victim.read_text() == "precious\n"


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_link_planted_at_a_vms_limit_report_is_not_read_through(
    tmp_path: Path, plant: str
) -> None:
    """It denies steering the host's read of a VM's limit report (`guest-limits.json` in
    the run directory, which QEMU can write): a symlink to a file of counters is not
    followed (no hit), and a FIFO neither blocks the host nor counts."""
    from agent_sandbox._host.limits import GuestLimits

    victim = tmp_path / "victim.json"
    victim.write_text('{"pids_max": 3}')
    report = tmp_path / "guest-limits.json"
    if plant == "symlink":
        report.symlink_to(victim)
    else:
        os.mkfifo(report)
    guest = GuestLimits(str(report), launcher_pid=2**22 + 1)  # no such process
    assert guest.new_hits(Policy(name="t", limits={"processes": 4})) == []
    report.unlink()
    report.write_text('{"pids_max": 3}')  # the control case: the relay's own file counts
    assert [r for r, _ in guest.new_hits(Policy(name="t", limits={"processes": 4}))] == [
        "limits.processes"
    ]


def test_the_vm_relay_never_writes_its_limit_report_through_a_link(tmp_path: Path) -> None:
    """It denies redirecting the host relay's write of `guest-limits.json`: a link at its
    temporary name is refused (ELOOP), the victim unchanged."""
    from agent_sandbox.providers.qemu import relay as _qemu_host

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    report = tmp_path / "guest-limits.json"
    (tmp_path / "guest-limits.json.tmp").symlink_to(victim)
    with pytest.raises(OSError):
        _qemu_host._write_limits(str(report), b'{"pids_max": 1}')
    assert victim.read_text() == "precious\n" and not report.exists()
