"""`SandboxedPythonTool` for LangChain and LangGraph (`langchain_core.tools.BaseTool`).

What the model sees and what the operator sees:

* The model reads a description generated from the tool's policy, and after each call the
  output (stdout, the last value, a traceback from its own code) or, for a refusal, a limit, a
  crash or an internal failure, a handled tool error (`ToolMessage.status == "error"`) whose
  text names the rule, the target and what would allow it. Nothing the sandbox does raises out
  of the tool, so `create_agent` never aborts because of it.
* The artifact of a successful call is `RunResult.to_dict()`. LangChain drops artifacts on the
  error path, so refusals are mirrored elsewhere: LangSmith tags and metadata on the tool run
  (`sandbox:denied`, `sandbox.rule:<rule>`, the policy's name and fingerprint), a custom event
  `sandbox_refusal` for `astream_events` users, and the exception's `.result`.
* Live stdout/stderr goes through LangGraph's stream writer (`stream_mode="custom"`) when the
  tool runs inside a graph. Images the code produces come back as image content blocks.

Sessions: `session="thread"` (default) gives each LangGraph `thread_id` its own interpreter
(a call without a `thread_id` gets a fresh one: such calls may come from different users),
`"tool"` one interpreter per tool instance, `"none"` a fresh interpreter per call.

The provider (default `auto`, the strongest kernel sandbox that works here) is resolved when
the tool is built: one that is unknown or cannot run here raises then. The description, every
result (`boundary`) and the LangSmith metadata (`sandbox.boundary`) name the boundary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, cast, get_type_hints

from agent_sandbox._errors import install_hint

try:
    import langchain_core  # noqa: F401  (present when the extra is installed)
except ModuleNotFoundError as _missing:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        "agent_sandbox.adapters.langchain needs the `langchain` extra: "
        + install_hint("langchain"),
        name=_missing.name,
    ) from None

from langchain_core.callbacks import AsyncCallbackManagerForToolRun, CallbackManagerForToolRun
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, ToolException
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
    image_blocks,
    learner_for,
    outcome,
)
from agent_sandbox.adapters._inputs import RunPythonInput, RunPythonWithFilesInput
from agent_sandbox.policies import Policy, resolve_policy

if TYPE_CHECKING:
    from agent_sandbox.adapters._common import tool_init

__all__ = ["RunPythonInput", "RunPythonWithFilesInput", "SandboxToolError", "SandboxedPythonTool"]

#: The name of the custom event dispatched for every refusal, limit or failure.
REFUSAL_EVENT = "sandbox_refusal"


class SandboxToolError(ToolException):
    """A refusal, limit, crash or internal failure, reported as a handled tool error.

    `.result` is the full `RunResult` (LangChain drops the artifact on the error path),
    `.outcome` the classified text and rules.
    """

    def __init__(self, out: Outcome, result: RunResult) -> None:
        super().__init__(out.text)
        self.outcome = out
        self.result = result
        self.rule = out.rule


def _error_text(exc: ToolException) -> str:
    return str(exc.args[0]) if exc.args else "the sandbox tool failed"


class SandboxedPythonTool(BaseTool):
    """Run the model's Python in a sandboxed worker under this tool's policy."""

    name: str = "run_python"
    description: str = ""
    args_schema: type[BaseModel] = RunPythonInput
    response_format: Literal["content", "content_and_artifact"] = "content_and_artifact"
    handle_tool_error: bool | str | Callable[[ToolException], str] | None = _error_text

    policy: Policy = Field(default_factory=lambda: resolve_policy(None))
    """A `Policy`, the name of a shipped policy, or a TOML path."""
    session: SessionMode = "thread"
    code_errors_as: CodeErrorsAs = "output"
    """`"output"`: a traceback from the model's code is ordinary output; `"error"`: status error."""
    provider: str | None = None
    warm: int = 1
    timeout: float | None = None
    max_sessions: int = 16
    """Live interpreters kept at most; beyond it the least recently used one is closed."""
    session_ttl: float = 1800.0
    """Seconds an idle session lives before it is closed."""
    """Per-call wall-time override in seconds (default: the policy's `limits.wall_seconds`)."""
    stream_output: bool = True
    """Send live stdout/stderr through LangGraph's stream writer when there is one."""
    return_files: bool = False
    """Put the bytes of the files each call wrote (base64, each within `limits.transfer_mb`)
    in the artifact's `file_contents`; `files` always lists their names and sizes."""
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

    @field_validator("policy", mode="before")
    @classmethod
    def _resolve(cls, value: Any) -> Policy:
        return coerce_policy(value)

    def _learner(self) -> Learner | None:
        self.learner = learner_for(self.mode, self.learner)
        return cast("Learner | None", self.learner)

    @model_validator(mode="after")
    def _setup(self) -> SandboxedPythonTool:
        self._runner = ToolRunner(
            self.policy,
            session=self.session,
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

    # -- the public extras -------------------------------------------------------------

    def sessions(self) -> list[str]:
        """Keys of the live sessions (`thread:<id>`, or `tool`)."""
        return self._runner.sessions()

    def reset(self, thread_id: object = None) -> None:
        """Forget the interpreter of a conversation thread (or of the tool's own session)."""
        self._runner.reset(thread_id)

    def close(self) -> None:
        """Stop every worker of this tool; a later call starts new ones."""
        self._runner.close()

    def put_file(
        self,
        name: str,
        data: bytes | None = None,
        *,
        source: str | os.PathLike[str] | None = None,
        thread_id: object = None,
        overwrite: bool = False,
    ) -> FileInfo:
        """Upload: place `data` (or the host file `source`) in the scratch of `thread_id`'s
        interpreter (the tool's own with `session="tool"`), where the model's code reads it
        as `name`. Bounded and refused as `Session.put_file`."""
        return self._runner.put_file(
            name, data, source=source, thread_id=thread_id, overwrite=overwrite
        )

    def offer_file(self, name: str, source: str | os.PathLike[str]) -> None:
        """Let the model ask for the host file `source` to be placed in its scratch as `name`.

        The model never names a host path: it names an offered `name` in the tool's `files`
        argument, and the call first copies `source` (read then, bounded and refused as
        `Session.put_file`) into the scratch of its session. Offer files before the tool is
        bound to a model or an agent (the argument and the description's list of offered
        names are part of the schema the model reads). `name` is checked now; `source` must
        be a regular file now and when it is placed.
        """
        self._offers.offer(self._runner, name, source)
        self.args_schema = RunPythonWithFilesInput
        if self._base_description is not None:
            self.description = self._offers.describe(self._base_description)

    def offered_files(self) -> list[str]:
        """The names the model may ask to place (`offer_file`)."""
        return self._offers.names()

    def get_file(self, name: str, *, thread_id: object = None) -> bytes:
        """Download: a file the code wrote in `thread_id`'s scratch (`Session.get_file`)."""
        return self._runner.get_file(name, thread_id=thread_id)

    def list_files(self, *, thread_id: object = None) -> list[FileInfo]:
        return self._runner.list_files(thread_id=thread_id)

    # -- running -----------------------------------------------------------------------

    # `config` must be annotated exactly `RunnableConfig` for LangChain to inject it.
    def _run(
        self,
        code: str,
        config: RunnableConfig,
        run_manager: CallbackManagerForToolRun | None = None,
        files: list[str] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        thread_id = _thread_id(config)
        if files:
            self._place(files, thread_id)
        result = self._runner.run(code, thread_id=thread_id, on_event=self._live_writer())
        content, artifact = self._finish(result, _dispatch_sync)
        return content, self._with_files(artifact, result, thread_id)

    async def _arun(
        self,
        code: str,
        config: RunnableConfig,
        run_manager: AsyncCallbackManagerForToolRun | None = None,
        files: list[str] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        thread_id = _thread_id(config)
        if files:
            import asyncio

            await asyncio.to_thread(self._place, files, thread_id)
        result = await self._runner.arun(code, thread_id=thread_id, on_event=self._live_writer())
        out, payload = self._classify(result)
        if payload is not None:
            await _dispatch_async(payload)
        content, artifact = self._respond(out, result)
        if self.return_files and result.files:
            import asyncio

            artifact = await asyncio.to_thread(self._with_files, artifact, result, thread_id)
        return content, artifact

    def _place(self, names: list[str], thread_id: object) -> None:
        """Copy the offered files `names` into the call's scratch; a name not offered, or a
        placement refused, is a handled tool error (the code does not run)."""
        try:
            self._offers.place(self._runner, names, thread_id)
        except OfferRefused as exc:
            raise ToolException(exc.text) from None

    def _with_files(
        self, artifact: dict[str, Any], result: RunResult, thread_id: object
    ) -> dict[str, Any]:
        if self.return_files and result.files:
            artifact["file_contents"] = self._runner.produced_files(result, thread_id)
        return artifact

    def _finish(
        self, result: RunResult, dispatch: Callable[[dict[str, Any]], None]
    ) -> tuple[Any, dict[str, Any]]:
        out, payload = self._classify(result)
        if payload is not None:
            dispatch(payload)
        return self._respond(out, result)

    def _classify(self, result: RunResult) -> tuple[Outcome, dict[str, Any] | None]:
        out = outcome(result, code_errors_as=self.code_errors_as)
        _annotate_trace(self.policy, result, out)
        payload = None
        if out.is_error or out.refused:
            payload = refusal_payload(self.name, self.policy, result, out)
        return out, payload

    def _respond(self, out: Outcome, result: RunResult) -> tuple[Any, dict[str, Any]]:
        if out.is_error:
            raise SandboxToolError(out, result)
        images = image_blocks(result)
        content: Any = out.text
        if images:
            content = [{"type": "text", "text": out.text}, *images]
        return content, result.to_dict()

    def _live_writer(self) -> Callable[[str, Any], None] | None:
        if not self.stream_output:
            return None
        writer = _stream_writer()
        if writer is None:
            return None
        name = self.name

        def on_event(kind: str, data: Any) -> None:
            if kind in ("stdout", "stderr") and isinstance(data, str):
                try:
                    writer({f"sandbox_{kind}": data, "tool": name})
                except Exception:
                    pass  # live output is best effort; the result carries everything

        return on_event


# LangChain looks for the `RunnableConfig` parameter of `_run`/`_arun` with
# `typing.get_type_hints` on every call; under `from __future__ import annotations` that
# evaluates (compiles) each annotation string again, about 80 us of host CPU per call (measured
# with `time.thread_time`, 600 calls). Resolved once here, the lookup reads plain objects.
for _method in (SandboxedPythonTool._run, SandboxedPythonTool._arun):
    _method.__annotations__ = get_type_hints(_method)
del _method


def _thread_id(config: RunnableConfig | None) -> object:
    """The config's `thread_id` as given (its type is part of the session key)."""
    if not config:
        return None
    configurable = config.get("configurable") or {}
    return configurable.get("thread_id")


def _stream_writer() -> Callable[[Any], None] | None:
    try:
        from langgraph.config import get_stream_writer
    except ImportError:
        return None
    try:
        return get_stream_writer()
    except Exception:  # outside a graph: "Called get_config outside of a runnable context"
        return None


def refusal_payload(tool: str, policy: Policy, result: RunResult, out: Outcome) -> dict[str, Any]:
    """The `sandbox_refusal` custom event: the user's refusals, and the raw counts."""
    return {
        "tool": tool,
        "kind": out.kind,
        "rule": out.rule,
        "rules": list(out.rules),
        "denials": [d.to_dict() for d in result.user_denials()],
        "denial_counts": result.denial_counts(),
        "policy": policy.name,
        "fingerprint": policy.fingerprint(),
        "session": result.session,
        "boundary": result.boundary,
    }


def _annotate_trace(policy: Policy, result: RunResult, out: Outcome) -> None:
    """Tags and metadata on the current LangSmith run (a no-op when tracing is off).

    `sandbox:denied` and `sandbox.rule:<rule>` follow the user's refusals only (caught or
    not); library-internal ones are counted in `sandbox.denial_counts` and listed in
    `sandbox.internal_denials`, never tagged.
    """
    try:
        from langsmith import get_current_run_tree

        run = get_current_run_tree()
    except Exception:
        return
    if run is None:
        return
    tags: list[str] = []
    if out.refused:
        tags.append("sandbox:denied")
    if any(d.learned for d in result.denials):
        tags.append("sandbox:learned")
    if out.kind in ("limit", "crashed", "internal", "exception"):
        tags.append(f"sandbox:{out.kind}")
    tags.extend(f"sandbox.rule:{rule}" for rule in out.rules)
    metadata: dict[str, Any] = {
        "sandbox.policy": policy.name,
        "sandbox.fingerprint": policy.fingerprint(),
        "sandbox.outcome": out.kind,
        "sandbox.boundary": result.boundary,
        "sandbox.provider": result.provider,
        "sandbox.denial_counts": result.denial_counts(),
    }
    if out.rules:
        metadata["sandbox.rules"] = list(out.rules)
    user = result.user_denials()
    if user:
        metadata["sandbox.denials"] = [d.to_dict() for d in user]
    internal = result.internal_denials()
    if internal:
        metadata["sandbox.internal_denials"] = [d.to_dict() for d in internal]
    try:
        if tags:
            run.add_tags(tags)
        run.add_metadata(metadata)
    except Exception:
        pass  # tracing must never break a tool call


def _dispatch_sync(payload: dict[str, Any]) -> None:
    try:
        from langchain_core.callbacks.manager import dispatch_custom_event

        dispatch_custom_event(REFUSAL_EVENT, payload)
    except Exception:
        pass  # no parent run (plain invoke outside a runnable): nothing to dispatch to


async def _dispatch_async(payload: dict[str, Any]) -> None:
    try:
        from langchain_core.callbacks.manager import adispatch_custom_event

        await adispatch_custom_event(REFUSAL_EVENT, payload)
    except Exception:
        pass


def sandboxed_langchain_tool(
    tool: BaseTool,
    *,
    policy: Any = None,
    provider: str | None = None,
    timeout: float | None = None,
    warm: int = 0,
) -> BaseTool:
    """A copy of `tool` whose body runs in a sandboxed worker under `policy` (see `sandboxed`).

    Refusals and limits become handled tool errors naming the rule; an exception raised by the
    body becomes a handled tool error with its traceback. The return value must be JSON data.
    """
    from langchain_core.tools import StructuredTool

    from agent_sandbox.adapters._function import SandboxedFunction, tool_body

    func, fields = tool_body(tool, BaseTool)
    body: SandboxedFunction[..., Any] = SandboxedFunction(
        func, policy=policy, provider=provider, timeout=timeout, warm=warm, self_fields=fields
    )

    def present(result: RunResult) -> Any:
        out = outcome(result, code_errors_as="error")
        _annotate_trace(body.policy, result, out)
        if out.refused or (out.is_error and out.kind != "exception"):
            _dispatch_sync(refusal_payload(tool.name, body.policy, result, out))
        if out.is_error:
            raise SandboxToolError(out, result)
        return result.value

    def call(**kwargs: Any) -> Any:
        return present(body.run(**kwargs))

    async def acall(**kwargs: Any) -> Any:
        return present(await body.arun(**kwargs))

    wrapped = StructuredTool(
        name=tool.name,
        description=tool.description,
        args_schema=tool.args_schema or tool.get_input_schema(),
        func=call,
        coroutine=acall,
        handle_tool_error=_error_text,
        tags=tool.tags,
        metadata={
            **(tool.metadata or {}),
            "sandbox.policy": body.policy.name,
            "sandbox.fingerprint": body.policy.fingerprint(),
            "sandbox.boundary": body.boundary.name,
        },
    )
    call.sandbox = body  # type: ignore[attr-defined]  # so callers can close it
    return wrapped
