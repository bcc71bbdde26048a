"""Granted dynamic code (eval/exec/compile of strings) runs checked AND rewritten."""

from __future__ import annotations

import warnings

import pytest

from agent_sandbox import Policy, Sandbox

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # granting dynamic-code warns at load, by design
    POLICY = Policy(
        name="danger-dynamic",
        api={"allow": ["dynamic-code"]},
        code={"budgets": {"max_iterations": 10_000}},
        limits={"wall_seconds": 20},
    )


@pytest.fixture(scope="module")
def session():
    sb = Sandbox(POLICY, warm=0)
    try:
        yield sb.session()
    finally:
        sb.close()


def test_eval_of_an_ordinary_expression_works(session) -> None:
    """It runs ordinary granted eval/exec/compile."""
    result = session.run(
        "ns = {}\nexec('y = [i * i for i in range(5)]', ns)\n"
        "[eval('2 + 3'), ns['y'], eval(compile('7', 'f', 'eval'))]"
    )
    assert result.value == [5, [0, 1, 4, 9, 16], 7], result.error


def test_blocks_a_computed_dunder_inside_eval(session) -> None:
    """It denies `getattr(f, '__glo' + 'bals__')` run through eval (a run-time check)."""
    result = session.run(
        "def f():\n    pass\n"
        "try:\n    leaked = eval(\"getattr(f, '__glo' + 'bals__')\")\n    outcome = 'leaked'\n"
        "except AttributeError:\n    outcome = 'refused'\noutcome"
    )
    assert result.value == "refused", result.error
    assert any(d.rule.startswith("code.") for d in result.denials)


def test_blocks_an_unbounded_loop_inside_exec(session) -> None:
    """It counts loop iterations of exec'd code against the budget."""
    result = session.run("exec('n = 0\\nwhile True:\\n    n += 1')")
    assert result.error is not None and result.error.rule == "code.iterations"


def test_blocks_a_class_hierarchy_walk_inside_eval(session) -> None:
    """It refuses `__subclasses__` in an eval'd string before it runs."""
    result = session.run(
        "try:\n    eval('().__cl' + 'ass__.__ba' + 'ses__[0].__sub' + 'classes__()')\n    outcome = 'ran'\n"
        "except SyntaxError:\n    outcome = 'refused'\noutcome"
    )
    assert result.value == "refused", result.error


def test_compile_for_an_ast_only_returns_the_checked_tree(session) -> None:
    """It returns an AST for PyCF_ONLY_AST, which is checked again when it runs."""
    result = session.run(
        "tree = compile('1 + 1', 'f', 'eval', 0x400)  # ast.PyCF_ONLY_AST\n"
        "[type(tree).__name__, eval(compile(tree, 'f', 'eval'))]"
    )
    assert result.value == ["Expression", 2], result.error
