"""Framework-free logic shared by the LangChain and CrewAI tools.

* `describe_policy()` writes the tool description a model reads before its first call: what it
  may import, whether it has network, where it may write, the time limit, whether variables
  persist, the main code-layer restrictions, and that a refusal names its rule.
* `ToolRunner` owns the tool's `Sandbox` (started lazily), picks the session for a call and
  turns every failure of agent_sandbox itself into a `RunResult` instead of an exception, so an
  adapter has exactly one thing to translate.
* `outcome()` classifies a `RunResult` into what the model reads and whether it is an error for
  the framework (refusals, limits, crashes, internal failures) or ordinary output (a traceback
  from the model's own code, unless configured otherwise).
* `image_blocks()` turns `RunResult.images` into LangChain-style image content blocks.

Nothing here imports a framework.

This module is longer than 600 lines because it is the one framework-free piece every
adapter shares: the description a model reads (`describe_policy`) and the runner that turns
every failure into a result (`ToolRunner`, `outcome`) must say the same thing of one policy,
and each adapter stays a thin wrapper over both.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, cast

from agent_sandbox._denial import Denial
from agent_sandbox._host.boundary import NO_BOUNDARY, Boundary, resolve_boundary
from agent_sandbox._host.files import FileInfo
from agent_sandbox._host.result import RunError, RunResult
from agent_sandbox._host.sandbox import OnEvent, Sandbox
from agent_sandbox._render import clean, clean_block, quote
from agent_sandbox._tools.learn.observe import Learner
from agent_sandbox.policies import Policy, resolve_policy

__all__ = [
    "CodeErrorsAs",
    "FAILURE_KINDS",
    "FileOffers",
    "OfferRefused",
    "Outcome",
    "PolicySpec",
    "SessionMode",
    "ToolRunner",
    "coerce_policy",
    "describe_policy",
    "image_blocks",
    "internal_failure",
    "learner_for",
    "outcome",
    "produced_files",
    "thread_key",
]

PolicySpec = Policy | str | os.PathLike[str] | None
SessionMode = Literal["thread", "tool", "none"]
CodeErrorsAs = Literal["output", "error"]


_P = ParamSpec("_P")


def _signature_of(model: Callable[_P, None]) -> Callable[[Callable[..., None]], Callable[_P, None]]:
    """A decorator giving the function it decorates the signature of `model` (for type
    checkers; at run time it returns the function unchanged)."""
    return lambda function: function  # type: ignore[return-value]


def _tool_init(
    self: Any,
    *,
    policy: PolicySpec = None,
    session: SessionMode = ...,
    code_errors_as: CodeErrorsAs = ...,
    provider: str | None = None,
    warm: int = ...,
    timeout: float | None = None,
    max_sessions: int = ...,
    session_ttl: float = ...,
    mode: Literal["enforce", "learn"] = ...,
    **fields: Any,
) -> None:
    """The constructor both adapters' `SandboxedPythonTool` show a type checker: `policy`
    takes a name or a path as well as a `Policy` (the tool's validator resolves it), while the
    field itself is always a `Policy` once built."""


#: Decorates the `if TYPE_CHECKING:` `__init__` stub of each adapter's tool (pydantic's own
#: `__init__` runs; a stub is needed because type checkers derive a model's constructor from
#: its fields, which would make `policy="data-analysis"` an error).
tool_init = _signature_of(_tool_init)


#: `RunError.kind`s that are a refusal or a failure of the sandbox, never ordinary output.
FAILURE_KINDS = frozenset({"denied", "limit", "crashed", "internal"})

_RETRY_NOTE = (
    "Running the same code again will be refused again: change the approach, or tell the "
    "user which policy line would allow it."
)
_MAX_LISTED_IMPORTS = 80
#: How much of the output printed before a refusal the model reads (the artifact has it all).
_PARTIAL_CHARS = 400


def describe_policy(
    policy: Policy,
    *,
    session: SessionMode | str = "thread",
    intro: str | None = None,
    boundary: str | None = None,
    timeout: float | None = None,
) -> str:
    """The tool description a model reads, generated from `policy` (kept short: it costs tokens).

    `boundary` is the kernel boundary the calls run behind (`Boundary.name`, e.g.
    `"bwrap+landlock+seccomp"`, or `"none"`); None leaves the line out. `timeout` is the
    tool's own per-call wall time when it sets one: the description states the limit that
    will actually apply.
    """
    lines = [
        intro
        or "Run Python 3 code in a sandboxed interpreter. Returns what the code prints and the "
        "value of its last expression; print() what you need to see."
    ]
    head = f"Policy '{policy.name}'"
    if policy.description:
        head += f": {policy.description.strip().rstrip('.')}."
    lines.append(head)
    allow = policy.imports.allow
    if "*" in allow:
        imports = "any module"
    elif allow:
        listed = list(allow[:_MAX_LISTED_IMPORTS])
        more = len(allow) - len(listed)
        imports = ", ".join(listed) + (f" and {more} more" if more > 0 else "")
    else:
        imports = "none (builtins only)"
    if policy.imports.deny:
        imports += f"; never {', '.join(policy.imports.deny)}"
    lines.append(f"- Imports allowed: {imports}. Any other import is refused.")
    if policy.net.allows_any():
        targets = [f"{r.host}:{r.ports}" for r in policy.net.rules if r.action == "allow"]
        lines.append(f"- Network: only {', '.join(targets)}.")
        if "egress-proxy" in (boundary or "").split("+"):
            # What works behind the host's egress proxy, and what does not (issue 31).
            from agent_sandbox._host.egress.handoff import loopback_forwards

            # The direct forwards are wired by bwrap and unshare (the host listens in the
            # sandbox's namespace), gvisor (a relay in the sandbox, a host socket per
            # service) and qemu (the guest agent listens on the guest's loopback, a channel
            # per connection to a host socket per service); the host's proxy judges each.
            forwarded = (boundary or "").split("+")[0] in ("bwrap", "unshare", "gvisor", "qemu")
            pairs = loopback_forwards(policy) if forwarded else []
            direct = [f"{h}:{p}" for h, p in pairs]
            text = (
                "  Through the proxy in HTTP_PROXY / HTTPS_PROXY / ALL_PROXY (HTTP, HTTPS "
                "via CONNECT, SOCKS5): requests, urllib, httpx, aiohttp with trust_env=True "
                "and pip use it; "
            )
            if direct:
                text += (
                    f"{', '.join(direct)} also by any client directly (sockets, http.client, "
                    "database drivers); a direct socket to anything else reaches nothing."
                )
            else:
                text += (
                    "a direct socket (socket.create_connection, http.client without "
                    "set_tunnel, database drivers) reaches nothing."
                )
            lines.append(text)
    else:
        lines.append("- Network: off.")
    writable = ["the scratch directory (the working directory)"]
    writable += [p for p in policy.files.write if p.rstrip("/") != "$SCRATCH"]
    lines.append(f"- Files: write only to {', '.join(writable)}.")
    if policy.files.read:
        lines.append(f"  Read also: {', '.join(policy.files.read)}.")
    lim = policy.limits
    wall = f"{timeout:g} s per call" if timeout is not None else f"{lim.wall_seconds:g} s per call"
    lines.append(
        f"- Limits: {wall}, {lim.cpu_seconds} s of CPU, {lim.memory_mb} MB memory, "
        f"{lim.output_bytes} bytes of output."
    )
    if session == "none":
        lines.append("- State: every call starts in a fresh interpreter; variables do not persist.")
    else:
        lines.append(
            "- State: variables and imports persist between calls"
            + (" of this conversation." if session == "thread" else ".")
        )
    if boundary == NO_BOUNDARY:
        lines.append("- Isolation: no kernel sandbox (explicit opt-out); Python-level checks only.")
    elif boundary:
        lines.append(f"- Isolation: kernel sandbox {boundary}.")
    granted = ", ".join(policy.api.allow) or "none"
    lines.append(
        f"- Subprocesses, eval/exec, ctypes and similar sensitive calls are refused "
        f"(granted: {granted})."
    )
    code = policy.code
    if code.enabled:
        lines.append(f"- The code is checked before it runs: {'; '.join(_code_checks(policy))}.")
    lines.append(
        "- A refusal names its rule (for example [imports]) and what would allow it; "
        "retrying the same thing is useless."
    )
    return "\n".join(lines)


def _code_checks(policy: Policy) -> list[str]:
    """The main restrictions of the code layer, in a few words each."""
    code = policy.code
    checks: list[str] = []
    try:
        from agent_sandbox.guards._code_check import DEFAULT_SYNTAX

        # Only what this policy takes away from the default sub-language is worth the tokens.
        missing = sorted(set(DEFAULT_SYNTAX) - set(code.syntax))
    except ImportError:  # pragma: no cover - the code layer is part of the package
        missing = []
    if missing:
        checks.append(f"no {', '.join(missing)} syntax")
    if "*" in code.names:
        checks.append("globals(), locals(), vars() refused")
    else:
        checks.append(f"only these names: {', '.join(code.names)}")
    if code.deny_names:
        checks.append(f"never: {', '.join(code.deny_names)}")
    if "*" not in code.attributes:
        checks.append(f"attributes limited to {', '.join(code.attributes)}")
    dunders = ", ".join(code.dunders) or "none"
    checks.append(f"dunder names refused except {dunders}")
    b = code.budgets
    if b.max_iterations:
        checks.append(f"at most {b.max_iterations} loop iterations")
    if b.max_call_depth:
        checks.append(f"call depth {b.max_call_depth}")
    return checks


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an adapter should present one `RunResult`.

    `is_error` means: report it to the framework as a failed tool call (a refusal, a limit, a
    crash, an internal failure, or the code's own exception when `code_errors_as="error"`).
    `kind` is `ok`, `caught` (completed, but the code met a refusal and went on), `exception`,
    `denied`, `limit`, `crashed` or `internal`; `rule` is the first rule involved (the CrewAI
    `ToolFailure.code`), `rules` all of them. `refused` is true when any refusal was the
    user's (caught or not): CrewAI reports every such call as a failure. `retryable` is true
    for a crash or an internal failure, where the same call may work next time; never for a
    closed sandbox (`SandboxClosed`), which refuses every later call too.
    """

    text: str
    is_error: bool
    kind: str
    rule: str | None
    rules: tuple[str, ...]
    refused: bool = False
    retryable: bool = False


def coerce_policy(value: Any) -> Policy:
    """A tool's `policy` argument as a Policy: a Policy, a shipped policy name or a TOML path."""
    if isinstance(value, Policy):
        return value
    if value is None or isinstance(value, str | os.PathLike):
        return resolve_policy(value)
    raise TypeError("policy must be a Policy, a shipped policy name or a TOML path")


def learner_for(mode: str, current: Any) -> Learner | None:
    """The tool's learner in learning mode (created on first use), None when enforcing."""
    if mode != "learn":
        return None
    return cast(Learner, current) if current is not None else Learner()


def outcome(result: RunResult, *, code_errors_as: CodeErrorsAs = "output") -> Outcome:
    """Classify `result` and write the text the model reads.

    Everything derives from the result's one classification of its refusals
    (`RunResult.user_denials()`): library-internal refusals are not shown to the model (the
    trace keeps them); a refusal that became the call's error is a refusal, not a traceback.
    """
    error = result.error
    rules = tuple(result.rules())
    user = result.user_denials()
    refused = bool(user) or (error is not None and error.kind == "denied")
    parts: list[str] = []
    for notice in result.notices:
        parts.append(f"[notice] {clean(notice, 1000)}")
    if error is not None and error.kind in FAILURE_KINDS:
        parts.append(_failure_text(result, error))
        if result.stdout or result.stderr:
            partial = _output_text(result)
            if len(partial) > _PARTIAL_CHARS:
                cut = len(partial) - _PARTIAL_CHARS
                partial = partial[:_PARTIAL_CHARS] + f"\n[... {cut} more characters not shown]"
            parts.append("Output before it stopped:\n" + partial)
        rule = error.rule or (rules[0] if rules else None)
        retryable = error.kind in ("crashed", "internal") and error.type != "SandboxClosed"
        return Outcome("\n".join(parts), True, error.kind, rule, rules, refused, retryable)
    out = _output_text(result)
    if out:
        parts.append(out)
    if error is not None:
        # The model's own code raised (or does not parse): show the traceback like a REPL.
        parts.append(clean_block(error.traceback or f"{error.type}: {error.message}").rstrip())
    else:
        value = result.value_text()
        if value:
            parts.append(value)
    if user:
        parts.append(
            "Refused during this call (the code caught the error and went on):\n"
            + "\n".join(f"- {_denial_line(d)}" for d in user)
        )
    learned = [d for d in result.denials if d.learned]
    if learned:
        parts.append(
            "Learning mode recorded would-be refusals:\n"
            + "\n".join(f"- {d.message()}" for d in learned)
        )
    if result.images:
        names = ", ".join(quote(i.name, 80) for i in result.images)
        parts.append(f"[{len(result.images)} image(s) attached: {names}]")
    text = "\n".join(parts) or "(no output)"
    if error is not None:
        is_error = code_errors_as == "error"
        return Outcome(
            text,
            is_error,
            "exception",
            error.rule or (rules[0] if rules else None),
            rules,
            refused,
        )
    kind = "caught" if user else "ok"
    return Outcome(text, False, kind, rules[0] if rules else None, rules, refused)


def _denial_line(d: Denial) -> str:
    text = d.message()
    if d.origin == "between-calls":
        text = "(by a thread of the code, between calls) " + text
    return text


def _output_text(result: RunResult) -> str:
    text = result.stdout
    if result.stderr:
        if text and not text.endswith("\n"):
            text += "\n"
        text += "[stderr]\n" + result.stderr
    return text.rstrip("\n")


def _failure_text(result: RunResult, error: RunError) -> str:
    if error.kind == "denied":
        lines = ["REFUSED by the sandbox policy."]
        denials = result.user_denials()
        if denials:
            lines.extend(_denial_line(d) for d in denials)
        else:
            lines.append(clean(error.message, 1000))
        if error.type and not error.type.startswith("agent_sandbox."):
            # A library turned the refusal into its own error: say what the code got.
            got = clean(error.code_message, 240)
            lines.append(f"Your code got {clean(error.type, 120)}: {got}")
        lines.append(_RETRY_NOTE)
        return "\n".join(lines)
    if error.kind == "limit":
        msgs = [d.message() for d in result.denials if d.rule == error.rule] or [
            clean(error.message, 1000)
        ]
        return "\n".join(
            [
                "STOPPED by a sandbox limit.",
                *msgs,
                "Make the code do less (smaller input, fewer iterations, less output) "
                "rather than running it again unchanged.",
            ]
        )
    if error.kind == "crashed":
        return (
            f"The sandbox worker crashed ([{error.rule or 'worker.crashed'}]): "
            f"{clean(error.message, 1000)}. "
            "The next call starts a fresh interpreter: define your variables again."
        )
    if error.type == "SandboxClosed":
        # Closed by its owner (the application is shutting the tool down): a retry meets the
        # same closed sandbox, so the model is told not to try again.
        return (
            f"The sandbox is closed ({clean(error.message, 1000)}): this tool cannot run "
            "code any more, so do not call it again. This was not caused by your code."
        )
    return (
        f"The sandbox failed internally ({clean(error.type, 120)}: {clean(error.message, 1000)}). "
        "This was not caused by your code's logic; you may try once more."
    )


def internal_failure(exc: BaseException, policy: Policy | None = None) -> RunResult:
    """A `RunResult` standing for a failure of agent_sandbox itself (never raised to the agent)."""
    return RunResult(
        error=RunError(kind="internal", type=type(exc).__name__, message=str(exc) or repr(exc)),
        policy=policy.name if policy else "",
        fingerprint=policy.fingerprint() if policy else "",
    )


class OfferRefused(Exception):
    """Offered files could not be placed before a call (the code did not run): `text` is what
    the model reads, `rule` the rule that refused it (`files.offer` for a name never offered,
    `files.host` for a host file that could not be read), `denial` the policy's refusal."""

    def __init__(self, text: str, rule: str, denial: Denial | None = None) -> None:
        super().__init__(text)
        self.text = text
        self.rule = rule
        self.denial = denial


class FileOffers:
    """Host files the operator offered a tool under names; the model asks for them by name.

    The model never names a host path: `place()` accepts only names given to `offer()`, and
    copies each one's host file (read then, bounded and refused as `Session.put_file`) into
    the scratch of the call's session. Shared by the LangChain and CrewAI tools.
    """

    def __init__(self) -> None:
        self._paths: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self._paths)

    def names(self) -> list[str]:
        return sorted(self._paths)

    def offer(self, runner: ToolRunner, name: str, source: str | os.PathLike[str]) -> str:
        """Check `name` (a plain scratch name the policy does not hide: `PermissionError`
        otherwise), `source` (a regular file now) and that the tool keeps a session."""
        from agent_sandbox._host import files

        checked = files.check_name(runner.policy, name, "offer")
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"offer_file: {path!r} is not a regular file on this host")
        if runner.session_mode == "none":
            raise ValueError(
                "offer_file needs a session (session='none' runs each call in a fresh "
                "interpreter with nothing placed before it)"
            )
        self._paths[checked] = path
        return checked

    def describe(self, base: str) -> str:
        """`base` (the tool description) with the offered names appended."""
        return (
            base
            + "\n- Files you may place with `files` (copied into the working directory "
            + "before the code runs): "
            + ", ".join(self.names())
            + "."
        )

    def place(self, runner: ToolRunner, names: list[str], thread_id: object = None) -> None:
        """Copy the offered files `names` into the call's scratch (a fresh copy replaces one
        there); `OfferRefused` for a name not offered or a placement refused."""
        from agent_sandbox._errors import FileTransferRefused

        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise OfferRefused(
                "REFUSED: `files` must be a list of offered names. The code did not run.",
                "files.offer",
            )
        unknown = [n for n in names if n not in self._paths]
        if unknown:
            offered = ", ".join(self.names()) or "none"
            raise OfferRefused(
                f"REFUSED: not offered files: {', '.join(quote(n, 80) for n in unknown[:10])}. "
                f"`files` takes only these names: {offered}. The code did not run.",
                "files.offer",
            )
        if runner.session_key(thread_id) is None:
            raise OfferRefused(
                "Files cannot be placed: this call has no session to keep them (no "
                "conversation thread). The code did not run.",
                "files.offer",
            )
        for name in dict.fromkeys(names):
            try:
                runner.put_file(name, source=self._paths[name], thread_id=thread_id, overwrite=True)
            except FileTransferRefused as exc:
                raise OfferRefused(
                    f"REFUSED by the sandbox policy: {exc.denial.message()} The code did not run.",
                    exc.denial.rule,
                    exc.denial,
                ) from None
            except OSError as exc:
                raise OfferRefused(
                    f"The offered file {quote(name, 80)} could not be read on the host "
                    f"({type(exc).__name__}). The code did not run.",
                    "files.host",
                ) from None


