"""`SandboxedExecutor`: smolagents' `CodeAgent` runs its code in a sandboxed session.

smolagents (written against 1.26.0, the `[smolagents]` extra) lets a `CodeAgent` take any
`PythonExecutor` (`CodeAgent(tools, model, executor=SandboxedExecutor(policy=...))`). The
interface is the one its own remote executors implement: `send_tools(tools)`,
`send_variables(variables)`, and `__call__(code) -> CodeOutput(output, logs,
is_final_answer)`; a failure raises `AgentError`, which the agent turns into the step's error.

* The code runs in one session of a `Sandbox` under the policy (state persists across steps,
  as with smolagents' own executors), behind the strongest kernel boundary that works here.
* The agent's tools stay in this process: the code gets a stub per tool that calls the host
  (`_host_tool`, `agent_sandbox._host.hosttools`). The host runs a tool only when the policy's
  `[tools] allow` lists it, within `tools.timeout_seconds`; otherwise the code meets a
  `PermissionError` naming the rule (`tools`, `tools.timeout`), recorded in the call's result.
* `final_answer(...)` is answered in the sandbox (no host call): the stub raises
  `FinalAnswerException`, and the executor reads the answer back as data.
* Files in: `agent.run(task, additional_args={"sales": SandboxFile("/data/sales.csv")})`. smolagents
  hands a run's `additional_args` to `send_variables`, which places each `SandboxFile` in the
  session's scratch (`Session.put_file`: the name checked, the size bounded by
  `limits.transfer_mb`, a host file that changes while read refused) and binds the variable to
  its name there; the task text the model reads shows that name, never the host path. A
  refused upload raises `FileTransferRefused` (naming its rule) before any step runs.
* Files out: `last_files` lists the files each step wrote (their bytes too with
  `return_files=True`); `get_file(name)` reads one from scratch.
* Every refusal, limit or crash is raised as `AgentError` with the same text the LangChain and
  CrewAI tools give (the rule, the target, what would allow it): smolagents logs it and keeps it
  in the step's memory (`ActionStep.error`), so the model reads it at the next step. A refusal
  the code caught and went past is appended to the step's logs.

smolagents is imported here only: `agent_sandbox` and its other adapters never load it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from agent_sandbox._errors import install_hint

try:
    import smolagents  # noqa: F401  (present when the extra is installed)
except ModuleNotFoundError as _missing:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        "agent_sandbox.adapters.smolagents needs the `smolagents` extra: "
        + install_hint("smolagents"),
        name=_missing.name,
    ) from None

from smolagents.local_python_executor import CodeOutput, PythonExecutor
from smolagents.utils import AgentError

from agent_sandbox._host.files import FileInfo
from agent_sandbox._host.result import RunResult
from agent_sandbox._host.sandbox import Sandbox, Session
from agent_sandbox._wire import name_problem
from agent_sandbox.adapters._common import outcome, produced_files
from agent_sandbox.policies import Policy, resolve_policy

__all__ = ["FINAL_ANSWER_EXCEPTION", "SandboxFile", "SandboxedExecutor"]

#: The name of the exception the sandboxed `final_answer` raises (as smolagents' remote
#: executors name theirs).
FINAL_ANSWER_EXCEPTION = "FinalAnswerException"

_SETUP = """
class FinalAnswerException(BaseException):
    pass

_final_answer_box = {}

def final_answer(answer=None, *args, **kwargs):
    _final_answer_box["value"] = answer
    raise FinalAnswerException("final answer")
"""

_STUB = """
def {name}(*args, **kwargs):
    return _host_tool({name!r}, list(args), kwargs)
