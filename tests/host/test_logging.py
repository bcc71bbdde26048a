"""The library logs through `logging` under the `agent_sandbox` namespace: which stack `auto`
chose and why, workers starting and ending, limits hit."""

from __future__ import annotations

import logging

import pytest

from agent_sandbox import Policy, Sandbox


def test_the_provider_choice_a_start_an_end_and_a_limit_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It logs the auto choice at INFO, a worker's start at DEBUG and a limit and its end at
    INFO, all under agent_sandbox."""
    caplog.set_level(logging.DEBUG, logger="agent_sandbox")
    policy = Policy(name="logged", limits={"output_bytes": 2048})
    with Sandbox(policy, warm=0) as sandbox:
        result = sandbox.run("print('x' * 100_000)")
    assert result.error is not None and result.error.rule == "limits.output"
    records = [r for r in caplog.records if r.name.startswith("agent_sandbox")]
    text = [(r.levelno, r.getMessage()) for r in records]
    assert any(
        level == logging.INFO and msg.startswith("auto chose ") and "'logged'" in msg
        for level, msg in text
    ), text
    assert any(level == logging.DEBUG and " started under " in msg for level, msg in text), text
    assert any(level == logging.INFO and "limits.output hit" in msg for level, msg in text), text
    assert any(level == logging.INFO and " ended: " in msg for level, msg in text), text
