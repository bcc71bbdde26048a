"""`SandboxedPythonTool` for CrewAI (`crewai.tools.BaseTool`); the only module importing crewai.

* Refusals, limits, crashes and internal failures are RETURNED as CrewAI's `ToolFailure`
  (`code` = the rule, `details` = the denials), never raised: a raised error makes CrewAI's
  text-mode (ReAct) agent run the tool up to three times, and it would be recorded as an
  exception rather than a reported failure. The agent reads `"<text> (code: <rule>)"`; the
  operator finds the failure in `TaskOutput.tool_failures` and as a `ToolFailureDetectedEvent`.
  `tool_failure_policy=ToolFailurePolicy.RAISE` on the tool aborts the crew instead.
* A traceback from the model's own code is ordinary output (`code_errors_as="error"` makes it a
  `ToolFailure` too).
* Results are never served from CrewAI's tool cache: the interpreter has state, so the same
  code can give a different answer.
* Sessions: `session="tool"` (default) keeps one interpreter per tool instance; `"none"` starts
  a fresh one per call. (CrewAI has no conversation thread id; `"thread"` means `"tool"` here.)

* Files: `put_file` (the operator's), `offer_file(name, path)` (the agent names offered files in
  the args schema's `files`; a name not offered or a placement refused is a returned
  `ToolFailure` with its rule, and the code does not run); `last_files` lists what a call wrote.

CrewAI versions without `crewai.tools.tool_failure` get the same text as a plain string.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, cast

from agent_sandbox._errors import install_hint

try:
    import crewai  # noqa: F401  (present when the extra is installed)
except ModuleNotFoundError as _missing:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        "agent_sandbox.adapters.crewai needs the `crewai` extra: " + install_hint("crewai"),
        name=_missing.name,
    ) from None

from crewai.tools import BaseTool
from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from agent_sandbox._host.files import FileInfo
from agent_sandbox._host.result import RunResult
from agent_sandbox._tools.learn.observe import Learner
from agent_sandbox.adapters._common import (
    CodeErrorsAs,
    FileOffers,
    OfferRefused,
    Outcome,
    SessionMode,
    ToolRunner,
    coerce_policy,
    describe_policy,
    learner_for,
    outcome,
)
from agent_sandbox.adapters._inputs import RunPythonInput, RunPythonWithFilesInput
from agent_sandbox.policies import Policy, resolve_policy

if TYPE_CHECKING:
    from agent_sandbox.adapters._common import tool_init

_ToolFailure: Any
try:
    from crewai.tools.tool_failure import ToolFailure as _ToolFailure
except ImportError:  # pragma: no cover - CrewAI before ToolFailure existed
    _ToolFailure = None
ToolFailure = _ToolFailure

__all__ = ["RunPythonInput", "RunPythonWithFilesInput", "SandboxedPythonTool", "never_cache"]


def never_cache(_args: Any = None, _result: Any = None) -> bool:
    """CrewAI cache predicate: a stateful interpreter's results are never reused."""
    return False


