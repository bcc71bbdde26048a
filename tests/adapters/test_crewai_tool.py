"""CrewAI `SandboxedPythonTool` (all CrewAI tests live here: importing crewai takes ~6 s).

CrewAI is imported inside a module fixture with telemetry and tracing off and HOME /
CREWAI_STORAGE_DIR pointed at a temp dir (it writes there on import and on kickoff).
"""

from __future__ import annotations

import importlib.util
import os
import signal
from types import SimpleNamespace
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._tools.demo import CREWAI_OFFLINE_ENV, scripted_crewai_llm

pytestmark = [
    pytest.mark.crewai,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.skipif(
        importlib.util.find_spec("crewai") is None,
        reason="crewai is not installed (pip install 'agent-sandbox-kit[crewai]')",
    ),
]


@pytest.fixture(scope="module")
def crew(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("crewai-home")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in CREWAI_OFFLINE_ENV.items():
            mp.setenv(key, value)
        mp.setenv("CREWAI_STORAGE_DIR", str(home / "storage"))
        mp.setenv("HOME", str(home))
        try:
            import crewai
            from crewai.tools.tool_failure import ToolFailure
        except ImportError as exc:  # pragma: no cover
            pytest.skip(f"crewai cannot be imported: {exc}")
        from agent_sandbox.adapters import crewai as adapter

        yield SimpleNamespace(crewai=crewai, ToolFailure=ToolFailure, adapter=adapter)


def policy(**limits: Any) -> Policy:
    return Policy(
        name="crew-test",
        imports={"allow": ["math", "time"]},
        limits={"wall_seconds": 10, "output_bytes": 2048, **limits},
    )


@pytest.fixture
def tool(crew):
    t = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0)
    try:
        yield t
    finally:
        t.close()


def kickoff(
    crew, tool, steps: list[dict[str, Any]], *, native: bool = True, cache: bool = False
) -> tuple[Any, Any]:
    c = crew.crewai
    llm = scripted_crewai_llm(steps, native=native)
    agent = c.Agent(
        role="Analyst",
        goal="compute",
        backstory="terse",
        llm=llm,
        tools=[tool],
        allow_delegation=False,
        max_iter=8,
        verbose=False,
    )
    task = c.Task(description="Compute with run_python.", expected_output="a number", agent=agent)
    out = c.Crew(
        agents=[agent], tasks=[task], process=c.Process.sequential, verbose=False, cache=cache
    ).kickoff()
    return out, llm


def counting(crew, t):
    calls: list[str] = []
    original = t._runner.run

    def run(code: str, **kw: Any) -> Any:
        calls.append(code)
        return original(code, **kw)

    t._runner.run = run  # type: ignore[method-assign]
    return calls


STEPS = [
    {"tool": "run_python", "args": {"code": "x = 6 * 7\nprint(x)"}},
    {"tool": "run_python", "args": {"code": "for i in range(10_000):\n    print('row', i)"}},
    {"tool": "run_python", "args": {"code": "print(sum(range(10)))"}},
    {"final": "45"},
]


@pytest.mark.parametrize("native", [True, False], ids=["native-tools", "react-text"])
def test_crew_loop_refusal_is_a_tool_failure_run_once(crew, tool, native):
    """Allowed, refused (returned as ToolFailure, code = rule, executed once), corrected."""
    calls = counting(crew, tool)
    out, llm = kickoff(crew, tool, STEPS, native=native)
    assert out.raw == "45"
    assert len(calls) == 3  # a returned failure is not retried by the ReAct path
    assert "42" in llm.seen[0]
    assert "[limits.output]" in llm.seen[1] and "(code: limits.output)" in llm.seen[1]
    assert "45" in llm.seen[2]
    failures = out.tasks_output[0].tool_failures
    assert [(f.tool_name, f.failure.code) for f in failures] == [("run_python", "limits.output")]
    assert failures[0].failure.details["denials"][0]["rule"] == "limits.output"


