"""The offline demo (`agent-sandbox demo`) and the scripted models it runs on.

Two agents, no network, no API key: a LangChain `create_agent` agent and a CrewAI crew, each
driven by a scripted model that makes three calls to `SandboxedPythonTool`:

1. an allowed call;
2. a call the policy refuses: the model fetches its data with `requests` from an API the
   policy does not name (the library may be imported; the network is off), and `requests`
   turns the refused name lookup into its own `ConnectionError`; the refusal shows in the
   conversation as a refusal naming `net.resolve` and the `[[grant]]` that would allow it, and
   in what the framework records (LangChain callback events, CrewAI's
   `TaskOutput.tool_failures`);
3. the corrected call, then a final answer.

`scripted_chat_model()` and `scripted_crewai_llm()` are also what the tests and notebooks use
to drive both frameworks offline. Frameworks are imported inside the functions only.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from agent_sandbox.policies import Policy
from agent_sandbox.policies._model import ImportsPolicy, LimitsPolicy

__all__ = [
    "CREWAI_OFFLINE_ENV",
    "DemoScript",
    "Transcript",
    "crewai_offline_env",
    "demo_policy",
    "demo_script",
    "print_transcript",
    "run_crewai_demo",
    "run_demo",
    "run_langchain_demo",
    "scripted_chat_model",
    "scripted_crewai_llm",
    "tool_call",
]

#: Environment that keeps CrewAI offline and out of the user's home (set before importing it).
CREWAI_OFFLINE_ENV = {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "OTEL_SDK_DISABLED": "true",
    "CREWAI_TRACING_ENABLED": "false",
}


def crewai_offline_env(storage_dir: str | None = None) -> dict[str, str]:
    """Set (and return) the variables that keep CrewAI offline; storage goes to a temp dir."""
    env = dict(CREWAI_OFFLINE_ENV)
    folder = storage_dir or os.environ.get("CREWAI_STORAGE_DIR")
    if not folder:
        # Made here only when none is given, and removed when the process exits.
        folder = tempfile.mkdtemp(prefix="agent-sandbox-crewai-")
        atexit.register(shutil.rmtree, folder, True)
    env["CREWAI_STORAGE_DIR"] = folder
    os.environ.update(env)
    return env


def demo_policy() -> Policy:
    """The demo tool's policy: a few maths modules and `requests` (importable, but with no
    net rule it reaches nothing), small output, and the strongest kernel sandbox this
    machine offers (`auto`)."""
    return Policy(
        name="demo-analyst",
        description="Small statistics on numbers the user gives; no network, no files",
        provider="auto",
        imports=ImportsPolicy(allow=("math", "statistics", "json", "requests")),
        limits=LimitsPolicy(wall_seconds=10, output_bytes=2048),
    )


@dataclass(frozen=True)
class DemoScript:
    """The three pieces of code the scripted model sends, and the rule the refusal names."""

    allowed: str
    refused: str
    corrected: str
    rule: str
    answer: str = "The mean is 5.5 and the standard deviation is 3.03."
    question: str = "What are the mean and standard deviation of 1..10?"


def demo_script(policy: Policy | None = None, *, use_import: bool = True) -> DemoScript:
    """The demo's calls; the refusal is a `requests` fetch the policy's network rules do not
    allow (or, with `use_import=False`, a flood of output past `limits.output_bytes`)."""
    allowed = "import statistics\ndata = list(range(1, 11))\nprint(statistics.mean(data))"
    corrected = (
        "import statistics\ndata = list(range(1, 11))\nprint(round(statistics.stdev(data), 2))"
    )
    if use_import:
        refused = (
            "import requests, statistics\n"
            "data = requests.get('https://stats.example.com/v1/sample').json()\n"
            "print(statistics.stdev(data))"
        )
        return DemoScript(allowed, refused, corrected, "net.resolve")
    refused = "for i in range(100_000):\n    print('sample', i, data[i % 10])"
    return DemoScript(allowed, refused, corrected, "limits.output")


# -- scripted models ---------------------------------------------------------------------


def tool_call(
    code: str | None = None,
    *,
    call_id: str,
    name: str = "run_python",
    args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One LangChain tool call dict (`args` overrides `{"code": code}`, e.g. bad arguments)."""
    return {
        "name": name,
        "args": args if args is not None else {"code": code},
        "id": call_id,
        "type": "tool_call",
    }