class SandboxedPythonTool(BaseTool):
    """Run the agent's Python in a sandboxed worker under this tool's policy."""

    name: str = "run_python"
    description: str = ""
    args_schema: type[BaseModel] = RunPythonInput
    cache_function: Any = never_cache

    policy: Policy = Field(default_factory=lambda: resolve_policy(None))
    """A `Policy`, the name of a shipped policy, or a TOML path."""
    session: SessionMode = "tool"
    code_errors_as: CodeErrorsAs = "output"
    provider: str | None = None
    warm: int = 1
    timeout: float | None = None
    max_sessions: int = 16
    """Live interpreters kept at most; beyond it the least recently used one is closed."""
    session_ttl: float = 1800.0
    """Seconds an idle session lives before it is closed."""
    return_files: bool = False
    """Fetch the bytes of the files each call wrote into `last_files` (base64)."""
    mode: Literal["enforce", "learn"] = "enforce"
    """`"learn"`: run in the learning envelope; `learner` collects a proposed policy (see
    `agent_sandbox._tools.learn.propose.Learner`; write it with `tool.learner.write()`)."""
    learner: Any = None

    _runner: ToolRunner = PrivateAttr()
    _offers: FileOffers = PrivateAttr(default_factory=FileOffers)
    _base_description: str | None = PrivateAttr(default=None)

    if TYPE_CHECKING:

        @tool_init
        def __init__(self, **fields: Any) -> None: ...

    #: The last `RunResult` (for inspection in notebooks and tests).
    _last: RunResult | None = PrivateAttr(default=None)
    _last_files: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    @field_validator("policy", mode="before")
    @classmethod
    def _resolve(cls, value: Any) -> Policy:
        return coerce_policy(value)

    @field_validator("cache_function", mode="after")
    @classmethod
    def _no_cache(cls, value: Any) -> Any:
        return never_cache

    def _learner(self) -> Learner | None:
        self.learner = learner_for(self.mode, self.learner)
        return cast("Learner | None", self.learner)

    @model_validator(mode="after")
    def _setup(self) -> SandboxedPythonTool:
        mode: SessionMode = "none" if self.session == "none" else "tool"
        self._runner = ToolRunner(
            self.policy,
            session=mode,
            provider=self.provider,
            warm=self.warm,
            timeout=self.timeout,
            max_sessions=self.max_sessions,
            session_ttl=self.session_ttl,
            learner=self._learner(),
            tool_name=self.name,
        )
        if not self.description:
            self.description = describe_policy(
                self.policy,
                session=self.session,
                boundary=self._runner.boundary.name,
                timeout=self.timeout,
            )
            self._base_description = self.description
        return self

    @property
    def boundary(self) -> str:
        """The kernel boundary the calls run behind, e.g. `"bwrap+landlock+seccomp"`."""
        return self._runner.boundary.name

    @property
    def last_result(self) -> RunResult | None:
        """The `RunResult` of the most recent call."""
        return self._last

    def sessions(self) -> list[str]:
        return self._runner.sessions()

    def reset(self) -> None:
        """Forget the tool's interpreter; the next call starts from a clean one."""
        self._runner.reset(None)

    def close(self) -> None:
        """Stop every worker of this tool; a later call starts new ones."""
        self._runner.close()

    def put_file(
        self,
        name: str,
        data: bytes | None = None,
        *,
        source: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
    ) -> FileInfo:
        """Upload: place `data` (or the host file `source`) in the tool's interpreter's
        scratch, where the agent's code reads it as `name` (`Session.put_file`)."""
        return self._runner.put_file(name, data, source=source, overwrite=overwrite)

    def offer_file(self, name: str, source: str | os.PathLike[str]) -> None:
        """Let the agent ask for the host file `source` to be placed in its scratch as `name`.

        The agent never names a host path: it names an offered `name` in the tool's `files`
        argument, and the call first copies `source` (read then, bounded and refused as
        `Session.put_file`) into the tool's interpreter's scratch. A name not offered, or a
        placement refused, is a returned `ToolFailure` (code = the rule: `files.offer`,
        `limits.transfer`, `files.transfer`, ...) and the code does not run. Offer files
        before the agent is built (the argument and the description's list of offered names
        are what the agent reads). `name` is checked now; `source` must be a regular file now
        and when it is placed.
        """
        self._offers.offer(self._runner, name, source)
        self.args_schema = RunPythonWithFilesInput
        if self._base_description is not None:
            self.description = self._offers.describe(self._base_description)

    def offered_files(self) -> list[str]:
        """The names the agent may ask to place (`offer_file`)."""
        return self._offers.names()

    def get_file(self, name: str) -> bytes:
        """Download: a file the code wrote in the tool's scratch (`Session.get_file`)."""
        return self._runner.get_file(name)

    def list_files(self) -> list[FileInfo]:
        return self._runner.list_files()

    @property
    def last_files(self) -> list[dict[str, Any]]:
        """The files the most recent call wrote (`name`, `size`, and with `return_files`
        their bytes as `base64`, or the refusal that kept them)."""
        return list(self._last_files)

    def _run(self, code: str, files: list[str] | None = None) -> Any:
        if files:
            refused = self._place(files)
            if refused is not None:
                return refused
        result = self._runner.run(code)
        self._collect(result)
        return self._present(result)

    async def _arun(self, code: str, files: list[str] | None = None) -> Any:
        if files:
            import asyncio

            refused = await asyncio.to_thread(self._place, files)
            if refused is not None:
                return refused
        result = await self._runner.arun(code)
        if self.return_files and result.files:
            import asyncio

            await asyncio.to_thread(self._collect, result)
        else:
            self._collect(result)
        return self._present(result)

    def _place(self, names: list[str]) -> Any:
        """Place the offered files `names`; None, or the failure to return (nothing ran)."""
        try:
            self._offers.place(self._runner, names)
        except OfferRefused as exc:
            self._last, self._last_files = None, []
            if ToolFailure is None:  # pragma: no cover
                return exc.text
            return ToolFailure(
                message=exc.text,
                code=exc.rule,
                retryable=False,
                details={
                    "kind": "denied",
                    "rules": [exc.rule],
                    "denials": [exc.denial.to_dict()] if exc.denial is not None else [],
                    "policy": self.policy.name,
                    "fingerprint": self.policy.fingerprint(),
                    "files": list(names),
                    "offered": self._offers.names(),
                },
            )
        return None

    def _collect(self, result: RunResult) -> None:
        if self.return_files:
            self._last_files = self._runner.produced_files(result)
        else:
            self._last_files = [dict(f) for f in result.files]

    def _present(self, result: RunResult) -> Any:
        self._last = result
        out = outcome(result, code_errors_as=self.code_errors_as)
        # Every refusal of the user's code is a failure, caught or not (the operator's record
        # is `TaskOutput.tool_failures`); library-internal ones are not.
        if not (out.is_error or out.refused):
            return out.text
        if ToolFailure is None:  # pragma: no cover
            return out.text
        return ToolFailure(
            message=out.text,
            code=out.rule or out.kind,
            retryable=out.retryable,
            details=_details(self.policy, result, out),
        )


