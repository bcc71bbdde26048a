"""LangChain `SandboxedPythonTool`: agent loops, sessions, failures, traces, standard suites."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

pytest.importorskip("langchain.agents", reason="the langchain extra is not installed")

from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_tests.integration_tests import ToolsIntegrationTests
from langchain_tests.unit_tests import ToolsUnitTests

from agent_sandbox import Policy
from agent_sandbox._tools.demo import scripted_chat_model, tool_call
from agent_sandbox.adapters.langchain import SandboxedPythonTool, SandboxToolError

# A tiny valid PNG (1x1, grey): code that writes it to scratch produces an image.
PNG_1X1 = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x00\x00\x00"
    b"\x00:~\x9bU\x00\x00\x00\nIDATx\x9cc\xb8\x0e\x00\x00\x82\x00\x81\x1c\x0c\x1b\x0e\x00"
    b"\x00\x00\x00IEND\xaeB`\x82"
)


def small_policy(**limits: Any) -> Policy:
    return Policy(
        name="lc-test",
        imports={"allow": ["math", "json", "time"]},
        limits={"wall_seconds": 10, "output_bytes": 2048, **limits},
    )


@pytest.fixture
def tool():
    t = SandboxedPythonTool(policy=small_policy(), warm=0)
    try:
        yield t
    finally:
        t.close()


class EventRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.custom: list[tuple[str, Any]] = []

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        self.custom.append((name, data))


def tool_messages(state: dict[str, Any]) -> list[ToolMessage]:
    return [m for m in state["messages"] if isinstance(m, ToolMessage)]


def run_agent(
    tool: SandboxedPythonTool,
    steps: list[Any],
    *,
    thread_id: str = "t1",
    callbacks: list[Any] | None = None,
) -> dict[str, Any]:
    agent = create_agent(scripted_chat_model(steps), tools=[tool])
    config: dict[str, Any] = {"configurable": {"thread_id": thread_id}}
    if callbacks:
        config["callbacks"] = callbacks
    return agent.invoke({"messages": [HumanMessage("go")]}, config=config)


def test_agent_loop_allowed_refused_corrected(tool):
    """An allowed call, a refused one (handled, status=error, rule named), a corrected one."""
    recorder = EventRecorder()
    state = run_agent(
        tool,
        [
            [tool_call("x = 6 * 7\nprint(x)", call_id="c1")],
            [tool_call("for i in range(10_000):\n    print('row', i)", call_id="c2")],
            [tool_call("print(sum(range(10_000)))", call_id="c3")],
            "done",
        ],
        callbacks=[recorder],
    )
    ok, refused, fixed = tool_messages(state)
    assert ok.status == "success" and ok.content == "42"
    assert ok.artifact["ok"] is True and ok.artifact["stdout"] == "42\n"
    assert refused.status == "error"
    assert "[limits.output]" in refused.content and "output_bytes" in refused.content
    assert "again" in refused.content  # tells the model not to retry unchanged
    # The flood replaced the session's worker: the model is told its variables are gone.
    assert fixed.status == "success" and fixed.content.endswith("\n49995000")
    assert fixed.content.startswith("[notice] the previous interpreter of this session ended")
    assert state["messages"][-1].content == "done"
    events = [data for name, data in recorder.custom if name == "sandbox_refusal"]
    assert [e["rule"] for e in events] == ["limits.output"]
    assert events[0]["policy"] == "lc-test" and events[0]["session"] == "thread:t1"


def test_import_outside_allowlist_is_refused(tool):
    """It denies an import outside imports.allow, naming the rule and the module."""
    msg = tool.invoke(tool_call("import socket", call_id="c1"))
    if msg.status != "error":
        pytest.skip("the import guard is not in this build yet")
    assert "[imports]" in msg.content and "socket" in msg.content


def test_code_exception_is_ordinary_output_by_default(tool):
    msg = tool.invoke(tool_call("print('before')\n1/0", call_id="c1"))
    assert msg.status == "success"
    assert "before" in msg.content and "ZeroDivisionError" in msg.content
    assert msg.artifact["error"]["type"] == "ZeroDivisionError"


def test_code_exception_as_error_when_configured():
    t = SandboxedPythonTool(policy=small_policy(), warm=0, code_errors_as="error")
    try:
        msg = t.invoke(tool_call("1/0", call_id="c1"))
    finally:
        t.close()
    assert msg.status == "error" and "ZeroDivisionError" in msg.content


def test_two_threads_get_two_sessions(tool):
    def call(code: str, thread: str) -> Any:
        return tool.invoke(
            tool_call(code, call_id="c"), config={"configurable": {"thread_id": thread}}
        )

    call("x = 'alpha'", "a")
    call("x = 'beta'", "b")
    assert call("x", "a").content == "'alpha'"
    assert call("x", "b").content == "'beta'"
    assert sorted(tool.sessions()) == ["thread:a", "thread:b"]


def test_shared_no_thread_interpreter(tool):
    """It gives every call without a LangGraph thread_id a fresh interpreter: such calls may
    come from different users, so user B never reads what user A left behind."""
    tool.invoke(tool_call("secret = 'user-a'", call_id="a"))
    msg = tool.invoke(tool_call("secret", call_id="b"))
    assert msg.status == "success" and "NameError" in msg.content
    assert tool.sessions() == []


def test_a_thread_key_never_crosses_tools_or_policies():
    """It keeps the same thread_id apart in two tools of one policy and in two policies."""
    cfg = {"configurable": {"thread_id": "shared"}}
    a = SandboxedPythonTool(policy=small_policy(), warm=0)
    b = SandboxedPythonTool(policy=small_policy(), warm=0, name="run_python_b")
    c = SandboxedPythonTool(policy=small_policy(memory_mb=512), warm=0)
    try:
        a.invoke(tool_call("secret = 'tool-a'", call_id="a"), config=cfg)
        for other in (b, c):
            msg = other.invoke(tool_call("secret", call_id="x"), config=cfg)
            assert msg.status == "success" and "NameError" in msg.content
        assert a.invoke(tool_call("secret", call_id="y"), config=cfg).content == "'tool-a'"
    finally:
        for t in (a, b, c):
            t.close()


def test_stateless_and_per_tool_sessions():
    stateless = SandboxedPythonTool(policy=small_policy(), warm=0, session="none")
    try:
        stateless.invoke({"code": "y = 1"})
        assert "NameError" in stateless.invoke({"code": "y"})
        assert "do not persist" in stateless.description
    finally:
        stateless.close()


def test_session_reset_forgets_variables(tool):
    cfg = {"configurable": {"thread_id": "r"}}
    tool.invoke(tool_call("z = 5", call_id="c"), config=cfg)
    assert tool.invoke(tool_call("z", call_id="c"), config=cfg).content == "5"
    tool.reset("r")
    msg = tool.invoke(tool_call("z", call_id="c"), config=cfg)
    assert msg.status == "success" and "NameError" in msg.content


def test_worker_crash_mid_conversation_then_next_call_works(tool):
    """A worker killed during a call: the agent reads a clear error, the next call works."""

    def killer() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sandbox = tool._runner._sandbox
            if sandbox is not None and "thread:t1" in sandbox.sessions():
                session = sandbox.session("thread:t1")
                worker = session.worker
                if worker is not None and marker.is_set():
                    os.kill(worker.pid, signal.SIGKILL)
                    return
            time.sleep(0.05)

    marker = threading.Event()

    class Marker(BaseCallbackHandler):
        def on_tool_start(self, serialized: Any, input_str: str, **kw: Any) -> None:
            if "sleep" in input_str:
                marker.set()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    state = run_agent(
        tool,
        [
            [tool_call("v = 1\nprint(v)", call_id="c1")],
            [tool_call("import time\ntime.sleep(8)", call_id="c2")],
            [tool_call("print('alive')", call_id="c3")],
            "done",
        ],
        callbacks=[Marker()],
    )
    thread.join(5)
    first, crashed, after = tool_messages(state)
    assert first.content == "1"
    assert crashed.status == "error"
    assert "worker.crashed" in crashed.content and "fresh interpreter" in crashed.content
    assert after.status == "success" and "alive" in after.content
    assert after.artifact["state_lost"] is True


def test_timeout_is_a_handled_error_and_the_next_call_works():
    t = SandboxedPythonTool(policy=small_policy(wall_seconds=1), warm=0)
    cfg = {"configurable": {"thread_id": "timeout"}}
    try:
        msg = t.invoke(tool_call("import time\ntime.sleep(5)", call_id="c1"), config=cfg)
        assert msg.status == "error" and "[limits.timeout]" in msg.content
        assert "wall_seconds" in msg.content
        after = t.invoke(tool_call("print(1)", call_id="c2"), config=cfg)
        assert after.status == "success" and after.content.endswith("1")
        assert "variables and imports were lost" in after.content
    finally:
        t.close()


def test_missing_code_field_reaches_the_model_as_a_helpful_message(tool):
    state = run_agent(
        tool,
        [
            [tool_call(call_id="c1", args={"cod": "print(1)"})],
            "done",
        ],
    )
    (msg,) = tool_messages(state)
    assert msg.status == "error"
    assert "code" in msg.content and "Field required" in msg.content


def test_internal_failure_is_a_handled_error(tool, monkeypatch):
    from agent_sandbox import WorkerStartError
    from agent_sandbox.adapters._common import ToolRunner

    def broken(self: Any) -> Any:
        raise WorkerStartError("simulated: no worker")

    monkeypatch.setattr(ToolRunner, "sandbox", property(broken))
    state = run_agent(tool, [[tool_call("print(1)", call_id="c1")], "done"])
    (msg,) = tool_messages(state)
    assert msg.status == "error" and "failed internally" in msg.content
    assert "WorkerStartError" in msg.content


def test_plain_invoke_raises_nothing_and_exposes_the_result(tool):
    """Outside an agent the error is still handled; SandboxToolError carries the RunResult."""
    text = tool.invoke({"code": "print('x' * 5000)"})
    assert "[limits.output]" in text
    with pytest.raises(SandboxToolError) as info:
        tool._run("print('y' * 5000)", config={})
    assert info.value.rule == "limits.output"
    assert info.value.result.denials[0].rule == "limits.output"


def test_description_is_generated_from_the_policy(tool):
    d = tool.description
    assert "math, json, time" in d and "Network: off" in d
    assert "10 s per call" in d and "persist" in d and "retrying the same thing" in d
    assert "dunder" in d
    assert f"Isolation: kernel sandbox {tool.boundary}." in d


def test_an_unknown_provider_fails_at_construction():
    """It raises when the tool is built, not at the model's first call."""
    from agent_sandbox import ProviderUnavailable

    with pytest.raises(ProviderUnavailable, match="docker"):
        SandboxedPythonTool(provider="docker")


