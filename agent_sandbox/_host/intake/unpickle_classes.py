"""The restricted unpickler's class policy: the globals a stream may name, and their uses.

`BUILTIN_TYPES` is the allowlist every decoder starts from (builtin containers and numbers,
strings, bytes, `datetime`, `decimal`, `fractions`, `uuid`, pure paths, a few `collections`
types and builtin exceptions), each entry with the uses it grants (REDUCE, NEWOBJ, BUILD,
...) and the argument shapes it accepts. `Allowlist` adds what a policy names with
`result_types` and resolves every name without importing anything. `DENIED_GLOBALS` and
`DENIED_MODULES` are the denylist backstop, checked first. The flow is in
`agent_sandbox._host.intake.unpickle`.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import pathlib
import re
import sys
import types
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from agent_sandbox._errors import UnpickleRefused

if TYPE_CHECKING:
    from agent_sandbox._host.intake.unpickle_prescan import _Val

__all__ = [
    "BUILTIN_TYPES",
    "DENIED_GLOBALS",
    "DENIED_MODULES",
    "Allowlist",
    "denied_name",
    "APPENDS",
    "BUILD",
    "NEWOBJ",
    "NEWOBJ_EX",
    "REDUCE",
    "SETITEMS",
]


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
    # NOTE: keyed by both names a pickler may use: 3.13 defines them in `pathlib._local`
    # (and pickles them under that name), 3.11 and 3.12 in `pathlib`; a worker on one
    # version and a host on another still agree.
    for path in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        for module in ("pathlib", "pathlib._local"):
            add(path, (REDUCE,), _strings, name=f"{module}.{path.__qualname__}")
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
            entry = self._policy_entry(name, _public_name(name))
        self._cache[name] = entry
        return entry

    def _policy_entry(self, name: str, public: str | None) -> _Entry:
        """`public` is the name a user writes for the global the pickle names `name` from a
        private module (`_public_name`): a policy may name either, and a refusal names both."""
        module, qualname = _split(name)
        if module is None or qualname is None:
            named = name in self.exact or any(name.startswith(m + ".") for m in self.modules)
            if named:
                raise UnpickleRefused(
                    f"{name}: its module is not loaded in the host, and the decoder never "
                    f"imports; import it in the host before the call",
                    target=name,
                )
            raise _not_allowed(name, public)
        if name in self.exact or (public in self.exact and not denied_name(str(public))):
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
        raise _not_allowed(name, public)


def _not_allowed(name: str, public: str | None = None) -> UnpickleRefused:
    """The refusal of a global no table allows; a global defined in a private module is
    named as users write it, then where it is defined (`pathlib.PosixPath (defined as
    pathlib._local.PosixPath)` on 3.13), and the hint names the public form."""
    shown = name if public is None else f"{public} (defined as {name})"
    named = public or name
    mod = name.rpartition(".")[0] or name
    return UnpickleRefused(
        f"{shown} is not in the objects allowlist",
        target=name,
        hint=f'result_types = ["{named}"]  (or "{mod}.*" for its models and dataclasses)',
    )


def _public_name(name: str) -> str | None:
    """The public name of a global a pickle names from a private module: the nearest
    loaded parent package without a `_` part that holds the same object under the same
    qualname (`pathlib._local.PosixPath` -> `pathlib.PosixPath`). None when `name` is public,
    or no such parent holds it. Like `_resolve`, it reads `__dict__`s only."""
    module, qualname = _split(name)
    if module is None or qualname is None:
        return None
    parts = module.split(".")
    if not any(part.startswith("_") for part in parts):
        return None
    try:
        obj = _resolve(module, qualname, name)
    except UnpickleRefused:
        return None
    for end in range(len(parts) - 1, 0, -1):
        parent = parts[:end]
        if any(part.startswith("_") for part in parent) or ".".join(parent) not in sys.modules:
            continue
        try:
            if _resolve(".".join(parent), qualname, name) is obj:
                return f"{'.'.join(parent)}.{qualname}"
        except UnpickleRefused:
            continue
    return None


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
