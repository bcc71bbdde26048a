"""What one call returns: `RunResult`, with its `RunError` and `Image`s.

These are host values: `agent_sandbox._host.intake.builder` makes them from events it has
judged, and `raise_error()` raises the call's failure in the host, as the type the worker
raised (rebuilt by the intake) or an exception the host makes itself.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from agent_sandbox._denial import Denial

__all__ = ["NO_BOUNDARY", "Image", "OutputFile", "RunError", "RunResult", "boundary_name"]

#: What `boundary_name` says when no kernel mechanism held the worker.
NO_BOUNDARY = "none"


def boundary_name(stack: tuple[str, ...] | list[str], is_boundary: bool | None = None) -> str:
    """`"bwrap+landlock+seccomp"`; `"none"` for the `subprocess` provider; `""` if unknown."""
    if not stack:
        return ""
    if is_boundary is False or stack[0] == "subprocess":
        return NO_BOUNDARY
    return "+".join(stack)


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

    @staticmethod
    def refusal_first(refusal: str, type_: str, message: str) -> str:
        """The message of a refusal a library turned into its own error: the host's record
        of the refusal (rule, target, reason, hint) first, then what the code got."""
        return f"{refusal}\n(the code's error, {type_}: {message})"

    @property
    def code_message(self) -> str:
        """The message of the exception the code itself got (without the refusal put
        first by `refusal_first`)."""
        _, sep, rest = self.message.partition(f"\n(the code's error, {self.type}: ")
        return rest[:-1] if sep and rest.endswith(")") else self.message


@dataclasses.dataclass(frozen=True)
class Image:
    """An image the code produced (a matplotlib figure or a PNG written to scratch)."""

    name: str
    mime: str
    data_base64: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mime": self.mime, "data": self.data_base64}


@dataclasses.dataclass(frozen=True)
class OutputFile:
    """A file the call wrote or changed in scratch, with its bytes, or why they are not here.

    `data` is None when the file was not returned, and `reason` says why (over what
    `limits.result_bytes` leaves for the call's files, returned as an image, the worker
    ended, a refusal of the read); `Session.get_file(name)` can still fetch a file the bound
    left out while the session's interpreter lives."""

    name: str
    size: int
    data: bytes | None = None
    reason: str = ""

    def to_dict(self, *, data: bool = True) -> dict[str, Any]:
        """JSON-safe: `data` as base64 (None when not returned, or when `data=False`),
        `returned` whether the bytes are in the result, `not_returned` the reason."""
        import base64

        return {
            "name": self.name,
            "size": self.size,
            "returned": self.data is not None,
            "data": base64.b64encode(self.data).decode("ascii")
            if data and self.data is not None
            else None,
            "not_returned": self.reason or None,
        }


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
    #: The files of `files` with their bytes (or why not), in the same order; see
    #: `OutputFile`. Empty for a call that wrote no file.
    output_files: tuple[OutputFile, ...] = ()

    @property
    def boundary(self) -> str:
        """The kernel boundary that held the worker, e.g. `"bwrap+landlock+seccomp"`;
        `"none"` under the `subprocess` opt-out; `""` when no worker ran."""
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

    def to_dict(self, *, images: bool = True, file_data: bool = False) -> dict[str, Any]:
        """A JSON-safe dict (the `--json` output and the adapters' artifact). The files of
        `output_files` are listed by name, size and whether they were returned; their bytes
        (base64) only with `file_data` (the adapters add them when asked: `return_files`)."""
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
            "output_files": [f.to_dict(data=file_data) for f in self.output_files],
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
    if error.rule == "worker.protocol":
        return _errors.TransportError(error.message)
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
