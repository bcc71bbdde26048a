"""The module views of the import guard (`ModuleView` in guards/_fastimport.c), in-process.

User code holds a view of each allowed module: reads and writes go to the module, a module
reached through it is judged like an import. These tests pin what the view forwards, what
it judges, what it hides, and that the arming state's counter sees every write of the flag.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

from agent_sandbox.guards import _imports, _state

pytestmark = pytest.mark.skipif(
    _imports.ModuleView is None, reason="the C extension is not built (see test_fast_import.py)"
)


def outcome(guard: Any, body: str) -> Any:
    """Run `body` (setting `result`) as a cell; an exception's type name is the result."""
    code = "try:\n" + "".join(f"    {line}\n" for line in body.splitlines())
    code += "except Exception as exc:\n    result = type(exc).__name__\n"
    guard.run(code)
    return guard.namespace.get("result")


def test_a_view_reads_and_writes_through_to_its_module(armed: Callable[..., Any]) -> None:
    """It forwards reads, writes and deletes to the module and is a module itself."""
    guard = armed(imports={"allow": ["json"]})
    json = sys.modules["json"]
    try:
        guard.run(
            "import json\njson.extra_for_test = 5\n"
            "result = [json.dumps([1]), isinstance(json, type(json)), repr(json)]"
        )
        assert json.extra_for_test == 5  # type: ignore[attr-defined]
        assert guard.namespace["result"] == ["[1]", True, repr(json)]
        guard.run("del json.extra_for_test")
        assert not hasattr(json, "extra_for_test")
        assert isinstance(guard.namespace["json"], types.ModuleType)
    finally:
        json.__dict__.pop("extra_for_test", None)


def test_a_module_reached_as_an_attribute_is_judged_by_its_own_name(
    armed: Callable[..., Any],
) -> None:
    """It refuses `typing.sys` and records the denial with the attribute named."""
    guard = armed(imports={"allow": ["typing"]})
    assert outcome(guard, "import typing\nresult = typing.sys") == "ImportDenied"
    denials = guard.denials()
    assert [(d.rule, d.target) for d in denials] == [("imports", "sys")]
    assert "reached as the attribute typing.sys" in denials[0].detail


def test_a_packages_own_submodule_counts_as_part_of_it(armed: Callable[..., Any]) -> None:
    """It judges `os.path` (the module `posixpath`) as `os.path`, allowed with `os`."""
    guard = armed(imports={"allow": ["os"]})
    guard.run("import os\nresult = os.path.join('a', 'b')")
    assert guard.namespace["result"] == "a/b" and guard.denials() == []


def test_a_judged_module_is_remembered_while_the_attribute_holds_it(
    armed: Callable[..., Any],
) -> None:
    """It asks the guard once per attribute and module object, and again when it changes."""
    guard = armed(imports={"allow": ["os", "json"]})
    calls: list[str] = []
    original = _imports._judge_attribute

    def counting(real: Any, name: str, value: Any) -> Any:
        calls.append(name)
        return original(real, name, value)

    _imports._judge_attribute = counting  # type: ignore[assignment]
    try:
        guard.run("import os\nfor _ in range(3):\n    os.path")
        assert calls == ["path"]
    finally:
        _imports._judge_attribute = original  # type: ignore[assignment]


def test_vars_dir_and_star_import_leave_refused_modules_out(armed: Callable[..., Any]) -> None:
    """It lists allowed modules as views and never the refused ones, with no denial."""
    guard = armed(imports={"allow": ["typing", "collections"]})
    guard.run(
        "import typing\nfrom typing import *\n"
        "result = ['sys' in vars(typing), 'sys' in dir(typing), 'List' in dir(typing),"
        " type(vars(typing)['collections']).__name__]"
    )
    assert guard.namespace["result"] == [False, False, True, "ModuleView"]
    assert "sys" not in guard.namespace
    assert guard.denials() == []


def test_the_views_own_namespace_is_empty(armed: Callable[..., Any]) -> None:
    """It gives nothing through the module type's own getattr or object's, and refuses a
    write or delete through object's setattr: 3.11 and 3.12 check that call against the
    view type's own setattr (TypeError); 3.13 checks it only for types, and the view has no
    namespace of its own for object's code to write (AttributeError). The module keeps
    nothing of the attempt."""
    guard = armed(imports={"allow": ["typing", "types"]})
    for getter in ("types.ModuleType.__getattribute__", "object.__getattribute__"):
        found = outcome(guard, f"import typing, types\nresult = {getter}(typing, 'sys')")
        assert found == "AttributeError", getter
    refusal = "TypeError" if sys.version_info < (3, 13) else "AttributeError"
    for write in ("object.__setattr__(typing, 'x', 1)", "object.__delattr__(typing, 'List')"):
        source = f"import typing\n{write}\nresult = 'done'"
        assert outcome(guard, source) == refusal, write
    guard.run("import typing\nresult = [hasattr(typing, 'x'), typing.List is not None]")
    assert guard.namespace["result"] == [False, True]
    assert not hasattr(sys.modules["typing"], "x")


def test_the_module_table_judges_what_it_hands_out(armed: Callable[..., Any]) -> None:
    """It refuses a forbidden module from `sys.modules` and serves allowed ones as views."""
    guard = armed(imports={"allow": ["sys", "json"]})
    assert outcome(guard, "import sys\nresult = sys.modules['socket']") == "ImportDenied"
    guard.run(
        "import sys\nresult = ['socket' in sys.modules, sys.modules['json'].dumps(2),"
        " len(sys.modules) > 10, all(k != 'socket' for k, _ in sys.modules.items())]"
    )
    assert guard.namespace["result"] == [True, "2", True, True]


def test_library_code_keeps_the_modules_themselves(armed: Callable[..., Any]) -> None:
    """It hands views to user code only: the module table and the import system are real."""
    guard = armed(imports={"allow": ["json", "importlib"]})
    guard.run("import json, importlib\nresult = importlib.import_module('json')")
    assert type(sys.modules["json"]) is types.ModuleType
    assert guard.namespace["result"] is guard.namespace["json"]
    assert guard.namespace["result"] is not sys.modules["json"]


def test_every_write_of_the_armed_flag_is_counted() -> None:
    """It counts each write of `armed` (changed or not) where the host reads it."""
    if _state.block_info() is None:
        pytest.skip("the C extension is not built")
    before = _state.block_read()[0]
    was = _state.state.armed
    _state.state.armed = was
    _state.state.armed = was
    assert _state.block_read()[0] == before + 2
    info = _state.block_info()
    assert info is not None and info["size"] == 40 and info["address"] > 0


def test_odd_attribute_names_behave_as_on_the_module(armed: Callable[..., Any]) -> None:
    """It answers an empty or missing name, and dunders, as the module itself would."""
    guard = armed(imports={"allow": ["json"]})
    assert outcome(guard, "import json\nresult = getattr(json, '')") == "AttributeError"
    assert outcome(guard, "import json\nresult = json.no_such_name") == "AttributeError"
    guard.run("import json\nresult = [json.__name__, json.__class__.__name__]")
    assert guard.namespace["result"] == ["json", "module"]
