"""`sandboxed()`: run the body of any tool or plain function in a worker under a policy.

A plain function becomes a `SandboxedFunction` (`_function.py`, where the way a call
crosses is described); a LangChain or CrewAI tool is wrapped by the helper of its framework
(`adapters.langchain` / `adapters.crewai`, imported only when such a tool is passed), which
returns a tool of the same framework whose refusals are handled tool errors / `ToolFailure`s.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from agent_sandbox.adapters._common import PolicySpec
from agent_sandbox.adapters._function import SandboxedFunction

__all__ = ["sandboxed"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

if TYPE_CHECKING:
    from langchain_core.tools import BaseTool as _LangChainTool

_Tool = TypeVar("_Tool", bound="_LangChainTool")


@overload
def sandboxed(
    target: _Tool,
    *,
    policy: PolicySpec = None,
    provider: str | None = None,
    timeout: float | None = None,
    warm: int = 0,
) -> _Tool: ...


@overload
def sandboxed(
    target: Callable[_P, _R],
    *,
    policy: PolicySpec = None,
    provider: str | None = None,
    timeout: float | None = None,
    warm: int = 0,
) -> SandboxedFunction[_P, _R]: ...


def sandboxed(
    target: Any,
    *,
    policy: PolicySpec = None,
    provider: str | None = None,
    timeout: float | None = None,
    warm: int = 0,
) -> Any:
    """Run `target` in a sandboxed worker under `policy` on every call.

    `target` is a plain function (returns a `SandboxedFunction`, called like the original), a
    LangChain tool (returns a LangChain tool) or a CrewAI tool (returns a CrewAI tool). The
    policy is a `Policy`, a shipped policy name or a TOML path (default `pure-computation`).
    """
    framework = _framework_of(target)
    if framework == "langchain":
        from agent_sandbox.adapters.langchain import sandboxed_langchain_tool

        return sandboxed_langchain_tool(
            target, policy=policy, provider=provider, timeout=timeout, warm=warm
        )
    if framework == "crewai":
        from agent_sandbox.adapters.crewai import sandboxed_crewai_tool

        return sandboxed_crewai_tool(
            target, policy=policy, provider=provider, timeout=timeout, warm=warm
        )
    if isinstance(target, types.FunctionType):
        return SandboxedFunction(
            target, policy=policy, provider=provider, timeout=timeout, warm=warm
        )
    raise TypeError(
        f"sandboxed() takes a function or a LangChain/CrewAI tool, not {type(target).__name__}"
    )


def _framework_of(obj: Any) -> str | None:
    for cls in type(obj).__mro__:
        module = cls.__module__ or ""
        if module.startswith("langchain_core."):
            return "langchain"
        if module.startswith("crewai."):
            return "crewai"
    return None