def _details(policy: Policy, result: RunResult, out: Outcome) -> dict[str, Any]:
    return {
        "kind": out.kind,
        "rules": list(out.rules),
        "denials": [d.to_dict() for d in result.user_denials()],
        "denial_counts": result.denial_counts(),
        "policy": policy.name,
        "fingerprint": policy.fingerprint(),
        "boundary": result.boundary,
        "session": result.session,
        "error": result.error.to_dict() if result.error else None,
    }


def sandboxed_crewai_tool(
    tool: BaseTool,
    *,
    policy: Any = None,
    provider: str | None = None,
    timeout: float | None = None,
    warm: int = 0,
) -> BaseTool:
    """A CrewAI tool running `tool`'s body in a sandboxed worker under `policy`.

    Refusals, limits and exceptions from the body are returned as `ToolFailure` (code = rule,
    or the exception type); results are never cached. The return value must be JSON data.
    """
    from crewai.tools.base_tool import Tool

    from agent_sandbox.adapters._function import SandboxedFunction, tool_body

    func, fields = tool_body(tool, BaseTool)
    body: SandboxedFunction[..., Any] = SandboxedFunction(
        func, policy=policy, provider=provider, timeout=timeout, warm=warm, self_fields=fields
    )

    def call(**kwargs: Any) -> Any:
        result = body.run(**kwargs)
        out = outcome(result, code_errors_as="error")
        if not (out.is_error or out.refused):
            return result.value
        if ToolFailure is None:  # pragma: no cover
            return out.text
        code = out.rule or (result.error.type if result.error else out.kind)
        return ToolFailure(
            message=out.text,
            code=code,
            details=_details(body.policy, result, out),
        )

    call.sandbox = body  # type: ignore[attr-defined]  # so callers can close it
    return Tool(
        name=tool.name,
        description=tool.description,
        args_schema=tool.args_schema,
        func=call,
        cache_function=never_cache,
    )
