"""The trial probes remembered across processes (`providers/_probe_cache.py`).

Every test points `XDG_CACHE_HOME` at its own temporary directory (the session does too,
`tests/conftest.py`), so nothing here reads or writes the real home.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox.providers import _probe_cache
from agent_sandbox.providers._base import ProbeResult
from agent_sandbox.providers._bwrap import BwrapProvider


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(_probe_cache.ENV, raising=False)
    monkeypatch.setattr(_probe_cache, "_afresh", False)
    yield tmp_path / "agent-sandbox" / "probes.json"


class Trial:
    """A fake trial that counts its runs."""

    def __init__(self, result: ProbeResult) -> None:
        self.result = result
        self.runs = 0

    def __call__(self) -> ProbeResult:
        self.runs += 1
        return self.result


YES = ProbeResult("bwrap", True, version="0.8.0", details={"path": "/usr/bin/bwrap"})
NO = ProbeResult("bwrap", False, reason="no user namespaces")


def test_a_working_trial_is_remembered_across_processes(cache: Path) -> None:
    """It runs the trial once, then answers from the file, with the same result."""
    trial = Trial(YES)
    first = _probe_cache.cached_probe("bwrap", {"bwrap": ["/usr/bin/bwrap", 1]}, trial)
    second = _probe_cache.cached_probe("bwrap", {"bwrap": ["/usr/bin/bwrap", 1]}, trial)
    assert first == second == YES
    assert trial.runs == 1
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    assert stat.S_IMODE(cache.parent.stat().st_mode) == 0o700
    assert [p.name for p in cache.parent.iterdir()] == ["probes.json"]  # no temporary left


def test_a_failed_trial_is_not_remembered(cache: Path) -> None:
    """It probes a failure again every time: a remembered "no" could hide a stronger
    provider that works now (auto would downgrade without saying so)."""
    trial = Trial(NO)
    for _ in range(2):
        assert _probe_cache.cached_probe("bwrap", {}, trial) == NO
    assert trial.runs == 2
    assert not cache.exists()


@pytest.mark.parametrize("changed", ["tool", "kernel", "user", "package", "sysctl"])
def test_a_changed_key_probes_again(
    cache: Path, monkeypatch: pytest.MonkeyPatch, changed: str
) -> None:
    """It runs the trial again when the tool, the kernel, the user, the package or a
    user-namespace sysctl differs from what the answer was measured under."""
    trial = Trial(YES)
    _probe_cache.cached_probe("bwrap", {"bwrap": ["/usr/bin/bwrap", 1]}, trial)
    tool: dict[str, object] = {"bwrap": ["/usr/bin/bwrap", 1]}
    if changed == "tool":
        tool = {"bwrap": ["/usr/bin/bwrap", 2]}  # another size or mtime
    else:
        real = _probe_cache._common_key

        def other() -> dict[str, object]:
            key = real()
            field = {"kernel": "kernel", "user": "user", "package": "package"}.get(changed)
            if field:
                key[field] = [*key[field], "changed"]
            else:
                key["sysctl"] = {**key["sysctl"], "/proc/sys/user/max_user_namespaces": "0"}
            return key

        monkeypatch.setattr(_probe_cache, "_common_key", other)
    _probe_cache.cached_probe("bwrap", tool, trial)
    assert trial.runs == 2


def test_installs_sharing_the_file_keep_their_own_answers(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It keeps one answer per key (two installs of the package alternating do not evict
    each other's answer), and at most `MAX_ENTRIES` answers, dropping the oldest."""
    real = _probe_cache._common_key
    install = ["a"]
    monkeypatch.setattr(_probe_cache, "_common_key", lambda: {**real(), "package": [install[0]]})
    trial = Trial(YES)
    for name in ("a", "b", "a", "b"):
        install[0] = name
        assert _probe_cache.cached_probe("bwrap", {}, trial) == YES
    assert trial.runs == 2
    for i in range(_probe_cache.MAX_ENTRIES):
        install[0] = f"other-{i}"
        _probe_cache.cached_probe("bwrap", {}, trial)
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == _probe_cache.MAX_ENTRIES
    install[0] = "a"  # the oldest: dropped
    runs = trial.runs
    _probe_cache.cached_probe("bwrap", {}, trial)
    assert trial.runs == runs + 1


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b"[]",
        b'{"format": 99, "entries": {}}',
        b'{"format": 1, "entries": []}',
        b'{"format": 1, "entries": {"bwrap": {"key": {}, "result": "yes"}}}',
        b"[" * 100_000,
    ],
)
def test_a_malformed_file_is_never_trusted(cache: Path, content: bytes) -> None:
    """It probes again when the file does not parse into exactly the expected shape, and
    rewrites it."""
    cache.parent.mkdir(mode=0o700)
    cache.write_bytes(content)
    cache.chmod(0o600)
    trial = Trial(YES)
    assert _probe_cache.cached_probe("bwrap", {}, trial) == YES
    assert trial.runs == 1
    assert json.loads(cache.read_text())["format"] == _probe_cache.FORMAT