def produced_files(result: RunResult, get_file: Callable[[str], bytes]) -> list[dict[str, Any]]:
    """The files `result` says its call wrote, with their bytes (base64): the ones the
    result carries (`RunResult.output_files`), else where `get_file` (a session's, bounded
    and refused as `Session.get_file`) gives them; one it refuses (too large, a link,
    changed while read) carries the refusal."""
    from agent_sandbox._errors import FileTransferRefused

    carried = {f.name: f.data for f in result.output_files if f.data is not None}
    out: list[dict[str, Any]] = []
    for entry in result.files:
        name = str(entry.get("name", ""))
        item: dict[str, Any] = {"name": name, "size": entry.get("size")}
        data = carried.get(name)
        if data is not None:
            item["base64"] = base64.b64encode(data).decode()
            out.append(item)
            continue
        try:
            item["base64"] = base64.b64encode(get_file(name)).decode()
        except FileTransferRefused as exc:
            item["refused"] = exc.denial.to_dict()
        except Exception as exc:  # the file went with its interpreter, or the sandbox closed
            item["error"] = str(exc)
        out.append(item)
    return out


def image_blocks(result: RunResult) -> list[dict[str, Any]]:
    """LangChain-style image content blocks, one per image the code produced."""
    return [
        {"type": "image", "base64": img.data_base64, "mime_type": img.mime or "image/png"}
        for img in result.images
    ]


