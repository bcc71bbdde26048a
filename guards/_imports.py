"""The import guard: user code imports only what `[imports]` allows.

What it enforces:

1. Only imports made directly by user code are judged: the `<cell-N>` cells and strings they
   compile. Imports made by the standard library, installed packages and the worker itself
   (a granted package's own internals, `numpy` importing `pickle`) are not charged to the
   policy; the other guards still judge what that code then does.
2. Two hooks judge, so that both fresh and already-loaded modules are covered:
   * the user namespace gets its own `__builtins__` whose `__import__` judges every import
     statement of user code, including modules loaded before arming (`socket`, which the
     worker's transport uses) and relative imports (judged by their absolute name). That
     `__import__` is `user_import`: the C `FastImport` of `_fastimport.c`, which answers a
     plain `import x` of a top-level module this guard already allowed and imported (the
     `_ok` set) straight from `sys.modules`, and passes every other call to `guarded_import`
     unchanged. Without the compiled extension, `user_import` is `guarded_import` itself;
   * a finder at the head of `sys.meta_path` judges imports that reach the import system by
     another route (`importlib.import_module`, which is also wrapped, or `__import__` reached
     through the real `builtins`), by looking at the frame that started the import.
3. A PEP 578 audit hook keeps the finder at index 0: before each import that reaches the
   import system, it moves the finder back if another one overtook it (setuptools'
   `DistutilsMetaFinder`, wrapt's post-import `ImportHookFinder`, crewai's CLI shim) or
   re-inserts it if it was removed. Overtaking is the ordinary case, so it is repaired, not
   refused.
4. `allow = ["pkg"]` allows `pkg` and `pkg.*`; `deny` beats `allow`; `"*"` allows all.
   `from pkg import sub` is allowed when `pkg` is, or when every `pkg.sub` named is.
5. User code never holds an allowed module itself but its view (`ModuleView` of
   `_fastimport.c`): reads and writes go to the module, and a module reached through it
   as an attribute (`typing.sys`, `random._os`, `numpy.ctypeslib.ctypes`) is judged like an
   import of that module, by its own name, unless it is the attribute's own submodule
   (`os.path`, `numpy.linalg`). An extension module that leads to no other module (`math`,
   `itertools`: no module among its attributes, no `__builtins__`, not a package) is handed
   out as it is. `__dict__` (so `vars()` and `dir()`) lists the allowed
   modules as views and leaves the refused ones out; `sys.modules` read through the view
   of `sys` is a table that judges each module it hands out; `__builtins__` is the user
   namespace's own. Library code keeps the modules themselves: only what user code reaches
   is judged.

What it does NOT stop: a module handed out by a function of an allowed module
(`inspect.getmodule`, `pkgutil.resolve_name`), or reached through a dunder (a function's
`__globals__`) or the class hierarchy; a granted package that re-exports a forbidden one
as a non-module object. The audit hook cannot be removed, but it only repairs the finder;
it is not a boundary either.
"""

from __future__ import annotations

import builtins
import importlib
import sys
import types
from _thread import get_ident
from collections.abc import Iterator, MutableMapping
from importlib.machinery import BuiltinImporter, FrozenImporter, PathFinder

from agent_sandbox._denial import Denial
from agent_sandbox._errors import ImportDenied
from agent_sandbox._hints import grant_hint
from agent_sandbox.guards import _patch
from agent_sandbox.guards._state import is_user_frame, refuse, state

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "GuardFinder",
    "ImportRules",
    "configure",
    "finder",
    "guarded_import",
    "install",
    "make_user_builtins",
    "restore_finder",
    "user_import",
]

_st = state
_orig_import = builtins.__import__
_modules = sys.modules
_getframe = sys._getframe


