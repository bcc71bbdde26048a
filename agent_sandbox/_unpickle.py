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
"""

from __future__ import annotations

import binascii
import builtins
import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import io
import operator
import pathlib
import pickle
import re
import struct
import sys
import types
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import tblib

from agent_sandbox._denial import Denial
from agent_sandbox._errors import ChildException, UnpickleRefused
from agent_sandbox._errors import SandboxDenied as _SandboxDenied
from agent_sandbox._intake import quote

try:  # the C prescan of plain-data streams and strict base64 (optional: setup.py)
    from agent_sandbox.guards import _fastscan
except ImportError:  # pragma: no cover - built by `pip install -e .`
    _fastscan = None  # type: ignore[assignment]

__all__ = [
    "BUILTIN_TYPES",
    "DENIED_GLOBALS",
    "DENIED_MODULES",
    "Allowlist",
    "Budgets",
    "Decoder",
    "Rebuilt",
    "denied_name",
    "load_restricted",
    "prescan",
]

# -- budgets ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Caps the prescan enforces before anything is built (each refusal names its budget)."""

    max_bytes: int = 4_000_000
    max_opcodes: int = 2_000_000
    max_depth: int = 100
    max_memo: int = 500_000
    max_globals: int = 256
    max_int_bytes: int = 65_536
    max_same_hash: int = 64


# -- uses and argument shapes -------------------------------------------------------------------

# What a stream may do with a global. Every global may appear as a plain value (a
# defaultdict's factory, an Ellipsis); the uses below are granted per entry.
REDUCE = "reduce"  # callable(*args)
NEWOBJ = "newobj"  # cls.__new__(cls, *args)
NEWOBJ_EX = "newobj_ex"  # cls.__new__(cls, *args, **kwargs)
BUILD = "build"  # instance.__setstate__(state) or instance.__dict__.update(state)
SETITEMS = "setitems"  # instance[key] = value
APPENDS = "appends"  # instance.append(x) / instance.extend(xs)
ALL_USES = frozenset({REDUCE, NEWOBJ, NEWOBJ_EX, BUILD, SETITEMS, APPENDS})

_SCALARS = frozenset({"none", "bool", "int", "float", "str", "bytes"})
_DATA = _SCALARS | {"tuple", "list", "dict", "set", "frozenset", "bytearray"}

ArgCheck = Callable[[list["_Val"]], bool]


def _shape(*alternatives: tuple[frozenset[str] | str, ...]) -> ArgCheck:
    """An argument check: the args tuple matches one of the alternatives, slot by slot.

    A slot is a set of symbolic kinds, or `"obj:<module.qualname>"` for an instance of that
    allowlisted type built earlier in the stream.
    """

    def check(args: list[_Val]) -> bool:
        for alt in alternatives:
            if len(alt) == len(args) and all(
                _slot_ok(s, a) for s, a in zip(alt, args, strict=True)
            ):
                return True
        return False

    return check


def _slot_ok(slot: frozenset[str] | str, val: _Val) -> bool:
    if isinstance(slot, str):
        return val.kind == "obj" and val.name == slot.removeprefix("obj:")
    return val.kind in slot


def _any_data(args: list[_Val]) -> bool:
    """Any number of arguments, each plain data or an instance built in the stream."""
    return all(a.kind in _DATA or a.kind == "obj" for a in args)


def _strings(args: list[_Val]) -> bool:
    return all(a.kind == "str" for a in args)


def _no_args(args: list[_Val]) -> bool:
    return not args


def _one_scalar(args: list[_Val]) -> bool:
    return len(args) == 1 and args[0].kind in _SCALARS


def _factory(args: list[_Val]) -> bool:
    """defaultdict(factory): None, or a global that is a plain builtin type."""
    if len(args) != 1:
        return False
    a = args[0]
    return a.kind == "none" or (a.kind == "global" and a.name in _FACTORY_TYPES)


