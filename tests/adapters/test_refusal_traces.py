"""What the LangChain trace holds for a refused fetch and for a plot: one classification.

A `requests` call refused by the policy is a handled tool error, tagged `sandbox:denied` with
its rule; a successful matplotlib plot, whose font probes a library handled itself, carries no
refusal tag and only the raw counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("langchain.agents", reason="the langchain extra is not installed")
pytest.importorskip("requests")
pytest.importorskip("matplotlib")

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import ToolMessage
from langchain_core.tracers.langchain import LangChainTracer
from langsmith import Client

from agent_sandbox._tools.demo import tool_call
from agent_sandbox.adapters.langchain import SandboxedPythonTool
from agent_sandbox.policies import policy_from_toml

POLICY = """
name = "fetcher"
extends = "data-analysis"

[[grant]]
imports.allow = ["requests"]
"""


class RecordingClient(Client):
    """A LangSmith client that records payloads instead of sending them (no network)."""

    def __init__(self) -> None:
        super().__init__(api_key="test-key", api_url="http://127.0.0.1:9", auto_batch_tracing=False)
        self.payloads: list[dict[str, Any]] = []

    def create_run(self, *args: Any, **kwargs: Any) -> None:
        self.payloads.append(dict(kwargs))

    def update_run(self, run_id: Any, **kwargs: Any) -> None:
        self.payloads.append(dict(kwargs))


class Events(BaseCallbackHandler):
    def __init__(self) -> None:
        self.custom: list[tuple[str, Any]] = []

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        self.custom.append((name, data))


@pytest.fixture(scope="module")
def tool() -> Iterator[SandboxedPythonTool]:
    t = SandboxedPythonTool(policy=policy_from_toml(POLICY), warm=0, session="tool")
    try:
        yield t
    finally:
        t.close()


def traced(tool: SandboxedPythonTool, code: str, monkeypatch: Any) -> tuple[Any, list[str], dict]:
    client = RecordingClient()
    tracer = LangChainTracer(client=client, project_name="offline")
    message = tool.invoke(tool_call(code, call_id="c1"), config={"callbacks": [tracer]})
    tracer.wait_for_futures()
    tags = [t for p in client.payloads for t in (p.get("tags") or [])]
    metadata: dict[str, Any] = {}
    for p in client.payloads:
        metadata.update((p.get("extra") or {}).get("metadata") or {})
    return message, tags, metadata


def test_a_refused_requests_call_is_a_tagged_tool_error(tool, monkeypatch):
    """It makes the model read a refusal and the trace carry the rule, for `requests`."""
    code = "import requests\nrequests.get('https://example.com/rates.json').json()"
    message, tags, metadata = traced(tool, code, monkeypatch)
    assert isinstance(message, ToolMessage) and message.status == "error"
    assert message.content.startswith("REFUSED by the sandbox policy.")
    assert "[net.resolve]" in message.content and "[[grant]]" in message.content
    assert "sandbox:denied" in tags and "sandbox.rule:net.resolve" in tags
    assert metadata["sandbox.outcome"] == "denied"
    assert [d["rule"] for d in metadata["sandbox.denials"]] == ["net.resolve"]
    assert metadata["sandbox.denial_counts"]["user"] == 1


def test_a_successful_plot_carries_no_refusal_tag(tool, monkeypatch):
    """It keeps library-internal refusals out of the tags, in the counts only."""
    code = (
        "import matplotlib.font_manager as fm\nfm.findSystemFonts()\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n'plotted'"
    )
    message, tags, metadata = traced(tool, code, monkeypatch)
    assert message.status == "success"
    assert not any(t == "sandbox:denied" or t.startswith("sandbox.rule:") for t in tags)
    assert metadata["sandbox.outcome"] == "ok" and "sandbox.denials" not in metadata
    assert metadata["sandbox.denial_counts"]["user"] == 0
    assert metadata["sandbox.denial_counts"]["internal"] >= 1
    assert metadata["sandbox.internal_denials"]


def test_the_custom_event_follows_the_same_classification(tool):
    """It dispatches `sandbox_refusal` for the user's refusals only, caught ones included."""
    from langchain_core.runnables import RunnableLambda

    events = Events()

    def call(code: str) -> Any:
        return tool.invoke(tool_call(code, call_id="c9"))

    runnable = RunnableLambda(call)
    runnable.invoke(
        "import requests\ntry:\n    requests.get('https://example.com/')\nexcept Exception:\n"
        "    print('offline')",
        config={"callbacks": [events]},
    )
    runnable.invoke(
        "import matplotlib.font_manager as fm\nfm.findSystemFonts()\n1",
        config={"callbacks": [events]},
    )
    refusals = [data for name, data in events.custom if name == "sandbox_refusal"]
    assert len(refusals) == 1
    assert refusals[0]["kind"] == "caught" and refusals[0]["rule"] == "net.resolve"
