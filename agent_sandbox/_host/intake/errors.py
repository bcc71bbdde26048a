"""The worker's `error` event, judged: its shape, its kind, the host's wording, its exception.

`check_error` refuses a malformed event (`WorkerMisbehaved`) and words a refusal or a limit
in the host's voice; `error_from_wire` builds the `RunError`, with the worker's exception
rebuilt by the decoder (`agent_sandbox._host.intake.unpickle`): its rich form only in
objects mode, else from its primitive descriptor.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from agent_sandbox._denial import RULES, rule_doc
from agent_sandbox._host.intake.events import (
    MAX_ERROR_REFUSALS,
    HintMaker,
    WorkerMisbehaved,
    check_denial,
    quote,
)
from agent_sandbox._host.result import RunError

if TYPE_CHECKING:
    from agent_sandbox._host.intake.unpickle import Decoder

__all__ = ["check_error"]
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
        "proxy_refusals",
        "memory",
    }
)
#: The longest proxy refusal line a worker's error may carry (`_denial.refusal_line`'s own
#: bound is 2,048 characters).
MAX_MARKED_CHARS = 4096
#: The most a worker's memory report may name (bytes): beyond it the number is not used.
MAX_MEMORY_REPORT = 1 << 50
_TYPE_NAME = re.compile(r"[\w.<>\[\]]{1,200}")  # a dotted class path (`f.<locals>.E`)


def check_error(
    data: Any,
    decoder: Decoder | None,
    notices: list[str],
    policy: str,
    *,
    hint: HintMaker | None = None,
    deadline: float | None = None,
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
    marked = data.get("proxy_refusals", [])
    if (
        not isinstance(marked, list)
        or len(marked) > MAX_ERROR_REFUSALS
        or not all(isinstance(m, str) and len(m) <= MAX_MARKED_CHARS for m in marked)
    ):
        raise WorkerMisbehaved("the worker's error carries a malformed list of proxy refusals")
    memory = data.get("memory")
    if memory is not None and (
        rule != "limits.memory"
        or not isinstance(memory, dict)
        or not set(memory) <= {"peak", "asked"}
        or any(type(v) is not int or not 0 <= v <= MAX_MEMORY_REPORT for v in memory.values())
    ):
        raise WorkerMisbehaved("the worker's error carries a malformed memory report")
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
    return error_from_wire(fixed, decoder, notices, deadline)


def error_from_wire(
    data: dict[str, Any],
    decoder: Decoder | None = None,
    notices: list[str] | None = None,
    deadline: float | None = None,
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
        **_rebuild(data.get("exception"), decoder, notices, deadline),
    )


def _rebuild(
    payload: Any, decoder: Decoder | None, notices: list[str] | None, deadline: float | None
) -> dict[str, Any]:
    if not isinstance(payload, dict):
        return {}
    from agent_sandbox._errors import UnpickleRefused
    from agent_sandbox._host.intake.unpickle import Decoder

    try:
        rebuilt = (decoder or Decoder(objects=False)).rebuild_exception(payload, deadline)
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
