"""Scripted models for offline demos, notebooks and tests (no network, no API key).

* `scripted_chat_model(steps)`: a LangChain chat model that answers with the given steps in
  order; a step is text (a final answer), an `AIMessage`, or a list of tool calls made with
  `tool_call(code, call_id=...)`.
* `scripted_crewai_llm(steps)`: the same for a CrewAI agent; a step is
  `{"tool": name, "args": {...}}` or `{"final": text}`.
* `scripted_smolagents_model(codes)`: a smolagents `Model` whose `CodeAgent` runs the given
  code blocks in order.
* `crewai_offline_env()`: environment variables that keep CrewAI from reaching the network.

The frameworks are imported only when these are called.
"""

from __future__ import annotations

from agent_sandbox._tools.demo import (
    crewai_offline_env,
    scripted_chat_model,
    scripted_crewai_llm,
    scripted_smolagents_model,
    tool_call,
)

__all__ = [
    "crewai_offline_env",
    "scripted_chat_model",
    "scripted_crewai_llm",
    "scripted_smolagents_model",
    "tool_call",
]