_INT = frozenset({"int"})
_BOOL_INT = frozenset({"int", "bool"})
_NUM = frozenset({"int", "float", "bool"})
_INT_NONE = frozenset({"int", "none"})
_STR = frozenset({"str"})
_BYTES = frozenset({"bytes"})
_LIST = frozenset({"list"})
_SEQ = frozenset({"list", "tuple"})
_DICT = frozenset({"dict"})
_TZ = "obj:datetime.timezone"


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One allowlisted global: the object, the uses granted, and its argument check."""

    obj: Any
    uses: frozenset[str] = frozenset()
    args: ArgCheck | None = None  # None: any arguments
    #: Named exactly by a policy: arguments and BUILD state are not checked.
    trusted: bool = False
    #: The class defines its own `__setstate__`, which takes any data state; without one,
    #: BUILD updates the instance dict, so the state must be a dict of safe names.
    own_setstate: bool = False


def _table() -> dict[str, _Entry]:
    t: dict[str, _Entry] = {}

    def add(
        obj: Any,
        uses: Iterable[str] = (),
        args: ArgCheck | None = _no_args,
        name: str | None = None,
    ) -> None:
        key = name or f"{obj.__module__}.{obj.__qualname__}"
        t[key] = _Entry(obj, frozenset(uses), args)

    # NOTE: allowed as plain values only (a defaultdict factory); calling them with stream
    # data could allocate without bound (`bytearray(10**12)`), so REDUCE is not granted.
    for typ in (int, float, str, bytes, bytearray, bool, list, tuple, dict, set, frozenset):
        add(typ, (), None)
    add(complex, (REDUCE,), _shape((_NUM, _NUM), (_NUM,)))
    # NOTE: range and slice are lazy; they allocate nothing from their bounds.
    add(range, (REDUCE,), _shape((_INT,), (_INT, _INT), (_INT, _INT, _INT)))
    add(
        slice,
        (REDUCE,),
        _shape((_INT_NONE,), (_INT_NONE, _INT_NONE), (_INT_NONE, _INT_NONE, _INT_NONE)),
    )
    t["builtins.Ellipsis"] = _Entry(Ellipsis)
    t["builtins.NotImplemented"] = _Entry(NotImplemented)
    add(datetime.date, (REDUCE,), _shape((_BYTES,)))
    add(datetime.datetime, (REDUCE,), _shape((_BYTES,), (_BYTES, _TZ)))
    add(datetime.time, (REDUCE,), _shape((_BYTES,), (_BYTES, _TZ)))
    add(datetime.timedelta, (REDUCE,), _shape((_INT, _INT, _INT)))
    add(
        datetime.timezone,
        (REDUCE,),
        _shape(("obj:datetime.timedelta",), ("obj:datetime.timedelta", _STR)),
    )
    add(decimal.Decimal, (REDUCE,), _shape((_STR,)))
    # NOTE: Fraction only from two ints: Fraction('1e999999999') would compute 10**999999999.
    add(fractions.Fraction, (REDUCE,), _shape((_INT, _INT)))
    add(uuid.UUID, (NEWOBJ, BUILD), _no_args)
    for path in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        add(path, (REDUCE,), _strings)
    add(collections.OrderedDict, (REDUCE, SETITEMS, BUILD), _no_args)
    add(collections.defaultdict, (REDUCE, SETITEMS, BUILD), _factory)
    # deque.__reduce_ex__ gives (deque, ((), maxlen), state, iter(items)): items by APPENDS.
    add(collections.deque, (REDUCE, BUILD, APPENDS), _shape((), (_SEQ,), (_SEQ, _INT_NONE)))
    add(collections.Counter, (REDUCE, BUILD), _shape((_DICT,)))
    # Builtin exceptions as values (`[ValueError('x')]`): their constructors are C code.
    for name, obj in vars(builtins).items():
        if isinstance(obj, type) and issubclass(obj, Exception) and not name.startswith("_"):
            add(obj, (REDUCE, BUILD), _any_data, name=f"builtins.{name}")
    return t


#: The allowlist every objects-mode decoder starts from, keyed by `module.qualname`.
BUILTIN_TYPES: dict[str, _Entry] = _table()

#: Plain builtin types a defaultdict may use as its factory.
_FACTORY_TYPES = frozenset(
    f"builtins.{t.__name__}" for t in (int, float, str, bytes, list, tuple, dict, set, frozenset)
)

#: Gadgets refused even when a policy names them, keyed by every name a pickle can use
#: for them (the C twins included). A denylist fails open: it is a backstop behind the
#: allowlist, never the reason something is safe.
DENIED_GLOBALS = frozenset(
    {
        "builtins.eval",
        "builtins.exec",
        "builtins.compile",
        "builtins.open",
        "builtins.getattr",
        "builtins.setattr",
        "builtins.delattr",
        "builtins.__import__",
        "builtins.globals",
        "builtins.locals",
        "builtins.vars",
        "builtins.input",
        "builtins.breakpoint",
        "builtins.type",
        "builtins.super",
        "builtins.object",
        "builtins.memoryview",
        "builtins.print",
        "builtins.help",
        "builtins.exit",
        "builtins.quit",
        "builtins.classmethod",
        "builtins.staticmethod",
        "builtins.property",
        "builtins.apply",
        "__builtin__.eval",
        "__builtin__.getattr",
        "__builtin__.__import__",
        "functools.partial",
        "functools.reduce",
        "functools.partialmethod",
        "_functools.partial",
        "_functools.reduce",
        "operator.attrgetter",
        "operator.itemgetter",
        "operator.methodcaller",
        "_operator.attrgetter",
        "_operator.itemgetter",
        "_operator.methodcaller",
        "copyreg._reconstructor",
        "copyreg.__newobj__",
        "copyreg.__newobj_ex__",
        "copy_reg._reconstructor",
        "pickle.loads",
        "_pickle.loads",
        "pickle.load",
        "_pickle.load",
        "marshal.loads",
        "codecs.decode",
        "_codecs.decode",
        "types.FunctionType",
        "types.CodeType",
        "types.LambdaType",
        "types.MethodType",
        "collections.namedtuple",
        "dataclasses.make_dataclass",
        "enum.Enum",
        "typing.NamedTuple",
        "pydantic.create_model",
        "numpy.load",
        "numpy.lib.npyio.load",
        "numpy.frombuffer.__self__",
        "pandas.read_pickle",
        "pandas.eval",
        "torch.load",
    }
)

#: Whole modules (and their sub-modules) a stream may never name.
DENIED_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "_posixsubprocess",
        "subprocess",
        "pty",
        "socket",
        "_socket",
        "ssl",
        "_ssl",
        "ctypes",
        "_ctypes",
        "cffi",
        "sys",
        "importlib",
        "_imp",
        "imp",
        "_frozen_importlib",
        "_frozen_importlib_external",
        "runpy",
        "code",
        "codeop",
        "pickle",
        "_pickle",
        "marshal",
        "shelve",
        "dill",
        "cloudpickle",
        "multiprocessing",
        "_multiprocessing",
        "signal",
        "_signal",
        "shutil",
        "io",
        "_io",
        "tempfile",
        "webbrowser",
        "gc",
        "inspect",
        "types",
        "copyreg",
        "copy_reg",
        "threading",
        "_thread",
        "asyncio",
        "concurrent",
        "http",
        "urllib",
        "requests",
        "httpx",
        "__main__",
        "__builtin__",
        "site",
        "sysconfig",
        "platform",
        "resource",
        "fcntl",
        "mmap",
        "select",
        "selectors",
        "telnetlib",
        "ftplib",
        "smtplib",
        "xmlrpc",
        "logging",
        "agent_sandbox",
    }
)

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_MAX_NAME = 200


def denied_name(name: str) -> bool:
    """Whether `module.qualname` (or a policy entry) falls under the denylist."""
    if name in DENIED_GLOBALS:
        return True
    parts = name.split(".")
    return any(".".join(parts[:i]) in DENIED_MODULES for i in range(1, len(parts) + 1))


# -- the allowlist a decoder uses ----------------------------------------------------------------


class Allowlist:
    """Resolves `module.qualname` to an allowlisted global without importing anything.

    `extra` holds policy entries: `"pkg.mod.Name"` (that global, trusted as given) or
    `"pkg.mod.*"` (the pydantic models, dataclasses, enums, named tuples and exception
    classes defined in `pkg.mod`). Modules must already be loaded in the host.
    """

    def __init__(self, extra: Iterable[str] = ()) -> None:
        self.exact: set[str] = set()
        self.modules: set[str] = set()
        for entry in extra:
            if entry.endswith(".*"):
                self.modules.add(entry[:-2])
            else:
                self.exact.add(entry)
        self._cache: dict[str, _Entry] = {}

    def lookup(self, name: str) -> _Entry:
        """The entry for `name`, or raise `UnpickleRefused` saying why and how to allow it."""
        hit = self._cache.get(name)
        if hit is not None:
            return hit
        if len(name) > _MAX_NAME or not _NAME_RE.match(name):
            raise UnpickleRefused(f"the global name {name[:80]!r} is malformed", target=name[:80])
        if name.startswith("__main__."):
            raise UnpickleRefused(
                f"{name} was defined in the call itself (`__main__`); only types defined in a "
                f"module named in `result_types` can cross, and never the host's own `__main__`",
                target=name,
            )
        if denied_name(name):
            raise UnpickleRefused(
                f"{name} is a known gadget and is never rebuilt in the host", target=name
            )
        entry = BUILTIN_TYPES.get(name)
        if entry is None:
            entry = self._policy_entry(name)
        self._cache[name] = entry
        return entry

    def _policy_entry(self, name: str) -> _Entry:
        module, qualname = _split(name)
        if module is None or qualname is None:
            named = name in self.exact or any(name.startswith(m + ".") for m in self.modules)
            if named:
                raise UnpickleRefused(
                    f"{name}: its module is not loaded in the host, and the decoder never "
                    f"imports; import it in the host before the call",
                    target=name,
                )
            raise _not_allowed(name)
        if name in self.exact:
            return _Entry(_resolve(module, qualname, name), ALL_USES, None, trusted=True)
        if module in self.modules:
            obj = _resolve(module, qualname, name)
            found = _model_uses(obj, module, qualname)
            if found is None:
                raise UnpickleRefused(
                    f"{name} is not a pydantic model, dataclass, enum, named tuple or "
                    f"exception class, so `{module}.*` does not allow it; name it exactly "
                    f"in `result_types` if the host trusts it",
                    target=name,
                )
            return _Entry(obj, found[0], found[1], own_setstate=_own_setstate(obj))
        raise _not_allowed(name)


def _not_allowed(name: str) -> UnpickleRefused:
    mod = name.rpartition(".")[0] or name
    return UnpickleRefused(
        f"{name} is not in the objects allowlist",
        target=name,
        hint=f'result_types = ["{name}"]  (or "{mod}.*" for its models and dataclasses)',
    )


def _split(name: str) -> tuple[str | None, str | None]:
    """Split `pkg.mod.Outer.Inner` at the longest prefix that is a loaded module."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in sys.modules:
            return module, ".".join(parts[i:])
    return None, None


