"""The test-only switch that turns a kernel protection off (providers/_test_switch.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent_sandbox import ProviderUnavailable
from agent_sandbox.providers._landlock import probe_landlock
from agent_sandbox.providers._seccomp import probe_seccomp
from agent_sandbox.providers._test_switch import VARIABLE


def test_the_switch_turns_the_named_protections_off_in_a_test(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under pytest, the named protections' probes say they are switched off."""
    monkeypatch.setenv(VARIABLE, "landlock,seccomp")
    landlock = probe_landlock()
    assert not landlock.available and VARIABLE in landlock.reason
    ok, why = probe_seccomp()
    assert not ok and VARIABLE in why


def test_the_switch_refuses_an_unknown_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """It names what it knows rather than ignore a misspelt protection."""
    monkeypatch.setenv(VARIABLE, "landlok")
    with pytest.raises(ProviderUnavailable, match="landlok"):
        probe_landlock()


def test_the_switch_is_refused_outside_the_test_suite() -> None:
    """It denies weakening a real agent: outside pytest the variable is an error."""
    code = (
        "from agent_sandbox import ProviderUnavailable\n"
        "from agent_sandbox.providers._landlock import probe_landlock\n"
        "try:\n    probe_landlock()\nexcept ProviderUnavailable as exc:\n    print('refused', exc)\n"
        "else:\n    print('honoured')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, VARIABLE: "landlock"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.startswith("refused") and VARIABLE in out and "unset it" in out
