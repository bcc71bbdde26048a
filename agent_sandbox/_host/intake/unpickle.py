"""The parent's restricted unpickler: the only place the host reads a pickle from a worker.

Everything a worker sends is attacker-controlled bytes. A pickle is a program for a small
stack machine whose opcodes can name any importable callable and call it, so a plain
`pickle.loads` in the host is code execution outside the sandbox (smolagents
CVE-2025-14931 was exactly that). Decoding here happens in three steps, and nothing is
built before the first two have accepted the whole stream:

1. **Opcode prescan** (`prescan`). A symbolic run of the stream over an allowlist of opcode
   families, with budgets on size, opcodes, nesting depth, memo entries, distinct globals
   and integer size. It only accepts what CPython's own pickler emits at protocol 4 and 5
   (no text opcodes, no PUT, no extension registry, no persistent ids, no out-of-band
   buffers). Because it tracks what each stack slot holds, it also checks *how* a global is
   used: REDUCE and NEWOBJ may only call a global whose allowlist entry grants that use,
   with the argument shapes the entry accepts (`Fraction` takes two ints, never a string
   like `'1e999999999'`); BUILD only targets an instance built in the stream, never a class
   (so a stream cannot `setattr` on a host class), with string keys that are not dunders;
   dict and set insertions are checked for hash flooding (many distinct keys sharing one
   hash, which costs the host quadratic time).
2. **`find_class`**, called by the real unpickler for each global. It imports nothing: a
   name resolves only through the allowlist tables built at import time, or through a
   module the policy names (`result_types`) that is already in the host's `sys.modules`,
   by plain `__dict__` look-ups (no `getattr`, so no module `__getattr__` can run).
3. The C unpickler (`_pickle.Unpickler` subclass) builds the value.

The allowlist (`BUILTIN_TYPES`) is what closes the class of attacks: builtin containers and
numbers, strings, bytes, `datetime`, `decimal`, `fractions`, `uuid`, pure paths, a few
`collections` types and builtin exceptions; plus pydantic models, dataclasses, enums and
named tuples of the modules a policy names with `result_types = ["pkg.models.*"]`, and
any global a policy names exactly (`"pkg.mod.Name"`: trusted as given, arguments
unchecked). `DENIED_GLOBALS` and `DENIED_MODULES` are a denylist kept for breadth: it is
checked before the allowlist, so a policy cannot name `posix.system` or
`functools.partial`, but a denylist fails open (a gadget it does not list passes if an
allowlist lets it), so it is a backstop and never the reason a stream is refused.

What this does NOT do: it does not make the values safe to *use* (a policy-named class's
own methods run on attacker-chosen field values), and it does not defend against a worker
that sends a legitimate but huge result within the cap (the cap is `limits.result_bytes`).

Step 1 is `unpickle_prescan`; the allowlist, the argument shapes and the denylists are
`unpickle_classes`; steps 2 and 3, the decoder of one worker's results and the exception
channel are here.
"""

from __future__ import annotations

import binascii
import builtins
import dataclasses
import pickle
import re
import sys
import types
from collections.abc import Iterable
from typing import Any

import tblib

from agent_sandbox._denial import Denial
from agent_sandbox._errors import ChildException, UnpickleRefused
from agent_sandbox._errors import SandboxDenied as _SandboxDenied
from agent_sandbox._host.intake.events import quote
from agent_sandbox._host.intake.unpickle_classes import _MAX_NAME, _NAME_RE, Allowlist, _resolve
from agent_sandbox._host.intake.unpickle_prescan import Budgets, check_deadline, prescan

try:  # the C prescan of plain-data streams and strict base64 (optional: setup.py)
    from agent_sandbox._host.intake import _fastscan
except ImportError:  # pragma: no cover - built by `pip install -e .`
    _fastscan = None  # type: ignore[assignment]

__all__ = ["Decoder", "Rebuilt", "load_restricted"]

# The one-blob decoder (None from a build of the extension that predates it: the general
# path then decodes every result, as before).
_decode_blob = getattr(_fastscan, "decode_blob", None)


# -- steps 2 and 3: find_class and the C unpickler -----------------------------------------------


