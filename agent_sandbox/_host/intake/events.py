"""The host's judgement of what a worker sends during one call: order, shape, bounds, voice.

The worker may be compromised (see "What stays as trustworthy as the worker" in
`docs/architecture.md`), so nothing it sends is taken on its word:

* **Order.** A call's stream is `start`, then output (`stdout`, `stderr`, `denial`,
  `image`, `files`, `notice`), then exactly one outcome (`result` or `error`), then the
  after-call events (`internal`, `denial`, late `stdout`/`stderr` from threads the code
  left running, `counts`, `notice`), then `done`, last. Anything else (an unknown kind, a result
  before `start`, two outcomes, anything after `done`, a second `files`) is a
  `WorkerMisbehaved`.
* **Shape.** Every event's data is checked field by field: types, known keys only, rule
  names from the host's catalogue (`RULES`), actions as short lowercase words.
* **Bounds** (`HostBounds`, from the policy's limits, independent of the worker's own):
  characters of stdout+stderr, number of events, number and size of denials, images,
  files and notices, the size of the outcome, and the total kept per call. Past a bound
  the host raises `MessageTooLarge`; the caller stops reading and kills the worker.
* **Voice.** Text the model reads in the sandbox's voice is host text: a notice is a
  code from `NOTICES` plus typed data fields that the host renders; a denial's rule and
  policy name are the host's, its target is quoted data, its detail is shown as the
  sandbox's words only when it has the shape of one the guards write (`shapes().detail`),
  and otherwise as the worker's quoted, unverified words; the same for a hint
  (`shapes().hint`). Control characters in worker strings are escaped before they are kept.

Standard library only; used by `agent_sandbox._host.intake.builder.ResultBuilder`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

from agent_sandbox._denial import BETWEEN_CALLS, DURING_CALL, RULES, Denial
from agent_sandbox._errors import MessageTooLarge, TransportError
from agent_sandbox._hints import METADATA_REFUSED

__all__ = [
    "shapes",
    "HostBounds",
    "NOTICES",
    "StreamOrder",
    "WorkerMisbehaved",
    "clean_text",
    "render_notice",
    "check_denial",
]

#: How many images one call may return (the worker keeps to the same number).
MAX_IMAGES = 8
#: How many denials one call may report (the worker records at most 1000, plus tampering).
MAX_DENIALS = 1024
#: The characters of all denials of one call (targets, details and hints together).
MAX_DENIAL_CHARS = 2_000_000
#: Entries of the `files` event (the worker lists at most 100).
MAX_FILES = 100
#: Notices one call may carry.
MAX_NOTICES = 16
#: The most times one refusal can be counted in one call (as the worker's own tally caps it).
MAX_COUNT = 10**15
#: Entries of the error's `refusals` (the worker sends at most 10: the exception chain's).
MAX_ERROR_REFUSALS = 16
#: The largest `start`, `done`, `denial`, `notice`, `internal` or `files` event, in bytes.
SMALL_EVENT_BYTES = 256 * 1024
#: Longest kept target, detail and hint of a denial (longer ones are cut, marked).
MAX_FIELD_CHARS = 4096
#: JSON can escape one character as `\\u00XX`: six bytes on the wire for one kept.
_JSON_EXPANSION = 6
_SLACK = 64 * 1024


class WorkerMisbehaved(TransportError):
    """The worker sent something malformed, out of order or contradictory (host wording)."""


#: The largest host-tool request one event may carry (its JSON arguments).
HOST_CALL_BYTES = 1_000_000


@dataclasses.dataclass(frozen=True)
class HostBounds:
    """What the host keeps from one call at most, from the policy's limits.

    `output_chars` is `limits.output_bytes` (the worker counts UTF-8 bytes, and a string
    has at most as many characters as bytes, so an honest worker never reaches it);
    `result_bytes` is `limits.result_bytes` for the outcome event and, separately, for the
    base64 text of all images together. The rest are fixed ceilings.
    """

    output_chars: int = 1_000_000
    result_bytes: int = 4_000_000
    images: int = MAX_IMAGES
    denials: int = MAX_DENIALS
    denial_chars: int = MAX_DENIAL_CHARS
    notices: int = MAX_NOTICES
    files: int = MAX_FILES
    image_pixels: int = 16_777_216
    image_frames: int = 1

    @classmethod
    def from_policy(cls, policy: Any) -> HostBounds:
        limits = policy.limits
        return cls(
            output_chars=int(limits.output_bytes),
            result_bytes=int(limits.result_bytes),
            image_pixels=int(limits.image_pixels),
            image_frames=int(limits.image_frames),
        )

    @property
    def image_chars(self) -> int:
        """The base64 characters of all images of one call."""
        return self.result_bytes

    @property
    def events(self) -> int:
        """Events of one call: an honest stdout/stderr event carries at least a character."""
        return self.output_chars + self.denials + self.images + self.notices + 16

    @property
    def total(self) -> int:
        """What the host keeps of one call, at most (characters and bytes together)."""
        return (
            self.output_chars
            + self.result_bytes
            + self.image_chars
            + self.denial_chars
            + self.notices * 1024
            + self.files * 512
        )

    def kind_caps(self) -> dict[str, tuple[int, str]]:
        """The largest wire event of each kind, for `SSEParser` (with the setting to raise)."""
        output = self.output_chars * _JSON_EXPANSION + _SLACK
        outcome = self.result_bytes + 4 * _SLACK
        small = SMALL_EVENT_BYTES
        return {
            "stdout": (output, "limits.output_bytes"),
            "stderr": (output, "limits.output_bytes"),
            "result": (outcome, "limits.result_bytes"),
            "error": (outcome, "limits.result_bytes"),
            "image": (self.image_chars + _SLACK, "limits.result_bytes"),
            "start": (small, "limits.output_bytes"),
            "done": (small, "limits.output_bytes"),
            "denial": (small, "limits.output_bytes"),
            "internal": (small, "limits.output_bytes"),
            # One entry per distinct refusal counted more than once, each with its last
            # occurrence in full: bounded like all the call's denials together.
            "counts": (self.denial_chars * 2 + _SLACK, "limits.output_bytes"),
            "notice": (small, "limits.output_bytes"),
            "files": (small, "limits.output_bytes"),
            "host_call": (HOST_CALL_BYTES, "limits.output_bytes"),
        }

    def max_event_bytes(self) -> int:
        return max(cap for cap, _ in self.kind_caps().values())


def over(what: str, size: int, cap: int, setting: str = "limits.output_bytes") -> MessageTooLarge:
    """The error for a host bound crossed (the caller kills the worker)."""
    return MessageTooLarge(what, size, cap, setting)


# -- order -------------------------------------------------------------------------------

_OUTPUT = frozenset({"stdout", "stderr", "denial", "image", "files", "notice"})
_AFTER = frozenset({"stdout", "stderr", "denial", "internal", "counts", "notice"})


class StreamOrder:
    """The order of one call's events (see the module docstring); raises WorkerMisbehaved."""

    def __init__(self) -> None:
        self.phase = "new"  # new -> running -> finished -> done
        self.seen: set[str] = set()

    def step(self, kind: str) -> None:
        phase = self.phase
        if phase == "done":
            raise WorkerMisbehaved(f"the worker sent a {kind!r} event after `done`")
        if kind == "start":
            if phase != "new":
                raise WorkerMisbehaved("the worker started the same call twice")
            self.phase = "running"
            return
        if phase == "new":
            raise WorkerMisbehaved(f"the worker sent a {kind!r} event before `start`")
        if kind == "done":
            if phase != "finished":
                raise WorkerMisbehaved("the worker ended the call without a result or an error")
            self.phase = "done"
            return
        if kind in ("result", "error"):
            if phase != "running":
                raise WorkerMisbehaved("the worker sent two outcomes for one call")
            self.phase = "finished"
            return
        allowed = _OUTPUT if phase == "running" else _AFTER
        if kind not in allowed:
            raise WorkerMisbehaved(f"the worker sent a {kind!r} event out of order")
        if kind in ("files", "internal", "counts"):
            if kind in self.seen:
                raise WorkerMisbehaved(f"the worker sent a second {kind!r} event")
            self.seen.add(kind)


