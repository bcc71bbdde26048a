"""What one call returns: `RunResult`, with its error and images, and how events build it."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any

from agent_sandbox._denial import RULES, Denial, rule_doc
from agent_sandbox._host.intake.events import (
    MAX_COUNT,
    MAX_ERROR_REFUSALS,
    HintMaker,
    HostBounds,
    StreamOrder,
    WorkerMisbehaved,
    check_denial,
    clean_text,
    denial_chars,
    over,
    quote,
    render_notice,
)

if TYPE_CHECKING:
    from agent_sandbox._host.intake.unpickle import Decoder

__all__ = ["Image", "Mark", "RunError", "RunResult", "ResultBuilder", "check_error"]


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
        from agent_sandbox._host.boundary import boundary_name

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


#: Distinct refusals the host keeps from one call, whatever a worker sends (past it, the
#: rest are counted per rule under `_OTHER_TARGETS`).
MAX_DENIALS = 256
_OTHER_TARGETS = "(other targets)"
#: Rules whose refusals are never library-internal, whatever a worker says: the code layer
#: and the limits act on the user's code itself; the rest are the host's or the guards' own.
_NEVER_INTERNAL = ("code.", "limits.", "guard.", "worker.", "result.")


@dataclasses.dataclass(frozen=True)
class Mark:
    """A point in a call's events that `ResultBuilder.rollback` returns to."""

    stdout: int
    stderr: int
    output_chars: int
    denials: tuple[Denial, ...]
    wire: int
    images: int
    image_chars: int
    files: tuple[dict[str, Any], ...]
    notices: int
    value: Any
    error: RunError | None
    error_refusals: tuple[Denial, ...]


