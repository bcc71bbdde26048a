"""How the host builds one call's `RunResult` from the events a worker sent.

`ResultBuilder` judges every event with `agent_sandbox._host.intake.events` (order, shape,
the host's bounds and wording) before it keeps anything; the worker's `error` event is
judged, and its exception rebuilt, by `agent_sandbox._host.intake.errors`.
"""

from __future__ import annotations

import binascii
import dataclasses
import re
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent_sandbox._denial import Denial, find_refusal, fold_detail, hide_token, is_sensitive
from agent_sandbox._host.intake.errors import check_error
from agent_sandbox._host.intake.events import (
    MAX_COUNT,
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
from agent_sandbox._host.intake.images import ImageRejected, image_info
from agent_sandbox._host.result import Image, RunError, RunResult

if TYPE_CHECKING:
    from agent_sandbox._host.intake.unpickle import Decoder

__all__ = ["Mark", "ResultBuilder"]


#: Distinct refusals the host keeps from one call, whatever a worker sends (past it, the
#: rest are counted per rule under `_OTHER_TARGETS`).
MAX_DENIALS = 256
MAX_SENSITIVE = 192
_OTHER_TARGETS = "(other targets)"
_OTHER_SENSITIVE = "(other sensitive targets)"
_FOLDS = frozenset({_OTHER_TARGETS, _OTHER_SENSITIVE})
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
    error_proxy: tuple[str, ...] = ()


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
    `wall` the call's effective wall time (for a timeout's hint); `deadline` the call's
    (a `time.monotonic` instant, `wall` from now by default): the long parses (an
    objects-mode result, an exception's rich form) look at it as they go and stop with a
    `TimeoutError` past it, which ends the call as its wall-clock limit does.
    """

    def __init__(
        self,
        decoder: Decoder | None = None,
        policy: Any = None,
        wall: float | None = None,
        *,
        bounds: HostBounds | None = None,
        call: int | None = None,
        deadline: float | None = None,
        proxy_token: str = "",
    ) -> None:
        self.decoder = decoder
        #: The worker's refusal token (`WorkerSetup.egress["token"]`), when it has a proxy.
        self._proxy_token = proxy_token
        if deadline is None and wall is not None:
            deadline = time.monotonic() + wall
        self.deadline = deadline
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
        # Computed once: the bounds are frozen, and `add` compares against these per event.
        self._max_events = self.bounds.events
        self._max_total = self.bounds.total
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
        self._kept = {False: 0, True: 0}  # distinct refusals kept: ordinary, sensitive
        self._wire: list[int] = []  # the worker's n-th denial event -> index in `denials`
        self._error_refusals: list[Denial] = []
        #: The proxy's refusals the worker's guard found, marked with its token, in the texts
        #: of the error's exceptions (`guards/_net_refusal.proxy_refusals`), and the refusals the
        #: host's egress proxy recorded in this call, with the worker's token
        #: (`add_proxy_denial`): see `verdict()`.
        self._error_proxy: list[str] = []
        self._proxy_keys: set[tuple[str, str]] = set()
        #: A MemoryError's `peak` and `asked` bytes as the worker reported them (its word).
        self.memory_report: dict[str, int] = {}
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
            error_proxy=tuple(self._error_proxy),
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
        self._error_proxy = list(mark.error_proxy)
        if mark.error is None:
            self.memory_report = {}

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
            denial = denial.replace(internal=False)
        return denial

    def add_denial(self, denial: Denial) -> int:
        """Keep one refusal (merged with the same one, bounded); returns its index.

        The host's own bound, whatever the worker folded: `MAX_DENIALS` distinct ordinary
        refusals and a reserve of `MAX_SENSITIVE` sensitive ones (`_denial.is_sensitive`);
        past them, refusals are folded per rule, the sensitive ones apart.
        """
        key = denial.key()
        pos = self._positions.get(key)
        if pos is None and denial.target not in _FOLDS:
            sensitive = is_sensitive(denial.rule, denial.target)
            budget = MAX_SENSITIVE if sensitive else MAX_DENIALS
            if self._kept[sensitive] >= budget:
                actual = denial.last or denial
                denial = denial.replace(
                    action="*",
                    target=_OTHER_SENSITIVE if sensitive else _OTHER_TARGETS,
                    detail=fold_detail(denial.rule, budget, sensitive),
                    hint="",
                    last=actual.replace(count=1, last=None),
                )
                key = denial.key()
                pos = self._positions.get(key)
            elif pos is None:
                self._kept[sensitive] += 1
        if pos is None:
            self._positions[key] = len(self.denials)
            self.denials.append(denial)
            return len(self.denials) - 1
        old = self.denials[pos]
        self.denials[pos] = old.replace(
            count=min(old.count + denial.count, MAX_COUNT), last=denial.last or denial
        )
        return pos

    def add_proxy_denial(self, denial: Denial) -> int:
        """Keep a refusal the host's egress proxy recorded for this call (`add_denial`).
        The call's error is taken for such a refusal only by the proxy's line with the
        worker's token (`verdict()`), never by its words alone: a server can write those."""
        self._proxy_keys.add((denial.rule, denial.target))
        return self.add_denial(denial)

    def add(self, kind: str, data: Any) -> tuple[str, Any] | None:
        """Judge and keep one event; returns it as accepted (None: nothing to forward)."""
        self.events += 1
        if self.events > self._max_events:
            raise over("the worker's events in one call", self.events, self._max_events)
        self.order.step(kind)
        # A table, not getattr(self, "_on_" + kind): Python 3.11's method cache keeps a
        # reference to the name of every lookup, placed by the name's address, so a name
        # built per event filled it with up to 4,096 dead strings (about 240 KB).
        handler = _HANDLERS.get(kind)
        if handler is None:  # pragma: no cover - the parser knows every kind
            raise WorkerMisbehaved(f"the worker sent an unknown event kind {kind!r}")
        result: tuple[str, Any] | None = handler(self, data)
        # Each kind has its own bound; their sum is the call's total (checked all the same).
        kept = self.output_chars + self.denial_chars + self.image_chars + 1024 * len(self.notices)
        if kept > self._max_total:
            raise over("what the host kept of one call", kept, self._max_total)
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
            self.denials[pos] = old.replace(count=max(old.count, count), last=last)
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
                self.denials[pos] = self.denials[pos].replace(internal=True)
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
        name = clean_text(data["name"], 255)
        refused = self._image_refusal(data["data"])
        if refused:
            # The code's own image, not the worker's breach: dropped, and the result says so.
            text = f"image {quote(name, 100)} was not returned: {refused}"
            if len(self.notices) >= self.bounds.notices:
                raise over(
                    "the worker's notices (a count)", len(self.notices) + 1, self.bounds.notices
                )
            self.notices.append(text)
            return "notice", text
        image = Image(name, "image/png", data["data"])
        self.images.append(image)
        return "image", image.to_dict()

    def _image_refusal(self, text: str) -> str:
        """Why an image may not be returned ("" when it may): what its headers declare."""
        try:
            info = image_info(binascii.a2b_base64(text))
        except (ImageRejected, binascii.Error, struct.error) as exc:
            return f"it is not an image the host can measure ({exc})"
        if info.format != "png":
            return f"it is {info.format.upper()} data, not the PNG it is named as"
        if info.pixels > self.bounds.image_pixels:
            return (
                f"it declares {info.width} x {info.height} pixels, more than "
                f"limits.image_pixels ({self.bounds.image_pixels})"
            )
        if info.frames > self.bounds.image_frames:
            return (
                f"it declares {info.frames} frames, more than "
                f"limits.image_frames ({self.bounds.image_frames})"
            )
        return ""

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
        self.error = check_error(
            data, self.decoder, self.notices, self.policy, hint=hint, deadline=self.deadline
        )
        if token := self._proxy_token:  # a client's text may quote a proxy line whole
            texts = {k: v for k in ("message", "traceback") if isinstance(v := data.get(k), str)}
            data = {**data, **{k: hide_token(v, token) for k, v in texts.items()}}
            error = self.error
            tb = hide_token(error.traceback, token)
            self.error = dataclasses.replace(
                error, message=hide_token(error.message, token), traceback=tb
            )
        # The refusals the error carries (its exception chain's): the user's (`verdict()`).
        self._error_refusals = [self._check(r, nested=False) for r in data.get("refusals", ())]
        self._error_proxy = list(data.get("proxy_refusals", ()))
        # A MemoryError's figures (checked above): the worker's word, for the hint's number.
        self.memory_report = dict(data.get("memory") or {})
        # The marked lines hold the worker's token: kept here, never passed on.
        return "error", {k: v for k, v in data.items() if k != "proxy_refusals"}

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
        in the error's text: a library turned it into the error the user's code got. For a
        refusal the host's egress proxy recorded, the text that counts is only the proxy's
        own refusal line, marked with this worker's token, as the worker's guard found it in
        a client's error (`proxy_refusals`): an allowed server's reason phrase can name any
        rule and target, never that token. An error of kind `exception` that carries a
        refusal becomes a refusal (`denied`).
        """
        error = self.error
        if error is None:
            return
        from agent_sandbox._render import quote

        text = f"{error.message}\n{error.traceback}"
        tokens = (self._proxy_token,) if self._proxy_token else ()
        genuine = [f[2] for line in self._error_proxy if (f := find_refusal(line, tokens))]
        carried = {(d.rule, d.target) for d in self._error_refusals}
        first: Denial | None = None
        for i, d in enumerate(self.denials):
            said = genuine if (d.rule, d.target) in self._proxy_keys else [text]
            shown = any(f"[{d.rule}]" in t and quote(d.target) in t for t in said)
            if (d.rule, d.target) in carried or (shown and d.target):
                if d.internal:
                    self.denials[i] = d.replace(internal=False)
                if not d.learned and first is None:
                    first = d
        if error.kind == "exception" and first is not None:
            limit = first.rule.startswith("limits.")
            message = error.message
            if not message.startswith(f"[{first.rule}]"):
                # The refusal first, with its hint, as the host recorded it; then what the
                # client library made of it (`('Connection aborted.', BadStatusLine(...`).
                message = RunError.refusal_first(first.message(), error.type, message)
            self.error = dataclasses.replace(
                error, kind="limit" if limit else "denied", rule=first.rule, message=message
            )

    def _decode_value(self, data: dict[str, Any]) -> None:
        """Decode an objects-mode value; a refusal becomes the call's error and a denial."""
        from agent_sandbox._errors import UnpickleRefused
        from agent_sandbox._hints import grant_hint
        from agent_sandbox._host.intake.unpickle import Decoder

        decoder = self.decoder or Decoder(objects=False)
        try:
            self.value = decoder.decode_value(data, self.deadline)
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
            stdout=hide_token(self.stdout, self._proxy_token),
            stderr=hide_token(self.stderr, self._proxy_token),
            value=self.value,
            error=self.error,
            denials=tuple(self.denials),
            images=tuple(self.images),
            files=tuple(self.files),
            notices=tuple(self.notices) + tuple(fields.pop("notices", ())),
            **fields,
        )


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


#: The handler of each event kind (`ResultBuilder.add`).
_HANDLERS: dict[str, Callable[[ResultBuilder, Any], tuple[str, Any] | None]] = {
    name[len("_on_") :]: handler
    for name, handler in vars(ResultBuilder).items()
    if name.startswith("_on_")
}
