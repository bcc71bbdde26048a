"""Worker side of `objects` mode: pickling a value, and the fail-closed exception channel.

The worker imports this module before it arms the guards, and binds here, at import time,
the C functions it needs (`_pickle.dumps`, `binascii.b2a_base64`). The guards patch
`pickle`'s module attributes when they arm; references bound earlier stay the originals,
so the framework's own serialization is not charged to the user's policy while the
`deserialization` category stays denied to user code. This module only *writes* pickles:
the worker never loads one.

What crosses for a value (objects mode): `{"encoding": "pickle-b64", "pickle": <base64>}`,
protocol 5, refused here with a `limits.result` denial when the encoded size exceeds
`limits.result_bytes` (the worker survives; nothing is truncated).

What crosses for an exception (both modes), as `"exception"` in the `error` event:

* `descriptor`: primitives only: class module and qualname, the builtin classes of its MRO,
  the message, and the denials it carries (a SandboxDenied's own, and those of its cause and
  context). The host falls back to this when the rich form is refused.
* `traceback`: tblib's `Traceback.as_dict()` shape (plain JSON), with the worker's own
  frames removed and at most `_MAX_FRAMES` frames kept.
* `rich` (objects mode only): a pickle of `(args, state)` taken through the nearest builtin
  base's C `__reduce__` (so a user `__reduce__` does not choose what crosses); the class
  itself is never in the pickle, the host rebuilds it by name without running its code.
* `cause` / `context`: the same for the chained exceptions, a few levels deep.

The value and the exception are encoded while the guards are armed: pickling and `str()`
run user methods (`__reduce__`, `__getstate__`, `__str__`), which must stay guarded.
Standard library only.
"""

from __future__ import annotations

import _pickle
import binascii
import copyreg  # noqa: F401 - loaded now so pickling never imports it while armed
import enum
import io
import os
import re
import sys

from agent_sandbox._denial import Denial
from agent_sandbox._errors import SandboxDenied
from agent_sandbox._hints import grant_hint

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["TooLarge", "encode_value", "exception_payload", "result_too_large"]

# Bound before arming (see the module docstring); never looked up again at call time.
_plain_dumps = _pickle.dumps


class _ProbeEnum(enum.Enum):
    MEMBER = 1


#: Some 3.11 releases (Debian 12's 3.11.2 among them) pickle an Enum member as
#: `getattr(cls, name)`, which the host's unpickler refuses as a gadget; later ones pickle it
#: as `cls(value)`. On the former, members are written the later way.
_ENUM_THROUGH_GETATTR = _ProbeEnum.MEMBER.__reduce_ex__(5)[0] is getattr


class _EnumByValue(_pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum) and not isinstance(obj, type):
            return type(obj), (obj.value,)
        return NotImplemented


def _dumps(value: Any, protocol: int) -> bytes:
    if not _ENUM_THROUGH_GETATTR:
        return _plain_dumps(value, protocol=protocol)
    buffer = io.BytesIO()
    _EnumByValue(buffer, protocol=protocol).dump(value)
    return buffer.getvalue()


_b64 = binascii.b2a_base64
_PROTOCOL = 5

_HERE = os.path.join(os.path.dirname(os.path.realpath(__file__)), "")
_PACKAGES = (
    "agent_sandbox",
    "agent_sandbox.guards",
    "agent_sandbox.providers",
    "agent_sandbox.policies",
    "agent_sandbox.adapters",
)


def _own_dirs() -> tuple[str, ...]:
    """The folders of agent_sandbox's packages (the worker's frames are not the user's)."""
    dirs = {_HERE}
    for name in _PACKAGES:
        module = sys.modules.get(name)
        for path in getattr(module, "__path__", None) or ():
            dirs.add(os.path.join(os.path.abspath(path), ""))
    return tuple(dirs)


_MAX_FRAMES = 100
_HEAD_FRAMES = 30
_MAX_CHAIN = 4
_MAX_TEXT = 2000


class TooLarge(Exception):
    """The encoded value exceeds the policy's `limits.result_bytes`."""

    def __init__(self, size: int, cap: int) -> None:
        self.size = size
        self.cap = cap
        super().__init__(f"{size} > {cap}")


def encode_value(value: Any, cap: int) -> dict[str, Any]:
    """The `result` event data for `value` in objects mode; raises TooLarge over `cap`."""
    try:
        raw = _dumps(value, protocol=_PROTOCOL)
    except (_pickle.PicklingError, TypeError, AttributeError) as err:
        raise TypeError(
            f"objects mode cannot send this {type(value).__qualname__} value ({err}); types "
            "defined in the call itself cannot cross: define them in a module and name it in "
            "the policy's `result_types`"
        ) from None
    if b"\xed" in raw and _SURROGATE_BYTES.search(raw):
        # A lone surrogate has no UTF-8 form; the host refuses a pickled string holding one.
        # The rule for text (U+FFFD, as in data-only mode) is applied to plain containers;
        # a surrogate inside another object still reaches the host's refusal.
        raw = _dumps(_valid_text(value, 0), protocol=_PROTOCOL)
    encoded_size = (len(raw) + 2) // 3 * 4
    if encoded_size > cap:
        raise TooLarge(encoded_size, cap)
    return {"encoding": "pickle-b64", "pickle": _b64(raw, newline=False).decode("ascii")}