# -- text --------------------------------------------------------------------------------

# C0 and C1 controls, DEL, line and paragraph separators, bidirectional overrides and
# isolates, zero-width characters and the BOM: none of them may reach the model raw.
_CONTROL_CHARS = "\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"
_CONTROL = re.compile("[" + _CONTROL_CHARS + "]")


def clean_text(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """`text` with control characters escaped (`\\x0a`, `\\u202e`) and cut at `limit`."""
    if len(text) > limit:
        text = text[:limit] + f"...<{len(text) - limit} more characters>"
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def quote(text: str, limit: int = 200) -> str:
    """`text` as quoted data for a sentence the host writes (repr escapes every control)."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return ascii(text) if _CONTROL.search(text) else repr(text)


# -- notices -----------------------------------------------------------------------------

#: The notices a worker may send: code -> (host template, the data fields and their types).
NOTICES: dict[str, tuple[str, dict[str, type]]] = {
    "images.dropped": (
        "{count} image(s) were not attached: a call returns at most {max_images} images "
        "and {max_chars} characters of them",
        {"count": int, "max_images": int, "max_chars": int},
    ),
}


def render_notice(data: Any) -> str:
    """The host's text for a worker's notice `{"code": ..., "data": {...}}`."""
    if not isinstance(data, dict) or set(data) != {"code", "data"}:
        raise WorkerMisbehaved("the worker sent a notice that is not a code with its data")
    code, fields = data["code"], data["data"]
    if not isinstance(code, str) or code not in NOTICES:
        shown = quote(code, 60) if isinstance(code, str) else type(code).__name__
        raise WorkerMisbehaved(f"the worker sent a notice with an unknown code {shown}")
    template, types = NOTICES[code]
    if not isinstance(fields, dict) or set(fields) != set(types):
        raise WorkerMisbehaved(f"the worker's {code!r} notice does not carry its data fields")
    values: dict[str, str] = {}
    for name, kind in types.items():
        value = fields[name]
        if kind is int:
            if type(value) is not int or not 0 <= value < 2**53:
                raise WorkerMisbehaved(f"the worker's {code!r} notice has a bad {name!r}")
            values[name] = str(value)
        else:
            if not isinstance(value, str):
                raise WorkerMisbehaved(f"the worker's {code!r} notice has a bad {name!r}")
            values[name] = quote(value)
    return template.format(**values)


# -- denials -----------------------------------------------------------------------------

#: An action is a verb of a few lowercase words (`read`, `connect`, `format field`), or
#: `*` for the refusals counted per rule past the worker's bound on distinct ones.
_ACTION = r"\*|(?=.{1,24}$)[a-z][a-z0-9_.-]*(?: [a-z][a-z0-9_.-]*){0,2}"
_FIELD_TYPES: dict[str, str] = dict(Denial.__annotations__)  # field -> its type, as written
_NOT = _CONTROL_CHARS
# One quoted data slot (a repr, a TOML string or a code span; backslash escapes allowed),
# holding no control character.
_Q = f"(?:'(?:[^'\\\\{_NOT}]|\\\\[^{_NOT}])*'|\"(?:[^\"\\\\{_NOT}]|\\\\[^{_NOT}])*\"|`[^`{_NOT}]*`)"
_N = r"[0-9]+(?:\.[0-9]+)?"


def _fill(pattern: str) -> str:
    return pattern.replace("Q", _Q).replace("N", _N)


#: The shapes of the details the guards write: fixed words around quoted or numeric data
#: (`Q`, `N`). A detail of another shape is still shown, as the worker's quoted words.
_DETAIL_PATTERNS = (
    # files
    r"the name matches Q in \[files\] hide, so it looks absent",
    r"the worker's control directory \(its socket and log\) is never reachable from user code",
    r"the policy file is never writable from inside the sandbox",
    r"Q is listed in \[files\] deny, which beats every grant",
    r"the path is outside \[files\] write \(only the scratch directory is writable unless "
    r"the policy says more\)",
    r"the path is outside \[files\] read",
    r"the landlock provider refuses every change of a file's mode, owner, times or extended "
    r"attributes \(Landlock cannot judge them\), inside the grants too; in scratch the "
    r"host makes os\.chmod, os\.utime and a same-owner os\.chown of a path",
    # the refusal trail's folds (`_denial.fold_detail`)
    r"past the first N distinct (?:sensitive )?targets of this rule in one call, further "
    r"refusals are counted here \(count: how many; last: the latest, in full\)",
    # imports, calls, environment
    r"Q is listed in \[imports\] deny, which beats \[imports\] allow",
    r"the module is not in \[imports\] allow",
    r"Q is listed in \[api\] deny, which beats \[api\] allow",
    r"[\w.]+ is a sensitive call \([\w-]+\) the policy does not grant",
    # host tools (the host's own words, relayed by the worker's stub)
    r"the tool is not in \[tools\] allow",
    r"the tool did not return within N s \(\[tools\] timeout_seconds\)",
    r"the variable exists on the host but the policy does not pass it",
    # network
    r"not an IP address",
    r"a deny rule for Q matches, and deny beats allow",
    r"no \[net\] rule allows [a-z]+ [a-z]+ to this address",
    r"no \[net\] rule names this host, so it is not resolved \(names are pinned when the "
    r"policy loads\)",
    r"a \[net\] rule names this host but it did not resolve when the policy loaded, so it "
    r"reaches nothing",
    r"abstract Unix sockets are never allowed",
    r"only IPv4, IPv6 and Unix sockets are judged; other families are refused",
    # limits, results and the worker
    r"the call printed more than N bytes; further output was refused and the worker "
    r"is replaced \(its variables are lost\)",
    r"the encoded result is N bytes, above the cap of N bytes; it was refused, not "
    r"truncated \(return a smaller value or write it to a file\)",
    r"a guard was disarmed or displaced; this worker will be discarded",
    # the code layer's budgets
    r"an allocation of about N bytes exceeds the code budget max_allocation = N",
    r"the object behind an AttributeError is not readable in the sub-language",
    r"the call ran more than N loop iterations \(code budget max_iterations = N\)",
    r"calls nested deeper than N frames \(code budget max_call_depth = N\)",
)
#: The code layer's checks, after `line N, column N: ` (static) or `at run time: `.
_CODE_PATTERNS = (
    r"Q reaches interpreter internals; no policy can grant it",
    r"the dunder Q is not granted",
    r"the attribute Q is not in the sub-language",
    r"Q is reserved; no policy can grant binding it",
    r"binding the dunder Q is not granted",
    r"the dunder name Q is not granted",
    r"the name Q is denied by Q",
    r"Q exposes a whole namespace and is not granted",
    r"the name Q is not in the sub-language",
    r"Q syntax has no rule in this checker and is refused",
    r"Q(?: syntax| \(exception groups\))? is not in the sub-language",
    r"Q is reserved",
    r"the keyword Q is reserved",
    r"a string naming Q, which reaches interpreter internals; no policy can grant it",
)
_CODE_WHERE = r"(?:line [0-9]+, column [0-9]+|at run time): (.*)"
#: The code layer's summary of a rejected cell: one line per violation.
_CODE_SUMMARY = (
    r"the code leaves the policy's sub-language in N places?; fix all of them and run "
    r"it again:\n(?:  line N, column N: Q: (?:"
    + "|".join(_CODE_PATTERNS)
    + r")(?: \(to allow it: [^\n]*\))?\n)+"
)
#: A file guard adds how the path was asked for.
_REQUESTED = r"(.*) \(requested as Q\)"
#: A hint is a policy line: `[section] key = value` (repeated for `[[net.rules]]`),
#: `[code] key: remove Q`, `remove Q from [section] key` or `remove the deny rule for Q
#: from [net] rules`; its values are data (quoted, lists of quoted, or numbers).
_HINT = (
    r"\[\[?[a-z_.]+\]\]?(?: [a-z_]+ (?:= (?:Q|N|\[(?:Q(?:, )?)*\])|: remove Q))+"
    r"|remove (?:the deny rule for )?Q from \[[a-z_.]+\](?: [a-z_]+)?"
)


class _Shapes:
    """The patterns above, compiled on first use: about 40 regular expressions, some large,
    which cost tens of milliseconds at import (every `import agent_sandbox`) while only a
    denial needs them."""

    def __init__(self) -> None:
        self.action = re.compile(_ACTION)
        self.detail = tuple(re.compile(_fill(p)) for p in _DETAIL_PATTERNS)
        self.code = tuple(re.compile(_fill(p)) for p in _CODE_PATTERNS)
        self.code_where = re.compile(_CODE_WHERE)
        self.code_summary = re.compile(_fill(_CODE_SUMMARY))
        self.requested = re.compile(_fill(_REQUESTED))
        self.hint = re.compile(_fill(_HINT))


@functools.cache
def shapes() -> _Shapes:
    """The compiled shapes: `.detail` (the guards' details), `.code` (the code layer's),
    `.hint` (a policy line), and the helpers."""
    return _Shapes()


def _detail_is_the_sandboxes(detail: str) -> bool:
    """Whether `detail` has the shape of one the guards write (data slots hold no control)."""
    compiled = shapes()
    if compiled.code_summary.fullmatch(detail):
        return True
    match = compiled.requested.fullmatch(detail)
    if match is not None:
        detail = match.group(1)
    if any(shape.fullmatch(detail) for shape in compiled.detail):
        return True
    match = compiled.code_where.fullmatch(detail)
    if match is not None:
        detail = match.group(1)
        if detail.startswith("at run time: "):
            detail = detail[len("at run time: ") :]
        return any(shape.fullmatch(detail) for shape in compiled.code)
    return False


#: Host hint maker: (rule, target, the worker's well-formed hint) -> the hint to show.
HintMaker = Callable[[str, str, str], str]
_CLASSIFICATIONS = ("user", "internal", "learned")


def _hint_is_well_formed(hint: str) -> bool:
    """A hint of a shape the guards write: a `[[grant]]` fragment or a policy line."""
    if not hint:
        return True
    if len(hint) > MAX_FIELD_CHARS:
        return False
    if hint == METADATA_REFUSED:
        return True
    if shapes().hint.fullmatch(hint):
        return True
    from agent_sandbox._hints import parse_grant

    return parse_grant(hint) is not None


def check_denial(
    data: Any, policy: str, *, hint: HintMaker | None = None, nested: bool = True
) -> Denial:
    """A denial the worker reported, judged and re-worded by the host (see the docstring).

    With `hint`, the hint shown is the host's own (`_hints.host_hint`), made from the rule,
    the target and the host's policy; the worker's hint is read only when it is well formed
    (a `[[grant]]` fragment or a policy line), and one of another shape is kept only as the
    worker's quoted, unverified words. `count`, `origin`, `classification` and `last` (one
    level deep when `nested`) are checked too.
    """
    if not isinstance(data, dict):
        raise WorkerMisbehaved("the worker sent a denial that is not an object")
    unknown = set(data) - set(_FIELD_TYPES) - {"classification"}
    if unknown:
        raise WorkerMisbehaved(
            "the worker sent a denial with unknown fields "
            + ", ".join(sorted(quote(k, 40) for k in unknown))
        )
    for name, value in data.items():
        if name in ("count", "last", "classification"):
            continue
        want = bool if _FIELD_TYPES[name] in ("bool", bool) else str
        if type(value) is not want:
            raise WorkerMisbehaved(
                f"the worker sent a denial whose {name!r} is not a {want.__name__}"
            )
    rule = data.get("rule")
    if not isinstance(rule, str) or rule not in RULES:
        shown = quote(rule, 60) if isinstance(rule, str) else "none"
        raise WorkerMisbehaved(f"the worker sent a denial with an unknown rule {shown}")
    action = data.get("action", "")
    if not shapes().action.fullmatch(action):
        raise WorkerMisbehaved(
            f"the worker sent a denial with a malformed action {quote(action, 60)}"
        )
    count = data.get("count", 1)
    if type(count) is not int or not 1 <= count <= MAX_COUNT:
        raise WorkerMisbehaved("the worker sent a denial with a malformed count")
    origin = data.get("origin", DURING_CALL)
    if origin not in (DURING_CALL, BETWEEN_CALLS):
        raise WorkerMisbehaved("the worker sent a denial with an unknown origin")
    learned = bool(data.get("learned", False))
    internal = bool(data.get("internal", False))
    if "classification" in data:
        said = data["classification"]
        derived = "learned" if learned else "internal" if internal else "user"
        if said not in _CLASSIFICATIONS or said != derived:
            raise WorkerMisbehaved("the worker sent a denial whose classification contradicts it")
    last: Denial | None = None
    raw_last = data.get("last")
    if raw_last is not None:
        if not nested:
            raise WorkerMisbehaved("the worker sent a denial nested more than one level")
        last = check_denial(raw_last, policy, hint=hint, nested=False)
        if last.rule != rule:
            raise WorkerMisbehaved("the worker sent a denial whose last occurrence is another rule")
    # The shapes are matched on the worker's own text, whose data slots may hold no
    # control character; anything else is kept only escaped, quoted and attributed.
    detail = data.get("detail", "")
    if len(detail) > MAX_FIELD_CHARS * 4 or not _detail_is_the_sandboxes(detail):
        detail = clean_text(detail)
        if detail:
            detail = f"the worker reported (unverified): {quote(detail, MAX_FIELD_CHARS)}"
    raw_target = data.get("target", "")
    target = clean_text(raw_target)
    shown_hint = data.get("hint", "")
    well_formed = (
        _hint_is_well_formed(shown_hint)
        if hint is not None
        else len(shown_hint) <= MAX_FIELD_CHARS
        and (shown_hint == METADATA_REFUSED or bool(shapes().hint.fullmatch(shown_hint)))
    )
    if not well_formed:
        shown_hint = clean_text(shown_hint)
        if shown_hint:
            extra = f"the worker suggested (unverified): {quote(shown_hint, MAX_FIELD_CHARS)}"
            detail = f"{detail}; {extra}" if detail else extra
            shown_hint = ""
    elif hint is not None:
        # The host never shows a worker's hint as sent: it makes its own, for the target
        # as it is (a grant of the escaped text would name another path).
        shown_hint = (
            hint(rule, raw_target, shown_hint) if len(raw_target) <= MAX_FIELD_CHARS else ""
        )
    return Denial(
        rule=rule,
        action=action,
        target=target,
        policy=policy,
        hint=shown_hint,
        detail=detail,
        learned=learned,
        internal=internal,
        count=count,
        origin=origin,
        last=last,
    )


def denial_chars(denial: Denial) -> int:
    own = len(denial.target) + len(denial.detail) + len(denial.hint) + len(denial.action) + 64
    return own + (denial_chars(denial.last) if denial.last is not None else 0)