def _resolve(module: str, qualname: str, name: str) -> Any:
    """Walk `qualname` from a loaded module through `__dict__` only: nothing runs, nothing
    is imported."""
    mod = sys.modules.get(module)
    if mod is None:
        raise UnpickleRefused(
            f"{name}: the module {module} is not loaded in the host, and the decoder never "
            f"imports; import it in the host before the call",
            target=name,
        )
    obj: Any = mod
    for part in qualname.split("."):
        namespace = _namespace(obj)
        if part not in namespace:
            raise UnpickleRefused(f"{name} does not exist in the host", target=name)
        obj = namespace[part]
    return obj


_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
_TYPE_DICT: Any = vars(type)["__dict__"]


def _namespace(obj: Any) -> Any:
    """A module's or class's own namespace, read through the real descriptors, so no
    `__getattr__` or metaclass hook runs; anything else has none."""
    kind = type(obj)
    if issubclass(kind, types.ModuleType):
        return _MODULE_DICT.__get__(obj)
    if issubclass(kind, type):
        return _TYPE_DICT.__get__(obj)
    return {}


def _own_setstate(cls: type) -> bool:
    for klass in cls.__mro__:
        if klass is object or klass.__module__ == "builtins":
            continue
        if "__setstate__" in _namespace(klass):
            return True
    return False


