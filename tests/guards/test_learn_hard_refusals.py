"""Learning mode lets would-be denials proceed, except what no proposal may ever grant."""

from __future__ import annotations

from pathlib import Path

from agent_sandbox import Sandbox
from agent_sandbox.policies import load_policy


def _learning_policy(tmp_path: Path, *, opt_out: bool = False) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / ".env").write_text("TOKEN=canary-learn-3d1f\n")
    (data / "notes.txt").write_text("plain notes\n")
    policy = tmp_path / "tool.toml"
    # The opt-out (no kernel boundary) is for a test of what the guards let through.
    head = 'provider = "subprocess"\nno_kernel_boundary = "accepted"\n' if opt_out else ""
    policy.write_text(
        head + f'name = "learner"\nmode = "learn"\n[files]\nread = ["{data}/**", "{tmp_path}/**"]\n'
        f'write = ["{tmp_path}/**"]\n[imports]\nallow = ["os"]\n[code]\nenabled = false\n'
    )
    return policy


def test_blocks_editing_the_policy_file_while_learning(tmp_path: Path) -> None:
    """It denies a write to the policy file even in learning mode; the file is unchanged."""
    path = _learning_policy(tmp_path)
    before = path.read_text()
    with Sandbox(load_policy(path), warm=0) as sb:
        result = sb.run(
            f"try:\n    open({str(path)!r}, 'a').write('\\n[api]\\nallow = [\"native-code\"]\\n')\n"
            "    outcome = 'written'\nexcept PermissionError:\n    outcome = 'refused'\noutcome"
        )
    assert result.value == "refused", result.error
    assert path.read_text() == before
    assert any(d.rule == "files.write" and not d.learned for d in result.denials)


def test_blocks_reading_a_hidden_name_while_learning(tmp_path: Path) -> None:
    """It keeps hidden names (`.env`) absent in learning mode, while other reads proceed."""
    path = _learning_policy(tmp_path)
    data = tmp_path / "data"
    with Sandbox(load_policy(path), warm=0) as sb:
        result = sb.run(
            f"notes = open({str(data / 'notes.txt')!r}).read()\n"
            f"try:\n    secret = open({str(data / '.env')!r}).read()\n"
            "except FileNotFoundError:\n    secret = 'absent'\n[notes, secret]"
        )
    assert result.value == ["plain notes\n", "absent"], result.error
    assert "canary-learn-3d1f" not in result.stdout + str(result.value)


def test_learning_still_records_and_lets_ordinary_reads_proceed(tmp_path: Path) -> None:
    """It records a read outside the policy as a learned denial and lets the guards pass it
    (under the opt-out: a kernel provider would still refuse the read, as it should)."""
    path = _learning_policy(tmp_path, opt_out=True)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("outside\n")
    try:
        with Sandbox(load_policy(path), warm=0) as sb:
            result = sb.run(f"open({str(outside)!r}).read()")
    finally:
        outside.unlink()
    assert result.value == "outside\n", result.error
    assert any(d.learned and d.target == str(outside) for d in result.denials)
