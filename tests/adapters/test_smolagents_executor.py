"""`SandboxedExecutor` with the published smolagents package (1.26): its executor interface,
its own remote-executor test cases run through it, and a `CodeAgent` loop with a scripted model.

The cases under "smolagents' own executor cases" follow smolagents' tests for its remote
executors (`tests/test_remote_executors.py`: state persistence, a final answer, a syntax
error, cleanup) and for `PythonExecutor` users (`send_variables`, `send_tools`), written
against this executor.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

smolagents = pytest.importorskip("smolagents")

from smolagents import CodeAgent, tool  # noqa: E402
from smolagents.local_python_executor import CodeOutput, PythonExecutor  # noqa: E402
from smolagents.monitoring import LogLevel  # noqa: E402
from smolagents.utils import AgentError, AgentExecutionError  # noqa: E402

from agent_sandbox import Policy, Sandbox  # noqa: E402
from agent_sandbox.adapters.smolagents import SandboxedExecutor  # noqa: E402
from agent_sandbox.testing import scripted_smolagents_model  # noqa: E402
from tests.conftest import GrowOnRead  # noqa: E402


def _policy(**tools: Any) -> Policy:
    return Policy(
        name="smol-test",
        imports={"allow": ["math", "statistics"]},
        tools={"allow": ["lookup", "stuck"], "timeout_seconds": 1, **tools},
        limits={"wall_seconds": 20},
    )


@pytest.fixture
def executor():
    ex = SandboxedExecutor(_policy(), warm=0)
    try:
        yield ex
    finally:
        ex.cleanup()


# -- smolagents' own executor cases -------------------------------------------------------


def test_it_is_a_smolagents_python_executor(executor: SandboxedExecutor) -> None:
    assert isinstance(executor, PythonExecutor)
    assert isinstance(executor("1 + 1"), CodeOutput)


def test_state_persistence(executor: SandboxedExecutor) -> None:
    """Variables and imports of one snippet persist in the next."""
    executor("import math; a = 2")
    output = executor("print(math.sqrt(a))")
    assert "1.41421" in output.logs
    assert output.is_final_answer is False


def test_execute_output(executor: SandboxedExecutor) -> None:
    """`final_answer(...)` ends the step with the answer as the output."""
    executor.send_tools({})
    output = executor('final_answer("This is the final answer")')
    assert output.output == "This is the final answer"
    assert output.is_final_answer is True


def test_syntax_error_handling(executor: SandboxedExecutor) -> None:
    """A syntax error raises an AgentError that names it."""
    with pytest.raises(AgentError) as excinfo:
        executor('print("Missing Parenthesis')
    assert "SyntaxError" in str(excinfo.value) or "code.syntax" in str(excinfo.value)


def test_cleanup_ends_the_worker() -> None:
    ex = SandboxedExecutor(_policy(), warm=0)
    ex("x = 1")
    worker = ex.session.worker
    assert worker is not None and worker.alive()
    ex.cleanup()
    assert not worker.alive()


def test_send_variables(executor: SandboxedExecutor) -> None:
    """JSON variables are set in the session; others are skipped and logged."""
    executor.send_variables({"numbers": [1, 2, 3], "name": "x", "obj": object()})
    assert executor("sum(numbers), name").output == [6, "x"]
    with pytest.raises(AgentError):
        executor("obj")


def test_last_value_and_logs(executor: SandboxedExecutor) -> None:
    output = executor("print('hello')\n21 * 2")
    assert output.output == 42 and output.logs == "hello\n"


# -- host tools ---------------------------------------------------------------------------


def test_a_listed_tool_runs_on_the_host(executor: SandboxedExecutor) -> None:
    calls: list[str] = []

    def lookup(city: str) -> str:
        calls.append(city)
        return {"paris": "2.1M"}[city.lower()]

    executor.send_tools({"lookup": lookup})
    assert executor("lookup('Paris')").output == "2.1M"
    assert calls == ["Paris"]


def test_denies_a_tool_the_policy_does_not_list(executor: SandboxedExecutor) -> None:
    """It denies a call to a registered tool that `[tools] allow` does not list; the tool never
    runs, and the refusal names its rule."""
    ran: list[bool] = []
    executor.send_tools({"secret": lambda: ran.append(True) or "s3cr3t"})
    with pytest.raises(AgentError) as excinfo:
        executor("secret()")
    assert "[tools]" in str(excinfo.value) and "secret" in str(excinfo.value)
    assert 'tools.allow = ["secret"]' in str(excinfo.value)  # the host's hint
    assert ran == []
    assert executor.last_result is not None
    assert [d.rule for d in executor.last_result.denials] == ["tools"]


def test_denies_a_direct_host_call_the_policy_does_not_list(executor: SandboxedExecutor) -> None:
    """It denies `_host_tool` called by hand with a name no tool has (the host decides)."""
    executor.send_tools({})
    with pytest.raises(AgentError) as excinfo:
        executor("_host_tool('os_system', ['id'], {})")
    assert "[tools]" in str(excinfo.value)


def test_a_tool_that_never_returns_is_refused_after_its_timeout(
    executor: SandboxedExecutor,
) -> None:
    """A callback that never returns is cut off at `tools.timeout_seconds` (rule
    `tools.timeout`); the session goes on."""
    release = threading.Event()
    entered = threading.Event()

    def stuck() -> str:
        entered.set()
        release.wait(60)
        return "late"

    executor.send_tools({"stuck": stuck})
    try:
        with pytest.raises(AgentError) as excinfo:
            executor("stuck()")
        assert entered.is_set()
        assert "tools.timeout" in str(excinfo.value)
        assert "tools.timeout_seconds = 2" in str(excinfo.value)
        assert executor("1 + 1").output == 2
    finally:
        release.set()


def test_a_caught_refusal_reaches_the_logs(executor: SandboxedExecutor) -> None:
    executor.send_tools({"secret": lambda: "x"})
    output = executor("try:\n    secret()\nexcept PermissionError:\n    print('fallback')")
    assert "fallback" in output.logs and "[tools]" in output.logs


def test_a_plain_session_refuses_host_tools() -> None:
    """Outside an executor (no tools served) every host call is refused by rule."""
    with Sandbox(_policy(), warm=0) as sb:
        result = sb.session().run("_host_tool('lookup', [], {})")
    assert result.error is not None and result.error.kind == "denied"
    assert [d.rule for d in result.denials] == ["tools"]


# -- a CodeAgent loop ---------------------------------------------------------------------


@tool
def lookup(city: str) -> str:
    """The population of a city.

    Args:
        city: the city's name
    """
    return {"paris": "2.1M"}.get(city.lower(), "unknown")


@tool
def secret() -> str:
    """A tool the policy does not list."""
    return "s3cr3t"


def test_code_agent_runs_under_the_policy_and_reads_refusals() -> None:
    """A CodeAgent's steps run in the session: a tool the policy does not list and an import
    it refuses reach the step's memory as text naming the rule; the listed tool and
    `final_answer` work."""
    model = scripted_smolagents_model(
        ["print(secret())", "import socket", "p = lookup('Paris')\nprint(p)\nfinal_answer(p)"]
    )
    executor = SandboxedExecutor(_policy(), warm=0)
    try:
        agent = CodeAgent(
            tools=[lookup, secret],
            model=model,
            executor=executor,
            max_steps=5,
            verbosity_level=LogLevel.OFF,
        )
        assert agent.run("Population of Paris?") == "2.1M"
    finally:
        executor.cleanup()
    steps = [s for s in agent.memory.steps if hasattr(s, "code_action")]
    assert len(steps) == 3
    assert isinstance(steps[0].error, AgentExecutionError) and "[tools]" in str(steps[0].error)
    assert "[imports]" in str(steps[1].error) and "socket" in str(steps[1].error)
    assert steps[2].error is None and steps[2].is_final_answer
    # The model read each refusal at its next step.
    assert "[tools]" in model.seen[1] and "[imports]" in model.seen[2]


def test_a_tool_that_outlasts_the_call_ends_it_as_a_timeout() -> None:
    """The host waits for a tool no longer than the call's own wall time: a tool slower than
    `limits.wall_seconds` (with a longer `tools.timeout_seconds`) ends the call as
    `limits.timeout`, and the next step runs in a fresh interpreter."""
    policy = Policy(
        name="smol-wall",
        tools={"allow": ["stuck"], "timeout_seconds": 600},
        limits={"wall_seconds": 1},
    )
    release = threading.Event()
    ex = SandboxedExecutor(policy, warm=0)
    try:
        ex.send_tools({"stuck": lambda: release.wait(60)})
        with pytest.raises(AgentError) as excinfo:
            ex("stuck()")
        assert "limits.timeout" in str(excinfo.value)
        assert ex.last_result is not None and ex.last_result.error is not None
        assert ex.last_result.error.rule == "limits.timeout"
        # The next step runs in a fresh interpreter with the stubs defined again.
        output = ex("callable(stuck), callable(final_answer)")
        assert output.output == [True, True]
        assert "[notice]" in output.logs and "variables" in output.logs  # the model reads it
    finally:
        release.set()
        ex.cleanup()


# -- files in and out ---------------------------------------------------------------------


def test_a_run_argument_file_is_uploaded_and_produced_files_are_kept(tmp_path) -> None:
    """A `SandboxFile` given in a run's `additional_args` is placed in scratch before the
    first step and its variable is the name there; the task the model reads shows the name,
    never the host path. A file a step writes is in `last_files` (bytes with
    `return_files`) and `get_file`."""
    import base64

    from agent_sandbox.adapters.smolagents import SandboxFile

    src = tmp_path / "sales-2026.csv"
    src.write_bytes(b"region,total\nnorth,3\nsouth,4\n")
    code = (
        "rows = open(sales).read().splitlines()[1:]\n"
        "open('total.txt', 'w').write(str(sum(int(r.split(',')[1]) for r in rows)))\n"
        "final_answer(len(rows))"
    )
    model = scripted_smolagents_model([code])
    executor = SandboxedExecutor(_policy(), warm=0, return_files=True)
    try:
        agent = CodeAgent(tools=[], model=model, executor=executor, verbosity_level=LogLevel.OFF)
        answer = agent.run(
            "How many rows?", additional_args={"sales": SandboxFile(src, name="sales.csv")}
        )
        assert answer == 2
        task = agent.memory.steps[0].task
        assert "'sales.csv'" in task and str(tmp_path) not in task
        (produced,) = executor.last_files
        assert produced["name"] == "total.txt" and base64.b64decode(produced["base64"]) == b"7"
        assert executor.get_file("total.txt") == b"7"
        assert [f.name for f in executor.list_files()] == ["sales.csv", "total.txt"]
    finally:
        executor.cleanup()


def test_an_upload_over_the_transfer_limit_is_refused_with_its_rule(tmp_path) -> None:
    """It denies a `SandboxFile` larger than `limits.transfer_mb`: `FileTransferRefused`
    naming `limits.transfer` before any step, nothing placed, no variable set."""
    from agent_sandbox import FileTransferRefused
    from agent_sandbox.adapters.smolagents import SandboxFile

    src = tmp_path / "big.bin"
    src.write_bytes(b"x" * (1024 * 1024 + 1))
    ex = SandboxedExecutor(
        Policy(name="smol-small", limits={"transfer_mb": 1, "wall_seconds": 20}), warm=0
    )
    try:
        with pytest.raises(FileTransferRefused) as excinfo:
            ex.send_variables({"big": SandboxFile(src), "n": 1})
        assert excinfo.value.denial.rule == "limits.transfer"
        assert "transfer_mb" in str(excinfo.value)
        assert ex.list_files() == []
        assert ex("'big' in dir(), 'n' in dir()").output == [False, False]
    finally:
        ex.cleanup()


@pytest.mark.parametrize("name", ["../escape.csv", "a\x00b.csv", "..", "sub/x.csv", ""])
def test_an_upload_name_outside_scratch_is_refused(tmp_path, name: str) -> None:
    """It refuses a `SandboxFile` name that is not one plain file name (`..`, NUL, `/`):
    a ValueError naming the problem, when the file is described."""
    from agent_sandbox.adapters.smolagents import SandboxFile

    src = tmp_path / "a.csv"
    src.write_bytes(b"1\n")
    with pytest.raises(ValueError, match="cannot be a file name in scratch"):
        SandboxFile(src, name=name)
    with pytest.raises(ValueError, match="cannot be a file name in scratch"):
        SandboxFile(str(tmp_path) + "/..")  # its base name is '..'


def test_an_upload_that_changes_while_read_is_refused(
    executor: SandboxedExecutor, tmp_path, monkeypatch: pytest.MonkeyPatch, grow_on_read: GrowOnRead
) -> None:
    """It denies a host file that grows while it is uploaded (a writer between two reads):
    `files.transfer`, nothing placed."""
    from agent_sandbox import FileTransferRefused
    from agent_sandbox.adapters.smolagents import SandboxFile

    src = tmp_path / "growing.csv"
    src.write_bytes(b"x" * 1000)
    grow_on_read.arm(src)
    with pytest.raises(FileTransferRefused) as excinfo:
        executor.send_variables({"data": SandboxFile(src)})
    monkeypatch.undo()
    assert grow_on_read.grew, "the writer never ran"
    assert excinfo.value.denial.rule == "files.transfer"
    assert "changed while it was read" in str(excinfo.value)
    assert executor.list_files() == []


def test_an_upload_under_a_hidden_name_is_refused(tmp_path) -> None:
    """It denies an upload whose name matches `files.hide` (the code could not see it)."""
    from agent_sandbox import FileTransferRefused
    from agent_sandbox.adapters.smolagents import SandboxFile

    src = tmp_path / ".env"
    src.write_bytes(b"KEY=1\n")
    ex = SandboxedExecutor(Policy(name="smol-hide", files={"hide": [".env"]}), warm=0)
    try:
        with pytest.raises(FileTransferRefused) as excinfo:
            ex.send_variables({"env": SandboxFile(src)})
        assert excinfo.value.denial.rule == "files.hidden"
    finally:
        ex.cleanup()


def test_a_refused_upload_stops_the_run_before_any_step(tmp_path) -> None:
    """Through `CodeAgent.run`: an upload over `limits.transfer_mb` raises
    `FileTransferRefused` (rule `limits.transfer`) out of the run; the model was never asked."""
    from agent_sandbox import FileTransferRefused
    from agent_sandbox.adapters.smolagents import SandboxFile

    src = tmp_path / "big.bin"
    src.write_bytes(b"x" * (1024 * 1024 + 1))
    model = scripted_smolagents_model(["final_answer('read it')"])
    ex = SandboxedExecutor(
        Policy(name="smol-small", limits={"transfer_mb": 1, "wall_seconds": 20}), warm=0
    )
    try:
        agent = CodeAgent(tools=[], model=model, executor=ex, verbosity_level=LogLevel.OFF)
        with pytest.raises(FileTransferRefused) as excinfo:
            agent.run("Read it.", additional_args={"data": SandboxFile(src)})
        assert excinfo.value.denial.rule == "limits.transfer"
        assert model.seen == [] and ex.list_files() == []
    finally:
        ex.cleanup()
