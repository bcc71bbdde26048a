"""The README's examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def test_quick_start_runs_and_shows_a_refusal() -> None:
    """It runs the README's Python quick start: a value comes back and /etc/passwd is refused."""
    code = _blocks("python")[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "6 True"
    assert "files.read /etc/passwd" in out.stdout


def test_policy_example_loads(tmp_path: Path) -> None:
    """It loads the README's TOML policy example."""
    from agent_sandbox.policies import load_policy

    path = tmp_path / "analyst.toml"
    path.write_text(_blocks("toml")[0])
    policy = load_policy(path)
    assert policy.net.rules[0].ports == "443"
    assert policy.provider == "auto" and "numpy" in policy.imports.allow


def test_the_two_setup_commands_are_there() -> None:
    """It keeps exactly two set-up commands: the demo and the tests."""
    commands = [line for line in _blocks("sh")[0].splitlines() if line.strip()]
    assert [c.split("#")[0].strip() for c in commands] == [
        "bash scripts/demo.sh",
        "bash scripts/test.sh",
    ]