def test_denials_and_limits_are_returned_never_raised(crew):
    t = crew.adapter.SandboxedPythonTool(policy=policy(wall_seconds=1), warm=0)
    try:
        timed_out = t.run(code="import time\ntime.sleep(5)")
        assert isinstance(timed_out, crew.ToolFailure)
        assert timed_out.code == "limits.timeout" and not timed_out.retryable
        assert "wall_seconds" in timed_out.message
        loud = t.run(code="print('x' * 5000)")
        assert isinstance(loud, crew.ToolFailure) and loud.code == "limits.output"
        assert t.run(code="print('ok')").endswith("ok")
    finally:
        t.close()


def test_code_exception_is_output_unless_configured(crew, tool):
    assert "ZeroDivisionError" in tool.run(code="1/0")
    strict = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0, code_errors_as="error")
    try:
        failure = strict.run(code="1/0")
        assert isinstance(failure, crew.ToolFailure) and failure.code == "exception"
    finally:
        strict.close()


def test_results_are_never_cached(crew, tool):
    """Even with Crew(cache=True), the same code runs each time (the interpreter has state)."""
    code = "try:\n    n += 1\nexcept NameError:\n    n = 1\nprint(n)"
    steps = [{"tool": "run_python", "args": {"code": code}}] * 3 + [{"final": "3"}]
    _out, llm = kickoff(crew, tool, steps, cache=True)
    assert [s.strip() for s in llm.seen] == ["1", "2", "3"]
    assert tool.cache_function({"code": code}, "1") is False


def test_session_reset_and_stateless_mode(crew, tool):
    tool.run(code="v = 3")
    assert tool.run(code="v") == "3"
    tool.reset()
    assert "NameError" in tool.run(code="v")
    stateless = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0, session="none")
    try:
        stateless.run(code="w = 1")
        assert "NameError" in stateless.run(code="w")
    finally:
        stateless.close()


def test_worker_crash_then_next_call_works(crew, tool):
    tool.run(code="v = 1")
    worker = tool._runner.sandbox.session("tool").worker
    os.kill(worker.pid, signal.SIGKILL)
    worker.proc.wait(5)
    text = tool.run(code="print('alive')")
    assert "alive" in text and "variables and imports were lost" in text
    assert tool.last_result.state_lost


def test_missing_code_field_reaches_the_agent(crew, tool):
    steps = [{"tool": "run_python", "args": {"cod": "print(1)"}}, {"final": "gave up"}]
    out, llm = kickoff(crew, tool, steps)
    assert out.raw == "gave up"
    assert llm.seen and "code" in llm.seen[0].lower()


def test_sandboxed_crewai_tool_runs_its_body_under_the_policy(crew):
    from crewai.tools import tool as crew_tool

    from agent_sandbox.adapters import sandboxed

    @crew_tool("hypot")
    def hypot(a: float, b: float) -> float:
        """Length of the hypotenuse."""
        import math

        return math.hypot(a, b)

    @crew_tool("chatty")
    def chatty(n: int) -> int:
        """Print a lot."""
        for i in range(n):
            print("line", i)
        return n

    ok = sandboxed(hypot, policy=policy())
    loud = sandboxed(chatty, policy=policy())
    try:
        assert ok.run(a=3, b=4) == 5.0
        failure = loud.run(n=10_000)
        assert isinstance(failure, crew.ToolFailure) and failure.code == "limits.output"
        assert loud.cache_function({}, None) is False
    finally:
        for t in (ok, loud):
            t.func.sandbox.close()


def test_failure_policy_raise_aborts_the_crew(crew):
    from crewai.tools.tool_failure import ToolFailurePolicy

    t = crew.adapter.SandboxedPythonTool(
        policy=policy(), warm=0, tool_failure_policy=ToolFailurePolicy.RAISE
    )
    try:
        with pytest.raises(Exception, match=r"limits\.output"):
            kickoff(
                crew,
                t,
                [{"tool": "run_python", "args": {"code": "print('x' * 5000)"}}, {"final": "never"}],
            )
    finally:
        t.close()


