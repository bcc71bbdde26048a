"""The one module that monkey-patches: every guard installs its wrappers through here.

What it does:

1. `wrap(owner, name, wrapper)` replaces `owner.name` with a wrapt `FunctionWrapper` (as
   `wrapt.wrap_function_wrapper` does, with a subclass that pickles by name) that
   calls `wrapper(wrapped, instance, args, kwargs)`, and records the original.
2. `wrap_later(module, name, wrapper)` does the same for a module that may not be imported
   yet: the patch is applied by a post-import hook (`_PostImportFinder`) right after the
   module executes.
3. `set_attr(owner, name, value)` is the rare plain replacement (a class swap, a module
   attribute that must stay a class); it records the original too.
4. `uninstall()` restores every original, newest first; `broken()` lists the patches whose
   attribute no longer holds what was installed (a guard replaced or removed).
5. A module imported again (removed from `sys.modules` first, or reloaded) gets the same
   patches again: every patch of a module, or of a class a module defines, is remembered by
   the module's name, and the post-import finder re-applies them right after each execution
   of that name. A fresh `_io`, `posix` or `_ctypes` (an extension module imported again is
   a new module object built from the original functions) or a fresh `ctypes` is patched
   before the import returns.

What it does NOT do: it cannot patch immutable C types (`_io.FileIO`, `_pickle.Unpickler`,
the methods of `_socket.socket`), and it cannot hide the originals, which stay reachable from
the wrappers (`__wrapped__`) and the class hierarchy. It is a guardrail's plumbing, not a
boundary.
"""

from __future__ import annotations

import itertools
import operator
import sys
import threading
import types
from collections.abc import Callable

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

    Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

__all__ = [
    "Patch",
    "broken",
    "deferred",
    "patches",
    "keep_post_import_finder",
    "resolve_global",
    "set_attr",
    "uninstall",
    "wrap",
    "wrap_later",
]


_MISSING = object()


class Patch:
    """One applied patch: where, what was there before, what we put there."""

    __slots__ = ("installed", "label", "name", "original", "owner", "where")

    def __init__(
        self, owner: Any, name: str, original: Any, installed: Any, label: str, where: Any = None
    ) -> None:
        self.owner = owner
        self.name = name
        self.original = original
        self.installed = installed
        self.label = label
        #: vars(owner), kept so the tamper check is one dict lookup per patch
        self.where = where


def _function_wrapper_type() -> Any:
    """wrapt's FunctionWrapper type, without running `wrapt/__init__.py` when it can.

    Importing the wrapt package costs about 40 ms at worker start-up (it imports asyncio,
    inspect and importlib.metadata) and the worker needs only the C type. Where wrapt is
    already imported (the host, the tests) its type is used as it is. Otherwise the C
    extension is loaded under a bare `wrapt` package that is removed again at once, so a
    later `import wrapt` by user code gets the whole, ordinary package.
    """
    loaded = sys.modules.get("wrapt")
    if loaded is not None and hasattr(loaded, "FunctionWrapper"):
        return loaded.FunctionWrapper
    import importlib
    import importlib.util
    import types

    spec = importlib.util.find_spec("wrapt")
    names = ("wrapt", "wrapt.exceptions", "wrapt._wrappers")
    saved = {name: sys.modules.get(name) for name in names}
    if spec is not None and spec.submodule_search_locations:
        bare = types.ModuleType("wrapt")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["wrapt"] = bare
        try:
            return importlib.import_module("wrapt._wrappers").FunctionWrapper
        except ImportError:
            pass  # no C extension (WRAPT_DISABLE_EXTENSIONS): use the package below
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    import wrapt

    return wrapt.FunctionWrapper


def _resolve_original(owner: Any, name: str) -> Any:
    """`owner.name` as stored, walking a class's MRO through `__dict__` (getattr would bind)."""
    if isinstance(owner, type):
        for cls in owner.__mro__:
            if name in vars(cls):
                return vars(cls)[name]
    return getattr(owner, name)