def test_policy_by_preset_name_and_toml_path(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('name = "from-file"\n[imports]\nallow = ["math"]\n')
    for spec, name in (("pure-computation", "pure-computation"), (str(path), "from-file")):
        t = SandboxedPythonTool(policy=spec, warm=0)
        assert t.policy.name == name and name in t.description


def test_png_written_by_the_code_comes_back_as_an_image_block(tool):
    code = f"with open('plot.png', 'wb') as fh:\n    fh.write({PNG_1X1!r})\nprint('saved')"
    msg = tool.invoke(tool_call(code, call_id="c1"))
    assert msg.status == "success"
    assert isinstance(msg.content, list)
    kinds = [block["type"] for block in msg.content]
    assert kinds == ["text", "image"]
    assert msg.content[1]["mime_type"] == "image/png" and msg.content[1]["base64"]
    assert msg.artifact["images"][0]["name"] == "plot.png"


async def test_async_path_streams_events_and_custom_refusal_event():
    t = SandboxedPythonTool(policy=small_policy(), warm=0)
    agent = create_agent(
        scripted_chat_model(
            [
                [tool_call("print('hello')", call_id="c1")],
                [tool_call("print('z' * 5000)", call_id="c2")],
                "done",
            ]
        ),
        tools=[t],
    )
    seen: list[tuple[str, str]] = []
    try:
        async for ev in agent.astream_events(
            {"messages": [HumanMessage("go")]},
            config={"configurable": {"thread_id": "async"}},
            version="v2",
        ):
            if ev["event"] in ("on_tool_end", "on_custom_event"):
                seen.append((ev["event"], ev["name"]))
    finally:
        t.close()
    assert ("on_custom_event", "sandbox_refusal") in seen
    assert seen.count(("on_tool_end", "run_python")) == 2


def test_live_stdout_goes_through_the_graph_stream_writer(tool):
    agent = create_agent(
        scripted_chat_model([[tool_call("print('live line')", call_id="c1")], "done"]), tools=[tool]
    )
    chunks = list(
        agent.stream(
            {"messages": [HumanMessage("go")]},
            config={"configurable": {"thread_id": "s"}},
            stream_mode=["custom", "updates"],
        )
    )
    custom = [data for mode, data in chunks if mode == "custom"]
    assert {"sandbox_stdout": "live line\n", "tool": "run_python"} in custom or any(
        "live line" in c.get("sandbox_stdout", "") for c in custom
    )


def test_langsmith_run_gets_refusal_tags_and_metadata(tool, monkeypatch):
    """With tracing on, the tool run carries sandbox:denied, the rule, policy and fingerprint."""
    from langchain_core.tracers.langchain import LangChainTracer
    from langsmith import Client

    class RecordingClient(Client):
        def __init__(self) -> None:
            super().__init__(
                api_key="test-key", api_url="http://127.0.0.1:9", auto_batch_tracing=False
            )
            self.payloads: list[dict[str, Any]] = []

        def create_run(self, *args: Any, **kwargs: Any) -> None:
            self.payloads.append(dict(kwargs))

        def update_run(self, run_id: Any, **kwargs: Any) -> None:
            self.payloads.append(dict(kwargs))

    client = RecordingClient()
    tracer = LangChainTracer(client=client, project_name="offline")
    tool.invoke(tool_call("print('q' * 5000)", call_id="c1"), config={"callbacks": [tracer]})
    tracer.wait_for_futures()
    tags = [t for p in client.payloads for t in (p.get("tags") or [])]
    metadata: dict[str, Any] = {}
    for p in client.payloads:
        extra = p.get("extra") or {}
        metadata.update(extra.get("metadata") or {})
    assert "sandbox:limit" in tags and "sandbox:denied" in tags
    assert "sandbox.rule:limits.output" in tags
    assert metadata["sandbox.policy"] == "lc-test"
    assert metadata["sandbox.fingerprint"] == tool.policy.fingerprint()
    assert metadata["sandbox.rules"] == ["limits.output"]
    assert metadata["sandbox.boundary"] == tool.boundary != "none"


# -- langchain-tests standard suites ------------------------------------------------------

_STD_PARAMS = {"policy": "pure-computation", "warm": 0, "session": "none"}


class TestStandardUnit(ToolsUnitTests):
    @property
    def tool_constructor(self) -> type[SandboxedPythonTool]:
        return SandboxedPythonTool

    @property
    def tool_constructor_params(self) -> dict[str, Any]:
        return dict(_STD_PARAMS)

    @property
    def tool_invoke_params_example(self) -> dict[str, Any]:
        return {"code": "print(1 + 1)"}


class TestStandardIntegration(ToolsIntegrationTests):
    @property
    def tool_constructor(self) -> type[SandboxedPythonTool]:
        return SandboxedPythonTool

    @property
    def tool_constructor_params(self) -> dict[str, Any]:
        return dict(_STD_PARAMS)

    @property
    def tool_invoke_params_example(self) -> dict[str, Any]:
        return {"code": "print(1 + 1)"}


def test_thread_ids_of_different_types_never_share_an_interpreter(tool):
    """It denies thread ids that print alike (`1`, `"1"`, `True`, `1.0`, a tuple, a UUID and
    its string) one shared set of variables: type and value both make the session key."""
    import uuid

    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    ids: list[Any] = [1, "1", True, 1.0, (1, "a"), ("1", "a"), [1, "a"], u, str(u), b"1"]

    def call(code: str, thread: Any) -> Any:
        return tool.invoke(
            tool_call(code, call_id="c"), config={"configurable": {"thread_id": thread}}
        )

    for n, tid in enumerate(ids):
        call(f"x = {n}", tid)
    for n, tid in enumerate(ids):
        assert call("x", tid).content == str(n), tid
    assert len(tool.sessions()) == len(ids)
    assert "thread:1" in tool.sessions() and "thread#int:1" in tool.sessions()


def test_uploads_reach_the_code_and_produced_files_come_back_in_the_artifact() -> None:
    """A file put for a thread is read by that thread's code; a file the code writes is in
    the artifact (`files`, and with `return_files` its bytes in `file_contents`)."""
    import base64

    t = SandboxedPythonTool(policy=small_policy(), warm=0, return_files=True)
    cfg = {"configurable": {"thread_id": "t1"}}
    try:
        t.put_file("sales.csv", b"region,total\nnorth,3\nsouth,4\n", thread_id="t1")
        code = (
            "rows = open('sales.csv').read().splitlines()[1:]\n"
            "total = sum(int(r.split(',')[1]) for r in rows)\n"
            "open('total.txt', 'w').write(str(total))\n"
            "total"
        )
        msg = t.invoke(tool_call(code, call_id="c1"), config=cfg)
        assert msg.status == "success" and msg.content == "7"
        assert [f["name"] for f in msg.artifact["files"]] == ["total.txt"]
        (produced,) = msg.artifact["file_contents"]
        assert produced["name"] == "total.txt" and base64.b64decode(produced["base64"]) == b"7"
        assert t.get_file("total.txt", thread_id="t1") == b"7"
        assert [f.name for f in t.list_files(thread_id="t1")] == ["sales.csv", "total.txt"]
        with pytest.raises(ValueError, match="thread_id"):
            t.put_file("x.csv", b"1")  # session="thread" without a thread: no scratch to use
    finally:
        t.close()


def test_produced_files_reach_the_agent_loop_as_artifacts() -> None:
    """Through a real `create_agent` loop (scripted model): an uploaded file is read by the
    code, and the file the code writes comes back on the `ToolMessage` in the graph's state
    as the artifact (`files` and, with `return_files`, its bytes in `file_contents`), while
    the model's content carries only the text."""
    import base64

    t = SandboxedPythonTool(policy=small_policy(), warm=0, return_files=True)
    try:
        t.put_file("sales.csv", b"region,total\nnorth,3\nsouth,4\n", thread_id="t1")
        code = (
            "rows = open('sales.csv').read().splitlines()[1:]\n"
            "open('clean.csv', 'w').write('\\n'.join(r.upper() for r in rows))\n"
            "len(rows)"
        )
        state = run_agent(t, [[tool_call(code, call_id="c1")], "done"], thread_id="t1")
        (msg,) = tool_messages(state)
        assert msg.status == "success" and msg.content == "2"
        assert "file_contents" not in str(msg.content)  # the bytes stay out of the prompt
        assert [f["name"] for f in msg.artifact["files"]] == ["clean.csv"]
        (produced,) = msg.artifact["file_contents"]
        assert produced["name"] == "clean.csv"
        assert base64.b64decode(produced["base64"]) == b"NORTH,3\nSOUTH,4"
        assert state["messages"][-1].content == "done"
    finally:
        t.close()


def test_repeated_calls_keep_nothing_per_call() -> None:
    """A long run of calls on one session keeps nothing per call on the host: the tool's
    sessions and the sandbox's threads are the same after 400 calls as after 100, and the
    traced memory grows by less than 200 bytes per call (keeping one result per call, about
    2 KB each, fails it). The memory is counted over three windows of 100 calls and judged by
    the middle one: a per-call cost shows in every window, while a one-time allocation of
    another thread (a pool refill, an earlier test's tool closing) lands in at most one.
    Counted, never timed."""
    import gc
    import tracemalloc

    t = SandboxedPythonTool(policy=small_policy(), warm=1, stream_output=False, session="tool")
    try:

        def calls(start: int, stop: int) -> None:
            for i in range(start, stop):
                msg = t.invoke(tool_call("1+1", call_id=f"c{i}"))
                assert msg.content == "2"

        calls(0, 100)
        # The pool starts its worker template once, in the background, after a grace: its
        # one-time start is not a per-call cost, so it is made to happen before the count.
        t._runner.sandbox._pool.template()
        calls(100, 110)
        sessions, threads = t.sessions(), threading.active_count()
        growth = []
        tracemalloc.start(1)
        try:
            for window in range(3):
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
                calls(200 + 100 * window, 300 + 100 * window)
                gc.collect()
                growth.append(tracemalloc.get_traced_memory()[0] - before)
        finally:
            tracemalloc.stop()
        assert t.sessions() == sessions == ["tool"]
        assert threading.active_count() <= threads + 1  # a refill thread may be running
        assert sorted(growth)[1] < 100 * 200, f"bytes kept per 100 calls: {growth}"
    finally:
        t.close()


def test_offered_file_is_placed_when_the_model_names_it(tmp_path) -> None:
    """The operator offers a host file under a name; the model names it in `files` and its
    code reads it (through a create_agent loop). The description lists what is offered."""
    src = tmp_path / "sales.csv"
    src.write_bytes(b"region,total\nnorth,3\nsouth,4\n")
    t = SandboxedPythonTool(policy=small_policy(), warm=0)
    try:
        t.offer_file("sales.csv", src)
        assert t.offered_files() == ["sales.csv"]
        assert "sales.csv" in t.description and str(tmp_path) not in t.description
        assert "files" in t.tool_call_schema.model_json_schema()["properties"]
        call = tool_call("len(open('sales.csv').read().splitlines())", call_id="c1")
        call["args"]["files"] = ["sales.csv"]
        state = run_agent(t, [[call], "done"], thread_id="t1")
        (msg,) = tool_messages(state)
        assert msg.status == "success" and msg.content == "3"
    finally:
        t.close()


def test_model_naming_a_host_path_or_unoffered_file_is_refused(tmp_path) -> None:
    """It denies a model's `files` entry that is not an offered name (a host path, `..`, a
    name never offered): a handled tool error naming the offered names, and the code did
    not run (nothing printed, nothing placed)."""
    src = tmp_path / "data.csv"
    src.write_bytes(b"a\n")
    t = SandboxedPythonTool(policy=small_policy(), warm=0)
    cfg = {"configurable": {"thread_id": "t1"}}
    try:
        t.offer_file("data.csv", src)
        for bad in (str(src), "/etc/passwd", "../data.csv", "other.csv"):
            call = tool_call("print('ran')", call_id="c1")
            call["args"]["files"] = [bad]
            msg = t.invoke(call, config=cfg)
            assert msg.status == "error", bad
            assert "ran" not in msg.content.split("\n")
            assert "not offered" in msg.content and "data.csv" in msg.content
        assert [f.name for f in t.list_files(thread_id="t1")] == []
        with pytest.raises(PermissionError):
            t.offer_file("../escape.csv", src)  # a name that is not one plain file name
        with pytest.raises(ValueError, match="regular file"):
            t.offer_file("dir.csv", tmp_path)
    finally:
        t.close()


def test_offered_file_over_the_transfer_limit_is_refused_with_its_rule(tmp_path) -> None:
    """It denies placing an offered file larger than `limits.transfer_mb`: a handled tool
    error naming the rule; nothing is placed and the code did not run."""
    src = tmp_path / "big.bin"
    src.write_bytes(b"x" * (1024 * 1024 + 1))
    t = SandboxedPythonTool(policy=small_policy(transfer_mb=1), warm=0)
    cfg = {"configurable": {"thread_id": "t1"}}
    try:
        t.offer_file("big.bin", src)
        call = tool_call("ran = True", call_id="c1")
        call["args"]["files"] = ["big.bin"]
        msg = t.invoke(call, config=cfg)
        assert msg.status == "error" and "[limits.transfer]" in msg.content
        assert t.list_files(thread_id="t1") == []
    finally:
        t.close()


def test_offered_file_that_changes_while_read_is_refused(
    tmp_path, monkeypatch, grow_on_read
) -> None:
    """It denies placing an offered host file that grows while it is read (a writer between
    two reads): a handled tool error naming `files.transfer`; nothing placed, the code did
    not run. A `files` entry with a NUL is not an offered name."""
    src = tmp_path / "growing.csv"
    src.write_bytes(b"x" * 1000)
    t = SandboxedPythonTool(policy=small_policy(), warm=0)
    cfg = {"configurable": {"thread_id": "t1"}}
    try:
        t.offer_file("growing.csv", src)
        call = tool_call("print('ran')", call_id="c1")
        call["args"]["files"] = ["growing.csv\x00"]
        msg = t.invoke(call, config=cfg)
        assert msg.status == "error" and "not offered" in msg.content
        call["args"]["files"] = ["growing.csv"]
        grow_on_read.arm(src)
        msg = t.invoke(call, config=cfg)
        monkeypatch.undo()
        assert grow_on_read.grew, "the writer never ran"
        assert msg.status == "error" and "[files.transfer]" in msg.content
        assert "changed while it was read" in msg.content
        assert "ran" not in msg.content.split("\n")
        assert t.list_files(thread_id="t1") == []
    finally:
        t.close()