class ImportRules:
    """The `[imports]` section: which module names user code may import."""

    def __init__(self, imports: dict[str, Any], policy_name: str = "") -> None:
        self.allow: tuple[str, ...] = tuple(str(e) for e in imports.get("allow", ()))
        self.deny: tuple[str, ...] = tuple(str(e) for e in imports.get("deny", ()))
        self.policy_name = policy_name

    @staticmethod
    def _covers(entry: str, name: str) -> bool:
        if entry == "*":
            return True
        if entry.endswith(".*"):
            return name.startswith(entry[:-1])
        return name == entry or name.startswith(entry + ".")

    def denied_by(self, name: str) -> str | None:
        for entry in self.deny:
            if self._covers(entry, name):
                return entry
        return None

    def allows(self, name: str) -> bool:
        if self.denied_by(name) is not None:
            return False
        return any(self._covers(entry, name) for entry in self.allow)

    def denial(self, name: str) -> Denial:
        entry = self.denied_by(name)
        if entry is not None:
            return Denial(
                rule="imports",
                action="import",
                target=name,
                policy=self.policy_name,
                detail=f"{entry!r} is listed in [imports] deny, which beats [imports] allow",
                hint=f"remove {entry!r} from [imports] deny",
            )
        top = name.split(".")[0]
        return Denial(
            rule="imports",
            action="import",
            target=name,
            policy=self.policy_name,
            detail="the module is not in [imports] allow",
            hint=grant_hint({"imports.allow": [top]}),
        )


_rules = ImportRules({})
#: Top-level names user code already imported with the policy's blessing (fast path).
_ok: set[str] = set()
#: Top-level name -> the view user code gets for it (read by the C fast path).
_views: dict[str, Any] = {}
#: id(module) -> (module, its view): one view per module object.
_by_id: dict[int, tuple[Any, Any]] = {}
#: id(view) -> (view, its module), for the few calls that need the module itself (reload).
_real_of: dict[int, tuple[Any, Any]] = {}


def configure(rules: ImportRules) -> None:
    global _rules
    _rules = rules
    _ok.clear()
    _views.clear()
    _by_id.clear()
    _real_of.clear()


def _view_type() -> Any:
    try:
        from agent_sandbox.guards import _fastimport
    except ImportError:
        return None
    return getattr(_fastimport, "ModuleView", None)


ModuleView: Any = _view_type()
_ModuleType = types.ModuleType


def view_of(module: Any) -> Any:
    """The view user code gets for `module` (itself when it is no module or has no view)."""
    if ModuleView is None or not isinstance(module, _ModuleType) or type(module) is ModuleView:
        return module
    hit = _by_id.get(id(module))
    if hit is not None and hit[0] is module:
        return hit[1]
    namespace = module.__dict__
    if (
        module is not sys  # its `modules` is the module table
        and "__builtins__" not in namespace
        and "__path__" not in namespace
        and not any(isinstance(value, _ModuleType) for value in list(namespace.values()))
    ):
        # An extension module that leads to no other module (math, itertools): nothing to
        # judge, so user code gets the module itself and pays nothing per attribute.
        view = module
    else:
        view = ModuleView(module, _attribute_hook)
        _real_of[id(view)] = (view, module)
    _by_id[id(module)] = (module, view)
    name = module.__dict__.get("__name__")
    if isinstance(name, str) and "." not in name:
        _views[name] = view
    return view


def _attribute_target(real: Any, name: str, value: Any) -> str:
    """The module name an attribute read `real.name` is judged as.

    The attribute's own submodule (`os.path`, `numpy.linalg`) is judged by its place in the
    package; any other module (`typing.sys`, `numpy.ctypeslib.ctypes`) by its own name.
    """
    parent = real.__dict__.get("__name__")
    own = value.__dict__.get("__name__")
    if isinstance(parent, str):
        qualified = f"{parent}.{name}"
        if own == qualified or _modules.get(qualified) is value:
            return qualified
    if isinstance(own, str):
        return own
    return f"<a module without a name, reached as {parent}.{name}>"


def _judge_attribute(real: Any, name: str, value: Any) -> Any:
    target = _attribute_target(real, name, value)
    if not _rules.allows(target):
        denial = _rules.denial(target)
        where = f"{real.__dict__.get('__name__')}.{name}"
        if where != target:
            denial = denial.replace(detail=f"{denial.detail} (reached as the attribute {where})")
        refuse(ImportDenied, denial)  # returns only in learning mode
    return view_of(value)


def _attribute_hook(real: Any, name: str, value: Any) -> Any:
    """What user code gets for `view.name` (called by `ModuleView` for modules and for
    `__dict__`, `__builtins__` and `modules`)."""
    if not (_st.armed or (_st.user_threads and get_ident() in _st.user_threads)):
        return value
    if isinstance(value, _ModuleType):
        return _judge_attribute(real, name, value)
    if name == "__dict__" and type(value) is dict:
        return _visible_dict(real, value)
    if name == "__builtins__" and _user_builtins is not None:
        return _user_builtins
    if name == "modules" and real is sys:
        return _table
    return value