def test_a_refusal_the_code_caught_is_still_a_tool_failure(crew):
    """It reports every refusal of the user's code as a ToolFailure, caught or not."""
    t = crew.adapter.SandboxedPythonTool(policy="data-analysis", warm=0)
    try:
        caught = t.run(
            code="try:\n    open('/etc/passwd')\nexcept OSError:\n    print('used the fallback')"
        )
        assert isinstance(caught, crew.ToolFailure) and caught.code == "files.read"
        assert "used the fallback" in caught.message and "caught the error" in caught.message
        assert caught.details["kind"] == "caught"
        assert [d["target"] for d in caught.details["denials"]] == ["/etc/passwd"]
        # Refusals a library handled itself are not the user's: no failure.
        fonts = t.run(
            code="import matplotlib.font_manager as fm\nfm.findSystemFonts()\nprint('ok')"
        )
        assert isinstance(fonts, str) and fonts.startswith("ok")
        assert t.last_result is not None and t.last_result.internal_denials()
    finally:
        t.close()


def test_uploads_reach_the_code_and_produced_files_are_kept(crew):
    """A file put into the tool's interpreter is read by the agent's code; with
    `return_files` the files a call wrote are in `last_files` with their bytes."""
    import base64

    t = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0, return_files=True)
    try:
        t.put_file("notes.txt", b"alpha beta gamma")
        out = t._run(
            "n = len(open('notes.txt').read().split())\nopen('n.txt','w').write(str(n))\nn"
        )
        assert out == "3"
        (produced,) = t.last_files
        assert produced["name"] == "n.txt" and base64.b64decode(produced["base64"]) == b"3"
        assert t.get_file("n.txt") == b"3"
    finally:
        t.close()


# -- offered files: uploads as a tool input ------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native-tools", "react-text"])
def test_offered_file_is_placed_when_the_agent_names_it(crew, tmp_path, native):
    """The operator offers a host file under a name; the agent names it in `files` (a field
    of the tool's args schema) and its code reads it, through a crew loop. The description
    lists the offered name and never the host path; a file the code writes is in
    `last_files`."""
    import base64

    src = tmp_path / "sales.csv"
    src.write_bytes(b"region,total\nnorth,3\nsouth,4\n")
    t = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0, return_files=True)
    try:
        t.offer_file("sales.csv", src)
        assert t.offered_files() == ["sales.csv"]
        assert "sales.csv" in t.description and str(tmp_path) not in t.description
        assert "files" in t.args_schema.model_json_schema()["properties"]
        code = (
            "rows = open('sales.csv').read().splitlines()[1:]\n"
            "open('n.txt', 'w').write(str(len(rows)))\n"
            "print(len(rows))"
        )
        steps = [
            {"tool": "run_python", "args": {"code": code, "files": ["sales.csv"]}},
            {"final": "2"},
        ]
        out, llm = kickoff(crew, t, steps, native=native)
        assert out.raw == "2" and llm.seen[0].strip() == "2"
        (produced,) = t.last_files
        assert produced["name"] == "n.txt" and base64.b64decode(produced["base64"]) == b"2"
        assert [f.name for f in t.list_files()] == ["n.txt", "sales.csv"]
    finally:
        t.close()


def test_agent_naming_a_host_path_or_unoffered_file_is_refused(crew, tmp_path):
    """It denies a `files` entry that is not an offered name (a host path, `..`, a NUL, a
    name never offered): a returned ToolFailure with code `files.offer` naming the offered
    names; the code did not run and nothing was placed. Offering a name with `..` or a NUL
    is refused when offered."""
    src = tmp_path / "data.csv"
    src.write_bytes(b"a\n")
    t = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0)
    try:
        t.offer_file("data.csv", src)
        calls = counting(crew, t)
        for bad in (str(src), "/etc/passwd", "../data.csv", "data.csv\x00", "other.csv"):
            failure = t.run(code="print('ran')", files=[bad])
            assert isinstance(failure, crew.ToolFailure), bad
            assert failure.code == "files.offer" and "not offered" in failure.message
            assert "data.csv" in failure.message and "did not run" in failure.message
        assert calls == [] and t.list_files() == []
        for bad_name in ("../escape.csv", "a\x00b", "sub/x.csv", ".."):
            with pytest.raises(PermissionError):
                t.offer_file(bad_name, src)
        with pytest.raises(ValueError, match="regular file"):
            t.offer_file("dir.csv", tmp_path)
    finally:
        t.close()


