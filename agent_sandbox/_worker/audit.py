"""The worker's denial recorder: every refusal is recorded, classified and counted here.

Recording comes before raising, so a refusal reaches the result even when user code swallows
the exception. Three things happen to each refusal:

1. **Classification** (docs/denials.md, "Whose refusal is it?"). A refusal is the user's when
   it changed what the user's code got: its exception, or an error a library made of it,
   reached a frame of user code. It is *internal* only when a library handled it and the
   user's code went on as if nothing had happened. The recorder decides this by watching the
   innermost user frame on the stack when the refusal is raised: if the next thing that frame
   sees is an exception, the refusal is the user's; if the library call it made returned
   normally (the frame runs its next line, or returns), the refusal was internal. The watch
   is a `sys.settrace` hook active only from the refusal until that call returns (no cost to
   calls without refusals). A refusal raised with no user frame on its stack (a library's own
   thread), or whose watch never resolved by the end of the call, is the user's: in doubt,
   the user's. A refusal raised straight into user code is the user's at once.
2. **Counting** into a bounded tally (`Tally`): every distinct (rule, action, target,
   classification, origin) keeps its first and last occurrence in full and a count; past
   `PER_RULE` distinct targets of a rule or `MAX_KEYS` in all, further refusals are folded
   per rule into one "(other targets)" entry whose count says how many; sensitive targets
   (credentials, keys, metadata addresses; process, network and limit rules) have a reserve
   of their own and a fold of their own, so a flood of harmless refusals can neither
   exhaust memory nor push an important one out.
3. **Attribution**: refusals recorded by a thread of the code between two calls are kept and
   handed to the next call, marked `between-calls`.

The host treats `internal` as a presentation downgrade only (agent_sandbox/_host/intake/builder.py):
it never makes a failed call succeed, and a refusal that shows up in the call's error is the
user's whatever the worker says.

Standard library only (the worker imports it before arming).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType

from agent_sandbox._denial import BETWEEN_CALLS, DURING_CALL, Denial, fold_detail, is_sensitive

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "MAX_KEYS",
    "MAX_SENSITIVE",
    "PER_RULE",
    "Tally",
    "begin_call",
    "end_call",
    "forget_raised",
    "record",
    "record_raised",
    "set_policy_name",
    "set_user_frame_test",
    "stamp",
    "take",
]

#: Distinct ordinary refusals kept in full per call and classification (beyond: folded per
#: rule), at most `PER_RULE` of one rule; sensitive ones have a reserve of `MAX_SENSITIVE`.
MAX_KEYS = 200
PER_RULE = 50
MAX_SENSITIVE = 64
_MAX_STACK = 400
_OTHER_TARGETS = "(other targets)"
_OTHER_SENSITIVE = "(other sensitive targets)"
_FOLDS = frozenset({_OTHER_TARGETS, _OTHER_SENSITIVE})
#: Modules whose functions hand the code a listing, leaving out what they could not list.
_LISTING_MODULES = frozenset({"glob", "os", "pathlib", "posixpath", "genericpath", "shutil"})
#: Libraries that turn a refused metadata change into a warning at most and go on
#: (tarfile's `chown`, `chmod` and `utime` at the default `errorlevel`).
_METADATA_SWALLOWERS = frozenset({"tarfile"})

_lock = threading.RLock()
_sink: Callable[[Denial], None] | None = None
_policy_name = ""
_in_call = False
_is_user: Callable[[str], bool] = lambda filename: filename.startswith("<cell-")  # noqa: E731


class Tally:
    """Distinct refusals with counts; first and last occurrence in full; bounded so that the
    important ones survive any flood.

    Each classification (user, internal, learned) has budgets of its own, so library noise
    never crowds out the user's refusals. Within one:

    - ordinary refusals: at most `per_rule` distinct targets per rule and `max_keys` in
      all; past either, the rule's further ordinary refusals fold into one
      "(other targets)" entry (its count says how many were folded; `last`, the latest);
    - sensitive refusals (`_denial.is_sensitive`: credentials, keys, metadata addresses,
      process, network and limit rules) have a reserve of `max_sensitive` distinct entries
      beyond that, and fold into a rule's own "(other sensitive targets)" entry, so a
      flood of ordinary refusals can never fold an `/etc/shadow` away.
    """

    def __init__(
        self, max_keys: int = MAX_KEYS, per_rule: int = PER_RULE, max_sensitive: int = MAX_SENSITIVE
    ) -> None:
        self.max_keys = max_keys
        self.per_rule = per_rule
        self.max_sensitive = max_sensitive
        self.entries: dict[tuple[str, ...], list[Any]] = {}  # key -> [first, last, count]
        self._used: dict[tuple[str, ...], int] = {}  # budget name -> entries used

    def _full(self, denial: Denial, sensitive: bool) -> int:
        """0 when `denial` may have an entry of its own, else the budget it is past."""
        cls = denial.classification
        if sensitive:
            used = self._used.get((cls, "sensitive"), 0)
            return 0 if used < self.max_sensitive else self.max_sensitive
        if self._used.get((cls, "rule", denial.rule), 0) >= self.per_rule:
            return self.per_rule
        return 0 if self._used.get((cls, "all"), 0) < self.max_keys else self.max_keys

    def add(self, denial: Denial, count: int = 1) -> tuple[Denial, bool]:
        """Count `denial`; returns (the entry's first occurrence, whether it is new)."""
        key = denial.key()
        entry = self.entries.get(key)
        first = denial
        if entry is None and denial.target not in _FOLDS:
            sensitive = is_sensitive(denial.rule, denial.target)
            budget = self._full(denial, sensitive)
            if budget:
                first = Denial(
                    rule=denial.rule,
                    action="*",
                    target=_OTHER_SENSITIVE if sensitive else _OTHER_TARGETS,
                    policy=denial.policy,
                    detail=fold_detail(denial.rule, budget, sensitive),
                    learned=denial.learned,
                    internal=denial.internal,
                    origin=denial.origin,
                )
                key = first.key()
                entry = self.entries.get(key)
            elif entry is None:
                cls = denial.classification
                if sensitive:
                    names: tuple[tuple[str, ...], ...] = ((cls, "sensitive"),)
                else:
                    names = ((cls, "all"), (cls, "rule", denial.rule))
                for name in names:
                    self._used[name] = self._used.get(name, 0) + 1
        if entry is None:
            self.entries[key] = [first, denial, count]
            return first, True
        entry[1] = denial
        entry[2] += count
        return entry[0], False

    def merge(self, other: Tally) -> None:
        for first, last, count in other.entries.values():
            self.add(first, 1)
            if count > 1 or last is not first:
                self.add(last, max(count - 1, 1))

    def denials(self) -> list[Denial]:
        """One `Denial` per entry: the first occurrence, with `count` and `last`."""
        out = []
        for first, last, count in self.entries.values():
            extra: dict[str, Any] = {"count": count}
            if count > 1 or last is not first:
                extra["last"] = last.replace(count=1, last=None)
            out.append(first.replace(**extra))
        return out

    def __len__(self) -> int:
        return len(self.entries)


_call = Tally()
_between = Tally()


def set_policy_name(name: str) -> None:
    """The policy name stamped on denials that do not name one."""
    global _policy_name
    _policy_name = name


def set_user_frame_test(test: Callable[[str], bool]) -> None:
    """How the recorder tells user code from library code (by a frame's file name)."""
    global _is_user
    _is_user = test


def _stamp(denial: Denial) -> Denial:
    origin = DURING_CALL if _in_call else BETWEEN_CALLS
    changes: dict[str, Any] = {}
    if not denial.policy and _policy_name:
        changes["policy"] = _policy_name
    if denial.origin != origin:
        changes["origin"] = origin
    return denial.replace(**changes) if changes else denial


def _classified(denial: Denial, count: int = 1) -> None:
    """Count a classified refusal and stream it when it is the first of its kind."""
    with _lock:
        if _in_call:
            tally, sink = _call, _sink
        else:
            tally, sink = _between, None
            if denial.origin != BETWEEN_CALLS:
                denial = denial.replace(origin=BETWEEN_CALLS)
        first, new = tally.add(denial, count)
    if new and sink is not None:
        sink(first)


def record(denial: Denial) -> Denial:
    """Record a refusal that is the user's by construction (the code layer, a limit, or a
    learned would-be refusal); returns the stamped record."""
    denial = _stamp(denial)
    _classified(denial)
    return denial


# -- classification of raised refusals -----------------------------------------------------


class _Watch:
    """Refusals raised under one library call made by one user frame, awaiting the verdict."""

    __slots__ = ("frame", "pending", "raised", "thread")

    def __init__(self, frame: FrameType, thread: int) -> None:
        self.frame = frame
        self.thread = thread
        self.pending = Tally()
        #: Some of the exceptions raised for each pending refusal (to find them in a chain).
        self.raised: dict[tuple[str, ...], list[BaseException]] = {}


_watches: dict[int, _Watch] = {}  # id(frame) -> watch


def stamp(denial: Denial) -> Denial:
    """`denial` with the policy name and its origin (during a call, or between calls)."""
    return _stamp(denial)


def record_raised(denial: Denial, exc: BaseException | None = None) -> Denial:
    """Record a refusal (stamped) about to be raised as `exc`; classify it now or watch the
    user frame whose call it happened under (see the module docstring)."""
    frame: FrameType | None = sys._getframe(1)
    direct = True
    user: FrameType | None = None
    callee = ""  # the module of the function the user frame called
    depth = 0
    while frame is not None and depth < _MAX_STACK:
        name = frame.f_globals.get("__name__", "")
        if not (isinstance(name, str) and name.startswith("agent_sandbox.")):
            if _is_user(frame.f_code.co_filename):
                user = frame
                break
            direct = False
            callee = name if isinstance(name, str) else ""
        frame = frame.f_back
        depth += 1
    if user is None and not direct and denial.rule in _ABSENT_WHEN_REFUSED:
        # A library's own thread (aiohttp reads `.netrc` in an executor) met a hidden file:
        # it looks absent there too, so the probe is internal; the host makes it the
        # user's again if the call's error shows it (`ResultBuilder.verdict`).
        _classified(denial.replace(internal=True))
        return denial
    if user is None or direct:
        _classified(denial)  # straight into user code, or no user code to watch: the user's
        return denial
    if (denial.action == "list" and callee in _LISTING_MODULES) or (
        denial.rule == "files.metadata" and callee in _METADATA_SWALLOWERS
    ):
        # `glob.glob`, `Path.glob`, `os.walk` swallow the refusal and return less; tarfile
        # swallows a refused chmod, chown or utime and extracts files without the archive's
        # mode or times: what the code got changed, so it is the user's, though the call
        # returned normally.
        _classified(denial)
        return denial
    try:
        watching = _watch(user, denial, exc)
    except Exception:  # pragma: no cover - never let the recorder break the call
        watching = False
    if not watching:
        _classified(denial)
    return denial


def forget_raised(exc: BaseException) -> None:
    """A refusal the guards raised and caught themselves, to fail the user's own call in
    another way (SQLite's "not authorized"). Nothing to do: its refusal was raised with user
    code as the first frame outside agent_sandbox, so it is already the user's."""
    del exc


def _watch(frame: FrameType, denial: Denial, exc: BaseException | None) -> bool:
    current = sys.gettrace()
    if current is not None and current is not _global_tracer:
        return False  # someone else traces this thread: no verdict, so the user's
    with _lock:
        watch = _watches.get(id(frame))
        if watch is None or watch.frame is not frame:
            watch = _watches[id(frame)] = _Watch(frame, threading.get_ident())
        watch.pending.add(denial)
        kept = watch.raised.setdefault(denial.key(), [])
        if exc is not None and len(kept) < 8:
            kept.append(exc)
    frame.f_trace_lines = True
    frame.f_trace = _local_tracer
    if current is None:
        sys.settrace(_global_tracer)
    return True


def _global_tracer(frame: FrameType, event: str, arg: Any) -> None:
    """Installed only while a watch is open in this thread; traces no new frame."""
    if not _thread_has_watches():
        sys.settrace(None)


def _thread_has_watches() -> bool:
    me = threading.get_ident()
    with _lock:
        return any(w.thread == me for w in _watches.values())


def _local_tracer(frame: FrameType, event: str, arg: Any) -> Any:
    """The watched user frame's first event after the refusal decides whose it was."""
    if event == "exception" and isinstance(arg, tuple) and len(arg) == 3:
        _resolve(frame, internal=False, error=arg[1])
    else:
        _resolve(frame, internal=True)
    return None


def _chain_ids(exc: BaseException) -> set[int]:
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo and len(seen) < 64:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        todo += [item.__cause__, item.__context__]
        if isinstance(item, BaseExceptionGroup):
            todo += list(item.exceptions)
    return seen


#: Refusals the code sees as "not there" (a hidden file): a library that met one and went
#: on handled it, whatever error came later.
_ABSENT_WHEN_REFUSED = frozenset({"files.hidden"})


def _resolve(frame: FrameType, *, internal: bool, error: Any = None) -> None:
    """Settle a watch. With `error` (an exception reached the frame): the refusals whose
    exception is in its chain are the user's and the others were handled inside; when
    none is in the chain, all are the user's (in doubt, the user's)."""
    with _lock:
        watch = _watches.pop(id(frame), None)
    if watch is None or watch.frame is not frame:
        return
    try:
        frame.f_trace = None
    except (AttributeError, ValueError):  # pragma: no cover - a finished frame
        pass
    verdict = {key: internal for key in watch.pending.entries}
    if isinstance(error, BaseException):
        chain = _chain_ids(error)
        carried = {key for key, excs in watch.raised.items() if any(id(e) in chain for e in excs)}
        # A hidden file looks absent, and a library that probed one (requests' `.netrc`,
        # a credentials file) took it as absent and went on: when the error that reached
        # the user's code does not carry it, that probe is internal, even where nothing
        # else is in the chain (the failure came from elsewhere, such as the network).
        verdict = {
            key: key not in carried and (bool(carried) or key[0] in _ABSENT_WHEN_REFUSED)
            for key in verdict
        }
    for key, (first, last, count) in list(watch.pending.entries.items()):
        _classified(first.replace(internal=verdict[key]))
        if count > 1:
            _classified(last.replace(internal=verdict[key]), count - 1)
    mine = watch.thread == threading.get_ident()
    if mine and not _thread_has_watches() and sys.gettrace() is _global_tracer:
        sys.settrace(None)


def _resolve_all() -> None:
    """End of call: every refusal still awaiting a verdict is the user's."""
    with _lock:
        frames = [w.frame for w in _watches.values()]
    for frame in frames:
        _resolve(frame, internal=False)


# -- calls ---------------------------------------------------------------------------------


def begin_call(sink: Callable[[Denial], None] | None) -> None:
    """A call starts: refusals from between calls become its own (marked), then stream."""
    global _in_call, _sink, _call, _between
    with _lock:
        _call = Tally()
        _call.merge(_between)
        _between = Tally()
        _in_call = True
        _sink = sink
        carried = [e[0] for e in _call.entries.values()]
    if sink is not None:
        for denial in carried:
            sink(denial)


def end_call() -> list[Denial]:
    """A call ends: settle open verdicts; return the call's tally (first occurrences, counts)."""
    global _in_call, _sink, _call
    _resolve_all()
    with _lock:
        _in_call = False
        _sink = None
        out = _call.denials()
        _call = Tally()
    return out


def take() -> list[Denial]:
    """Settle and return everything recorded so far, and clear it (for in-process tests)."""
    global _call, _between
    _resolve_all()
    with _lock:
        out = _call.denials() + _between.denials()
        _call = Tally()
        _between = Tally()
    return out