class _Reader:
    """The stream as the unpickler reads it: each `read(n)` returns the next `n` bytes of
    the one buffer the prescan judged, in order.

    It has no `peek` and no `seek`, so the unpickler cannot prefetch past what it asked for
    and skip back, and `readline` refuses (the line-based opcodes are outside the allowed
    families). CPython's unpickler keeps a FRAME's bytes in a buffer and, when an opcode's
    argument crosses the frame's end, drops the buffer's rest and reads on from here; the
    prescan refuses such streams (and frames inside frames), so over what it accepts the
    reads here cover the stream once, in order, and `consumed` ends at its length.

    Each read looks at the call's deadline (the unpickler reads once per FRAME, or per
    opcode outside frames), so a build that runs past it stops at its next read.
    """

    __slots__ = ("_view", "consumed", "deadline")

    def __init__(self, data: bytes, deadline: float | None = None) -> None:
        self._view = memoryview(data)
        self.consumed = 0
        self.deadline = deadline

    def read(self, n: int = -1) -> bytes:
        check_deadline(self.deadline, "building the result from its pickle")
        start = self.consumed
        end = len(self._view) if n is None or n < 0 else min(start + n, len(self._view))
        self.consumed = end
        return bytes(self._view[start:end])

    def readinto(self, buffer: Any) -> int:
        check_deadline(self.deadline, "building the result from its pickle")
        target = memoryview(buffer).cast("B")
        chunk = self._view[self.consumed : self.consumed + len(target)]
        target[: len(chunk)] = chunk
        self.consumed += len(chunk)
        return len(chunk)

    def readline(self) -> bytes:
        raise UnpickleRefused("a line-based opcode (outside the allowed families)")


class _Unpickler(pickle.Unpickler):
    def __init__(self, reader: _Reader, allow: Allowlist) -> None:
        super().__init__(reader)
        self._allow = allow

    def find_class(self, module: str, name: str) -> Any:
        return self._allow.lookup(f"{module}.{name}").obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnpickleRefused("persistent ids are not allowed")


def load_restricted(
    data: bytes,
    allow: Allowlist | None = None,
    budgets: Budgets | None = None,
    deadline: float | None = None,
) -> Any:
    """Prescan `data`, then build it with the vetting `find_class`; the one entry point.

    `deadline` is the call's (a `time.monotonic` instant): past it, the prescan or the
    build stops with `DeadlinePassed` (a `TimeoutError`; the caller kills the worker)."""
    allow = allow or Allowlist()
    data = bytes(data)
    prescan(data, allow, budgets, deadline)
    check_deadline(deadline, "about to build the result from its pickle")
    reader = _Reader(data, deadline)
    try:
        value = _Unpickler(reader, allow).load()
    except (UnpickleRefused, TimeoutError):
        raise
    except RecursionError:
        raise UnpickleRefused("the value nests too deeply to build") from None
    except Exception as exc:
        raise UnpickleRefused(
            f"building the value failed: {type(exc).__name__}: {_short(exc)}"
        ) from None
    if reader.consumed != len(data):  # the prescan and the unpickler read it differently
        raise UnpickleRefused(
            f"the unpickler stopped at byte {reader.consumed} of {len(data)}: "
            f"it read the stream differently from the prescan"
        )
    return value


