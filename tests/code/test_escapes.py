"""Known Python-sandbox escapes, each refused before it runs (or, for names computed at run
time, refused at the access). Each snippet would set `LEAKED` if it got through: the test
judges by that effect (and by `STARTED`, set on the first line, for refusals before running).
"""

from __future__ import annotations

import ast
import contextlib
import io
from typing import Any

import pytest

from agent_sandbox._errors import AttributeDenied, CodeRejected
from agent_sandbox.guards import _code_budget
from agent_sandbox.guards._code_budget import check_code
from agent_sandbox.guards._code_check import compile_rules, find_violations


def run_checked(source: str, code_policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check, rewrite and run `source` like the worker does; returns the namespace.

    The namespace carries `__stdout__` (what the code printed). The recursion limit is
    left alone here (tests of the call-depth budget set and restore it themselves).
    """
    policy = code_policy if code_policy is not None else {}
    tree = check_code(source, policy, "<test>")
    _code_budget.start_call(compile_rules(policy), set_depth=False)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(tree, "<test>", "exec"), namespace)
    finally:
        namespace["__stdout__"] = out.getvalue()
    return namespace


def run_plain(source: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<plain>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


PRELUDE = "STARTED = True\nclass C:\n    def __init__(self):\n        self.x = 1\n"


def refused_before_running(snippet: str, policy: dict[str, Any] | None = None) -> CodeRejected:
    """Run PRELUDE + snippet; assert it was refused before the first line ran."""
    ns: dict[str, Any] = {}
    with pytest.raises(CodeRejected) as info:
        ns = run_checked(PRELUDE + snippet, policy)
    assert "STARTED" not in ns and "LEAKED" not in ns
    return info.value


def refused_at_access(snippet: str, policy: dict[str, Any] | None = None) -> AttributeDenied:
    """Run PRELUDE + snippet; it starts, but the computed access is refused."""
    holder: dict[str, Any] = {}
    source = PRELUDE + "try:\n" + "".join(f"    {line}\n" for line in snippet.splitlines())
    source += "except AttributeError as exc:\n    DENIED = exc\n"
    holder = run_checked(source, policy)
    assert holder.get("STARTED") is True
    assert "LEAKED" not in holder
    assert isinstance(holder.get("DENIED"), AttributeDenied)
    return holder["DENIED"]


def rules_of(exc: CodeRejected) -> set[str]:
    return {v.rule for v in exc.violations}


# --- class-hierarchy walks


def test_blocks_class_hierarchy_walk_via_bases():
    """It denies `().__class__.__bases__[0].__subclasses__()` before running."""
    exc = refused_before_running("LEAKED = ().__class__.__bases__[0].__subclasses__()")
    assert rules_of(exc) == {"code.attribute"}
    assert {v.text.rsplit(".", 1)[-1] for v in exc.violations} == {"__bases__", "__subclasses__"}


def test_blocks_class_hierarchy_walk_via_mro():
    """It denies `type(1).__mro__[-1].__subclasses__()`."""
    refused_before_running("LEAKED = type(1).__mro__[-1].__subclasses__()")


def test_blocks_class_hierarchy_walk_via_base():
    """It denies `int.__base__` (singular), another route to `object`."""
    refused_before_running("LEAKED = int.__base__")


def test_blocks_subclasses_through_getattr_with_computed_name():
    """It denies `getattr(object, '__sub' + 'classes__')` at the access."""
    denied = refused_at_access("LEAKED = getattr(object, '__sub' + 'classes__')()")
    assert denied.denial.rule == "code.attribute"


def test_blocks_getattr_alias_with_computed_name():
    """It denies a computed name through an alias of getattr (`g = getattr`)."""
    refused_at_access("g = getattr\nLEAKED = g(C().__init__, '__glo' + 'bals__')")


def test_blocks_object_getattribute():
    """It denies `object.__getattribute__(f, name)`, which bypasses getattr."""
    refused_before_running("LEAKED = object.__getattribute__(C().__init__, 'x')")


def test_blocks_setattr_of_code_with_computed_name():
    """It denies `setattr(f, '__co' + 'de__', ...)`."""
    refused_at_access("def f(): pass\nsetattr(f, '__co' + 'de__', None)\nLEAKED = 1")


# --- format-string attribute traversal


def test_blocks_format_string_attribute_traversal_literal():
    """It denies `'{0.__init__.__globals__}'.format(obj)` before running."""
    refused_before_running("LEAKED = '{0.__init__.__globals__}'.format(C())")


def test_blocks_format_string_attribute_traversal_computed():
    """It denies a format template built at run time that walks to `__globals__`."""
    denied = refused_at_access("fmt = '{0.__init__.__glo' + 'bals__}'\nLEAKED = fmt.format(C())")
    assert denied.denial.target == "__globals__"


def test_blocks_format_map_attribute_traversal():
    """It denies `format_map` with a computed traversal."""
    refused_at_access("fmt = '{c.__init__.__glo' + 'bals__}'\nLEAKED = fmt.format_map({'c': C()})")


def test_blocks_unbound_str_format_traversal():
    """It denies `str.format(template, obj)` with a computed traversal."""
    refused_at_access("LEAKED = str.format('{0.__class__.__ba' + 'se__}', 1)")


def test_blocks_str_format_through_getattr():
    """It denies `getattr(template, 'format')(obj)`: getattr hands back the checked method."""
    refused_at_access("t = '{0.__init__.__glo' + 'bals__}'\nLEAKED = getattr(t, 'format')(C())")


def test_blocks_string_formatter_get_field():
    """It denies `string.Formatter().get_field` with a computed attribute path."""
    refused_at_access(
        "import string\n"
        "LEAKED = string.Formatter().get_field('0.__init__.__glo' + 'bals__', [C()], {})"
    )


def test_blocks_string_formatter_vformat_and_format():
    """It denies `string.Formatter().vformat/format` with a computed traversal."""
    refused_at_access(
        "import string\nt = '{0.__init__.__glo' + 'bals__}'\n"
        "LEAKED = string.Formatter().vformat(t, [C()], {})"
    )
    refused_at_access(
        "from string import Formatter\nt = '{0.__init__.__glo' + 'bals__}'\n"
        "LEAKED = Formatter().format(t, C())"
    )


def test_blocks_formatter_subclass_get_field():
    """It denies `get_field` reached through `super()` in a Formatter subclass."""
    refused_at_access(
        "import string\n"
        "class F(string.Formatter):\n"
        "    def walk(self, path):\n"
        "        return super().get_field(path, [C()], {})\n"
        "LEAKED = F().walk('0.__init__.__glo' + 'bals__')"
    )


# --- generators, coroutines, frames, tracebacks


def test_blocks_generator_gi_frame():
    """It denies `gen.gi_frame.f_back.f_globals` (CVE-2023-37271 shape)."""
    exc = refused_before_running("g = (i for i in [1])\nLEAKED = g.gi_frame.f_back.f_globals")
    assert {"gi_frame", "f_back", "f_globals"} <= {
        v.text.rsplit(".", 1)[-1] for v in exc.violations
    }


def test_blocks_coroutine_cr_frame():
    """It denies `coro.cr_frame`."""
    refused_before_running("async def a(): pass\nco = a()\nLEAKED = co.cr_frame\nco.close()")


def test_blocks_async_generator_ag_frame():
    """It denies `agen.ag_frame`."""
    refused_before_running("async def a():\n    yield 1\nLEAKED = a().ag_frame")


def test_blocks_traceback_tb_frame():
    """It denies `exc.__traceback__.tb_frame.f_globals`."""
    refused_before_running(
        "try:\n    1/0\nexcept Exception as e:\n    LEAKED = e.__traceback__.tb_frame.f_globals"
    )


def test_blocks_gi_frame_through_getattr():
    """It denies `getattr(gen, 'gi_' + 'frame')` at the access."""
    refused_at_access("g = (i for i in [1])\nLEAKED = getattr(g, 'gi_' + 'frame')")


def test_blocks_function_code_globals_closure():
    """It denies `f.__code__`, `f.__globals__`, `f.__closure__`, `f.__defaults__`."""
    exc = refused_before_running(
        "def f(): pass\nLEAKED = (f.__code__, f.__globals__, f.__closure__, f.__defaults__)"
    )
    assert len(exc.violations) == 4


def test_blocks_guard_wrapper_original():
    """It denies `open.__wrapped__` (a guard wrapper's original)."""
    refused_before_running("LEAKED = open.__wrapped__")


# --- AttributeError.obj


def test_blocks_attribute_error_obj():
    """It denies `AttributeError.obj` (CVE-2024-47532 shape) at the access."""
    refused_at_access("try:\n    C().missing\nexcept AttributeError as e:\n    LEAKED = e.obj")


# --- decorator tricks


def test_blocks_decorator_calling_namespace_builtin():
    """It denies a decorator that calls `vars` without parentheses."""
    refused_before_running("@vars\nclass LEAKED:\n    pass")


def test_blocks_decorator_lambda_reaching_globals():
    """It denies `@lambda f: f.__globals__` on a function."""
    refused_before_running("@lambda f: f.__globals__\ndef LEAKED():\n    pass")


def test_blocks_decorator_with_format_traversal():
    """It denies a decorator made of a format method that walks attributes."""
    refused_before_running("@'{0.__globals__}'.format\ndef LEAKED():\n    pass")


# --- try/except* confusion


def test_blocks_try_star_unless_granted():
    """It denies `try/except*` unless the policy grants exception groups."""
    exc = refused_before_running(
        "try:\n    raise ExceptionGroup('g', [ValueError(1)])\nexcept* ValueError as eg:\n"
        "    LEAKED = eg"
    )
    assert rules_of(exc) == {"code.syntax"}
    assert "exception-groups" in exc.violations[0].hint


def test_blocks_escape_inside_granted_try_star():
    """It still checks the handler body of a granted `try/except*` (CVE-2025-22153 shape)."""
    from agent_sandbox.guards._code_check import DEFAULT_SYNTAX

    policy = {"syntax": [*DEFAULT_SYNTAX, "exception-groups"]}
    refused_before_running(
        "try:\n    raise ExceptionGroup('g', [ValueError(1)])\nexcept* ValueError as eg:\n"
        "    LEAKED = eg.exceptions[0].__traceback__.tb_frame",
        policy,
    )
    ns = run_checked(
        "try:\n    raise ExceptionGroup('g', [ValueError(1)])\nexcept* ValueError as eg:\n"
        "    OK = len(eg.exceptions)",
        policy,
    )
    assert ns["OK"] == 1


# --- positional-only parameters and other bindings shadowing guard names


def test_blocks_positional_only_param_shadowing_helper():
    """It denies a positional-only parameter named like a helper (CVE-2026-55830 shape)."""
    exc = refused_before_running("def f(__sbx_attr__, /):\n    return __sbx_attr__\nLEAKED = f")
    assert rules_of(exc) == {"code.name"}


def test_blocks_lambda_positional_only_shadowing_helper():
    """It denies `lambda __sbx_name__, /: ...`."""
    refused_before_running("LEAKED = (lambda __sbx_name__, /: __sbx_name__)(1)")


def test_blocks_every_binding_of_helper_names():
    """It denies helper names as import alias, handler name, global, keyword-only arg, target."""
    exc = refused_before_running(
        "import math as __sbx_zip__\n"
        "try:\n    pass\nexcept Exception as __sbx_deep__:\n    pass\n"
        "def g(*, __sbx_budget__=1): pass\n"
        "for __sbx_x__ in []: pass\n"
        "LEAKED = 1"
    )
    assert len(exc.violations) >= 4


def test_blocks_positional_only_getattr_parameter_passing_getattr():
    """It denies a computed name when getattr arrives as a positional-only parameter."""
    refused_at_access(
        "def f(getattr, /):\n    return getattr(C().__init__, '__glo' + 'bals__')\n"
        "LEAKED = f(getattr)"
    )


# --- __builtins__ games


def test_blocks_builtins_name():
    """It denies `__builtins__` as a name, whatever is done with it."""
    exc = refused_before_running("LEAKED = __builtins__")
    assert exc.violations[0].hint == ""


def test_blocks_builtins_through_globals():
    """It denies `globals()['__builtins__']`."""
    exc = refused_before_running("LEAKED = globals()['__builtins__']")
    assert len(exc.violations) == 2


def test_blocks_builtins_rebinding():
    """It denies binding `__builtins__` (a parameter, a class attribute, a target)."""
    refused_before_running("def f(__builtins__): pass\nLEAKED = 1")
    refused_before_running("class K:\n    __builtins__ = {}\nLEAKED = 1")


def test_blocks_import_dunder_name():
    """It denies `__import__` unless granted."""
    refused_before_running("LEAKED = __import__('os')")


# --- getattr/attrgetter/methodcaller with computed names


def test_blocks_attrgetter_computed():
    """It denies `operator.attrgetter` with a computed dunder path."""
    refused_at_access(
        "import operator\nLEAKED = operator.attrgetter('__init__.__glo' + 'bals__')(C())"
    )


def test_blocks_attrgetter_imported_under_alias():
    """It denies `from operator import attrgetter as ag` with a computed path."""
    refused_at_access("from operator import attrgetter as ag\nLEAKED = ag('gi_' + 'frame')(1)")


def test_blocks_methodcaller_subclasses():
    """It denies `operator.methodcaller('__subcl' + 'asses__')`."""
    refused_at_access(
        "import operator\nLEAKED = operator.methodcaller('__subcl' + 'asses__')(object)"
    )


def test_blocks_string_naming_internals():
    """It denies string constants naming internals (annotations, format strings, keys)."""
    refused_before_running("class K:\n    a: 'gi_frame'\nLEAKED = 1")
    refused_before_running("LEAKED = {}.get('__globals__')")


def test_blocks_match_class_attribute_pattern():
    """It denies `case object(gi_frame=f)`, an attribute read hidden in a pattern."""
    refused_before_running(
        "g = (i for i in [1])\nmatch g:\n    case object(gi_frame=f):\n        LEAKED = f"
    )


# --- unknown syntax


def test_blocks_unknown_syntax_node():
    """It denies a node type the checker has no rule for (as a newer Python would add)."""

    class FutureNode(ast.expr):
        _fields = ()

    tree = ast.parse("x = 1")
    tree.body[0].value = FutureNode(lineno=1, col_offset=4)  # type: ignore[attr-defined]
    violations = find_violations(tree, {})
    assert [v.rule for v in violations] == ["code.syntax"]
    assert "FutureNode" in violations[0].detail and violations[0].hint == ""


def test_reports_every_violation_at_once_with_positions_and_hints():
    """It reports all violations in one rejection, with line, column, text and policy line."""
    exc = refused_before_running(
        "a = vars()\nb = C().__dict__\nc = lambda: 1\n",
        {"syntax": ["assignment", "classes", "functions"]},
    )
    by_rule = {v.rule: v for v in exc.violations}
    assert set(by_rule) == {"code.name", "code.dunder", "code.syntax"}
    dunder = by_rule["code.dunder"]
    assert (dunder.line, dunder.column, dunder.text) == (6, 5, "C().__dict__")
    assert dunder.hint == '[[grant]]\ncode.dunders = ["__dict__"]'
    assert by_rule["code.syntax"].hint.endswith('"lambda"]')
    assert by_rule["code.name"].hint == '[[grant]]\ncode.names = ["vars"]'
    assert "3 places" in str(exc)
