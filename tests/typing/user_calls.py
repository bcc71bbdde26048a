"""Documented calls, as a user's type checker sees them (`mypy --strict` in scripts/check.sh).

Not collected by pytest (no test functions): a type error here fails the quality gate.
"""

from __future__ import annotations

from agent_sandbox import Policy, Sandbox
from agent_sandbox.adapters import sandboxed
from agent_sandbox.adapters.crewai import SandboxedPythonTool as CrewAITool
from agent_sandbox.adapters.langchain import SandboxedPythonTool


def add(a: int, b: int) -> int:
    return a + b


def documented_calls() -> None:
    tool = SandboxedPythonTool(policy="data-analysis")
    SandboxedPythonTool(policy=Policy(name="mine"), session="none", timeout=30)
    SandboxedPythonTool()
    CrewAITool(policy="data-analysis", session="tool")
    with Sandbox("data-analysis") as sandbox:
        value = sandbox.session("thread-1").run("1 + 1").value
        print(value)
    safe_add = sandboxed(add, policy="pure-computation")
    total: int = safe_add(1, 2)
    print(tool.name, total)