class ResultBuilder:
    """Accumulates one call's events from the worker into a `RunResult`.

    Every event goes through `add()`, which judges it with `agent_sandbox._host.intake.events`
    (order, shape, the host's bounds, the host's wording) before anything is kept, and returns the
    event as the host accepted it (for live forwarding). A bound crossed raises
    `MessageTooLarge` after keeping what fits; anything malformed, out of order or
    contradictory raises `WorkerMisbehaved`. Either way the caller kills the worker.

    What a worker says about its refusals is checked too (docs/denials.md, "What the host
    checks"): with the host's `Policy`, hints are re-derived from the rule and target by host
    templates (`_hints.host_hint`); the number of distinct refusals kept is bounded, the rest
    counted; "internal" is only ever a presentation downgrade and is withdrawn for a refusal
    that shows in the call's error or whose rule is never internal (`verdict()`); a call
    with an error is never ok.

    `policy` is the host's `Policy` (or only its name, for tests of the intake alone);
    `wall` the call's effective wall time (for a timeout's hint).
    """

    def __init__(
        self,
        decoder: Decoder | None = None,
        policy: Any = None,
        wall: float | None = None,
        *,
        bounds: HostBounds | None = None,
        call: int | None = None,
    ) -> None:
        self.decoder = decoder
        if policy is None or isinstance(policy, str):
            self.host_policy: Any = None
            self.policy: str = policy or ""
        else:
            self.host_policy = policy
            self.policy = str(policy.name)
        self.wall = wall
        if bounds is None and self.host_policy is not None:
            bounds = HostBounds.from_policy(policy)
        self.bounds = bounds or HostBounds()
        self.call = call
        self.order = StreamOrder()
        # Output is kept as UTF-8 (lone surrogates pass through), so the host's memory for
        # it is the bytes, not one object per event.
        self._output = {"stdout": bytearray(), "stderr": bytearray()}
        self.output_chars = 0
        self.events = 0
        self.denial_events = 0
        self.denial_chars = 0
        self.image_chars = 0
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

    @property
    def stdout(self) -> str:
        return self._output["stdout"].decode("utf-8", "surrogatepass")

    @property
    def stderr(self) -> str:
        return self._output["stderr"].decode("utf-8", "surrogatepass")

    def mark(self) -> Mark:
        """Where the call stands now (see `rollback`)."""
        return Mark(
            stdout=len(self._output["stdout"]),
            stderr=len(self._output["stderr"]),
            output_chars=self.output_chars,
            denials=tuple(self.denials),
            wire=len(self._wire),
            images=len(self.images),
            image_chars=self.image_chars,
            files=tuple(self.files),
            notices=len(self.notices),
            value=self.value,
            error=self.error,
            error_refusals=tuple(self._error_refusals),
        )

    def rollback(self, mark: Mark) -> None:
        """Withdraw what was kept since `mark` (events the host withheld), keeping the
        counts that bound the call: what the worker sent still counts against its bounds."""
        del self._output["stdout"][mark.stdout :]
        del self._output["stderr"][mark.stderr :]
        self.denials = list(mark.denials)
        self._positions = {d.key(): i for i, d in enumerate(self.denials)}
        del self._wire[mark.wire :]
        del self.images[mark.images :]
        del self.notices[mark.notices :]
        self.files = list(mark.files)
        self.value = mark.value
        self.error = mark.error
        self._error_refusals = list(mark.error_refusals)

    def withhold(self) -> None:
        """Drop the call's output, images, files and value (the worker was tampered with)."""
        self._output = {"stdout": bytearray(), "stderr": bytearray()}
        self.images.clear()
        self.files = []
        self.value = None

    # -- the host's view of a worker's refusals ------------------------------------------

    def _policy_wire(self) -> dict[str, Any]:
        if self._wire_policy is None:
            try:
                self._wire_policy = (
                    self.host_policy.model_dump(mode="json") if self.host_policy is not None else {}
                )
            except Exception:
                self._wire_policy = {}
        return self._wire_policy

    def _host_hint(self, rule: str, target: str, worker_hint: str) -> str:
        from agent_sandbox._hints import host_hint

        return host_hint(rule, target, worker_hint, self._policy_wire(), timeout=self.wall)

    def _check(self, data: Any, *, nested: bool = True) -> Denial:
        """A worker's refusal as the host shows it: checked, host-worded, host hint."""
        hint = self._host_hint if self.host_policy is not None else None
        denial = check_denial(data, self.policy, hint=hint, nested=nested)
        if denial.internal and denial.rule.startswith(_NEVER_INTERNAL):
            denial = dataclasses.replace(denial, internal=False)
        return denial

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
            old, count=min(old.count + denial.count, MAX_COUNT), last=denial.last or denial
        )
        return pos

    def add(self, kind: str, data: Any) -> tuple[str, Any] | None:
        """Judge and keep one event; returns it as accepted (None: nothing to forward)."""
        self.events += 1
        if self.events > self.bounds.events:
            raise over("the worker's events in one call", self.events, self.bounds.events)
        self.order.step(kind)
        handler = getattr(self, "_on_" + kind, None)
        if handler is None:  # pragma: no cover - the parser knows every kind
            raise WorkerMisbehaved(f"the worker sent an unknown event kind {kind!r}")
        result: tuple[str, Any] | None = handler(data)
        # Each kind has its own bound; their sum is the call's total (checked all the same).
        kept = self.output_chars + self.denial_chars + self.image_chars + 1024 * len(self.notices)
        if kept > self.bounds.total:
            raise over("what the host kept of one call", kept, self.bounds.total)
        return result

    # -- one handler per kind ------------------------------------------------------------

    def _on_start(self, data: Any) -> None:
        if not isinstance(data, dict) or set(data) != {"call"} or type(data["call"]) is not int:
            raise WorkerMisbehaved("the worker's `start` event is malformed")
        # The worker may count fewer calls than the host (a call cancelled before it ran),
        # never more.
        if self.call is not None and not 1 <= data["call"] <= self.call:
            raise WorkerMisbehaved(
                f"the worker says this is its call {data['call']}, the host sent {self.call}"
            )
        return None  # framing only: not forwarded

    def _on_stdout(self, data: Any) -> tuple[str, Any]:
        return self._output_event("stdout", data)

    def _on_stderr(self, data: Any) -> tuple[str, Any]:
        return self._output_event("stderr", data)

    def _output_event(self, kind: str, data: Any) -> tuple[str, Any]:
        if not isinstance(data, str):
            raise WorkerMisbehaved(f"the worker's {kind} event is not text")
        room = self.bounds.output_chars - self.output_chars
        if len(data) > room:
            kept = data[: max(room, 0)]
            self._output[kind] += kept.encode("utf-8", "surrogatepass")
            self.output_chars += len(kept)
            raise over(
                "the worker's stdout and stderr",
                self.output_chars - len(kept) + len(data),
                self.bounds.output_chars,
            )
        self._output[kind] += data.encode("utf-8", "surrogatepass")
        self.output_chars += len(data)
        return kind, data

    def _on_denial(self, data: Any) -> tuple[str, Any]:
        denial = self._check(data)
        if self.denial_events >= self.bounds.denials:
            raise over(
                "the worker's denials (a count)", self.denial_events + 1, self.bounds.denials
            )
        self.denial_events += 1
        self.denial_chars += denial_chars(denial)
        if self.denial_chars > self.bounds.denial_chars:
            raise over("the worker's denials", self.denial_chars, self.bounds.denial_chars)
        self._wire.append(self.add_denial(denial))
        return "denial", denial.to_dict()

    def _on_counts(self, data: Any) -> tuple[str, Any]:
        """How often each streamed refusal happened, with its last occurrence (after the
        call). Each entry is `[n, count, last]`: the worker's n-th denial event of the call."""
        if not isinstance(data, list) or len(data) > len(self._wire):
            raise WorkerMisbehaved("the worker's `counts` event is malformed")
        accepted = []
        for item in data:
            if not (isinstance(item, list) and len(item) == 3):
                raise WorkerMisbehaved("the worker's `counts` event is malformed")
            index, count, raw_last = item
            if type(index) is not int or not 0 <= index < len(self._wire):
                raise WorkerMisbehaved("the worker's `counts` event names no denial of this call")
            if type(count) is not int or not 1 <= count <= MAX_COUNT:
                raise WorkerMisbehaved("the worker's `counts` event has a malformed count")
            last = self._check(raw_last, nested=False)
            pos = self._wire[index]
            old = self.denials[pos]
            if last.rule != old.rule:
                raise WorkerMisbehaved("the worker's `counts` event mixes up two rules")
            self.denial_chars += denial_chars(last)
            if self.denial_chars > self.bounds.denial_chars:
                raise over("the worker's denials", self.denial_chars, self.bounds.denial_chars)
            self.denials[pos] = dataclasses.replace(old, count=max(old.count, count), last=last)
            accepted.append([index, count, last.to_dict()])
        return "counts", accepted

    def _on_internal(self, data: Any) -> tuple[str, Any]:
        if not isinstance(data, list) or len(data) > len(self._wire):
            raise WorkerMisbehaved("the worker's `internal` event is malformed")
        for i in data:
            if type(i) is not int or not 0 <= i < len(self._wire):
                raise WorkerMisbehaved("the worker's `internal` event names no denial of this call")
            pos = self._wire[i]
            if not self.denials[pos].rule.startswith(_NEVER_INTERNAL):
                self.denials[pos] = dataclasses.replace(self.denials[pos], internal=True)
        return "internal", data

    def _on_image(self, data: Any) -> tuple[str, Any]:
        if (
            not isinstance(data, dict)
            or set(data) != {"name", "mime", "data"}
            or not all(isinstance(v, str) for v in data.values())
        ):
            raise WorkerMisbehaved("the worker's `image` event is malformed")
        if data["mime"] != "image/png" or not _BASE64.fullmatch(data["data"]):
            raise WorkerMisbehaved("the worker's image is not base64 PNG data")
        if len(self.images) >= self.bounds.images:
            raise over("the worker's images (a count)", len(self.images) + 1, self.bounds.images)
        self.image_chars += len(data["data"])
        if self.image_chars > self.bounds.image_chars:
            raise over(
                "the worker's images",
                self.image_chars,
                self.bounds.image_chars,
                "limits.result_bytes",
            )
        image = Image(clean_text(data["name"], 255), "image/png", data["data"])
        self.images.append(image)
        return "image", image.to_dict()

    def _on_files(self, data: Any) -> tuple[str, Any]:
        if not isinstance(data, list) or len(data) > self.bounds.files:
            raise WorkerMisbehaved("the worker's `files` event is malformed")
        files = []
        for entry in data:
            if (
                not isinstance(entry, dict)
                or set(entry) != {"name", "size"}
                or not isinstance(entry["name"], str)
                or type(entry["size"]) is not int
                or entry["size"] < 0
            ):
                raise WorkerMisbehaved("the worker's `files` event is malformed")
            files.append({"name": clean_text(entry["name"], 255), "size": entry["size"]})
        self.files = files
        return "files", files

    def _on_notice(self, data: Any) -> tuple[str, Any]:
        text = render_notice(data)
        if len(self.notices) >= self.bounds.notices:
            raise over("the worker's notices (a count)", len(self.notices) + 1, self.bounds.notices)
        self.notices.append(text)
        return "notice", text

    def _on_result(self, data: Any) -> tuple[str, Any]:
        if not isinstance(data, dict):
            raise WorkerMisbehaved("the worker's `result` event is malformed")
        if set(data) == {"encoding", "pickle"}:
            self._decode_value(data)
        elif set(data) == {"value"}:
            self.value = data["value"]
        else:
            raise WorkerMisbehaved("the worker's `result` event is malformed")
        return "result", data

    def _on_error(self, data: Any) -> tuple[str, Any]:
        hint = self._host_hint if self.host_policy is not None else None
        self.error = check_error(data, self.decoder, self.notices, self.policy, hint=hint)
        # The refusals the error carries (its exception chain's): the user's (`verdict()`).
        self._error_refusals = [self._check(r, nested=False) for r in data.get("refusals", ())]
        return "error", data

    def _on_done(self, data: Any) -> tuple[str, Any]:
        if (
            not isinstance(data, dict)
            or not set(data) <= {"duration", "discard", "denials"}
            or type(data.get("discard", False)) is not bool
            or type(data.get("denials", 0)) is not int
            or not isinstance(data.get("duration", 0.0), int | float)
            or isinstance(data.get("duration"), bool)
        ):
            raise WorkerMisbehaved("the worker's `done` event is malformed")
        self.done = True
        self.discard = bool(data.get("discard"))
        return "done", data

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
        from agent_sandbox._host.intake.unpickle import Decoder

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
            stdout=self.stdout,
            stderr=self.stderr,
            value=self.value,
            error=self.error,
            denials=tuple(self.denials),
            images=tuple(self.images),
            files=tuple(self.files),
            notices=tuple(self.notices) + tuple(fields.pop("notices", ())),
            **fields,
        )


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
#: The error kinds a worker may report (`crashed` is only ever the host's verdict).
_WORKER_ERROR_KINDS = frozenset({"exception", "syntax", "denied", "limit", "internal"})
_ERROR_KEYS = frozenset(
    {
        "kind",
        "type",
        "message",
        "traceback",
        "rule",
        "line",
        "column",
        "text",
        "denial",
        "exception",
        "refusals",
    }
)
_TYPE_NAME = re.compile(r"[\w.<>\[\]]{1,200}")  # a dotted class path (`f.<locals>.E`)