class _Wrapper(_function_wrapper_type()):  # type: ignore[misc]
    """wrapt's FunctionWrapper that pickles as the global it replaces (`posix.system`), so
    data holding a wrapped function (a pickled callback) still pickles while guarded."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (resolve_global, (self.__module__, self.__qualname__))


def resolve_global(module: str, qualname: str) -> Any:
    """What `module.qualname` names now (how a pickled wrapper is loaded again)."""
    import importlib

    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


_lock = threading.RLock()
_patches: list[Patch] = []
#: module name -> (dotted attribute, wrapper or None, value for a plain set, label): every
#: patch of that module, applied again to each new execution of it.
_pending: dict[str, list[tuple[str, Wrapper | None, Any, str]]] = {}
_hooked: set[str] = set()
#: (module, dotted attribute) of every entry in `_pending` (a membership test per patch).
_pending_names: set[tuple[str, str]] = set()
#: ids of every object installed, so a patch is never applied twice to the same place.
_installed: set[int] = set()
_generation = 0
_version = 0  # bumped on every change to _patches


def _label(owner: Any, name: str) -> str:
    base = getattr(owner, "__name__", None) or type(owner).__name__
    return f"{base}.{name}"


def _changed() -> None:
    global _version
    _version += 1


def _where(owner: Any) -> Any:
    try:
        return vars(owner)
    except TypeError:
        return None


def _own_value(owner: Any, name: str) -> Any:
    """The attribute as stored on `owner` itself (not found through the MRO)."""
    try:
        return vars(owner).get(name, _MISSING)
    except TypeError:
        return _MISSING


def _home(owner: Any, name: str) -> tuple[str, str] | None:
    """(module name, dotted attribute) under which a patch of `owner.name` is re-applied."""
    if isinstance(owner, types.ModuleType):
        # The name it is imported by: `_io` calls itself `io`, and a fresh `io` must not
        # get the patches of `_io`.
        spec = owner.__dict__.get("__spec__")
        module = getattr(spec, "name", None) or owner.__dict__.get("__name__")
        if spec is None and isinstance(module, str) and "." in module:
            parent = sys.modules.get(module.rpartition(".")[0])
            if parent is not None and not hasattr(parent, "__path__"):
                # A namespace hung on a module that is no package (`sys.monitoring`): the
                # import system never executes it again, so there is nothing to re-apply.
                return None
        return (module, name) if isinstance(module, str) else None
    if isinstance(owner, type):
        module, qualname = owner.__module__, owner.__qualname__
        if isinstance(module, str) and "<" not in qualname:
            return module, f"{qualname}.{name}"
    return None


def _remember(owner: Any, name: str, wrapper: Wrapper | None, value: Any, label: str) -> None:
    home = _home(owner, name)
    if home is None:
        return
    module, dotted = home
    if (module, dotted) not in _pending_names:
        _pending_names.add((module, dotted))
        _pending.setdefault(module, []).append((dotted, wrapper, value, label))
    _hook_module(module)


def wrap(owner: Any, name: str, wrapper: Wrapper, *, label: str = "") -> Any:
    """Wrap `owner.name` with `wrapper` and record the original; returns the installed wrapper."""
    with _lock:
        original = _own_value(owner, name)
        installed = _Wrapper(_resolve_original(owner, name), wrapper)
        setattr(owner, name, installed)
        label = label or _label(owner, name)
        _patches.append(Patch(owner, name, original, installed, label, _where(owner)))
        _installed.add(id(installed))
        _remember(owner, name, wrapper, None, label)
        _changed()
        return installed


def set_attr(owner: Any, name: str, value: Any, *, label: str = "") -> None:
    """Replace `owner.name` with `value` (no wrapper) and record the original."""
    with _lock:
        original = _own_value(owner, name)
        if original is _MISSING and name == "__class__":
            original = type(owner)
        setattr(owner, name, value)
        label = label or _label(owner, name)
        _patches.append(Patch(owner, name, original, value, label))
        _installed.add(id(value))
        if name != "__class__":
            _remember(owner, name, None, value, label)
        _changed()


def wrap_later(module: str, name: str, wrapper: Wrapper, *, label: str = "") -> None:
    """Wrap `module.name` now if the module is loaded, else when it is first imported.

    `name` may be dotted (`Popen.__init__`). A missing attribute (an optional C twin,
    a platform-only function) is skipped.
    """
    with _lock:
        label = label or f"{module}.{name}"
        if (module, name) not in _pending_names:
            _pending_names.add((module, name))
            _pending.setdefault(module, []).append((name, wrapper, None, label))
        _hook_module(module)
        loaded = sys.modules.get(module)
        if loaded is not None:
            _apply_dotted(loaded, name, wrapper, None, label)


def _hook_module(module: str) -> None:
    if module not in _hooked:
        _hooked.add(module)
        _hooks[module] = _make_hook(module, _generation)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _apply_dotted(
    module: Any, dotted: str, wrapper: Wrapper | None, value: Any, label: str
) -> None:
    """Apply one remembered patch to `module`, unless what is there is already ours."""
    owner = module
    *parents, name = dotted.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
        if owner is None:
            return
    current = _own_value(owner, name)
    if current is _MISSING and not hasattr(owner, name):
        return
    if id(current) in _installed and current is not _MISSING:
        # Already one of ours: a module executed again in place (`importlib.reload(io)`
        # copies `_io.open`, which is guarded, into `io.open`). Its patch now expects that.
        for patch in _patches:
            if patch.owner is owner and patch.name == name:
                patch.installed = current
        _changed()
        return
    if wrapper is not None:
        wrap(owner, name, wrapper, label=label)
    else:
        set_attr(owner, name, value, label=label)


_hooks: dict[str, Callable[[Any], None]] = {}


class _HookedLoader:
    """Wraps a module's loader to run its post-import hook right after the module executes."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        hook = _hooks.get(module.__name__)
        if hook is not None:
            hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportFinder:
    """A meta-path finder that only wraps the loader of modules with pending patches.

    It asks the finders after it for the real spec and never decides an import itself (the
    import guard's finder does that, ahead of it).
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _hooks:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader)  # type: ignore[assignment]
        return spec


_FINDER = _PostImportFinder()


def keep_post_import_finder() -> None:
    """Put the post-import finder back (right after the head) if patches wait on it.

    Called by the import guard's audit hook before each import, so clearing
    `sys.meta_path` cannot leave a later `import subprocess` unpatched.
    """
    if _hooks:
        meta = sys.meta_path
        if isinstance(meta, list) and _FINDER not in meta:
            meta.insert(1 if meta else 0, _FINDER)


def _make_hook(module: str, generation: int) -> Callable[[Any], None]:
    def hook(loaded: Any) -> None:
        with _lock:
            if generation != _generation:
                return  # uninstalled since: a stale hook does nothing
            for name, wrapper, value, label in list(_pending.get(module, ())):
                _apply_dotted(loaded, name, wrapper, value, label)

    return hook


def patches() -> list[Patch]:
    """The patches applied so far, oldest first."""
    with _lock:
        return list(_patches)


def deferred() -> int:
    """How many `wrap_later` patches wait for their module's first import."""
    with _lock:
        waiting = (entries for module, entries in _pending.items() if module not in sys.modules)
        return sum(len(entries) for entries in waiting)