#: A surrogate as `surrogatepass` writes it in a pickle's UTF-8 (0xED 0xA0-0xBF ...).
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_text(value: Any, depth: int) -> Any:
    """`value` with lone surrogates in its strings replaced by U+FFFD (plain containers)."""
    kind = type(value)
    if kind is str:
        return _SURROGATE.sub("\ufffd", value)
    if depth > 50:
        return value
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        return kind(_valid_text(v, depth + 1) for v in value)
    if kind is dict:
        return {_valid_text(k, depth + 1): _valid_text(v, depth + 1) for k, v in value.items()}
    return value


def result_too_large(size: int, cap: int, policy: str) -> Denial:
    """The `limits.result` denial for a value of `size` encoded bytes over `cap`."""
    return Denial(
        rule="limits.result",
        action="return",
        target="the result",
        policy=policy,
        detail=f"the encoded result is {size} bytes, above the cap of {cap} bytes; "
        "it was refused, not truncated (return a smaller value or write it to a file)",
        hint=grant_hint({"limits.result_bytes": max(size * 2, cap * 2)}),
    )


def _path(cls: type) -> tuple[str, str]:
    return str(getattr(cls, "__module__", "builtins")), str(getattr(cls, "__qualname__", "?"))


def _builtin_base(cls: type) -> type:
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            return klass
    return BaseException


def _text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = f"<unprintable {type(exc).__name__}>"
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "...<truncated>"


def _denials_of(exc: BaseException) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(out) < 16:
        seen.add(id(current))
        if isinstance(current, SandboxDenied):
            out.append(current.denial.to_dict())
        current = current.__cause__ or current.__context__
    return out


def _traceback_dict(tb: Any) -> dict[str, Any] | None:
    """tblib's `as_dict()` shape for `tb`, built without recursion, worker frames removed."""
    frames = []
    own = _own_dirs()
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(own):
            name = tb.tb_frame.f_globals.get("__name__")
            frames.append(
                (
                    code.co_filename,
                    code.co_name,
                    tb.tb_lineno,
                    name if isinstance(name, str) else "?",
                )
            )
        tb = tb.tb_next
    if len(frames) > _MAX_FRAMES:
        frames = frames[:_HEAD_FRAMES] + frames[-(_MAX_FRAMES - _HEAD_FRAMES) :]
    node: dict[str, Any] | None = None
    for filename, name, lineno, module in reversed(frames):
        node = {
            "tb_frame": {
                "f_globals": {"__name__": module, "__file__": filename},
                "f_locals": {},
                "f_code": {"co_filename": filename, "co_name": name},
                "f_lineno": lineno,
            },
            "tb_lineno": lineno,
            "tb_next": node,
        }
    return node


def _rich(exc: BaseException, cap: int) -> dict[str, Any]:
    """The pickled `(args, state)` of `exc`, or why it could not be made."""
    if isinstance(exc, SandboxDenied):
        return {"refused": "a SandboxDenied is rebuilt from its denial"}
    base = _builtin_base(type(exc))
    try:
        reduced = base.__reduce__(exc)  # type: ignore[call-arg]
        args = tuple(reduced[1]) if len(reduced) > 1 else ()
        raw_state = reduced[2] if len(reduced) > 2 and isinstance(reduced[2], dict) else {}
        state = {
            k: v
            for k, v in raw_state.items()
            if isinstance(k, str) and (not k.startswith("__") or k == "__notes__")
        }
        raw = _dumps((args, state), protocol=_PROTOCOL)
    except Exception as err:
        return {"refused": f"{type(err).__name__}: {_text(err)}"}
    if len(raw) * 4 // 3 > cap:
        return {"refused": f"its attributes are {len(raw)} bytes, above `limits.result_bytes`"}
    return {"pickle": _b64(raw, newline=False).decode("ascii")}


def exception_payload(
    exc: BaseException, *, objects: bool, cap: int, _depth: int = 0
) -> dict[str, Any]:
    """The `exception` entry of an `error` event (see the module docstring)."""
    cls = type(exc)
    module, qualname = _path(cls)
    payload: dict[str, Any] = {
        "descriptor": {
            "module": module,
            "qualname": qualname,
            "bases": [".".join(_path(k)) for k in cls.__mro__ if k.__module__ == "builtins"],
            "message": _text(exc),
            "denials": _denials_of(exc),
        },
        "traceback": _traceback_dict(exc.__traceback__),
        "suppress_context": bool(exc.__suppress_context__),
    }
    if objects:
        payload["rich"] = _rich(exc, cap)
    if _depth < _MAX_CHAIN:
        for key, chained in (("cause", exc.__cause__), ("context", exc.__context__)):
            if chained is not None and chained is not exc:
                payload[key] = exception_payload(
                    chained, objects=objects, cap=cap, _depth=_depth + 1
                )
    return payload
