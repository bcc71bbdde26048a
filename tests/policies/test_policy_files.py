"""Policy files are hostile input: what `extends`, special files and deep nesting cannot do.

Each hostile file is checked twice: in-process (`load_policy` raises one `PolicyError`
naming the file) and through `agent-sandbox policy check` in a subprocess, which must end
(the timeout is far above the second it needs, so this is not a timed test) with one line
on stderr and a non-zero status. The subprocess runs under a 1 GiB address-space limit so
that a regression (reading `/dev/zero` forever) fails the test instead of the host.
"""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agent_sandbox import PolicyError
from agent_sandbox.policies import load_policy, policy_from_toml
from agent_sandbox.policies._load import (
    MAX_EXTENDS_DEPTH,
    MAX_NESTING,
    MAX_POLICY_BYTES,
    MAX_PROBLEMS,
    read_policy_text,
)

CLI = [sys.executable, "-m", "agent_sandbox"]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def check_cli(path: Path) -> subprocess.CompletedProcess[str]:
    """`agent-sandbox policy check PATH`, bounded in memory; TimeoutExpired fails the test."""
    return subprocess.run(
        [*CLI, "policy", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limit_memory,
        cwd=path.parent,
    )


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _zero_extends(tmp: Path) -> Path:
    return _write(tmp / "zero.toml", 'name = "x"\nextends = "../../../../dev/zero"\n')


def _zero_extends_absolute(tmp: Path) -> Path:
    return _write(tmp / "zero-abs.toml", 'name = "x"\nextends = "/dev/zero"\n')


def _zero_device_extends(tmp: Path) -> Path:
    """A `.toml` name that is a character device reading like /dev/zero (root may mknod)."""
    try:
        os.mknod(tmp / "zero-dev.toml", 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("mknod is not permitted here")
    return _write(tmp / "uses-zero-dev.toml", 'name = "x"\nextends = "zero-dev.toml"\n')


def _fifo(tmp: Path) -> Path:
    path = tmp / "fifo.toml"
    os.mkfifo(path)
    return path


def _fifo_extends(tmp: Path) -> Path:
    os.mkfifo(tmp / "pipe.toml")
    return _write(tmp / "uses-pipe.toml", 'name = "x"\nextends = "pipe.toml"\n')


def _cycle(tmp: Path) -> Path:
    _write(tmp / "b.toml", 'name = "b"\nextends = "a.toml"\n')
    return _write(tmp / "a.toml", 'name = "a"\nextends = "b.toml"\n')


def _self_cycle(tmp: Path) -> Path:
    return _write(tmp / "self.toml", 'name = "s"\nextends = "self.toml"\n')


def _deep_arrays(tmp: Path) -> Path:
    return _write(tmp / "deep.toml", "a = " + "[" * 10000 + "]" * 10000 + "\n")


def _deep_inline_tables(tmp: Path) -> Path:
    return _write(tmp / "deep-inline.toml", "a = " + "{b = " * 10000 + "1" + "}" * 10000 + "\n")


def _deep_dotted_key(tmp: Path) -> Path:
    return _write(tmp / "deep-dotted.toml", "a." * 10000 + "b = 1\n")


def _deep_header(tmp: Path) -> Path:
    return _write(tmp / "deep-header.toml", "[" + "a." * 10000 + "b]\nc = 1\n")


def _huge_sparse(tmp: Path) -> Path:
    path = tmp / "huge.toml"
    with open(path, "wb") as fh:
        fh.truncate(8 << 30)  # 8 GiB of holes: costs no disk
    return path


def _huge_text(tmp: Path) -> Path:
    line = "# " + "x" * 1021 + "\n"
    return _write(tmp / "big.toml", line * (MAX_POLICY_BYTES // len(line) + 2))


HOSTILE: dict[str, tuple[Callable[[Path], Path], str]] = {
    "extends-dev-zero": (_zero_extends, "extends"),
    "extends-dev-zero-absolute": (_zero_extends_absolute, "extends"),
    "extends-zero-device": (_zero_device_extends, "character device"),
    "fifo": (_fifo, "FIFO"),
    "extends-fifo": (_fifo_extends, "FIFO"),
    "cycle": (_cycle, "cycle: a.toml -> b.toml -> a.toml"),
    "self-cycle": (_self_cycle, "cycle: self.toml -> self.toml"),
    "deep-arrays": (_deep_arrays, f"deeper than {MAX_NESTING}"),
    "deep-inline-tables": (_deep_inline_tables, f"deeper than {MAX_NESTING}"),
    "deep-dotted-key": (_deep_dotted_key, f"deeper than {MAX_NESTING}"),
    "deep-header": (_deep_header, f"deeper than {MAX_NESTING}"),
    "huge-sparse": (_huge_sparse, "too large"),
    "huge-text": (_huge_text, "too large"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_policy_file_is_one_policy_error(tmp_path: Path, case: str) -> None:
    """It refuses each hostile file with one PolicyError naming a file and what to do."""
    make, needle = HOSTILE[case]
    path = make(tmp_path)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert str(tmp_path) in message or "/dev/zero" in message
    assert "expected" in message


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_policy_check_prints_one_line_and_fails(tmp_path: Path, case: str) -> None:
    """It ends `policy check` on each hostile file with one line and a non-zero status."""
    make, needle = HOSTILE[case]
    out = check_cli(make(tmp_path))
    assert out.returncode != 0
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in out.stderr


def test_special_files_are_refused_before_any_read(tmp_path: Path) -> None:
    """It reads only regular files: a device, a directory and a FIFO are refused."""
    with pytest.raises(PolicyError, match="character device"):
        read_policy_text("/dev/zero")
    with pytest.raises(PolicyError, match="directory"):
        read_policy_text(tmp_path)
    os.mkfifo(tmp_path / "p")
    with pytest.raises(PolicyError, match="FIFO"):
        read_policy_text(tmp_path / "p")


def test_a_relative_extends_stays_in_the_including_files_directory(tmp_path: Path) -> None:
    """It resolves a relative `extends` against the including file's directory (not the
    current one) and refuses one that leaves it, by `..` or through a link."""
    policies = tmp_path / "policies"
    (policies / "shared").mkdir(parents=True)
    _write(policies / "shared" / "base.toml", 'name = "base"\n[limits]\nwall_seconds = 7\n')
    tool = _write(policies / "tool.toml", 'name = "tool"\nextends = "shared/base.toml"\n')
    assert load_policy(tool).limits.wall_seconds == 7  # the cwd is elsewhere

    outside = _write(tmp_path / "outside.toml", 'name = "outside"\n')
    climbing = _write(policies / "climb.toml", 'name = "c"\nextends = "../outside.toml"\n')
    with pytest.raises(PolicyError, match="leads out of this file's directory") as info:
        load_policy(climbing)
    assert str(climbing) in str(info.value)

    (policies / "link.toml").symlink_to(outside)
    linked = _write(policies / "linked.toml", 'name = "l"\nextends = "link.toml"\n')
    with pytest.raises(PolicyError, match="leads out of"):
        load_policy(linked)


def test_an_absolute_extends_is_how_a_policy_reaches_outside(tmp_path: Path) -> None:
    """It accepts an absolute `.toml` path: the policy says where it reaches, on purpose."""
    base = _write(tmp_path / "base.toml", 'name = "base"\n[limits]\nwall_seconds = 5\n')
    (tmp_path / "d").mkdir()
    tool = _write(tmp_path / "d" / "tool.toml", f'name = "t"\nextends = "{base}"\n')
    assert load_policy(tool).limits.wall_seconds == 5


def test_extends_must_name_a_preset_or_a_toml_file(tmp_path: Path) -> None:
    """It refuses an `extends` that is neither a shipped policy nor a `.toml` path."""
    with pytest.raises(PolicyError, match="not a shipped policy"):
        load_policy(_write(tmp_path / "a.toml", 'name = "a"\nextends = "no-such-preset"\n'))
    with pytest.raises(PolicyError, match=r"does not name a \.toml file"):
        load_policy(_write(tmp_path / "b.toml", 'name = "b"\nextends = "sub/passwd"\n'))


def test_an_extends_chain_has_a_depth_limit(tmp_path: Path) -> None:
    """It follows a chain of `MAX_EXTENDS_DEPTH` files and refuses a longer one."""
    _write(tmp_path / "p0.toml", 'name = "p0"\n')
    for i in range(1, MAX_EXTENDS_DEPTH + 1):
        _write(tmp_path / f"p{i}.toml", f'name = "p{i}"\nextends = "p{i - 1}.toml"\n')
    assert load_policy(tmp_path / f"p{MAX_EXTENDS_DEPTH - 1}.toml").name == (
        f"p{MAX_EXTENDS_DEPTH - 1}"
    )
    with pytest.raises(PolicyError, match=f"deeper than {MAX_EXTENDS_DEPTH} files"):
        load_policy(tmp_path / f"p{MAX_EXTENDS_DEPTH}.toml")


def test_nesting_within_the_limit_still_parses() -> None:
    """It parses brackets, dots and strings that only look deep (the scan skips strings)."""
    policy = policy_from_toml(
        'name = "x"\ndescription = "[[[[{{{{ a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u.v.w.x.y.z.'
        'a.b.c.d.e.f.g.h.i.j ]]]]"\n'
        "# [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n"
        "[[net.rules]]\nhost = '127.0.0.1'\nports = [80, 443]\n"
    )
    assert policy.net.rules[0].ports == "80,443"


def test_a_policy_with_many_problems_lists_a_bounded_number(tmp_path: Path) -> None:
    """It lists at most `MAX_PROBLEMS` validation problems and counts the rest."""
    text = 'name = "x"\n' + "".join(f"bogus{i} = 1\n" for i in range(5000))
    with pytest.raises(PolicyError) as info:
        policy_from_toml(text)
    message = str(info.value)
    assert message.count("unknown key") == MAX_PROBLEMS
    assert f"and {5000 - MAX_PROBLEMS} more" in message