def _is_broken(patch: Patch) -> bool:
    if patch.where is not None:
        return patch.where.get(patch.name, _MISSING) is not patch.installed
    if patch.name == "__class__":
        return type(patch.owner) is not patch.installed
    return _own_value(patch.owner, patch.name) is not patch.installed


#: (the `_version` it was built for, groups, the rest): patches grouped by their owner, so
#: the check after every call is one C-level `itemgetter` and `map(is_)` per owner.
_groups: tuple[int, list[tuple[Any, Any, tuple[Any, ...], list[Patch]]], list[Patch]] = (
    -1,
    [],
    [],
)
#: The same, flat, for the usual outcome (nothing broken): (the dictionaries, a getter of
#: a tuple of the current values of each, every installed object in that order).
_flat: tuple[int, list[tuple[Any, Any]], tuple[Any, ...]] = (-1, [], ())


def _grouped() -> tuple[list[tuple[Any, Any, tuple[Any, ...], list[Patch]]], list[Patch]]:
    global _groups, _flat
    if _groups[0] != _version:
        by_owner: dict[int, list[Patch]] = {}
        others: list[Patch] = []
        for patch in _patches:
            if patch.where is None:
                others.append(patch)
            else:
                by_owner.setdefault(id(patch.owner), []).append(patch)
        groups = []
        flat_pairs = []
        flat_installed: list[Any] = []
        for members in by_owner.values():
            names = [p.name for p in members]
            getter = operator.itemgetter(*names)
            installed = tuple(p.installed for p in members)
            groups.append((members[0].where, getter, installed, members))
            # Always a tuple (`itemgetter` of one name gives the bare value).
            flat_pairs.append((members[0].where, operator.itemgetter(*names, *names[:1])))
            flat_installed.extend((*installed, *installed[:1]))
        _groups = (_version, groups, others)
        _flat = (_version, flat_pairs, tuple(flat_installed))
    return _groups[1], _groups[2]


def _all_intact() -> bool:
    """Whether every grouped patch still holds its installed object, as one pass of C-level
    `itemgetter`s and `map(is_)` (identity: an equal stand-in is a broken patch)."""
    _version_built, pairs, installed = _flat
    try:
        current = [get(where) for where, get in pairs]
    except (KeyError, TypeError):
        return False
    return all(map(operator.is_, itertools.chain.from_iterable(current), installed))


def broken() -> list[str]:
    """Labels of the patches whose attribute no longer holds the installed object."""
    out: list[str] = []
    keep_post_import_finder()
    with _lock:
        groups, others = _grouped()
        if _all_intact():
            groups = []  # the usual case: only the others are looked at one by one
        for where, getter, installed, members in groups:
            try:
                current = getter(where)
                if len(members) == 1:
                    current = (current,)
                intact = all(map(operator.is_, current, installed))
            except KeyError:
                intact = False
            if not intact:
                out.extend(p.label for p in members if _is_broken(p))
        out.extend(p.label for p in others if _is_broken(p))
        if _hooks and _FINDER not in sys.meta_path:
            out.append(
                "the post-import hook finder (deferred patches of "
                + ", ".join(sorted(_hooks))
                + ")"
            )
    return out


def uninstall() -> None:
    """Restore every original, newest first, and forget pending (deferred) patches."""
    global _generation
    with _lock:
        _generation += 1
        _changed()
        _pending.clear()
        _pending_names.clear()
        _hooked.clear()
        _hooks.clear()
        _installed.clear()
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
        while _patches:
            patch = _patches.pop()
            if patch.original is _MISSING:
                try:
                    delattr(patch.owner, patch.name)
                except (AttributeError, TypeError):
                    pass
            else:
                setattr(patch.owner, patch.name, patch.original)