def test_an_entry_with_extra_fields_or_odd_details_is_not_trusted(cache: Path) -> None:
    """It ignores an entry whose result carries more than it writes, or details that are
    not plain strings and booleans."""
    trial = Trial(YES)
    _probe_cache.cached_probe("bwrap", {}, trial)
    data = json.loads(cache.read_text())
    (filed,) = data["entries"]
    for result in (
        {**data["entries"][filed]["result"], "available": False},
        {"version": "1", "details": {"path": ["/bin/sh"]}},
    ):
        data["entries"][filed]["result"] = result
        cache.write_text(json.dumps(data))
        _probe_cache.cached_probe("bwrap", {}, trial)
    assert trial.runs == 3


def test_a_file_others_can_write_is_not_trusted(cache: Path) -> None:
    """It ignores a file, or a directory, that someone else could have written."""
    trial = Trial(YES)
    _probe_cache.cached_probe("bwrap", {}, trial)
    cache.chmod(0o622)
    _probe_cache.cached_probe("bwrap", {}, trial)
    assert trial.runs == 2
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600  # rewritten
    cache.parent.chmod(0o777)
    try:
        _probe_cache.cached_probe("bwrap", {}, trial)
    finally:
        cache.parent.chmod(0o700)
    assert trial.runs == 3


def test_a_symlinked_file_is_not_followed(cache: Path, tmp_path: Path) -> None:
    """It does not read the file through a symbolic link."""
    trial = Trial(YES)
    _probe_cache.cached_probe("bwrap", {}, trial)
    target = tmp_path / "elsewhere.json"
    cache.rename(target)
    cache.symlink_to(target)
    _probe_cache.cached_probe("bwrap", {}, trial)
    assert trial.runs == 2


@pytest.mark.parametrize("value", ["off", "0", "no", "FALSE"])
def test_the_environment_variable_bypasses_the_file(
    cache: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """It probes every time, and writes nothing, under AGENT_SANDBOX_PROBE_CACHE=off."""
    monkeypatch.setenv(_probe_cache.ENV, value)
    trial = Trial(YES)
    for _ in range(2):
        _probe_cache.cached_probe("bwrap", {}, trial)
    assert trial.runs == 2
    assert not cache.parent.exists()


def test_the_doctor_probes_afresh(cache: Path) -> None:
    """It bypasses the file once `probe_afresh()` was called (what `doctor` does)."""
    trial = Trial(YES)
    _probe_cache.cached_probe("bwrap", {}, trial)
    _probe_cache.probe_afresh()
    _probe_cache.cached_probe("bwrap", {}, trial)
    assert trial.runs == 2


def test_the_key_names_the_tool_the_kernel_the_user_and_the_package() -> None:
    """Its key holds the uname release and version, the uids, the interpreter and the
    package's sources."""
    key = _probe_cache._common_key()
    uname = os.uname()
    assert key["kernel"][1:3] == [uname.release, uname.version]
    assert key["user"][:2] == [os.getuid(), os.geteuid()]
    assert key["python"][1] == os.path.realpath(sys.executable)
    sources = [part[0] for part in key["package"]]
    assert any(path.endswith("_bwrap.py") for path in sources)
    assert any(path.endswith(os.path.join("agent_sandbox", "__init__.py")) for path in sources)
    assert all(part[1] is not None for part in key["package"])  # every source was found


@pytest.mark.skipif(not BwrapProvider().probe().available, reason="bwrap does not work here")
def test_a_fresh_process_reads_the_real_probes(cache: Path) -> None:
    """It answers `auto`'s probes in a second fresh process from the file the first wrote,
    with the same results."""
    code = "from agent_sandbox.providers import AutoProvider\nprint(repr(AutoProvider().probe()))\n"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent.parent)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert any(name.startswith("bwrap:") for name in json.loads(cache.read_text())["entries"])


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_link_planted_at_the_cache_file_is_replaced_not_written_through(
    cache: Path, tmp_path: Path, dangling: bool
) -> None:
    """It denies writing through a link planted at `probes.json` (to a file of the
    victim's, or dangling, where following it would create the file): the answer is
    written to a fresh file renamed over the link, the link's target is untouched."""
    victim = tmp_path / "victim.txt"
    if not dangling:
        victim.write_text("the victim's own content\n")
    cache.parent.mkdir(mode=0o700)
    cache.symlink_to(victim)
    trial = Trial(YES)
    _probe_cache.cached_probe("bwrap", {}, trial)
    assert trial.runs == 1  # the attack ran: a probe answer was stored at the planted path
    assert not cache.is_symlink() and stat.S_ISREG(cache.lstat().st_mode)
    assert json.loads(cache.read_text())["entries"]
    if dangling:
        assert not victim.exists()
    else:
        assert victim.read_text() == "the victim's own content\n"


def test_nothing_is_written_to_a_cache_folder_others_can_write(cache: Path) -> None:
    """It denies another user a planted answer: a cache folder writable by others is
    neither read (above) nor written."""
    cache.parent.mkdir(mode=0o700)
    cache.parent.chmod(0o777)
    try:
        _probe_cache.cached_probe("bwrap", {}, Trial(YES))
        assert os.listdir(cache.parent) == []
    finally:
        cache.parent.chmod(0o700)
