"""`sandboxed()` says what it cannot carry: at wrap time for globals, at call time for values."""

from __future__ import annotations

import pytest

from agent_sandbox.adapters import sandboxed

SCALE = 3


def _helper(x: int) -> int:
    return x * 2


def uses_a_helper(x: int) -> int:
    return _helper(x) + SCALE


def uses_a_constant(x: int) -> list[int]:
    return [x, SCALE]


def returns_a_set() -> set[int]:
    return {1, 2}


def test_a_helper_from_the_module_is_a_type_error_at_wrap_time() -> None:
    """It names the helper the worker would not have, before any call."""
    with pytest.raises(TypeError, match=r"`_helper` \(function\).*define it inside uses_a_helper"):
        sandboxed(uses_a_helper)


def test_imports_and_literal_constants_are_carried() -> None:
    """A literal constant of the module crosses with the function."""
    with sandboxed(uses_a_constant) as fn:
        assert fn(1) == [1, 3]


def test_a_value_data_only_mode_cannot_carry_is_a_type_error() -> None:
    """A set is not passed off as a {'__repr__', '__type__'} dict."""
    with sandboxed(returns_a_set) as fn, pytest.raises(TypeError, match="returned a set"):
        fn()
