"""What one call returns: `RunResult`, with its error and images, and how events build it."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from agent_sandbox._denial import Denial

if TYPE_CHECKING:
    from agent_sandbox._unpickle import Decoder

__all__ = ["Image", "RunError", "RunResult", "ResultBuilder"]


@dataclasses.dataclass(frozen=True)
class RunError:
    """Why a call did not complete normally.

    `kind` is one of `exception` (the user's code raised), `syntax` (it does not parse),
    `denied` (a policy refusal escaped the code), `limit` (a limit ended the call),
    `crashed` (the worker died), `internal` (agent_sandbox itself failed).
    `rule` is set for `denied`, `limit` and `crashed`.
    """

    kind: str
    type: str
    message: str
    traceback: str = ""
    rule: str | None = None
    line: int | None = None
    column: int | None = None
    #: The worker's exception rebuilt in the host (objects mode: with its attributes), and
    #: the worker's traceback to splice in when it is raised; see `RunResult.raise_error()`.
    exception: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)
    child_traceback: Any = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("exception", "child_traceback")
        }


@dataclasses.dataclass(frozen=True)
class Image:
    """An image the code produced (a matplotlib figure or a PNG written to scratch)."""

    name: str
    mime: str
    data_base64: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mime": self.mime, "data": self.data_base64}


@dataclasses.dataclass(frozen=True)
class RunResult:
    """The outcome of one call: output, value, error, denials, timings and worker identity.

    `value` is JSON-safe data (objects that are not become `{"__repr__", "__type__"}`); in
    the `objects` result mode it is the object itself, rebuilt by the restricted unpickler
    (`to_dict()` stays JSON-safe by turning such objects into the same marked repr).
    `unwrap()` returns the value or raises the worker's exception as its own type.
    `ok` is true when the code completed and nothing was denied. `state_lost` says that the
    session's previous worker died and this call ran in a fresh interpreter.
    """

    stdout: str = ""
    stderr: str = ""
    value: Any = None
    error: RunError | None = None
    denials: tuple[Denial, ...] = ()
    duration: float = 0.0
    worker_id: str = ""
    session: str | None = None
    policy: str = ""
    fingerprint: str = ""
    provider: str = ""
    stack: tuple[str, ...] = ()
    state_lost: bool = False
    notices: tuple[str, ...] = ()
    images: tuple[Image, ...] = ()
    files: tuple[dict[str, Any], ...] = ()

    @property
    def boundary(self) -> str:
        """The kernel boundary that held the worker, e.g. `"bwrap+landlock+seccomp"`;
        `"none"` under the `subprocess` opt-out; `""` when no worker ran."""
        from agent_sandbox._boundary import boundary_name

        return boundary_name(self.stack)

    @property
    def ok(self) -> bool:
        """The code completed and none of its refusals was the user's (library-internal
        refusals, handled by a library while the code went on, do not count; they stay in
        `denials`). A call that raised is never ok, whatever its refusals are."""
        return self.error is None and not self.user_denials()

    @property
    def denied(self) -> bool:
        """Whether a refusal was the user's (it changed what the code got, caught or not)."""
        return bool(self.user_denials())

    def user_denials(self) -> tuple[Denial, ...]:
        """The refusals that were the user's: their exception, or an error a library made of
        it, reached the user's code (see docs/denials.md, "Whose refusal is it?")."""
        return tuple(d for d in self.denials if not d.internal and not d.learned)

    def internal_denials(self) -> tuple[Denial, ...]:
        """Refusals a library raised and handled while the user's code went on."""
        return tuple(d for d in self.denials if d.internal)

    def denial_counts(self) -> dict[str, int]:
        """Raw counts of every refusal of the call, by classification (for the trace)."""
        counts = {"user": 0, "internal": 0, "learned": 0, "between_calls": 0, "distinct": 0}
        for d in self.denials:
            counts[d.classification] += d.count
            counts["distinct"] += 1
            if d.origin == "between-calls":
                counts["between_calls"] += d.count
        return counts

    def rules(self) -> list[str]:
        """The distinct rules of the call's error and of its refusals that were the user's (and
        learning mode's would-be ones), in order of first appearance; never internal ones."""
        seen: dict[str, None] = {}
        if self.error is not None and self.error.rule:
            seen.setdefault(self.error.rule, None)
        for d in self.denials:
            if not d.internal:  # the user's, then learning mode's would-be refusals
                seen.setdefault(d.rule, None)
        return list(seen)

    def to_dict(self, *, images: bool = True) -> dict[str, Any]:
        """A JSON-safe dict (the `--json` output and the adapters' artifact)."""
        return {
            "ok": self.ok,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "value": _json_safe(self.value),
            "error": self.error.to_dict() if self.error else None,
            "denials": [d.to_dict() for d in self.denials],
            "denial_counts": self.denial_counts(),
            "duration": round(self.duration, 6),
            "worker_id": self.worker_id,
            "session": self.session,
            "policy": self.policy,
            "fingerprint": self.fingerprint,
            "provider": self.provider,
            "stack": list(self.stack),
            "boundary": self.boundary,
            "state_lost": self.state_lost,
            "notices": list(self.notices),
            "images": [i.to_dict() for i in self.images]
            if images
            else [i.name for i in self.images],
            "files": list(self.files),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    def value_text(self) -> str:
        """The value as a model should read it: a repr-like text, empty when None."""
        if self.value is None:
            return ""
        if isinstance(self.value, dict) and set(self.value) == {"__repr__", "__type__"}:
            return str(self.value["__repr__"])
        if isinstance(self.value, str):
            return repr(self.value)
        try:
            return json.dumps(self.value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return _safe_repr(self.value)

    def raise_error(self) -> None:
        """Raise the call's failure in the host, as the type the worker raised; else return.

        The worker's traceback is spliced in, so the stack trace reads like a direct call:
        the host's frames, then the worker's (`<cell-N>` for the call's code). A class the
        host does not have becomes a `ChildException[<path>]` stand-in; a refusal or a limit
        raises its `SandboxDenied` subclass; a crash raises `WorkerCrashed`; a broken
        channel `TransportError`. Denials the code caught are not errors (see `denials`).
        """
        if self.error is None:
            return
        exc = self.error.exception
        if exc is None:
            exc = _error_exception(self.error, self.denials)
            raise exc
        raise exc.with_traceback(self.error.child_traceback)

    def unwrap(self) -> Any:
        """The value, or raise the call's failure as `raise_error()` does."""
        self.raise_error()
        return self.value


#: Distinct refusals the host keeps from one call, whatever a worker sends.
MAX_DENIALS = 256
_OTHER_TARGETS = "(other targets)"
#: Rules whose refusals are never library-internal, whatever a worker says: the code layer
#: and the limits act on the user's code itself; the rest are the host's or the guards' own.
_NEVER_INTERNAL = ("code.", "limits.", "guard.", "worker.", "result.")


class ResultBuilder:
    """Accumulates events from the worker into a `RunResult` (and forwards them live).

    What a worker says about its refusals is checked here (docs/denials.md, "What the host
    checks"): hints are re-derived from the rule and target by host templates; the number of
    distinct refusals kept is bounded; "internal" is only ever a presentation downgrade and
    is withdrawn for a refusal that shows in the call's error or whose rule is never
    internal; a call with an error is never ok.
    """

    def __init__(
        self,
        decoder: Decoder | None = None,
        policy: Any = None,
        wall: float | None = None,
    ) -> None:
        self.decoder = decoder
        self.policy = policy
        self.wall = wall
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.value: Any = None
        self.error: RunError | None = None
        self.denials: list[Denial] = []
        self.images: list[Image] = []
        self.files: list[dict[str, Any]] = []
        self.notices: list[str] = []
        self.done = False
        self.discard = False
        self._positions: dict[tuple[str, ...], int] = {}
        self._wire: list[int] = []  # the worker's n-th denial event -> index in `denials`
        self._error_refusals: list[Denial] = []
        self._wire_policy: dict[str, Any] | None = None

    def _policy_wire(self) -> dict[str, Any]:
        if self._wire_policy is None:
            try:
                self._wire_policy = (
                    self.policy.model_dump(mode="json") if self.policy is not None else {}
                )
            except Exception:
                self._wire_policy = {}
        return self._wire_policy

    def _vet(self, denial: Denial) -> Denial:
        """A worker's refusal as the host shows it: host-made hint, host policy name."""
        from agent_sandbox._hints import host_hint

        hint = host_hint(
            denial.rule, denial.target, denial.hint, self._policy_wire(), timeout=self.wall
        )
        changes: dict[str, Any] = {"hint": hint}
        if self.policy is not None:
            changes["policy"] = self.policy.name
        if denial.internal and denial.rule.startswith(_NEVER_INTERNAL):
            changes["internal"] = False
        return dataclasses.replace(denial, **changes)

    def add_denial(self, denial: Denial) -> int:
        """Keep one refusal (merged with the same one, bounded); returns its index."""
        key = denial.key()
        pos = self._positions.get(key)
        if pos is None and len(self.denials) >= MAX_DENIALS:
            actual = denial.last or denial
            denial = dataclasses.replace(
                denial,
                action="*",
                target=_OTHER_TARGETS,
                detail=f"more than {MAX_DENIALS} distinct refusals in one call; the rest are "
                "counted per rule",
                hint="",
                last=dataclasses.replace(actual, count=1, last=None),
            )
            key = denial.key()
            pos = self._positions.get(key)
        if pos is None:
            self._positions[key] = len(self.denials)
            self.denials.append(denial)
            return len(self.denials) - 1
        old = self.denials[pos]
        self.denials[pos] = dataclasses.replace(
            old, count=min(old.count + denial.count, 10**15), last=denial.last or denial
        )
        return pos

    def _counts(self, data: list[Any]) -> None:
        for item in data[: len(self._wire)]:
            if not (isinstance(item, list) and len(item) == 3):
                continue
            index, count, last = item
            if not (isinstance(index, int) and 0 <= index < len(self._wire)):
                continue
            if not (isinstance(count, int) and 1 <= count <= 10**15 and isinstance(last, dict)):
                continue
            pos = self._wire[index]
            old = self.denials[pos]
            self.denials[pos] = dataclasses.replace(
                old,
                count=max(old.count, count),
                last=self._vet(Denial.from_dict(last, nested=False)),
            )

    def add(self, kind: str, data: Any) -> None:
        if kind == "stdout" and isinstance(data, str):
            self.stdout.append(data)
        elif kind == "stderr" and isinstance(data, str):
            self.stderr.append(data)
        elif kind == "denial" and isinstance(data, dict):
            pos = self.add_denial(self._vet(Denial.from_dict(data, nested=False)))
            if len(self._wire) < MAX_DENIALS * 4:
                self._wire.append(pos)
        elif kind == "counts" and isinstance(data, list):
            self._counts(data)
        elif kind == "result" and isinstance(data, dict):
            if "pickle" in data:
                self._decode_value(data)
            else:
                self.value = data.get("value")
        elif kind == "error" and isinstance(data, dict):
            self.error = error_from_wire(data, self.decoder, self.notices)
            refusals = data.get("refusals")
            if isinstance(refusals, list):
                self._error_refusals = [
                    Denial.from_dict(r, nested=False) for r in refusals[:10] if isinstance(r, dict)
                ]
        elif kind == "image" and isinstance(data, dict):
            self.images.append(
                Image(
                    str(data.get("name", "")), str(data.get("mime", "")), str(data.get("data", ""))
                )
            )
        elif kind == "files" and isinstance(data, list):
            self.files = [f for f in data if isinstance(f, dict)]
        elif kind == "notice" and isinstance(data, str):
            self.notices.append(data)
        elif kind == "done":
            self.done = True
            if isinstance(data, dict):
                self.discard = bool(data.get("discard"))

    def verdict(self) -> None:
        """The host's own checks on the worker's classification (see the class docstring).

        A refusal is the user's when the call's error carries it (the worker names the
        refusals in the error's exception chain) or when its rule and quoted target appear
        in the error's text: a library turned it into the error the user's code got. An
        error of kind `exception` that carries a refusal becomes a refusal (`denied`).
        """
        error = self.error
        if error is None:
            return
        from agent_sandbox._render import quote

        text = f"{error.message}\n{error.traceback}"
        carried = {(d.rule, d.target) for d in self._error_refusals}
        first_rule: str | None = None
        for i, d in enumerate(self.denials):
            shown = f"[{d.rule}]" in text and quote(d.target) in text
            if (d.rule, d.target) in carried or (shown and d.target):
                if d.internal:
                    self.denials[i] = dataclasses.replace(d, internal=False)
                if not d.learned and first_rule is None:
                    first_rule = d.rule
        if error.kind == "exception" and first_rule is not None:
            limit = first_rule.startswith("limits.")
            self.error = dataclasses.replace(
                error, kind="limit" if limit else "denied", rule=first_rule
            )

    def _decode_value(self, data: dict[str, Any]) -> None:
        """Decode an objects-mode value; a refusal becomes the call's error and a denial."""
        from agent_sandbox._errors import UnpickleRefused
        from agent_sandbox._hints import grant_hint
        from agent_sandbox._unpickle import Decoder

        decoder = self.decoder or Decoder(objects=False)
        try:
            self.value = decoder.decode_value(data)
        except UnpickleRefused as exc:
            too_big = exc.budget == "max_bytes"
            denial = Denial(
                rule="limits.result" if too_big else "result.refused",
                action="unpickle",
                target=exc.target or "the result",
                policy=decoder.policy,
                detail=exc.reason,
                hint=grant_hint({"limits.result_bytes": decoder.budgets.max_bytes * 2})
                if too_big
                else exc.hint,
            )
            self.value = None
            self.add_denial(denial)
            self.error = RunError(
                kind="limit" if too_big else "denied",
                type="UnpickleRefused",
                message=denial.message(),
                rule=denial.rule,
            )

    def build(self, **fields: Any) -> RunResult:
        self.verdict()
        return RunResult(
            stdout="".join(self.stdout),
            stderr="".join(self.stderr),
            value=self.value,
            error=self.error,
            denials=tuple(self.denials),
            images=tuple(self.images),
            files=tuple(self.files),
            notices=tuple(self.notices) + tuple(fields.pop("notices", ())),
            **fields,
        )


def error_from_wire(
    data: dict[str, Any], decoder: Decoder | None = None, notices: list[str] | None = None
) -> RunError:
    """Build a RunError from the worker's `error` event, tolerating missing fields.

    The `exception` entry (see `agent_sandbox._objects`) is rebuilt into a host exception by
    the decoder: its rich form only in objects mode, else from the primitive descriptor.
    """

    def opt_int(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    rule = data.get("rule")
    return RunError(
        kind=str(data.get("kind", "exception")),
        type=str(data.get("type", "Exception")),
        message=str(data.get("message", "")),
        traceback=str(data.get("traceback", "")),
        rule=str(rule) if rule else None,
        line=opt_int(data.get("line")),
        column=opt_int(data.get("column")),
        **_rebuild(data.get("exception"), decoder, notices),
    )


def _rebuild(payload: Any, decoder: Decoder | None, notices: list[str] | None) -> dict[str, Any]:
    if not isinstance(payload, dict):
        return {}
    from agent_sandbox._errors import UnpickleRefused
    from agent_sandbox._unpickle import Decoder

    try:
        rebuilt = (decoder or Decoder(objects=False)).rebuild_exception(payload)
    except UnpickleRefused as exc:
        if notices is not None:
            notices.append(f"the worker's exception could not be rebuilt: {exc.reason}")
        return {}
    for note in rebuilt.notes:
        if notices is not None:
            notices.append(note)
        try:
            rebuilt.exception.add_note(f"agent_sandbox: {note}")
        except Exception:
            pass
    return {"exception": rebuilt.exception, "child_traceback": rebuilt.traceback}


def _error_exception(error: RunError, denials: tuple[Denial, ...]) -> BaseException:
    """An exception for a RunError that carries no rebuilt one (made by the host itself)."""
    from agent_sandbox import _errors

    denial = next((d for d in denials if d.rule == error.rule), None)
    if error.kind in ("denied", "limit") and denial is not None:
        family = error.rule or ""
        for prefix, cls in _DENIAL_TYPES:
            if family == prefix or (prefix.endswith(".") and family.startswith(prefix)):
                return cls(denial)  # type: ignore[no-any-return]
        return _errors.SandboxDenied(denial)
    if error.kind == "crashed":
        return _errors.WorkerCrashed(None, log_tail=error.traceback)
    if error.kind == "internal" or error.type == "UnpickleRefused":
        return _errors.TransportError(error.message)
    if error.kind == "syntax":
        exc = SyntaxError(error.message)
        exc.lineno, exc.offset = error.line, error.column
        return exc
    return _errors.ChildException(error.message, child_type=error.type)


def _denial_types() -> tuple[tuple[str, type], ...]:
    from agent_sandbox import _errors

    return (
        ("files.hidden", _errors.HiddenPathDenied),
        ("files.", _errors.FileAccessDenied),
        ("net.", _errors.NetworkDenied),
        ("imports", _errors.ImportDenied),
        ("env", _errors.EnvDenied),
        ("api.", _errors.CallDenied),
        ("code.", _errors.CodeRejected),
        ("limits.", _errors.LimitExceeded),
    )


_DENIAL_TYPES = _denial_types()


def _json_safe(value: Any, depth: int = 0) -> Any:
    """`value` as JSON-safe data: objects (objects mode) become `{"__repr__", "__type__"}`."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int) and type(value) is int:
        return value if abs(value) < 2**63 else _marked(value)
    if isinstance(value, float) and type(value) is float:
        return value if value == value and abs(value) != float("inf") else _marked(value)
    if depth < 20 and type(value) in (list, tuple) and len(value) <= 10_000:
        return [_json_safe(v, depth + 1) for v in value]
    if (
        depth < 20
        and type(value) is dict
        and len(value) <= 10_000
        and all(type(k) is str for k in value)
    ):
        return {k: _json_safe(v, depth + 1) for k, v in value.items()}
    return _marked(value)


def _marked(value: Any) -> dict[str, str]:
    cls = type(value)
    module = getattr(cls, "__module__", "builtins")
    name = cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"
    return {"__repr__": _safe_repr(value), "__type__": name}


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<unrepresentable {type(value).__name__}>"
    return text if len(text) <= 10_000 else text[:10_000] + "...<truncated repr>"