def test_offered_file_over_the_transfer_limit_is_refused_with_its_rule(crew, tmp_path):
    """It denies placing an offered file larger than `limits.transfer_mb`: a ToolFailure
    with code `limits.transfer` (the agent reads the rule), nothing placed, the code did not
    run; through a crew loop it is a recorded tool failure."""
    src = tmp_path / "big.bin"
    src.write_bytes(b"x" * (1024 * 1024 + 1))
    t = crew.adapter.SandboxedPythonTool(policy=policy(transfer_mb=1), warm=0)
    try:
        t.offer_file("big.bin", src)
        calls = counting(crew, t)
        steps = [
            {"tool": "run_python", "args": {"code": "print('ran')", "files": ["big.bin"]}},
            {"final": "too big"},
        ]
        out, llm = kickoff(crew, t, steps)
        assert out.raw == "too big"
        assert "[limits.transfer]" in llm.seen[0] and "(code: limits.transfer)" in llm.seen[0]
        failures = out.tasks_output[0].tool_failures
        assert [f.failure.code for f in failures] == ["limits.transfer"]
        assert failures[0].failure.details["denials"][0]["rule"] == "limits.transfer"
        assert calls == [] and t.list_files() == []
    finally:
        t.close()


def test_offered_file_that_changes_while_read_is_refused(crew, tmp_path, monkeypatch, grow_on_read):
    """It denies an offered host file that grows while it is placed (a writer between two
    reads): code `files.transfer`, nothing placed, the code did not run."""
    src = tmp_path / "growing.csv"
    src.write_bytes(b"x" * 1000)
    t = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0)
    try:
        t.offer_file("growing.csv", src)
        calls = counting(crew, t)
        grow_on_read.arm(src)
        failure = t.run(code="print('ran')", files=["growing.csv"])
        monkeypatch.undo()
        assert grow_on_read.grew, "the writer never ran"
        assert isinstance(failure, crew.ToolFailure) and failure.code == "files.transfer"
        assert "changed while it was read" in failure.message
        assert calls == [] and t.list_files() == []
    finally:
        t.close()


def test_offered_files_need_a_session(crew, tmp_path):
    src = tmp_path / "a.csv"
    src.write_bytes(b"1\n")
    t = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0, session="none")
    try:
        with pytest.raises(ValueError, match="session"):
            t.offer_file("a.csv", src)
    finally:
        t.close()


async def test_offered_file_is_placed_on_the_async_path(crew, tmp_path):
    src = tmp_path / "a.csv"
    src.write_bytes(b"1\n2\n")
    t = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0)
    try:
        t.offer_file("a.csv", src)
        out = await t.arun(code="len(open('a.csv').read().split())", files=["a.csv"])
        assert out == "2"
        refused = await t.arun(code="1", files=["b.csv"])
        assert isinstance(refused, crew.ToolFailure) and refused.code == "files.offer"
    finally:
        t.close()


def test_offered_file_gone_from_the_host_is_a_failure_naming_it(crew, tmp_path):
    """An offered host file removed before the agent asks for it: a ToolFailure with code
    `files.host` naming the offered name (never the host path); the code did not run."""
    src = tmp_path / "gone.csv"
    src.write_bytes(b"1\n")
    t = crew.adapter.SandboxedPythonTool(policy=policy(), warm=0)
    try:
        t.offer_file("report.csv", src)
        src.unlink()
        calls = counting(crew, t)
        failure = t.run(code="print('ran')", files=["report.csv"])
        assert isinstance(failure, crew.ToolFailure) and failure.code == "files.host"
        assert "report.csv" in failure.message and str(tmp_path) not in failure.message
        assert calls == []
    finally:
        t.close()