def _short(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = "?"
    return text[:200]


# -- the decoder a worker process uses, and the exception channel -------------------------------


class Decoder:
    """Decodes one worker's `result` and `error` payloads under its policy.

    In `data-only` mode (`objects=False`) it never unpickles anything: a pickle from such a
    worker is refused unread, and exceptions are rebuilt from their descriptors only.
    """

    def __init__(
        self,
        *,
        objects: bool,
        result_types: Iterable[str] = (),
        max_bytes: int = 4_000_000,
        policy: str = "",
    ) -> None:
        self.objects = objects
        self.allow = Allowlist(result_types)
        self.budgets = Budgets(max_bytes=max_bytes, max_copied=max(8_000_000, 2 * max_bytes))
        self.policy = policy

    @classmethod
    def from_policy(cls, policy: Any) -> Decoder:
        """The decoder for a `Policy` (its result mode, `result_types` and result cap)."""
        return cls(
            objects=policy.result_mode == "objects",
            result_types=tuple(getattr(policy, "result_types", ())),
            max_bytes=int(policy.limits.result_bytes),
            policy=str(policy.name),
        )

    def decode_value(self, data: dict[str, Any], deadline: float | None = None) -> Any:
        """The value of a `result` event carrying a pickle; raises UnpickleRefused, or
        `DeadlinePassed` past `deadline` (the call's, a `time.monotonic` instant)."""
        if not self.objects:
            raise UnpickleRefused(
                "the worker sent a pickle although the policy's result mode "
                "is data-only; it was not read"
            )
        if data.get("encoding") != "pickle-b64":
            raise UnpickleRefused(f"unknown result encoding {str(data.get('encoding'))[:40]!r}")
        text = data.get("pickle")
        if _decode_blob is not None and isinstance(text, str):
            # One bytes or bytearray value and nothing else (a file, an image): decoded from
            # the base64 text straight into the value, with the prescan's checks and budgets
            # on its few opcodes; None for anything else, which takes the path below.
            blob = _decode_blob(
                text, self.budgets.max_bytes, self.budgets.max_opcodes, self.budgets.max_memo
            )
            if blob is not None:
                return blob
        return load_restricted(self._bytes(text), self.allow, self.budgets, deadline)

    def _bytes(self, text: Any) -> bytes:
        if not isinstance(text, str):
            raise UnpickleRefused("the pickle is not a base64 string")
        if len(text) > self.budgets.max_bytes * 4 // 3 + 4:
            raise UnpickleRefused(
                f"the pickle is about {len(text) * 3 // 4} bytes, above the cap of "
                f"{self.budgets.max_bytes} bytes",
                budget="max_bytes",
            )
        if _fastscan is not None:
            fast = _fastscan.b64decode(text)  # canonical base64, or None: then binascii decides
            if fast is not None:
                return fast
        try:
            return binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise UnpickleRefused("the pickle is not valid base64") from None

    def rebuild_exception(self, payload: Any, deadline: float | None = None) -> Rebuilt:
        """The worker's exception as the host should raise it (see `Rebuilt`); past
        `deadline` (the call's) its rich form's decoding stops with `DeadlinePassed`."""
        notes: list[str] = []
        exc, tb = self._rebuild(payload, notes, 0, deadline)
        return Rebuilt(exc, tb, notes)

    def _rebuild(
        self, payload: Any, notes: list[str], depth: int, deadline: float | None = None
    ) -> tuple[BaseException, types.TracebackType | None]:
        if not isinstance(payload, dict):
            raise UnpickleRefused("the exception payload is not an object")
        desc = _descriptor(payload.get("descriptor"))
        exc = None
        rich = payload.get("rich")
        cls = _exception_class(desc.module, desc.qualname)
        if cls is not None and issubclass(cls, _SandboxDenied):
            exc = _denied(cls, desc)
        elif cls is not None and self.objects and isinstance(rich, dict) and "pickle" in rich:
            try:
                args, state = self._args_state(rich["pickle"], deadline)
                exc = _construct(cls, args, state)
            except UnpickleRefused as refused:
                notes.append(
                    f"the attributes of {desc.path} were refused ({refused.reason}); "
                    f"it was rebuilt from its descriptor"
                )
        elif cls is not None and self.objects and isinstance(rich, dict) and "refused" in rich:
            notes.append(
                f"the attributes of {desc.path} could not be sent (the worker says: "
                f"{quote(str(rich['refused']))}); it was rebuilt from its descriptor"
            )
        if exc is None and cls is not None:
            try:
                exc = _construct(cls, (desc.message,), {})
            except UnpickleRefused:
                exc = None
        if exc is None:
            exc = _stand_in(desc)
        tb = _traceback(payload.get("traceback"))
        if depth < 4:
            for key in ("cause", "context"):
                if isinstance(payload.get(key), dict):
                    try:
                        chained, chained_tb = self._rebuild(
                            payload[key], notes, depth + 1, deadline
                        )
                    except UnpickleRefused:
                        continue
                    chained.__traceback__ = chained_tb
                    if key == "cause":
                        exc.__cause__ = chained
                    else:
                        exc.__context__ = chained
            exc.__suppress_context__ = bool(payload.get("suppress_context"))
        return exc, tb

    def _args_state(
        self, text: Any, deadline: float | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        value = load_restricted(self._bytes(text), self.allow, self.budgets, deadline)
        if (
            not isinstance(value, tuple)
            or len(value) != 2
            or not isinstance(value[0], tuple)
            or not isinstance(value[1], dict)
        ):
            raise UnpickleRefused("the exception state is not (args, attributes)")
        return value[0], value[1]


@dataclasses.dataclass
class Rebuilt:
    """A worker exception rebuilt in the host: the exception, the worker's traceback (to
    splice in when raising), and notes on what did not cross."""

    exception: BaseException
    traceback: types.TracebackType | None
    notes: list[str]


@dataclasses.dataclass(frozen=True)
class _Descriptor:
    module: str
    qualname: str
    bases: tuple[str, ...]
    message: str
    denials: tuple[dict[str, Any], ...]

    @property
    def path(self) -> str:
        return self.qualname if self.module == "builtins" else f"{self.module}.{self.qualname}"


def _descriptor(data: Any) -> _Descriptor:
    """Check the primitive descriptor's shape; every field is capped."""
    if not isinstance(data, dict):
        raise UnpickleRefused("the exception descriptor is not an object")
    module, qualname = data.get("module"), data.get("qualname")
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise UnpickleRefused("the exception descriptor lacks its class path")
    if not _NAME_RE.match(module) or len(module) > _MAX_NAME:
        module = "<invalid>"
    if not _QUALNAME_RE.match(qualname) or len(qualname) > _MAX_NAME:
        qualname = "<invalid>"
    message = data.get("message")
    bases = data.get("bases")
    denials = data.get("denials")
    return _Descriptor(
        module=module,
        qualname=qualname,
        bases=tuple(b for b in bases[:32] if isinstance(b, str)) if isinstance(bases, list) else (),
        message=message[:_MAX_MESSAGE] if isinstance(message, str) else "",
        denials=tuple(d for d in denials[:16] if isinstance(d, dict))
        if isinstance(denials, list)
        else (),
    )


_QUALNAME_RE = re.compile(r"^[A-Za-z_<][A-Za-z0-9_<>]*(\.[A-Za-z_<][A-Za-z0-9_<>]*)*$")
_MAX_MESSAGE = 20_000
_BUILTIN_EXCEPTIONS = frozenset(
    obj
    for obj in vars(builtins).values()
    if isinstance(obj, type) and issubclass(obj, BaseException)
)
_BASE_DICT: Any = vars(BaseException)["__dict__"]


def _exception_class(module: str, qualname: str) -> type[BaseException] | None:
    """The host's class for a worker exception, found without importing; None when the host
    has no such class or may not rebuild it (not an Exception: SystemExit, KeyboardInterrupt
    and GeneratorExit from a worker must not end or interrupt the host)."""
    if "<" in qualname or module not in sys.modules:
        return None
    try:
        obj = _resolve(module, qualname, f"{module}.{qualname}")
    except UnpickleRefused:
        return None
    if isinstance(obj, type) and issubclass(obj, Exception):
        return obj
    return None


def _builtin_base(cls: type) -> type[BaseException]:
    for klass in cls.__mro__:
        if klass in _BUILTIN_EXCEPTIONS:
            return klass  # type: ignore[no-any-return]
    return Exception


def _construct(
    cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]
) -> BaseException:
    """Build `cls` without running any of its own code: the nearest builtin base's C
    `__new__` and `__init__` take the arguments, and the attributes go straight into the
    instance dict (so no property, `__setattr__` or `__init__` of the class runs)."""
    base = _builtin_base(cls)
    try:
        exc = base.__new__(cls, *args)
        base.__init__(exc, *args)
    except Exception as err:
        raise UnpickleRefused(
            f"{cls.__qualname__} does not accept its arguments ({type(err).__name__})"
        ) from None
    namespace = _BASE_DICT.__get__(exc)
    for key, value in state.items():
        if not isinstance(key, str):
            continue
        if key == "__notes__":
            if isinstance(value, list) and all(isinstance(n, str) for n in value):
                namespace[key] = list(value)
        elif not key.startswith("__"):
            namespace[key] = value
    return exc


def _denied(cls: type[BaseException], desc: _Descriptor) -> BaseException | None:
    """A SandboxDenied subclass, rebuilt from the denial it carried (our own class)."""
    if not desc.denials:
        return None
    try:
        return cls(Denial.from_dict(dict(desc.denials[0])))  # type: ignore[call-arg]
    except Exception:
        return None


_STAND_INS: dict[tuple[str, type], type[ChildException]] = {}


def _stand_in(desc: _Descriptor) -> BaseException:
    """A `ChildException[<path>]` that also derives from the nearest builtin base reported."""
    base: type = Exception
    for name in desc.bases:
        candidate = getattr(builtins, name.removeprefix("builtins."), None)
        if (
            name.startswith("builtins.")
            and isinstance(candidate, type)
            and candidate in _BUILTIN_EXCEPTIONS
            and issubclass(candidate, Exception)
        ):
            base = candidate
            break
    key = (desc.path, base)
    cls = _STAND_INS.get(key)
    if cls is None:
        # No dots in the name: reprs and tracebacks would cut it at the last one.
        name = f"ChildException[{desc.path.replace('.', ':')}]"
        bases: tuple[type, ...] = (ChildException,) if base is Exception else (ChildException, base)
        try:
            cls = type(name, bases, {"__module__": "agent_sandbox._errors", "__qualname__": name})
        except TypeError:
            cls = type(
                name,
                (ChildException,),
                {"__module__": "agent_sandbox._errors", "__qualname__": name},
            )
        if len(_STAND_INS) < 256:
            _STAND_INS[key] = cls
    denials = []
    for d in desc.denials:
        denials.append(Denial.from_dict(dict(d)))
    try:
        return cls(desc.message, child_type=desc.path, denials=denials)
    except Exception:
        return ChildException(desc.message, child_type=desc.path, denials=denials)


_MAX_TB_FRAMES = 200
_MAX_TB_TEXT = 500
_MAX_LINENO = 10_000_000


class _Node:
    """The attribute shape `tblib.Traceback` reads (tb_frame, tb_lineno, tb_next)."""

    __slots__ = (
        "co_filename",
        "co_name",
        "f_code",
        "f_globals",
        "f_lineno",
        "tb_frame",
        "tb_lineno",
        "tb_next",
    )
    co_filename: str
    co_name: str
    f_code: _Node
    f_globals: dict[str, str]
    f_lineno: int
    tb_frame: _Node
    tb_lineno: int
    tb_next: _Node | None


def _frames(data: Any) -> list[tuple[str, str, int, str]]:
    """Check tblib's `as_dict()` shape iteratively; return (file, name, line, module) frames.

    Anything unexpected refuses the whole traceback (the exception still crosses)."""
    frames: list[tuple[str, str, int, str]] = []
    node = data
    while node is not None:
        if len(frames) >= _MAX_TB_FRAMES:
            raise UnpickleRefused(f"a traceback longer than {_MAX_TB_FRAMES} frames")
        if not isinstance(node, dict) or set(node) - {"tb_frame", "tb_lineno", "tb_next"}:
            raise UnpickleRefused("a traceback entry of the wrong shape")
        frame, lineno = node.get("tb_frame"), node.get("tb_lineno")
        if not isinstance(frame, dict) or set(frame) - {
            "f_globals",
            "f_locals",
            "f_code",
            "f_lineno",
        }:
            raise UnpickleRefused("a traceback frame of the wrong shape")
        code, glob = frame.get("f_code"), frame.get("f_globals", {})
        if frame.get("f_locals", {}) != {}:
            raise UnpickleRefused("a traceback frame carries locals")
        if not isinstance(code, dict) or not isinstance(glob, dict):
            raise UnpickleRefused("a traceback frame of the wrong shape")
        filename, name = code.get("co_filename"), code.get("co_name")
        module = glob.get("__name__", "?")
        if not (isinstance(filename, str) and isinstance(name, str) and isinstance(module, str)):
            raise UnpickleRefused("a traceback frame with a non-string name")
        if type(lineno) is not int or not 0 <= lineno <= _MAX_LINENO:
            raise UnpickleRefused("a traceback frame with a bad line number")
        frames.append(
            (filename[:_MAX_TB_TEXT], name[:_MAX_TB_TEXT], max(lineno, 1), module[:_MAX_TB_TEXT])
        )
        node = node.get("tb_next")
    return frames


def _traceback(data: Any) -> types.TracebackType | None:
    """A real traceback from a checked tblib dict, or None when there is none or it is
    malformed (then the exception crosses without the worker's frames)."""
    if data is None:
        return None
    try:
        frames = _frames(data)
    except UnpickleRefused:
        return None
    if not frames:
        return None
    head: _Node | None = None
    for filename, name, lineno, module in reversed(frames):
        node = _Node()
        node.tb_frame = _Node()
        node.tb_frame.f_code = _Node()
        node.tb_frame.f_code.co_filename = filename
        node.tb_frame.f_code.co_name = name
        node.tb_frame.f_globals = {"__name__": module, "__file__": filename}
        node.tb_frame.f_lineno = lineno
        node.tb_lineno = lineno
        node.tb_next = head
        head = node
    try:
        return tblib.Traceback(head).as_traceback()  # type: ignore[no-any-return]
    except Exception:
        return None