def _visible_dict(real: Any, namespace: dict[str, Any]) -> dict[str, Any]:
    """A copy of a module's namespace as user code may see it: allowed modules as views,
    refused ones left out (nobody asked for them, so nothing is recorded)."""
    out = {}
    for key, value in list(namespace.items()):
        if isinstance(value, _ModuleType) and type(value) is not ModuleView:
            if not _rules.allows(_attribute_target(real, key, value)):
                continue
            value = view_of(value)
        elif key == "__builtins__" and _user_builtins is not None:
            value = _user_builtins
        out[key] = value
    return out


class _ModuleTable(MutableMapping[str, "Any"]):  # (a string: no `typing` at run time)
    """`sys.modules` as user code sees it through the view of `sys`: each module it hands
    out is judged like an import of its name; writes and deletes go to `sys.modules`."""

    def __getitem__(self, name: str) -> Any:
        module = _modules[name]
        if isinstance(name, str) and not _rules.allows(name):
            denial = _rules.denial(name)
            refuse(
                ImportDenied,
                denial.replace(detail=f"{denial.detail} (reached through sys.modules)"),
            )
        return view_of(module)

    def __setitem__(self, name: str, module: Any) -> None:
        _modules[name] = module

    def __delitem__(self, name: str) -> None:
        del _modules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(_modules))

    def __len__(self) -> int:
        return len(_modules)

    def __contains__(self, name: object) -> bool:
        return name in _modules

    def values(self) -> Any:
        return [view_of(m) for k, m in list(_modules.items()) if _rules.allows(k)]

    def items(self) -> Any:
        return [(k, view_of(m)) for k, m in list(_modules.items()) if _rules.allows(k)]

    def __repr__(self) -> str:
        return f"<sys.modules as user code sees it: {len(_modules)} modules>"


_table = _ModuleTable()
_user_builtins: Any = None


def _judge(name: str) -> None:
    if not _rules.allows(name):
        refuse(ImportDenied, _rules.denial(name))


def _absolute(name: str, globals_: Any, level: int) -> str:
    """The absolute name of a relative import, as the import system would compute it."""
    package = None
    if isinstance(globals_, dict):
        package = globals_.get("__package__")
        if not package:
            spec = globals_.get("__spec__")
            package = getattr(spec, "parent", None)
    if not package or not isinstance(package, str):
        return name  # the import itself raises "no known parent package"
    bits = package.rsplit(".", level - 1)
    if len(bits) < level:
        return name
    base = bits[0]
    return f"{base}.{name}" if name else base


def guarded_import(
    name: str,
    globals: Any = None,
    locals: Any = None,
    fromlist: Any = (),
    level: int = 0,
    *,
    _ok: set[str] = _ok,
    _get: Any = _modules.get,
) -> Any:
    """`__import__` for user code: judge the module, then import it the ordinary way.

    The fast path (a plain `import x` of a top-level module already judged allowed) is the
    C one's twin for when `_fastimport` is not built; it uses keyword-only defaults as
    locals, as it then runs on every import statement of user code.
    """
    if name in _ok and not level and not fromlist:
        module = _get(name)
        if module is not None:
            return view_of(module)
    remember = False
    if _st.armed or (_st.user_threads and get_ident() in _st.user_threads):
        absolute = _absolute(name, globals, level) if level else name
        if _rules.allows(absolute):
            remember = not level and not fromlist and "." not in name
        elif fromlist and all(
            isinstance(item, str) and item != "*" and _rules.allows(f"{absolute}.{item}")
            for item in fromlist
        ):
            pass  # `from pkg import sub` where each `pkg.sub` is allowed
        elif level and not name and fromlist:
            for item in fromlist:  # `from . import x` names the module `package.x`
                _judge(f"{absolute}.{item}")
        else:
            _judge(absolute)
    module = _orig_import(name, globals, locals, fromlist, level)
    view = view_of(module)
    if remember:
        # Only once the import returned: a module another thread is still initialising
        # must never be served by a fast path (the import system makes that thread wait).
        _ok.add(name)
    return view