SessionKeyFn = Callable[[dict[str, Any]], "str | None"]


#: Thread-id types with a faithful text form (type and value both part of the key).
_SCALAR_TAGS: dict[type, str] = {bool: "bool", int: "int", float: "float", bytes: "bytes"}


def thread_key(thread_id: object) -> str | None:
    """The session key of a conversation thread id; None (a stateless call) for no id.

    Type and value both count, so no two ids a framework tells apart share an interpreter:
    a `str` id is `thread:<id>`; any other id is `thread#<type>:<value>` (`thread#int:1`,
    `thread#bool:True`, `thread#uuid:...`, `thread#tuple:[...]` of its items' keys), a
    form no `str` id can take. A `None` or empty-string id is no id. Types without a
    faithful text form are refused (`TypeError` naming the type) rather than guessed.
    """
    if thread_id is None or (type(thread_id) is str and thread_id == ""):
        return None
    return _typed_key(thread_id, 0)


def _typed_key(value: object, depth: int) -> str:
    if depth > 8:
        raise TypeError("a thread id nested more than 8 levels deep")
    kind = type(value)
    if kind is str:
        return f"thread:{value}"
    if kind in _SCALAR_TAGS:
        text = value.hex() if isinstance(value, bytes) else repr(value)
        return f"thread#{_SCALAR_TAGS[kind]}:{text}"
    if isinstance(value, uuid.UUID):
        return f"thread#uuid:{value}"
    if kind is tuple or kind is list:
        items = [_typed_key(item, depth + 1) for item in value]  # type: ignore[attr-defined]
        return f"thread#{kind.__name__}:{json.dumps(items, ensure_ascii=True)}"
    raise TypeError(
        f"a thread id of type {kind.__name__} has no faithful key: use a str, int, UUID, "
        "bytes, bool, float, or a tuple or list of them"
    )


