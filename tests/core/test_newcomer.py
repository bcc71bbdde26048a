"""A newcomer's first hour, replayed: scripts/newcomer.py (wheel, core dependencies only, an
unprivileged user when run as root, the README's examples and the common mistakes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "newcomer.py"


def test_a_newcomer_installs_the_wheel_and_every_readme_example_works() -> None:
    """Every check of the newcomer script passes, and it leaves no temporary directory."""
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 failed" in out.stdout
    workspace = out.stdout.split("newcomer: workspace ", 1)[1].split("\n", 1)[0]
    assert not Path(workspace).exists(), workspace
