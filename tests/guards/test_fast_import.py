"""The import guard's C fast path (`guards/_fastimport.c`): same answers, less cost.

`FastImport(ok, modules, slow)` is the user namespace's `__import__`. It serves a plain
`import x` of a name in `ok` from `modules` and passes every other call to `slow` (the
Python `guarded_import`) unchanged. These tests pin which calls take which path, that the
fast path answers what the slow path would, its reference counting, and that user code
cannot get the held objects out of it.
"""

from __future__ import annotations

import copy
import pickle
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox.guards import _imports

try:
    from agent_sandbox.guards._fastimport import FastImport
except ImportError:  # not built: test_the_c_fast_path_is_built fails, the rest skip
    FastImport = None  # type: ignore[assignment, misc]

needs_c = pytest.mark.skipif(FastImport is None, reason="the C extension is not built")


class Recorder:
    """A stand-in slow path: records each call and returns a marker."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.marker = object()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.marker


class StrName(str):
    pass


class EmptyTuple(tuple):  # type: ignore[type-arg]
    pass


class Fast:
    """A FastImport over its own `ok` set and module table, with a recording slow path."""

    def __init__(self) -> None:
        self.slow = Recorder()
        self.ok = {"json", "blocked", "gone"}
        self.modules: dict[str, Any] = {
            "json": sys.modules["json"], "os": sys.modules["os"], "blocked": None,
        }  # fmt: skip
        self.call = FastImport(self.ok, self.modules, self.slow)


@pytest.fixture
def fast() -> Fast:
    return Fast()


def attempt(guard: Any, body: str) -> Any:
    guard.run(
        f"try:\n{textwrap.indent(body, '    ')}\nexcept Exception as exc:\n    result = type(exc).__name__\n"
    )
    return guard.namespace.get("result")


def test_the_c_fast_path_is_built() -> None:
    """It fails when the extension is missing, so the import cost cannot regress silently."""
    import agent_sandbox.guards._fastimport as built

    assert type(_imports.user_import) is built.FastImport
    # Built from the current _fastimport.c (module views, the counted arming state): an
    # older build makes the guards fall back to Python state (rebuild: pip install -e .).
    assert built.VERSION >= 2 and _imports.ModuleView is built.ModuleView
    assert _imports.make_user_builtins().__import__ is _imports.user_import


@pytest.mark.parametrize(
    "args",
    [
        ("json",),
        ("json", {}),
        ("json", {}, None),
        ("json", {"__name__": "x"}, None, None),
        ("json", {}, None, None, 0),
        ("json", {}, {}, (), 0),
        ("json", {}, None, [], 0),
    ],
)
@needs_c
def test_a_plain_import_of_a_known_loaded_module_is_served_in_c(fast: Fast, args: Any) -> None:
    """It returns the module from the table without calling the slow path."""
    assert fast.call(*args) is fast.modules["json"]
    assert fast.slow.calls == []


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("os",), {}),  # loaded, but not (yet) allowed by the guard
        (("gone",), {}),  # allowed, but missing from the module table
        (("blocked",), {}),  # the table holds None: the import system must raise
        (("json", {}, None, None, 1), {}),  # relative
        (("json", {}, None, ("dumps",), 0), {}),  # from json import dumps
        (("json", {}, None, ["dumps"], 0), {}),
        (("json", {}, None, EmptyTuple(), 0), {}),  # not an exact tuple
        (("json", {}, None, "", 0), {}),  # falsy, but not None or an empty tuple or list
        (("json", {}, None, None, False), {}),  # not an exact int
        (("json", {}, None, None, 0.0), {}),
        (("json", {}, None, None, 2**70), {}),
        (("json",), {"fromlist": None}),  # any keyword argument
        (("json",), {"level": 0}),
        ((StrName("json"),), {}),  # not an exact str
        ((b"json",), {}),
        ((["json"],), {}),
        ((), {}),
        (("json", {}, None, None, 0, "sixth"), {}),
    ],
)
@needs_c
def test_every_other_call_goes_to_the_slow_path_unchanged(
    fast: Fast, args: Any, kwargs: Any
) -> None:
    """It passes the arguments, positional and keyword, to the slow path as received."""
    assert fast.call(*args, **kwargs) is fast.slow.marker
    assert len(fast.slow.calls) == 1
    got_args, got_kwargs = fast.slow.calls[0]
    assert got_args == args and all(a is b for a, b in zip(got_args, args, strict=True))
    assert got_kwargs == kwargs


@needs_c
def test_the_fast_path_follows_the_live_set_and_table(fast: Fast) -> None:
    """It reads `ok` and the module table on each call (the guard clears `ok` on configure)."""
    fast.ok.discard("json")
    assert fast.call("json") is fast.slow.marker
    fast.ok.add("os")
    assert fast.call("os") is fast.modules["os"]
    del fast.modules["os"]
    assert fast.call("os") is fast.slow.marker
    assert len(fast.slow.calls) == 2


@needs_c
def test_the_constructor_takes_a_set_a_dict_and_a_callable() -> None:
    """It refuses anything else (a frozenset, a set subclass, a mapping, a non-callable)."""

    class SetSub(set):  # type: ignore[type-arg]
        pass

    for bad in (
        (frozenset(), {}, print),
        (SetSub(), {}, print),
        (set(), [], print),
        (set(), {}, None),
    ):
        with pytest.raises(TypeError):
            FastImport(*bad)
    with pytest.raises(TypeError):
        FastImport(set(), {}, print, extra=1)  # type: ignore[call-arg]


@needs_c
def test_an_exception_of_the_slow_path_propagates() -> None:
    """It raises what the slow path raised, with no result."""

    def slow(*args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError("refused", name=args[0])

    fast_import = FastImport(set(), {}, slow)
    with pytest.raises(ModuleNotFoundError, match="refused"):
        fast_import("json")


@needs_c
def test_reference_counts_stay_stable() -> None:
    """It leaks nor drops a reference to the module, the arguments or the slow result."""
    recorder = Recorder()
    module = sys.modules["json"]
    name, globals_, fromlist = "json", {"__name__": "x"}, ("dumps",)
    fast_import = FastImport({"json"}, {"json": module}, recorder)

    def counts() -> list[int]:
        objects = (module, globals_, fromlist, recorder.marker, fast_import, recorder)
        return [sys.getrefcount(o) for o in objects]

    for _ in range(100):  # warm up anything cached on first use
        fast_import(name, globals_, None, None, 0)
        fast_import(name, globals_, None, fromlist, 0)
    recorder.calls.clear()
    before = counts()
    for _ in range(100_000):
        fast_import(name, globals_, None, None, 0)
        fast_import(name)
    for _ in range(1_000):
        fast_import(name, globals_, None, fromlist, 0)
        fast_import(name, fromlist=fromlist)
    recorder.calls.clear()
    assert counts() == before


@needs_c
def test_the_guard_serves_what_the_python_import_would(armed: Callable[..., Any]) -> None:
    """It answers the user namespace's `import json` with the object `guarded_import` gives:
    the view of `json` (see test_module_views.py)."""
    guard = armed(imports={"allow": ["json"]})
    user_import = guard.namespace["__builtins__"].__import__
    assert user_import is _imports.user_import
    guard.run("import json\nimport json as again\nresult = again")
    assert "json" in _imports._ok
    view = _imports.view_of(sys.modules["json"])
    assert view is not sys.modules["json"] and view.dumps is sys.modules["json"].dumps
    assert guard.namespace["result"] is view
    assert user_import("json") is _imports.guarded_import("json") is view
    assert guard.guards.tamper_check() == []


def test_a_module_loaded_before_arming_is_still_refused(armed: Callable[..., Any]) -> None:
    """It denies `import socket` on every try: a refused name never reaches the fast path."""
    guard = armed(imports={"allow": ["json"]})
    for _ in range(3):
        assert attempt(guard, "import socket\nresult = socket") == "ImportDenied"
    assert "socket" not in _imports._ok


@pytest.fixture
def slow_modules(tmp_path: Path) -> Iterator[Path]:
    """`probe_mod` records whether the guard already remembered it while it was loading;
    `broken_mod` raises while loading."""
    (tmp_path / "probe_mod.py").write_text(
        "from agent_sandbox.guards import _imports\nREMEMBERED = 'probe_mod' in _imports._ok\n"
    )
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('broken while loading')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("probe_mod", "broken_mod"):
            sys.modules.pop(name, None)


def test_a_module_is_remembered_only_after_its_import_returned(
    armed: Callable[..., Any], slow_modules: Path
) -> None:
    """It adds a name to the fast path's set after the import succeeded, never during it,
    so a partly initialised module is not handed out."""
    guard = armed(imports={"allow": ["probe_mod", "broken_mod"]})
    assert attempt(guard, "import probe_mod\nresult = probe_mod.REMEMBERED") is False
    assert "probe_mod" in _imports._ok
    assert attempt(guard, "import broken_mod\nresult = 'imported'") == "RuntimeError"
    assert "broken_mod" not in _imports._ok


@needs_c
def test_user_code_cannot_read_or_repoint_the_fast_import(armed: Callable[..., Any]) -> None:
    """It exposes no attribute holding the slow path, the set or the table, cannot be
    re-initialised, subclassed, copied or pickled."""
    guard = armed(imports={"allow": ["json"]})
    body = textwrap.dedent(
        """
        f = __import__
        names = [n for n in dir(f) if not n.startswith('__')]
        outcomes = [names, hasattr(f, '__dict__'), hasattr(f, '__wrapped__')]
        type(f).__init__(f, set(), {}, print)  # object.__init__: changes nothing
        import json
        outcomes.append(json.__name__)
        try:
            class Sub(type(f)):
                pass
            outcomes.append('subclassed')
        except TypeError:
            outcomes.append('no subclass')
        try:
            f.slow = print
            outcomes.append('set')
        except AttributeError:
            outcomes.append('no attribute')
        result = outcomes
        """
    )
    guard.run(body)
    assert guard.namespace["result"] == [
        [], False, False, "json", "no subclass", "no attribute"
    ]  # fmt: skip
    for make_copy in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot pickle"):
            make_copy(_imports.user_import)
    assert guard.guards.tamper_check() == []


@needs_c
def test_replacing_the_fast_import_is_reported(armed: Callable[..., Any]) -> None:
    """It reports a user namespace whose `__import__` is no longer the fast import, even
    when replaced by the Python guard it wraps."""
    guard = armed(imports={"allow": ["json"]})
    guard.namespace["python_import"] = _imports.guarded_import
    guard.run("__builtins__.__import__ = python_import")
    assert any("__import__" in r for r in guard.guards.tamper_check())
