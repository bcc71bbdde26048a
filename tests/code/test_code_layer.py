"""Ordinary code keeps working under the code layer, budgets hold, and the worker wires it in."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._errors import CodeRejected, LimitExceeded, PolicyError
from agent_sandbox.guards import _code_budget
from agent_sandbox.guards._code_budget import check_code, compile_rules
from agent_sandbox.policies import policy_from_toml, resolve_policy


def run_checked(source: str, code_policy: dict[str, Any] | None = None) -> str:
    """Check, rewrite and run `source` in a fresh namespace; return what it printed."""
    policy = code_policy if code_policy is not None else {}
    tree = check_code(source, policy, "<test>")
    _code_budget.start_call(compile_rules(policy), set_depth=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, "<test>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def run_plain(source: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<plain>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


ORDINARY = {
    "math": "import math\nprint(math.sqrt(2), math.pi)",
    "classes": (
        "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "    def __repr__(self):\n        return f'Point({self.x!r}, {self.y:>4})'\n"
        "    def __eq__(self, other):\n        return (self.x, self.y) == (other.x, other.y)\n"
        "print(Point(1, 2), Point(1, 2) == Point(1, 2), type(Point(1, 2)).__name__)"
    ),
    "dataclasses_and_namedtuple": (
        "from dataclasses import dataclass, field\nfrom collections import namedtuple, Counter\n"
        "@dataclass(frozen=True)\nclass Row:\n    name: str\n    tags: tuple = ()\n"
        "P = namedtuple('P', 'a b')\nprint(Row('x'), P(1, 2)._asdict(), Counter('hello').most_common(2))"
    ),
    "comprehensions_and_generators": (
        "data = [3, 1, 4, 1, 5, 9, 2, 6]\nsq = [x * x for x in data if x % 2]\n"
        "pairs = {k: v for k, v in zip('abc', data)}\nuniq = {x for x in data}\n"
        "def gen(n):\n    for i in range(n):\n        yield i * 2\n"
        "print(sq, pairs, sorted(uniq), sum(x for x in gen(5)), list(gen(3)))"
    ),
    "exceptions_and_with": (
        "import contextlib\ntry:\n    {}['missing']\nexcept KeyError as e:\n    print('key', e)\n"
        "finally:\n    print('done')\n@contextlib.contextmanager\ndef cm():\n    yield 5\n"
        "with cm() as v:\n    print(v)"
    ),
    "formatting": (
        "x = 3.14159\nprint(f'{x:.2f} {x!r} {x:>10.3f}', '{:>6}|{:<4}'.format('a', 'b'), "
        "'%5.1f%%' % 12.345, format(7, '08b'), 'ab'.center(8, '*'), '-' * 20)"
    ),
    "getattr_and_operator": (
        "import operator\nclass A:\n    x = 1\n    y = 2\n"
        "print(getattr(A, 'x'), getattr(A, 'z', 'default'), hasattr(A, 'y'), "
        "operator.attrgetter('x', 'y')(A), sorted([A()], key=operator.attrgetter('x'))[0].x, "
        "operator.methodcaller('upper')('abc'))"
    ),
    "async": (
        "import asyncio\nasync def twice(x):\n    await asyncio.sleep(0)\n    return 2 * x\n"
        "async def main():\n    out = []\n    async def agen():\n        for i in range(3):\n"
        "            yield i\n    async for i in agen():\n        out.append(await twice(i))\n"
        "    return out + [i async for i in agen()]\nprint(asyncio.run(main()))"
    ),
    "match_and_walrus": (
        "def kind(v):\n    match v:\n        case {'x': x}:\n            return f'dict {x}'\n"
        "        case [a, *rest]:\n            return f'list {a} {rest}'\n        case _:\n"
        "            return 'other'\nprint([kind(v) for v in ({'x': 1}, [1, 2, 3], 5)])\n"
        "if (n := len('abc')) > 2:\n    print(n)"
    ),
    "while_and_recursion": (
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "i = 0\nwhile i < 5:\n    i += 1\nelse:\n    print('end', i)\nprint(fib(15), 2 ** 100, 1 << 70)"
    ),
    "json_statistics_super": (
        "import json, statistics\nclass Base:\n    def hello(self):\n        return 'base'\n"
        "class Child(Base):\n    def hello(self):\n        return 'child+' + super().hello()\n"
        "print(json.dumps({'m': statistics.mean([1, 2, 3])}), Child().hello())"
    ),
}


@pytest.mark.parametrize("name", sorted(ORDINARY))
def test_ordinary_code_runs_like_plain_python(name: str) -> None:
    """It runs ordinary data-analysis code with the same output as plain exec."""
    source = ORDINARY[name]
    assert run_checked(source) == run_plain(source)


def test_eval_mode_is_checked_and_rewritten() -> None:
    """It checks `eval`-mode strings (for the dynamic-code guard) and refuses escapes."""
    tree = check_code("[i * 2 for i in range(3)]", {}, "<eval>", mode="eval")
    assert eval(compile(tree, "<eval>", "eval"), {}) == [0, 2, 4]
    with pytest.raises(CodeRejected):
        check_code("().__class__.__base__", {}, "<eval>", mode="eval")


def test_syntax_error_is_plain_syntax_error() -> None:
    """It lets a parse error through as the ordinary SyntaxError."""
    with pytest.raises(SyntaxError) as info:
        check_code("def (:", {}, "<x>")
    assert not isinstance(info.value, CodeRejected)


def test_names_allowlist_counts_bound_and_session_names() -> None:
    """It accepts names the code binds or the session already has under a names allowlist."""
    policy = {"names": ["builtins"]}
    check_code("x = len([1])\nprint(x)", policy, "<t>")
    check_code("print(earlier)", policy, "<t>", known_names=["earlier"])
    with pytest.raises(CodeRejected) as info:
        check_code("print(open)", policy, "<t>")
    assert info.value.violations[0].hint == '[[grant]]\ncode.names = ["open"]'


# --- budgets


def budget_policy(**budgets: int) -> dict[str, Any]:
    return {"budgets": budgets}


@pytest.mark.parametrize(
    "snippet",
    [
        "for i in range(1001): pass",
        "while True: pass",
        "x = [i for i in range(600)] + [i for i in range(600)]",
        "for i in range(40):\n    for j in range(40): pass",
        "def g():\n    yield from range(5000)\nlist(x for x in g())",
    ],
)
def test_iteration_budget(snippet: str) -> None:
    """It stops loops past `max_iterations` with a `code.iterations` denial."""
    with pytest.raises(LimitExceeded) as info:
        run_checked(snippet, budget_policy(max_iterations=1000))
    assert info.value.denial.rule == "code.iterations"
    assert "max_iterations = 10000" in info.value.denial.hint


def test_iteration_budget_exact() -> None:
    """It allows exactly `max_iterations` iterations."""
    run_checked("for i in range(1000): pass", budget_policy(max_iterations=1000))


def test_iteration_budget_cannot_be_caught_and_retried() -> None:
    """It keeps refusing after user code swallows the first refusal."""
    with pytest.raises(LimitExceeded):
        run_checked(
            "for k in range(3):\n    try:\n        for i in range(10**6): pass\n"
            "    except Exception:\n        pass\nfor j in range(10): pass",
            budget_policy(max_iterations=100),
        )


@pytest.mark.parametrize(
    "snippet",
    [
        "n = 10**9\ns = 'ab' * n",
        "n = 10**9\ns = [0] * n",
        "n = 10**9\ns = n * b'x'",
        "n = 10**9\nx = 7 ** n",
        "n = 10**9\nx = 1 << n",
        "n = 10**9\nx = 3\nx **= n",
        "n = 10**9\nx = pow(2, n)",
        "n = 10**9\ns = f'{1:>{n}}'",
        "s = f'{1:>999999999}'",
        "n = 10**9\ns = '%*d' % (n, 1)",
        "s = format(1, '>999999999')",
        "n = 10**9\ns = 'x'.rjust(n)",
        "n = 10**9\ns = '{:>{}}'.format(1, n)",
    ],
)
def test_allocation_budget(snippet: str) -> None:
    """It refuses allocations above `max_allocation` before making them (`code.allocation`)."""
    with pytest.raises(LimitExceeded) as info:
        run_checked(snippet, budget_policy(max_allocation=10_000_000))
    assert info.value.denial.rule == "code.allocation"


def test_allocation_budget_allows_ordinary_sizes() -> None:
    """It lets ordinary products, powers and shifts through."""
    out = run_checked(
        "n = 1000\nprint(len('ab' * n), len([0] * n), len(str(7 ** n)), (1 << n).bit_length(), "
        "len(f'{1:>{n}}'))",
        budget_policy(max_allocation=10_000_000),
    )
    assert out.split() == ["2000", "1000", "846", "1001", "1000"]


def test_call_depth_budget() -> None:
    """It turns recursion past `max_call_depth` into a `code.call-depth` denial."""
    policy = budget_policy(max_call_depth=50)
    saved = sys.getrecursionlimit()
    try:
        tree = check_code("def f(n):\n    return f(n + 1)\nf(0)", policy, "<t>")
        _code_budget.start_call(compile_rules(policy))
        with pytest.raises(LimitExceeded) as info:
            exec(compile(tree, "<t>", "exec"), {})
        assert info.value.denial.rule == "code.call-depth"
        _code_budget.start_call(compile_rules(policy))
        exec(
            compile(
                check_code("def f(n):\n    return 0 if n == 0 else f(n - 1)\nf(30)", policy, "<t>"),
                "<t>",
                "exec",
            ),
            {},
        )
    finally:
        sys.setrecursionlimit(saved)


def test_zero_budgets_mean_unlimited() -> None:
    """It leaves loops and functions unrewritten when their budgets are 0."""
    import ast

    policy = budget_policy(max_iterations=0, max_call_depth=0)
    tree = check_code("for i in range(3):\n    pass\ndef f():\n    return 1", policy, "<t>")
    assert "__sbx" not in ast.unparse(tree)


# --- policy


@pytest.mark.parametrize(
    "granted", ["__globals__", "gi_frame", "tb_frame", "__subclasses__", "f_back", "__builtins__"]
)
def test_policy_granting_internals_is_a_load_error(granted: str) -> None:
    """It refuses to load a policy that grants frame/code/generator internals."""
    key = "dunders" if granted.startswith("__") else "attributes"
    with pytest.raises(PolicyError, match="never be granted"):
        policy_from_toml(f'name = "p"\n[code]\n{key} = ["{granted}"]\n')


@pytest.mark.parametrize("preset", ["pure-computation", "data-analysis"])
def test_presets_declare_a_sub_language(preset: str) -> None:
    """It ships presets whose `[code]` section accepts ordinary code."""
    policy = resolve_policy(preset)
    wire = policy.to_wire()["code"]
    assert wire["enabled"] and wire["budgets"]["max_iterations"] > 0
    for source in ORDINARY.values():
        check_code(source, wire, "<t>")


# --- the worker


@pytest.fixture(scope="module")
def session() -> Iterator[Any]:
    policy = Policy(
        name="test-code",
        imports={"allow": ["math"]},
        code={"budgets": {"max_iterations": 100_000, "max_call_depth": 100}},
        limits={"wall_seconds": 20},
    )
    with Sandbox(policy, warm=0) as sb:
        s = sb.session("code-tests")
        yield s
        s.close()


def test_worker_rejects_all_violations_before_running(session: Any) -> None:
    """It refuses a cell with several violations before its first line runs, listing each."""
    result = session.run(
        "print('STARTED')\nx = vars()\ny = (1).__class__.__base__\nz = f.__globals__"
    )
    assert result.stdout == ""
    assert result.error is not None and result.error.kind == "denied"
    assert {d.rule for d in result.denials} == {"code.name", "code.attribute"}
    assert len(result.denials) == 3
    assert "line 3, column 5" in result.error.message


def test_worker_runs_ordinary_code_and_keeps_session_names(session: Any) -> None:
    """It runs ordinary code and sees names from earlier calls of the session."""
    assert session.run("import math\nr = math.sqrt(16)").ok
    result = session.run("class A:\n    def __init__(self, v):\n        self.v = v\nA(r).v + 1")
    assert result.ok and result.value == 5.0


def test_worker_budgets(session: Any) -> None:
    """It reports loop and recursion budgets as `code.*` limit errors."""
    result = session.run("while True:\n    pass")
    assert result.error is not None and result.error.rule == "code.iterations"
    result = session.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert result.error is not None and result.error.rule == "code.call-depth"
    assert session.run("sum(i for i in range(1000))").value == 499500


def test_worker_repeated_cell_keeps_its_budget_and_its_own_name(session: Any) -> None:
    """It gives an identical cell, compiled once and reused, a fresh budget and its own
    cell name in each call: the budget stops it every time, and its traceback names the
    cell that ran."""
    for _ in range(3):
        result = session.run("while True:\n    pass")
        assert result.error is not None and result.error.rule == "code.iterations"
    names = []
    for _ in range(2):
        result = session.run("def boom():\n    return 1 / 0\nboom()")
        assert result.error is not None and result.error.type == "ZeroDivisionError"
        names.append([line for line in result.error.traceback.splitlines() if "<cell-" in line])
    assert names[0] and names[1] and names[0] != names[1]


def test_worker_rechecks_a_repeated_cell_against_session_names() -> None:
    """It checks an identical cell again when `[code] names` is an allowlist: a name the
    session deleted is refused the second time."""
    policy = Policy(
        name="test-code-names", code={"names": ["builtins", "print"]}, limits={"wall_seconds": 20}
    )
    with Sandbox(policy, warm=0) as sb:
        s = sb.session("names")
        assert s.run("x = 1").ok
        assert s.run("x + 1").value == 2
        assert s.run("del x").ok
        result = s.run("x + 1")
        assert result.error is not None and result.error.kind == "denied", result.error


def test_worker_code_layer_disabled() -> None:
    """It skips the code layer when `[code] enabled = false`."""
    policy = Policy(name="test-code-off", code={"enabled": False}, limits={"wall_seconds": 20})
    with Sandbox(policy, warm=0) as sb:
        result = sb.run("sorted(vars())[:1]")
    assert result.ok, result.error


def test_docs_example_matches_the_checker() -> None:
    """It finds every violation the checker reports in the refusal docs/code-layer.md shows
    (the whole text is compared with the tool's in tests/core/test_doc_blocks.py)."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "code-layer.md").read_text()
    with pytest.raises(CodeRejected) as info:
        check_code(
            "g = (i for i in range(3))\nns = vars()\nframe = g.gi_frame\n",
            {},
            "<cell>",
            policy_name="pure-computation",
        )
    assert len(info.value.violations) == 2
    for v in info.value.violations:
        assert f'[{v.rule}] use "{v.text}" refused by policy "pure-computation"' in doc
        assert f"line {v.line}, column {v.column}: " in doc


def test_every_code_rule_is_catalogued() -> None:
    """It emits only `code.*` rules listed in the denial catalogue."""
    import re
    from pathlib import Path

    from agent_sandbox._denial import RULES

    root = Path(__file__).parents[2] / "guards"
    emitted = set()
    for name in ("_code_check.py", "_code_budget.py"):
        emitted |= set(re.findall(r'"(code\.[a-z-]+)"', (root / name).read_text()))
    assert emitted and emitted <= set(RULES)


@pytest.mark.parametrize(
    ("snippet", "rule"),
    [
        ("LEAKED = getattr(print, '__sel' + 'f__')", "code.dunder"),
        ("fmt = '{0.__init__.__glo' + 'bals__}'\nLEAKED = fmt.format(object())", "code.attribute"),
        ("try:\n    (1).nope\nexcept AttributeError as e:\n    LEAKED = e.obj", "code.attribute"),
        ("LEAKED = 'a' * (10**10)", "code.allocation"),
    ],
)
def test_worker_refuses_at_run_time(session: Any, snippet: str, rule: str) -> None:
    """It refuses computed attribute names and huge allocations inside the armed worker."""
    result = session.run(snippet)
    assert result.error is not None and result.error.rule == rule
    assert session.run("'LEAKED' in dir()").value is False


def test_class_bodies_may_define_dunder_methods() -> None:
    """It allows defining dunder methods and class attributes that are not granted for reading."""
    out = run_checked(
        "class Lazy:\n    __slots__ = ('data',)\n    def __init__(self):\n        self.data = {'a': 1}\n"
        "    def __getattr__(self, name):\n        return self.data[name]\n"
        "    def __init_subclass__(cls, **kw):\n        super().__init_subclass__(**kw)\n"
        "print(Lazy().a)"
    )
    assert out == "1\n"


def test_keyword_names_naming_internals_are_refused() -> None:
    """It refuses keyword arguments named like internals (`f(gi_frame=...)`)."""
    with pytest.raises(CodeRejected):
        check_code("dict(gi_frame=1)", {}, "<t>")


def test_lambda_recursion_stays_a_recursion_error() -> None:
    """It bounds lambda recursion by depth but reports it as a RecursionError (documented gap)."""
    policy = budget_policy(max_call_depth=50)
    saved = sys.getrecursionlimit()
    try:
        tree = check_code("f = lambda n: f(n + 1)\nf(0)", policy, "<t>")
        _code_budget.start_call(compile_rules(policy))
        with pytest.raises(RecursionError):
            exec(compile(tree, "<t>", "exec"), {})
    finally:
        sys.setrecursionlimit(saved)


def test_the_walk_skips_only_fields_that_never_hold_a_node() -> None:
    """The check's walk leaves out the fields whose ASDL type is a builtin (a name, a string,
    a constant, an int), read from each node class's signature. On real code (a slice of the
    standard library, every syntax it uses) none of the fields it leaves out holds a node."""
    import ast
    import pathlib
    import sysconfig

    from agent_sandbox.guards import _code_check

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [*sorted(stdlib.glob("*.py"))[:120], stdlib / "ast.py", stdlib / "typing.py"]
    checked = 0
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        for node in ast.walk(tree):
            # As the check does: a class outside the groups (3.12's `TypeAlias`) is worked
            # out at its first sight.
            visited = _code_check._CHILD_FIELDS.get(type(node)) or _code_check._child_fields(
                type(node)
            )
            for field in node._fields:
                if field in visited or field in _code_check._SKIPPED_FIELDS:
                    continue
                value = getattr(node, field, None)
                items = value if isinstance(value, list) else [value]
                assert not any(isinstance(v, ast.AST) for v in items), (type(node), field)
                checked += 1
    assert checked > 10_000

    # Without a signature that names exactly the class's fields, every field is visited.
    class Odd(ast.expr):
        """Odd(identifier name)"""

        _fields = ("name", "other")

    assert _code_check._child_fields(Odd) == ("name", "other")


def test_the_check_refuses_nodes_of_a_refused_or_unknown_type_anywhere() -> None:
    """A refused syntax deep inside optional and list slots (None in `kw_defaults`, dict
    unpacking's None key) is still found, and a node type with no rule is refused."""
    import ast

    from agent_sandbox.guards._code_check import find_violations

    source = "def f(*, a, b=(lambda: 1)):\n    return {**{}, 'k': [x async for x in y]}\n"
    rules = {"syntax": ["functions"]}
    found = {v.rule for v in find_violations(ast.parse(source), rules)}
    assert found == {"code.syntax"}
    texts = " ".join(v.detail for v in find_violations(ast.parse(source), rules))
    assert "lambda" in texts

    class Unknown(ast.expr):
        _fields = ()

    tree = ast.parse("x = 1")
    tree.body[0].value = Unknown()  # type: ignore[attr-defined]
    assert any("has no rule" in v.detail for v in find_violations(tree, {}))