def scripted_chat_model(steps: Iterable[Any]) -> Any:
    """A LangChain chat model that answers with `steps` in order, offline.

    Each step is an `AIMessage`, a string (a final answer) or a list of tool-call dicts
    (`tool_call()`). `bind_tools` returns the model itself; streaming is disabled so the
    tool calls survive `astream_events`.
    """
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    class ScriptedChatModel(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self

    messages = []
    for step in steps:
        if isinstance(step, AIMessage):
            messages.append(step)
        elif isinstance(step, str):
            messages.append(AIMessage(content=step))
        else:
            messages.append(AIMessage(content="", tool_calls=list(step)))
    return ScriptedChatModel(messages=iter(messages), disable_streaming=True)


def scripted_crewai_llm(steps: Sequence[dict[str, Any]], *, native: bool = True) -> Any:
    """A CrewAI `BaseLLM` that follows `steps`: `{"tool": name, "args": {...}}` or
    `{"final": text}`. `native=False` answers in ReAct text instead of tool-call lists.
    `.seen` collects the tool results the model was shown."""
    from crewai.llms.base_llm import BaseLLM
    from pydantic import Field

    # A scripted model has no tokenizer; CrewAI warns about that on every call.
    logging.getLogger("crewai.llms.base_llm").setLevel(logging.ERROR)

    class ScriptedCrewLLM(BaseLLM):
        script: list[dict[str, Any]] = Field(default_factory=list)
        native: bool = True
        seen: list[str] = Field(default_factory=list)
        calls: int = 0

        def supports_function_calling(self) -> bool:
            return self.native

        def supports_stop_words(self) -> bool:
            return False

        def get_context_window_size(self) -> int:
            return 8192

        def call(
            self,
            messages: Any,
            tools: Any = None,
            callbacks: Any = None,
            available_functions: Any = None,
            from_task: Any = None,
            from_agent: Any = None,
            response_model: Any = None,
        ) -> Any:
            if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
                last = messages[-1]
                content = str(last.get("content") or "")
                if last.get("role") == "tool":
                    self.seen.append(content)
            if not self.native and isinstance(messages, list):
                observed = [
                    str(m.get("content") or "")
                    .split("Observation:", 1)[1]
                    .split("\n\n\nYou ONLY have access", 1)[0]
                    .strip()
                    for m in messages
                    if isinstance(m, dict)
                    and m.get("role") == "assistant"
                    and "Observation:" in str(m.get("content") or "")
                ]
                self.seen[:] = observed
            step = self.script[self.calls] if self.calls < len(self.script) else {"final": "done"}
            self.calls += 1
            if "final" in step:
                text = str(step["final"])
                return (
                    text
                    if self.native
                    else (f"Thought: I now know the final answer\nFinal Answer: {text}")
                )
            if self.native:
                return [
                    {
                        "id": f"call_{self.calls}",
                        "type": "function",
                        "function": {"name": step["tool"], "arguments": json.dumps(step["args"])},
                    }
                ]
            return (
                f"Thought: I should run code.\nAction: {step['tool']}\n"
                f"Action Input: {json.dumps(step['args'])}"
            )

    return ScriptedCrewLLM(model="scripted-offline", script=list(steps), native=native)


# -- the transcript ------------------------------------------------------------------------


def scripted_smolagents_model(codes: Sequence[str]) -> Any:
    """A smolagents `Model` that answers with one code block per step, in order, offline
    (each reply is `Thought: ...` and the code between `<code>` tags, what a `CodeAgent`
    parses). `model.seen` keeps the last message of each prompt it was given."""
    from smolagents.models import ChatMessage, MessageRole, Model

    class ScriptedSmolagentsModel(Model):  # type: ignore[misc]  # (smolagents is untyped)
        def __init__(self, replies: Sequence[str]) -> None:
            super().__init__(model_id="scripted")
            self.replies = list(replies)
            self.seen: list[str] = []

        def generate(self, messages: Any, stop_sequences: Any = None, **kwargs: Any) -> Any:
            last = messages[-1] if messages else None
            content = getattr(last, "content", None) or (last or {}).get("content", "")  # type: ignore[union-attr]
            self.seen.append(str(content))
            if not self.replies:
                raise RuntimeError("the scripted model has no reply left")
            code = self.replies.pop(0)
            text = f"Thought: step {len(self.seen)}.\n<code>\n{code}\n</code>"
            return ChatMessage(role=MessageRole.ASSISTANT, content=text)

    return ScriptedSmolagentsModel(codes)


@dataclass
class Transcript:
    """What one demo run showed: lines, the refusals the framework recorded, the answer."""

    framework: str
    lines: list[tuple[str, str]] = field(default_factory=list)  # (kind, text)
    recorded: list[dict[str, Any]] = field(default_factory=list)
    answer: str = ""

    def add(self, kind: str, text: str) -> None:
        self.lines.append((kind, text))


_MAX_LINES = 12


def _style(stream: TextIO) -> Any:
    from agent_sandbox._tools.cli import Style

    return Style(stream)


def print_transcript(t: Transcript, stream: TextIO) -> None:
    """Print a transcript; refusals in red (when the stream is a terminal)."""
    style = _style(stream)
    print(style.bold(f"=== {t.framework} ==="), file=stream)
    for kind, text in t.lines:
        body = text.rstrip("\n")
        if body.count("\n") > _MAX_LINES:
            kept = body.splitlines()[:_MAX_LINES]
            body = "\n".join([*kept, f"[... {body.count(chr(10)) + 1 - _MAX_LINES} more lines]"])
        if kind == "user":
            print(style.bold("user  > ") + body, file=stream)
        elif kind == "call":
            print(style.dim("model > run_python:"), file=stream)
            for line in body.splitlines():
                print(style.dim("        | ") + line, file=stream)
        elif kind == "refused":
            print(style.bold(style.red("tool  ! REFUSED")), file=stream)
            for line in body.splitlines():
                print(style.red("        ") + style.red(line), file=stream)
        elif kind == "tool":
            print("tool  < " + body.replace("\n", "\n        "), file=stream)
        elif kind == "answer":
            print(style.green("model > ") + body, file=stream)
        else:
            print(style.yellow(f"{kind}: ") + body, file=stream)
    for rec in t.recorded:
        print(style.yellow("recorded > ") + json.dumps(rec, sort_keys=True), file=stream)
    print(file=stream)


def run_langchain_demo(
    script: DemoScript | None = None,
    policy: Policy | None = None,
    *,
    thread_id: str = "demo-thread",
) -> Transcript:
    """Run the LangChain agent; the refusal is recorded from the tool's callback events."""
    from langchain.agents import create_agent
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from agent_sandbox.adapters.langchain import SandboxedPythonTool

    policy = policy or demo_policy()
    script = script or demo_script(policy)
    recorded: list[dict[str, Any]] = []

    class Recorder(BaseCallbackHandler):
        def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
            if name == "sandbox_refusal":
                recorded.append(
                    {
                        "event": name,
                        "rule": data.get("rule"),
                        "policy": data.get("policy"),
                        "session": data.get("session"),
                    }
                )

    model = scripted_chat_model(
        [
            [tool_call(script.allowed, call_id="call_1")],
            [tool_call(script.refused, call_id="call_2")],
            [tool_call(script.corrected, call_id="call_3")],
            script.answer,
        ]
    )
    tool = SandboxedPythonTool(policy=policy, warm=0)
    try:
        agent = create_agent(model, tools=[tool])
        state = agent.invoke(
            {"messages": [HumanMessage(script.question)]},
            config={"configurable": {"thread_id": thread_id}, "callbacks": [Recorder()]},
        )
    finally:
        tool.close()
    t = Transcript("LangChain (create_agent)", recorded=recorded)
    for msg in state["messages"]:
        if isinstance(msg, HumanMessage):
            t.add("user", str(msg.content))
        elif isinstance(msg, AIMessage):
            for call in msg.tool_calls:
                t.add("call", str(call["args"].get("code", call["args"])))
            if msg.content:
                t.answer = str(msg.content)
                t.add("answer", t.answer)
        elif isinstance(msg, ToolMessage):
            text = msg.content if isinstance(msg.content, str) else str(msg.content)
            t.add("refused" if msg.status == "error" else "tool", text)
    return t


def run_crewai_demo(script: DemoScript | None = None, policy: Policy | None = None) -> Transcript:
    """Run the CrewAI crew; the refusal is recorded in `TaskOutput.tool_failures`."""
    crewai_offline_env()
    from crewai import Agent, Crew, Process, Task

    from agent_sandbox.adapters.crewai import SandboxedPythonTool

    policy = policy or demo_policy()
    script = script or demo_script(policy)
    llm = scripted_crewai_llm(
        [
            {"tool": "run_python", "args": {"code": script.allowed}},
            {"tool": "run_python", "args": {"code": script.refused}},
            {"tool": "run_python", "args": {"code": script.corrected}},
            {"final": script.answer},
        ]
    )
    tool = SandboxedPythonTool(policy=policy, warm=0)
    try:
        agent = Agent(
            role="Analyst",
            goal="Answer with numbers computed in Python",
            backstory="Careful and terse.",
            llm=llm,
            tools=[tool],
            allow_delegation=False,
            max_iter=8,
            verbose=False,
        )
        task = Task(description=script.question, expected_output="two numbers", agent=agent)
        crew = Crew(agents=[agent], tasks=[task], process=Process.sequential, verbose=False)
        output: Any = crew.kickoff()
    finally:
        tool.close()
    t = Transcript("CrewAI (Crew.kickoff)")
    t.add("user", script.question)
    codes = [script.allowed, script.refused, script.corrected]
    for code, seen in zip(codes, llm.seen, strict=False):
        t.add("call", code)
        refused = "(code: " in seen and ("REFUSED" in seen or "STOPPED" in seen)
        t.add("refused" if refused else "tool", seen)
    t.answer = str(output.raw)
    t.add("answer", t.answer)
    for task_output in output.tasks_output:
        for rec in getattr(task_output, "tool_failures", None) or []:
            failure = rec.failure
            t.recorded.append(
                {
                    "tool_failure": rec.tool_name,
                    "code": failure.code,
                    "reason": str(getattr(failure.reason, "value", failure.reason)),
                }
            )
    return t


def run_smolagents_demo(
    script: DemoScript | None = None, policy: Policy | None = None
) -> Transcript:
    """Run a smolagents `CodeAgent` whose code runs in a sandboxed session
    (`SandboxedExecutor`); the refusal is recorded from the step's memory."""
    from smolagents import CodeAgent
    from smolagents.monitoring import LogLevel

    from agent_sandbox.adapters.smolagents import SandboxedExecutor

    policy = policy or demo_policy()
    script = script or demo_script(policy)
    codes = [script.allowed, script.refused, script.corrected, f"final_answer({script.answer!r})"]
    model = scripted_smolagents_model(codes)
    executor = SandboxedExecutor(policy, warm=0)
    try:
        agent = CodeAgent(
            tools=[], model=model, executor=executor, max_steps=6, verbosity_level=LogLevel.OFF
        )
        answer = agent.run(script.question)
    finally:
        executor.cleanup()
    t = Transcript("smolagents (CodeAgent)")
    t.add("user", script.question)
    steps = [s for s in agent.memory.steps if hasattr(s, "code_action")]
    for step, code in zip(steps, codes, strict=False):
        t.add("call", code)
        error = getattr(step, "error", None)
        if error is not None:
            t.add("refused", str(getattr(error, "message", error)))
            rule = next((r for r in (script.rule,) if f"[{r}]" in str(error)), "")
            t.recorded.append({"step_error": type(error).__name__, "rule": rule})
        elif not getattr(step, "is_final_answer", False):
            t.add("tool", str(getattr(step, "observations", "") or ""))
    t.answer = str(answer)
    t.add("answer", t.answer)
    return t


def _stack_text(policy: Policy) -> str:
    """The sandbox stack the policy's provider gives a worker on this machine."""
    from agent_sandbox._host.sandbox import Sandbox

    with Sandbox(policy, warm=0) as sandbox:
        result = sandbox.run("None")
    return " + ".join(result.stack) or result.provider


def run_demo(stream: TextIO, *, only: str | None = None) -> list[Transcript]:
    """Run both demos (or `only` one) and print their transcripts."""
    policy = demo_policy()
    script = demo_script(policy)
    style = _style(stream)
    print(
        style.bold("agent-sandbox demo: two offline agents, one sandboxed Python tool"), file=stream
    )
    print(
        style.dim(
            f"policy {policy.name!r} (fingerprint {policy.fingerprint()}), provider "
            f"{policy.provider} -> {_stack_text(policy)}; "
            f"the refused call breaks rule [{script.rule}]"
        ),
        file=stream,
    )
    print(file=stream)
    transcripts = []
    if only in (None, "langchain"):
        transcripts.append(run_langchain_demo(script, policy))
        print_transcript(transcripts[-1], stream)
    if only in (None, "crewai"):
        transcripts.append(run_crewai_demo(script, policy))
        print_transcript(transcripts[-1], stream)
    if only == "smolagents" or (only is None and importlib.util.find_spec("smolagents")):
        transcripts.append(run_smolagents_demo(script, policy))
        print_transcript(transcripts[-1], stream)
    return transcripts