def _fast(slow: Any) -> Any:
    """`slow` behind the C fast path, or `slow` itself when the extension is not built."""
    try:
        from agent_sandbox.guards._fastimport import FastImport
    except ImportError:
        return slow
    if ModuleView is None:
        return FastImport(_ok, _modules, slow)
    return FastImport(_ok, _modules, slow, _views)


#: The `__import__` of the user namespace's builtins (`_install` checks it is still there).
user_import: Any = _fast(guarded_import)


_SKIP_PREFIXES: tuple[str, ...] = ("<frozen importlib",)


def _importer_is_user() -> bool:
    """Whether the frame that started this import (import machinery skipped) is user code."""
    frame: Any = _getframe(2)
    while frame is not None:
        filename: str = frame.f_code.co_filename
        if not filename.startswith(_SKIP_PREFIXES):
            return is_user_frame(filename)
        frame = frame.f_back
    return False


class GuardFinder:
    """The meta-path finder that judges imports started by user code; it never loads."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        active = _st.armed or (_st.user_threads and get_ident() in _st.user_threads)
        if active and _importer_is_user():
            _judge(fullname)
        return None

    def invalidate_caches(self) -> None:
        return None

    def __repr__(self) -> str:
        return "<agent_sandbox import guard>"


_finder = GuardFinder()
_finder_on = False
_displaced: list[str] = []


def finder() -> GuardFinder:
    return _finder


def restore_finder() -> bool:
    """Put the finder back at the head of `sys.meta_path`; False when that failed."""
    try:
        meta = sys.meta_path
        if not isinstance(meta, list):
            sys.meta_path = [_finder, BuiltinImporter, FrozenImporter, PathFinder]
            return True
        while _finder in meta:
            meta.remove(_finder)
        meta.insert(0, _finder)
        return True
    except Exception:
        return False


def _audit_hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "import" and _finder_on:
        meta = sys.meta_path
        if (not meta or meta[0] is not _finder) and not restore_finder():
            _displaced.append("the import finder could not be put back at sys.meta_path[0]")
        _patch.keep_post_import_finder()


_hook_added = False


def _import_module_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _st.armed or (_st.user_threads and get_ident() in _st.user_threads):
        frame = _getframe(1)
        if is_user_frame(frame.f_code.co_filename):
            name = args[0] if args else kwargs.get("name", "")
            package = args[1] if len(args) > 1 else kwargs.get("package")
            if isinstance(name, str):
                if name.startswith("."):
                    level = len(name) - len(name.lstrip("."))
                    name = _absolute(name[level:], {"__package__": package}, level)
                _judge(name)
                return view_of(wrapped(*args, **kwargs))
    return wrapped(*args, **kwargs)


def _reload_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """`importlib.reload` of a view reloads its module (the import system knows only that)."""
    if args:
        hit = _real_of.get(id(args[0]))
        if hit is not None and hit[0] is args[0]:
            return view_of(wrapped(hit[1], *args[1:], **kwargs))
    return wrapped(*args, **kwargs)


def make_user_builtins() -> types.ModuleType:
    """A copy of `builtins` for the user namespace, with the judging `__import__`."""
    global _user_builtins
    module = types.ModuleType("builtins", builtins.__doc__)
    module.__dict__.update(builtins.__dict__)
    module.__dict__["__import__"] = user_import
    _user_builtins = module
    return module


def install() -> None:
    """Insert the finder, add the audit hook (once per process) and wrap import_module."""
    global _finder_on, _hook_added
    _patch.wrap(importlib, "import_module", _import_module_wrapper)
    _patch.wrap(importlib, "reload", _reload_wrapper)
    _finder_on = True
    restore_finder()
    if not _hook_added:
        sys.addaudithook(_audit_hook)
        _hook_added = True


def uninstall() -> None:
    """Take the finder out (the audit hook stays, inert, for the life of the process)."""
    global _finder_on
    _finder_on = False
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def problems() -> list[str]:
    """Why the import guard is not intact (after trying to repair the finder's place)."""
    out = list(_displaced)
    _displaced.clear()
    if _finder_on:
        meta = sys.meta_path
        if not (isinstance(meta, list) and meta and meta[0] is _finder) and not restore_finder():
            out.append("the import finder was displaced from sys.meta_path and not restorable")
    return out