def check_error(
    data: Any,
    decoder: Decoder | None,
    notices: list[str],
    policy: str,
    *,
    hint: HintMaker | None = None,
) -> RunError:
    """The worker's `error` event, judged: its shape, its kind, and the host's wording.

    For a refusal or a limit, the message the model may read is the host's: the checked
    denial's message, or the rule's catalogue line with the worker's text quoted. For an
    internal failure, the worker's words are quoted as its report.
    """
    if not isinstance(data, dict) or not set(data) <= _ERROR_KEYS:
        raise WorkerMisbehaved("the worker's `error` event is malformed")
    kind = data.get("kind", "exception")
    if kind not in _WORKER_ERROR_KINDS:
        raise WorkerMisbehaved(f"the worker reported an error of kind {quote(str(kind), 40)}")
    for key in ("type", "message", "traceback", "text"):
        if key in data and not isinstance(data[key], str):
            raise WorkerMisbehaved(f"the worker's error has a {key!r} that is not text")
    for key in ("line", "column"):
        value = data.get(key)
        if value is not None and type(value) is not int:
            raise WorkerMisbehaved(f"the worker's error has a {key!r} that is not a number")
    if "type" in data and not _TYPE_NAME.fullmatch(data["type"]):
        raise WorkerMisbehaved("the worker's error names a malformed exception type")
    rule = data.get("rule")
    if rule is not None and (not isinstance(rule, str) or rule not in RULES):
        raise WorkerMisbehaved("the worker's error names an unknown rule")
    refusals = data.get("refusals", [])
    if not isinstance(refusals, list) or len(refusals) > MAX_ERROR_REFUSALS:
        raise WorkerMisbehaved("the worker's error carries a malformed list of refusals")
    for refusal in refusals:
        check_denial(refusal, policy, nested=False)
    if kind in ("denied", "limit") and rule is None:
        raise WorkerMisbehaved(f"the worker reported a {kind!r} error without its rule")
    message = str(data.get("message", ""))
    if kind in ("denied", "limit"):
        assert isinstance(rule, str)
        if "denial" in data:
            denial = check_denial(data["denial"], policy, hint=hint)
            if denial.rule != rule:
                raise WorkerMisbehaved("the worker's error and its denial name different rules")
            message = denial.message()
        else:
            message = f"[{rule}] {rule_doc(rule)}" + (
                f" (the worker's message: {quote(message)})" if message else ""
            )
    elif kind == "internal":
        message = f"the worker reported a failure of its own: {quote(message)}"
    elif "denial" in data:
        raise WorkerMisbehaved("the worker's error carries a denial but is not a refusal")
    fixed = {**data, "message": message}
    return error_from_wire(fixed, decoder, notices)


def error_from_wire(
    data: dict[str, Any], decoder: Decoder | None = None, notices: list[str] | None = None
) -> RunError:
    """Build a RunError from the worker's `error` event, tolerating missing fields.

    The `exception` entry (see `agent_sandbox._worker.objects`) is rebuilt into a host exception by
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
    from agent_sandbox._host.intake.unpickle import Decoder

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