def _model_uses(obj: Any, module: str, qualname: str) -> tuple[frozenset[str], ArgCheck] | None:
    """The uses and argument check a wildcard entry grants `obj`, or None when it is not a
    data class."""
    if not isinstance(obj, type):
        return None
    if getattr(obj, "__module__", None) != module or getattr(obj, "__qualname__", None) != qualname:
        return None  # a re-export: the pickler would have named the defining module
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and issubclass(obj, pydantic.BaseModel):
        return frozenset({NEWOBJ, BUILD}), _no_args
    if dataclasses.is_dataclass(obj):
        return frozenset({NEWOBJ, BUILD}), _no_args
    if issubclass(obj, enum.Enum):
        return frozenset({REDUCE}), _one_scalar
    if issubclass(obj, tuple) and "_fields" in _namespace(obj):
        return frozenset({NEWOBJ}), _any_data
    if issubclass(obj, Exception):
        return frozenset({REDUCE, BUILD}), _any_data
    return None


# -- step 1: the prescan --------------------------------------------------------------------------


class _Val:
    """What one stack slot holds, as far as the prescan can tell."""

    __slots__ = ("const", "depth", "hashes", "keys", "kind", "name")

    def __init__(self, kind: str, const: Any = None, name: str = "", depth: int = 0) -> None:
        self.kind = kind
        self.const = const  # the value for scalars; the items (list of _Val) for tuples
        self.name = name  # the global's name, for "global" and "obj"
        self.depth = depth
        self.keys: list[list[_Val]] | None = None  # a dict's key batches, checked at BUILD
        self.hashes: dict[int, int] | None = None


_NO_CONST = object()
_DEPTH = operator.attrgetter("depth")
_FLOODABLE = frozenset({"int", "float", "bool", "tuple"})


def _constant(v: _Val, depth: int = 0) -> Any:
    """The Python value of a hashable constant slot, or _NO_CONST."""
    if v.kind in _SCALARS:
        return v.const
    if v.kind == "tuple" and depth < 8 and v.const is not None:
        items = [_constant(x, depth + 1) for x in v.const]
        if all(i is not _NO_CONST for i in items):
            return tuple(items)
    return _NO_CONST


_PROTO = 0x80
_STATE_DUNDERS = frozenset(
    {"__dict__", "__pydantic_extra__", "__pydantic_fields_set__", "__pydantic_private__"}
)