"""


class SandboxFile:
    """A host file to upload into the executor's session, given as a run's variable.

    `agent.run(task, additional_args={"sales": SandboxFile("/data/sales.csv")})` places the
    file in scratch as `name` (default: the source's base name) before the first step, and the
    sandboxed code's `sales` is that name (`open(sales)`). Its `repr` is the name, so the task
    text smolagents writes from `additional_args` shows the model the name, not the host path.
    A name that is not one plain file name (`/`, `..`, NUL, ...) is refused here.
    """

    __slots__ = ("name", "source")

    def __init__(self, source: str | os.PathLike[str], name: str | None = None) -> None:
        self.source = os.fspath(source)
        chosen = os.path.basename(self.source) if name is None else name
        problem = name_problem(chosen)
        if problem:
            raise ValueError(f"SandboxFile: {chosen!r} cannot be a file name in scratch: {problem}")
        self.name: str = chosen

    def __repr__(self) -> str:
        return repr(self.name)


class _Logger:
    """What an executor logs through when the agent gives it no smolagents logger."""

    def __init__(self) -> None:
        self._log = logging.getLogger("agent_sandbox.smolagents")

    def log(self, *args: Any, **kwargs: Any) -> None:
        self._log.info(" ".join(str(a) for a in args))

    def log_error(self, message: str) -> None:
        # At INFO: the same text reaches the agent (and its own logger) as an AgentError.
        self._log.info(message)


class SandboxedExecutor(PythonExecutor):  # type: ignore[misc]  # (smolagents is untyped)
    """A smolagents `PythonExecutor` whose code runs in an agent_sandbox session.

    `policy` is a `Policy`, a shipped policy's name or a TOML path; `provider` overrides its
    provider. `logger` is the agent's `AgentLogger` (pass `agent.logger` to see refusals in its
    console; errors always reach the agent through `AgentError`). `sandbox` shares an existing
    `Sandbox` (closed by its owner, not by `cleanup()`).
    """

    def __init__(
        self,
        policy: Policy | str | None = None,
        *,
        provider: str | None = None,
        logger: Any = None,
        sandbox: Sandbox | None = None,
        session: str | None = None,
        warm: int = 1,
        return_files: bool = False,
    ) -> None:
        self.policy = resolve_policy(policy) if sandbox is None else sandbox.policy
        self._own_sandbox = sandbox is None
        self.sandbox = sandbox or Sandbox(
            self.policy, provider=provider, warm=warm, tool="smolagents"
        )
        self.session: Session = self.sandbox.session(session)
        self.logger = logger if logger is not None else _Logger()
        self.tools: dict[str, Callable[..., Any]] = {}
        #: The `RunResult` of the most recent step (for inspection and tests).
        self.last_result: RunResult | None = None
        #: Fetch the bytes of the files each step writes into `last_files` (base64).
        self.return_files = return_files
        self._last_files: list[dict[str, Any]] = []
        self._setup_done = False
        self._setup_code = ""

    # -- smolagents' PythonExecutor interface ------------------------------------------

    def send_tools(self, tools: Mapping[str, Any]) -> None:
        """Define a stub for each tool in the session; the tools themselves stay here."""
        code = [_SETUP]
        for name, tool in tools.items():
            if name == "final_answer":
                continue  # answered in the sandbox
            if not str(name).isidentifier():
                raise ValueError(f"a tool name must be a Python identifier, not {name!r}")
            self.tools[name] = _callable(tool)
            code.append(_STUB.format(name=name))
        unlisted = sorted(set(self.tools) - set(self.policy.tools.allow))
        if unlisted:
            self.logger.log(
                f"[sandbox] tools not in the policy's [tools] allow (calls will be refused): "
                f"{', '.join(unlisted)}"
            )
        self._setup_code = "".join(code)
        self._run_setup(self._setup_code)
        self._setup_done = True

    def send_variables(self, variables: Mapping[str, Any]) -> None:
        """Set each JSON-representable variable in the session (others are skipped, logged).

        A `SandboxFile` value is uploaded into scratch (replacing a file of its name) and the
        variable is its name there; a refused upload raises `FileTransferRefused` naming the
        rule, with no variable set.
        """
        lines = []
        skipped = []
        uploads: list[tuple[str, SandboxFile]] = []
        for name, value in variables.items():
            if isinstance(value, SandboxFile):
                if not str(name).isidentifier():
                    skipped.append(name)
                else:
                    uploads.append((name, value))
                continue
            try:
                data = json.loads(json.dumps(value))
            except (TypeError, ValueError):
                skipped.append(name)
                continue
            if not str(name).isidentifier():
                skipped.append(name)
                continue
            lines.append(f"{name} = {data!r}\n")
        if skipped:
            self.logger.log(
                "[sandbox] variables not sent (not JSON data, or not a Python name): "
                + ", ".join(map(str, skipped))
            )
        for name, upload in uploads:
            self.session.put_file(upload.name, source=upload.source, overwrite=True)
            lines.append(f"{name} = {upload.name!r}\n")
        if lines:
            self._run_setup("".join(lines))

    # -- the session files API, for the operator ----------------------------------------

    def put_file(
        self,
        name: str,
        data: bytes | None = None,
        *,
        source: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
    ) -> FileInfo:
        """Upload into the session's scratch (`Session.put_file`)."""
        return self.session.put_file(name, data, source=source, overwrite=overwrite)

    def get_file(self, name: str) -> bytes:
        """Download a file the code wrote in scratch (`Session.get_file`)."""
        return self.session.get_file(name)

    def list_files(self) -> list[FileInfo]:
        return self.session.list_files()

    @property
    def last_files(self) -> list[dict[str, Any]]:
        """The files the most recent step wrote (`name`, `size`, and with `return_files`
        their bytes as `base64`, or the refusal that kept them)."""
        return list(self._last_files)

    def __call__(self, code_action: str) -> CodeOutput:
        if not self._setup_done:
            self.send_tools({})
        worker = self.session.worker
        notes: list[str] = []
        if worker is None or worker.dead or not worker.alive():
            # A fresh interpreter (the last one hit a limit or crashed): its stubs and
            # `final_answer` are defined again first; the notice (what was lost) goes into
            # this step's logs, where the model reads it.
            notes = self._run_setup(self._setup_code)
        result = self.session.run(code_action, host_tools=self.tools)
        self.last_result = result
        self._collect(result)
        logs = "".join(f"[notice] {n}\n" for n in notes) + result.stdout + result.stderr
        error = result.error
        if (
            error is not None
            and error.kind == "exception"
            and error.type.rsplit(".", 1)[-1] == FINAL_ANSWER_EXCEPTION
        ):
            answer = self.session.run("_final_answer_box.get('value')")
            if answer.error is not None:
                raise AgentError(outcome(answer).text, self.logger)
            return CodeOutput(output=answer.value, logs=logs, is_final_answer=True)
        out = outcome(result, code_errors_as="error")
        if out.is_error:
            raise AgentError(out.text, self.logger)
        if out.refused:
            # The code caught a refusal and went on: the model reads it in the step's logs.
            note = "\n".join(d.message() for d in result.user_denials())
            logs = f"{logs}\n[sandbox refusals the code caught]\n{note}" if logs else note
        return CodeOutput(output=result.value, logs=logs, is_final_answer=False)

    def cleanup(self) -> None:
        """End the session (and the sandbox this executor made)."""
        if self._own_sandbox:
            self.sandbox.close()
        else:
            self.session.close()

    # -- helpers -----------------------------------------------------------------------

    def _collect(self, result: RunResult) -> None:
        if self.return_files and result.files:
            self._last_files = produced_files(result, self.session.get_file)
        else:
            self._last_files = [dict(f) for f in result.files]

    def _run_setup(self, code: str) -> list[str]:
        """Run set-up code; returns the notices its call carried (a replaced interpreter)."""
        result = self.session.run(code or "None", filename="<smolagents-setup>")
        for notice in result.notices:
            self.logger.log(f"[sandbox] {notice}")
        if result.error is not None:
            raise AgentError(outcome(result).text, self.logger)
        return list(result.notices)


def _callable(tool: Any) -> Callable[..., Any]:
    """A smolagents `Tool` (called with the model's arguments) or a plain function."""
    if callable(tool):
        return tool  # type: ignore[no-any-return]
    raise TypeError(f"a tool must be callable, not {type(tool).__name__}")
