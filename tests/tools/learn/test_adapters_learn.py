"""Learning mode through the adapters: a conversation's calls give one proposal per tool."""

from __future__ import annotations

import pytest

from agent_sandbox import load_policy
from agent_sandbox._tools.learn.observe import Learner

pytestmark = pytest.mark.slow


def test_langchain_tools_in_learning_mode_write_one_proposal_each(policy_file, tmp_path) -> None:
    """It collects every call of each LangChain tool and writes one proposal per tool."""
    from agent_sandbox.adapters.langchain import SandboxedPythonTool

    learner = Learner()
    analyst = SandboxedPythonTool(
        policy=policy_file, mode="learn", learner=learner, warm=0, name="analyst"
    )
    other_file = tmp_path / "other.toml"
    other_file.write_text('name = "other"\n[imports]\nallow = ["math"]\n')
    helper = SandboxedPythonTool(
        policy=other_file, mode="learn", learner=learner, warm=0, name="helper"
    )
    try:
        analyst.invoke({"code": "import csv\nprint('one')"})
        analyst.invoke({"code": "import statistics\nprint('two')"})
        helper.invoke({"code": "import fractions\nfractions.Fraction(1, 3)"})
    finally:
        analyst.close()
        helper.close()
    written = learner.write()
    assert set(written) == {"analyst", "helper"}
    assert written["analyst"].toml == policy_file.with_name("tool.proposed.toml")
    proposal = load_policy(written["analyst"].toml)
    assert {"csv", "statistics"} <= set(proposal.imports.allow)
    assert "fractions" in load_policy(written["helper"].toml).imports.allow
    assert "fractions" not in proposal.imports.allow
    assert load_policy(policy_file).imports.allow == ("math", "json")


def test_a_tool_in_enforce_mode_has_no_learner(policy_file) -> None:
    """It learns nothing unless the tool is put in learning mode."""
    from agent_sandbox.adapters.langchain import SandboxedPythonTool

    tool = SandboxedPythonTool(policy=policy_file, warm=0)
    assert tool.mode == "enforce" and tool.learner is None
    learning = SandboxedPythonTool(policy=policy_file, warm=0, mode="learn")
    assert isinstance(learning.learner, Learner)
    tool.close()
    learning.close()


@pytest.mark.crewai
def test_crewai_tool_in_learning_mode_writes_a_proposal(policy_file) -> None:
    """It learns through the CrewAI tool the same way."""
    from agent_sandbox.adapters.crewai import SandboxedPythonTool

    tool = SandboxedPythonTool(policy=policy_file, mode="learn", warm=0)
    try:
        tool.run(code="import csv\nprint('ok')")
    finally:
        tool.close()
    written = tool.learner.write()
    assert "csv" in load_policy(written[tool.name].toml).imports.allow