class _Scan:
    """One symbolic run of a stream (see `prescan`)."""

    def __init__(self, data: bytes, allow: Allowlist, budgets: Budgets) -> None:
        self.data = data
        self.allow = allow
        self.b = budgets
        self.stack: list[_Val] = []
        self.meta: list[list[_Val]] = []
        self.memo: list[_Val] = []
        self.globals: set[str] = set()

    def refuse(self, why: str, pos: int, budget: str | None = None) -> UnpickleRefused:
        return UnpickleRefused(f"{why} (at byte {pos})", budget=budget)

    def pop(self, pos: int) -> _Val:
        if not self.stack:
            raise self.refuse("stack underflow", pos)
        return self.stack.pop()

    def pop_mark(self, pos: int) -> list[_Val]:
        if not self.meta:
            raise self.refuse("a mark-consuming opcode without a MARK", pos)
        items = self.stack
        self.stack = self.meta.pop()
        return items

    def top(self, pos: int) -> _Val:
        if not self.stack:
            raise self.refuse("stack underflow", pos)
        return self.stack[-1]

    def push(self, v: _Val, pos: int) -> None:
        if v.depth > self.b.max_depth:
            raise self.refuse(f"nesting deeper than {self.b.max_depth}", pos, "max_depth")
        self.stack.append(v)

    def grow(self, target: _Val, items: list[_Val], pos: int) -> None:
        if items:
            deepest = max(map(_DEPTH, items)) + 1
            if deepest > target.depth:
                target.depth = deepest
        if target.depth > self.b.max_depth:
            raise self.refuse(f"nesting deeper than {self.b.max_depth}", pos, "max_depth")

    def count_hashes(self, target: _Val, keys: Iterable[_Val], pos: int) -> None:
        for k in keys:
            if k.kind not in _FLOODABLE:
                continue  # str and bytes hashes are salted per process: not craftable
            c = _constant(k)
            if c is _NO_CONST:
                continue
            try:
                h = hash(c)
            except TypeError:
                raise self.refuse("an unhashable key", pos) from None
            if target.hashes is None:
                target.hashes = {}
            n = target.hashes.get(h, 0) + 1
            target.hashes[h] = n
            if n > self.b.max_same_hash:
                raise self.refuse(
                    f"more than {self.b.max_same_hash} keys share one hash (hash flooding)",
                    pos,
                    "max_same_hash",
                )

    def use(self, g: _Val, use: str, pos: int, args: list[_Val] | None = None) -> _Entry:
        if g.kind != "global":
            raise self.refuse(
                f"{use.upper()} on something that is not an allowed global "
                f"({g.kind}): only a vetted global may be called",
                pos,
            )
        entry = self.allow.lookup(g.name)
        if use not in entry.uses:
            raise UnpickleRefused(
                f"{g.name} may not be used for {use.upper()} (at byte {pos})", target=g.name
            )
        if args is not None and entry.args is not None and not entry.args(args):
            kinds = ", ".join(a.kind if a.kind != "obj" else a.name for a in args)
            raise UnpickleRefused(
                f"{g.name} called with arguments ({kinds}) outside its allowed shapes "
                f"(at byte {pos})",
                target=g.name,
            )
        return entry

    def check_state(self, state: _Val, pos: int, own_setstate: bool) -> None:
        if own_setstate:
            if state.kind not in _DATA:
                raise self.refuse(f"BUILD with a {state.kind} state", pos)
            return
        parts = [state]
        if state.kind == "tuple" and state.const is not None and len(state.const) == 2:
            parts = list(state.const)
        for part in parts:
            if part.kind == "none":
                continue
            if part.kind != "dict":
                raise self.refuse(f"BUILD with a {part.kind} state (a dict is expected)", pos)
            for batch in part.keys or ():
                for k in batch:
                    if k.kind != "str":
                        raise self.refuse(f"BUILD sets an attribute named by a {k.kind}", pos)
                    if k.const.startswith("__") and k.const not in _STATE_DUNDERS:
                        raise self.refuse(f"BUILD sets the attribute {k.const[:40]!r}", pos)

    def run(self) -> None:
        data = self.data
        n = len(data)
        b = self.b
        if n > b.max_bytes:
            raise UnpickleRefused(
                f"the pickle is {n} bytes, above the cap of {b.max_bytes} bytes", budget="max_bytes"
            )
        if n < 3 or data[0] != _PROTO or data[1] not in (4, 5):
            raise UnpickleRefused("the stream does not start with PROTO 4 or 5")
        pos = 2
        ops = 0
        unpack = struct.unpack_from
        stack_push = self.push
        memo = self.memo
        # Every opcode takes at least one byte, so the opcode budget only needs counting
        # when it is smaller than the stream.
        count_ops = b.max_opcodes < n
        while True:
            if pos >= n:
                raise self.refuse("the stream ends before STOP", pos)
            if count_ops:
                ops += 1
                if ops > b.max_opcodes:
                    raise self.refuse(f"more than {b.max_opcodes} opcodes", pos, "max_opcodes")
            op = data[pos]
            at = pos
            pos += 1
            # Fast paths for the opcodes that dominate real streams (scalars have depth 0,
            # so they skip the depth check); each mirrors its general case below.
            if op == 0x8C:  # SHORT_BINUNICODE
                if pos >= n:
                    raise self.refuse("truncated length", at)
                end = pos + 1 + data[pos]
                if end > n:
                    raise self.refuse("a length past the end of the stream", at)
                try:
                    text = data[pos + 1 : end].decode("utf-8", "surrogatepass")
                except UnicodeDecodeError:
                    raise self.refuse("a string that is not UTF-8", at) from None
                pos = end
                self.stack.append(_Val("str", text))
                continue
            if op == 0x94:  # MEMOIZE
                if len(memo) >= b.max_memo:
                    raise self.refuse(f"more than {b.max_memo} memo entries", at, "max_memo")
                if not self.stack:
                    raise self.refuse("stack underflow", at)
                memo.append(self.stack[-1])
                continue
            if op == 0x47:  # BINFLOAT
                if pos + 8 > n:
                    raise self.refuse("truncated float", at)
                self.stack.append(_Val("float", unpack(">d", data, pos)[0]))
                pos += 8
                continue
            if op == 0x2E:  # STOP
                if self.meta or len(self.stack) != 1:
                    raise self.refuse("STOP with an unbalanced stack", at)
                if pos != n:
                    raise self.refuse("bytes after STOP", pos)
                return
            if op == 0x95:  # FRAME
                if pos + 8 > n:
                    raise self.refuse("truncated FRAME", at)
                (size,) = unpack("<Q", data, pos)
                pos += 8
                if size > n - pos:
                    raise self.refuse("a FRAME longer than the stream", at)
                continue
            if op == 0x58 or op == 0x8D:  # BINUNICODE, BINUNICODE8
                width = 4 if op == 0x58 else 8
                size, pos = _length(data, pos, width, at)
                raw = data[pos : pos + size]
                pos += size
                try:
                    text = raw.decode("utf-8", "surrogatepass")
                except UnicodeDecodeError:
                    raise self.refuse("a string that is not UTF-8", at) from None
                stack_push(_Val("str", text), at)
                continue
            if op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                width = 1 if op == 0x68 else 4
                if pos + width > n:
                    raise self.refuse("truncated GET", at)
                idx = data[pos] if width == 1 else unpack("<I", data, pos)[0]
                pos += width
                if idx >= len(self.memo):
                    raise self.refuse(f"GET of memo entry {idx} that was never stored", at)
                stack_push(self.memo[idx], at)
                continue
            if op == 0x4B or op == 0x4D or op == 0x4A:  # BININT1, BININT2, BININT
                fmt, width = {0x4B: ("<B", 1), 0x4D: ("<H", 2), 0x4A: ("<i", 4)}[op]
                if pos + width > n:
                    raise self.refuse("truncated integer", at)
                (value,) = unpack(fmt, data, pos)
                pos += width
                stack_push(_Val("int", value), at)
                continue
            if op == 0x8A or op == 0x8B:  # LONG1, LONG4
                size, pos = _length(data, pos, 1 if op == 0x8A else 4, at, signed=op == 0x8B)
                if size > b.max_int_bytes:
                    raise self.refuse(
                        f"an integer of {size} bytes (cap {b.max_int_bytes})", at, "max_int_bytes"
                    )
                value = int.from_bytes(data[pos : pos + size], "little", signed=True)
                pos += size
                stack_push(_Val("int", value), at)
                continue
            if op in (0x43, 0x42, 0x8E, 0x96):  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                width = {0x43: 1, 0x42: 4, 0x8E: 8, 0x96: 8}[op]
                size, pos = _length(data, pos, width, at)
                kind = "bytearray" if op == 0x96 else "bytes"
                stack_push(_Val(kind, bytes(data[pos : pos + size]) if size <= 64 else None), at)
                pos += size
                continue
            if op == 0x28:  # MARK
                if len(self.meta) >= b.max_depth:
                    raise self.refuse(f"MARKs nested deeper than {b.max_depth}", at, "max_depth")
                self.meta.append(self.stack)
                self.stack = []
                continue
            if op in (0x4E, 0x88, 0x89):  # NONE, NEWTRUE, NEWFALSE
                kind = "none" if op == 0x4E else "bool"
                stack_push(_Val(kind, None if op == 0x4E else op == 0x88), at)
                continue
            if op in (0x5D, 0x7D, 0x8F, 0x29):  # EMPTY_LIST, EMPTY_DICT, EMPTY_SET, EMPTY_TUPLE
                kind = {0x5D: "list", 0x7D: "dict", 0x8F: "set", 0x29: "tuple"}[op]
                stack_push(_Val(kind, [] if kind == "tuple" else None), at)
                continue
            if op == 0x61 or op == 0x65:  # APPEND, APPENDS
                items = [self.pop(at)] if op == 0x61 else self.pop_mark(at)
                target = self.top(at)
                if target.kind != "list" and not (
                    target.kind == "obj" and APPENDS in self.allow.lookup(target.name).uses
                ):
                    raise self.refuse(f"APPEND to a {target.kind}", at)
                self.grow(target, items, at)
                continue
            if op == 0x73 or op == 0x75:  # SETITEM, SETITEMS
                if op == 0x73:
                    value_v = self.pop(at)
                    items = [self.pop(at), value_v]
                else:
                    items = self.pop_mark(at)
                    if len(items) % 2:
                        raise self.refuse("SETITEMS with an odd number of items", at)
                target = self.top(at)
                if target.kind != "dict" and not (
                    target.kind == "obj" and SETITEMS in self.allow.lookup(target.name).uses
                ):
                    raise self.refuse(f"SETITEM on a {target.kind}", at)
                keys = items[0::2]
                self.count_hashes(target, keys, at)
                if target.kind == "dict":
                    if target.keys is None:
                        target.keys = []
                    target.keys.append(keys)
                self.grow(target, items, at)
                continue
            if op == 0x90:  # ADDITEMS
                items = self.pop_mark(at)
                target = self.top(at)
                if target.kind != "set":
                    raise self.refuse(f"ADDITEMS to a {target.kind}", at)
                self.count_hashes(target, items, at)
                self.grow(target, items, at)
                continue
            if op == 0x91:  # FROZENSET
                items = self.pop_mark(at)
                v = _Val("frozenset")
                self.count_hashes(v, items, at)
                self.grow(v, items, at)
                stack_push(v, at)
                continue
            if op == 0x74 or op in (0x85, 0x86, 0x87):  # TUPLE, TUPLE1..3
                if op == 0x74:
                    items = self.pop_mark(at)
                else:
                    count = op - 0x84
                    if len(self.stack) < count:
                        raise self.refuse("stack underflow", at)
                    items = self.stack[-count:]
                    del self.stack[-count:]
                v = _Val("tuple", items)
                self.grow(v, items, at)
                stack_push(v, at)
                continue
            if op == 0x30:  # POP
                if self.stack:
                    self.stack.pop()
                else:
                    self.pop_mark(at)
                continue
            if op == 0x31:  # POP_MARK
                self.pop_mark(at)
                continue
            if op == 0x93:  # STACK_GLOBAL
                name_v = self.pop(at)
                module_v = self.pop(at)
                if name_v.kind != "str" or module_v.kind != "str":
                    raise self.refuse("STACK_GLOBAL with names that are not literal strings", at)
                full = f"{module_v.const}.{name_v.const}"
                self.allow.lookup(full)  # refuses unknown or denied names right here
                self.globals.add(full)
                if len(self.globals) > b.max_globals:
                    raise self.refuse(
                        f"more than {b.max_globals} distinct globals", at, "max_globals"
                    )
                stack_push(_Val("global", name=full), at)
                continue
            if op == 0x52:  # REDUCE
                args = self.pop(at)
                func = self.pop(at)
                if args.kind != "tuple":
                    raise self.refuse("REDUCE with arguments that are not a tuple", at)
                self.use(func, REDUCE, at, args.const)
                stack_push(_Val("obj", name=func.name, depth=args.depth + 1), at)
                continue
            if op == 0x81:  # NEWOBJ
                args = self.pop(at)
                cls = self.pop(at)
                if args.kind != "tuple":
                    raise self.refuse("NEWOBJ with arguments that are not a tuple", at)
                self.use(cls, NEWOBJ, at, args.const)
                stack_push(_Val("obj", name=cls.name, depth=args.depth + 1), at)
                continue
            if op == 0x92:  # NEWOBJ_EX
                kwargs = self.pop(at)
                args = self.pop(at)
                cls = self.pop(at)
                if args.kind != "tuple" or kwargs.kind != "dict":
                    raise self.refuse("NEWOBJ_EX with malformed arguments", at)
                self.use(cls, NEWOBJ_EX, at, None)
                stack_push(_Val("obj", name=cls.name, depth=max(args.depth, kwargs.depth) + 1), at)
                continue
            if op == 0x62:  # BUILD
                state = self.pop(at)
                target = self.top(at)
                if target.kind != "obj":
                    raise self.refuse(
                        f"BUILD on a {target.kind}: only an instance built in "
                        f"the stream may receive state",
                        at,
                    )
                entry = self.allow.lookup(target.name)
                if BUILD not in entry.uses:
                    raise UnpickleRefused(
                        f"{target.name} may not receive state (BUILD)", target=target.name
                    )
                if not entry.trusted:  # globals a policy names exactly keep their own state
                    self.check_state(state, at, entry.own_setstate)
                self.grow(target, [state], at)
                continue
            name = _OPCODE_NAMES.get(op, f"0x{op:02x}")
            raise self.refuse(f"opcode {name} is outside the allowed families", at)


