"""Agent-framework adapters.

Framework imports stay inside `agent_sandbox.adapters.langchain` and
`agent_sandbox.adapters.crewai`: importing this package (and `sandboxed`) needs neither.
"""

from agent_sandbox.adapters._common import describe_policy as describe_policy
from agent_sandbox.adapters._function import SandboxedFunction as SandboxedFunction
from agent_sandbox.adapters._sandboxed import sandboxed as sandboxed

__all__ = ["SandboxedFunction", "describe_policy", "sandboxed"]