class ToolRunner:
    """The sandbox side of a tool: one lazily started `Sandbox`, sessions, and no exceptions.

    `session` is `"thread"` (one interpreter per conversation thread; a call that carries no
    thread id gets a fresh interpreter, since calls without one may come from different
    users), `"tool"` (one interpreter for the tool instance) or `"none"` (a fresh interpreter
    per call). Sessions live in the runner's own `Sandbox`: a key never reaches the
    interpreter of another tool or policy.

    The provider is resolved at construction (`boundary`): an unknown provider, one that does
    not work here or cannot serve the policy raises then, not at the first call.
    """

    def __init__(
        self,
        policy: PolicySpec,
        *,
        session: SessionMode = "thread",
        provider: str | None = None,
        warm: int = 1,
        timeout: float | None = None,
        learner: Learner | None = None,
        tool_name: str = "tool",
        max_sessions: int = 16,
        session_ttl: float = 1800.0,
    ) -> None:
        if session not in ("thread", "tool", "none"):
            raise ValueError(f"session must be 'thread', 'tool' or 'none', not {session!r}")
        self.policy = resolve_policy(policy)
        self.session_mode: SessionMode = session
        self.provider = provider
        self.warm = warm
        self.timeout = timeout
        self.max_sessions = max_sessions
        self.session_ttl = session_ttl
        # Learning mode: calls run in the learning envelope and each result goes to the learner.
        self.learner = learner
        self.tool_name = tool_name
        if learner is not None:
            learner.watch(tool_name, self.policy)
            self.boundary: Boundary = resolve_boundary(
                learner.envelope(self.policy, provider=provider)
            )
        else:
            self.boundary = resolve_boundary(self.policy, provider)
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()

    @property
    def sandbox(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None or self._sandbox.closed:
                if self.learner is not None:
                    envelope = self.learner.envelope(self.policy, provider=self.provider)
                    policy, provider = envelope, None
                else:
                    policy, provider = self.policy, self.provider
                self._sandbox = Sandbox(
                    policy,
                    provider=provider,
                    warm=self.warm,
                    max_sessions=self.max_sessions,
                    session_ttl=self.session_ttl,
                    tool=self.tool_name,
                )
            return self._sandbox

    def _learned(self, result: RunResult) -> RunResult:
        if self.learner is not None:
            self.learner.record(self.tool_name, self.policy, result)
        return result

    def session_key(self, thread_id: object) -> str | None:
        """The session a call runs in (None: stateless); see `thread_key`."""
        if self.session_mode == "none":
            return None
        if self.session_mode == "thread":
            return thread_key(thread_id)
        return "tool"

    def _call_options(self, on_event: OnEvent | None) -> dict[str, Any]:
        return {
            "timeout": self.timeout,
            "on_event": on_event,
            "timeout_source": f"the tool's timeout option ({self.tool_name!r})"
            if self.timeout is not None
            else None,
        }

    def run(
        self, code: str, *, thread_id: object = None, on_event: OnEvent | None = None
    ) -> RunResult:
        try:
            key = self.session_key(thread_id)
            sandbox = self.sandbox
            kw = self._call_options(on_event)
            if key is None:
                return self._learned(sandbox.run(code, **kw))
            return self._learned(sandbox.session(key).run(code, **kw))
        except Exception as exc:  # every failure of ours reaches the agent as data
            return internal_failure(exc, self.policy)

    async def arun(
        self, code: str, *, thread_id: object = None, on_event: OnEvent | None = None
    ) -> RunResult:
        try:
            key = self.session_key(thread_id)
            sandbox = self.sandbox
            kw = self._call_options(on_event)
            if key is None:
                result = await sandbox.arun(code, **kw)
            else:
                result = await sandbox.session(key).arun(code, **kw)
            return self._learned(result)
        except Exception as exc:
            return internal_failure(exc, self.policy)

    # -- files in a session's scratch (the session files API) ---------------------------

    def _file_session(self, thread_id: object) -> Any:
        key = self.session_key(thread_id)
        if key is None:
            raise ValueError(
                "files live in a session's scratch: this call has none (session='none', or "
                "session='thread' without a thread_id runs each call in a fresh interpreter)"
            )
        return self.sandbox.session(key)

    def put_file(
        self,
        name: str,
        data: bytes | None = None,
        *,
        source: str | os.PathLike[str] | None = None,
        thread_id: object = None,
        overwrite: bool = False,
    ) -> FileInfo:
        """Place a file in the scratch of `thread_id`'s session (`Session.put_file`)."""
        session = self._file_session(thread_id)
        return session.put_file(name, data, source=source, overwrite=overwrite)  # type: ignore[no-any-return]

    def get_file(self, name: str, *, thread_id: object = None) -> bytes:
        """A file of the scratch of `thread_id`'s session (`Session.get_file`)."""
        return self._file_session(thread_id).get_file(name)  # type: ignore[no-any-return]

    def list_files(self, *, thread_id: object = None) -> list[FileInfo]:
        return self._file_session(thread_id).list_files()  # type: ignore[no-any-return]

    def produced_files(self, result: RunResult, thread_id: object = None) -> list[dict[str, Any]]:
        """The files `result` says its call wrote, with their bytes (`produced_files`)."""
        if not result.files or self.session_key(thread_id) is None:
            return []
        return produced_files(result, lambda name: self.get_file(name, thread_id=thread_id))

    def sessions(self) -> list[str]:
        """Keys of the live sessions (`thread:<id>` or `tool`)."""
        with self._lock:
            return self._sandbox.sessions() if self._sandbox is not None else []

    def reset(self, thread_id: object = None) -> None:
        """Forget the interpreter of `thread_id`'s session (or the tool's own session)."""
        key = self.session_key(thread_id) or "tool"
        with self._lock:
            sandbox = self._sandbox
        if sandbox is not None and key in sandbox.sessions():
            sandbox.session(key).reset()

    def close(self) -> None:
        with self._lock:
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()