def _length(data: bytes, pos: int, width: int, at: int, *, signed: bool = False) -> tuple[int, int]:
    if pos + width > len(data):
        raise UnpickleRefused(f"truncated length (at byte {at})")
    size = int.from_bytes(data[pos : pos + width], "little", signed=signed)
    pos += width
    if size < 0 or size > len(data) - pos:
        raise UnpickleRefused(f"a length of {size} past the end of the stream (at byte {at})")
    return size, pos


_OPCODE_NAMES = {
    ord("c"): "GLOBAL",
    ord("i"): "INST",
    ord("o"): "OBJ",
    ord("P"): "PERSID",
    ord("Q"): "BINPERSID",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    ord("p"): "PUT",
    ord("q"): "BINPUT",
    ord("r"): "LONG_BINPUT",
    ord("g"): "GET",
    ord("S"): "STRING",
    ord("T"): "BINSTRING",
    ord("U"): "SHORT_BINSTRING",
    ord("V"): "UNICODE",
    ord("I"): "INT",
    ord("L"): "LONG",
    ord("F"): "FLOAT",
    ord("2"): "DUP",
    ord("d"): "DICT",
    ord("l"): "LIST",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
    0x80: "PROTO",
}


def prescan(
    data: bytes, allow: Allowlist | None = None, budgets: Budgets | None = None
) -> set[str]:
    """Check a stream before anything is built; return the globals it names.

    Raises `UnpickleRefused` naming the opcode, the global or the budget at fault. A stream
    of plain data (no globals) is first offered to the C prescan (`guards/_fastscan.c`),
    which accepts only what this Python scan accepts and answers "not sure" for everything
    else; then this scan runs and decides.
    """
    data = bytes(data)
    budgets = budgets or Budgets()
    if _fastscan is not None and _fastscan.prescan_data(
        data,
        budgets.max_bytes,
        budgets.max_opcodes,
        budgets.max_depth,
        budgets.max_memo,
        budgets.max_int_bytes,
        budgets.max_same_hash,
    ):
        return set()
    return python_prescan(data, allow, budgets)


