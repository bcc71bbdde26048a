"""`agent-sandbox demo`: offline, both frameworks, refusal visible in the transcript and records."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.crewai,
    pytest.mark.skipif(
        importlib.util.find_spec("crewai") is None or importlib.util.find_spec("langchain") is None,
        reason="the demo needs both the langchain and crewai extras",
    ),
]


def _no_network_prefix() -> list[str]:
    """`unshare -n` (a network namespace with no interfaces) when this machine allows it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    probe = subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=10)
    return [unshare, "-n"] if probe.returncode == 0 else []


def test_demo_command_runs_offline_and_shows_the_refusal(tmp_path: Path):
    """It runs both agents with no network at all (under `unshare -n` where possible)."""
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_API_KEY", "_TOKEN"))}
    env.update(HOME=str(tmp_path), NO_COLOR="1", CREWAI_STORAGE_DIR=str(tmp_path / "crewai"))
    out = subprocess.run(
        [*_no_network_prefix(), sys.executable, "-m", "agent_sandbox", "demo"],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "=== LangChain (create_agent) ===" in text and "=== CrewAI (Crew.kickoff) ===" in text
    frameworks = 3 if importlib.util.find_spec("smolagents") else 2
    if frameworks == 3:
        assert "=== smolagents (CodeAgent) ===" in text
    assert text.count("tool  ! REFUSED") == frameworks
    rule = "net.resolve"  # a `requests` call the policy's network rules refuse
    assert "rule [net.resolve]" in text
    assert 'net.rules = [{ host = "stats.example.com", ports = "443" }]' in text
    assert f'"rule": "{rule}"' in text  # LangChain custom event recorded
    assert f'"code": "{rule}"' in text  # CrewAI TaskOutput.tool_failures
    assert text.count("The mean is 5.5 and the standard deviation is 3.03.") >= frameworks
    # One worker per session for the whole run: none died between the agent's calls.
    assert "[notice]" not in text and "worker.crashed" not in text