def python_prescan(
    data: bytes, allow: Allowlist | None = None, budgets: Budgets | None = None
) -> set[str]:
    """`prescan` without the C fast path (the reference the C prescan is tested against)."""
    scan = _Scan(bytes(data), allow or Allowlist(), budgets or Budgets())
    try:
        scan.run()
    except UnpickleRefused:
        raise
    except (RecursionError, MemoryError, OverflowError, ValueError, struct.error) as exc:
        raise UnpickleRefused(f"the prescan failed: {type(exc).__name__}") from None
    return scan.globals


# -- steps 2 and 3: find_class and the C unpickler -----------------------------------------------


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allow: Allowlist) -> None:
        super().__init__(io.BytesIO(data))
        self._allow = allow

    def find_class(self, module: str, name: str) -> Any:
        return self._allow.lookup(f"{module}.{name}").obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnpickleRefused("persistent ids are not allowed")


def load_restricted(
    data: bytes, allow: Allowlist | None = None, budgets: Budgets | None = None
) -> Any:
    """Prescan `data`, then build it with the vetting `find_class`; the one entry point."""
    allow = allow or Allowlist()
    data = bytes(data)
    prescan(data, allow, budgets)
    try:
        return _Unpickler(data, allow).load()
    except UnpickleRefused:
        raise
    except RecursionError:
        raise UnpickleRefused("the value nests too deeply to build") from None
    except Exception as exc:
        raise UnpickleRefused(
            f"building the value failed: {type(exc).__name__}: {_short(exc)}"
        ) from None


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
        self.budgets = Budgets(max_bytes=max_bytes)
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

    def decode_value(self, data: dict[str, Any]) -> Any:
        """The value of a `result` event carrying a pickle; raises UnpickleRefused."""
        if not self.objects:
            raise UnpickleRefused(
                "the worker sent a pickle although the policy's result mode "
                "is data-only; it was not read"
            )
        if data.get("encoding") != "pickle-b64":
            raise UnpickleRefused(f"unknown result encoding {str(data.get('encoding'))[:40]!r}")
        return load_restricted(self._bytes(data.get("pickle")), self.allow, self.budgets)

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

    def rebuild_exception(self, payload: Any) -> Rebuilt:
        """The worker's exception as the host should raise it (see `Rebuilt`)."""
        notes: list[str] = []
        exc, tb = self._rebuild(payload, notes, 0)
        return Rebuilt(exc, tb, notes)

    def _rebuild(
        self, payload: Any, notes: list[str], depth: int
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
                args, state = self._args_state(rich["pickle"])
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
                        chained, chained_tb = self._rebuild(payload[key], notes, depth + 1)
                    except UnpickleRefused:
                        continue
                    chained.__traceback__ = chained_tb
                    if key == "cause":
                        exc.__cause__ = chained
                    else:
                        exc.__context__ = chained
            exc.__suppress_context__ = bool(payload.get("suppress_context"))
        return exc, tb

    def _args_state(self, text: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        value = load_restricted(self._bytes(text), self.allow, self.budgets)
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
