"""The patching module: every patch records its original and `uninstall()` restores it."""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox.guards import _patch


@pytest.fixture(autouse=True)
def _restore() -> Any:
    assert not _patch.patches(), "another test left patches installed"
    try:
        yield
    finally:
        _patch.uninstall()


def _tag(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return ("wrapped", wrapped(*args, **kwargs))


def test_wrap_calls_through_and_uninstall_restores_the_original() -> None:
    """It wraps a module function and puts the very same object back."""
    module = types.ModuleType("m")
    module.f = lambda x: x + 1  # type: ignore[attr-defined]
    original = module.f  # type: ignore[attr-defined]
    _patch.wrap(module, "f", _tag)
    assert module.f(1) == ("wrapped", 2)  # type: ignore[attr-defined]
    assert module.f.__wrapped__ is original  # type: ignore[attr-defined]
    _patch.uninstall()
    assert module.f is original  # type: ignore[attr-defined]


def test_wrapping_an_inherited_method_removes_the_shadow_on_uninstall() -> None:
    """It wraps a method found through the MRO and deletes its own slot afterwards."""

    class Base:
        def hello(self) -> str:
            return "hi"

    class Child(Base):
        pass

    _patch.wrap(Child, "hello", _tag)
    assert Child().hello() == ("wrapped", "hi")
    _patch.uninstall()
    assert "hello" not in vars(Child)
    assert Child().hello() == "hi"


def test_broken_lists_a_replaced_wrapper() -> None:
    """It reports a wrapper that user code replaced."""
    module = types.ModuleType("m2")
    module.g = len  # type: ignore[attr-defined]
    _patch.wrap(module, "g", _tag, label="m2.g")
    assert _patch.broken() == []
    module.g = lambda x: 0  # type: ignore[attr-defined]
    assert _patch.broken() == ["m2.g"]


def test_broken_finds_an_equal_stand_in_and_a_removed_one_among_several() -> None:
    """The check after every call goes by identity over every owner at once: a stand-in
    that compares equal to the wrapper is reported, and so is a removed one, by its label
    only (owners of one and of several patches alike)."""

    class Equal:
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = object.__hash__

    one = types.ModuleType("m3")
    one.a = len  # type: ignore[attr-defined]
    many = types.ModuleType("m4")
    many.b, many.c = len, abs  # type: ignore[attr-defined]
    _patch.wrap(one, "a", _tag, label="m3.a")
    _patch.wrap(many, "b", _tag, label="m4.b")
    _patch.wrap(many, "c", _tag, label="m4.c")
    assert _patch.broken() == []
    many.c = Equal()  # type: ignore[attr-defined]
    assert _patch.broken() == ["m4.c"]
    del one.a  # type: ignore[attr-defined]
    assert sorted(_patch.broken()) == ["m3.a", "m4.c"]


def test_set_attr_of_a_class_is_restored() -> None:
    """It swaps an instance's class and restores it."""

    class A:
        pass

    class B(A):
        pass

    obj = A()
    _patch.set_attr(obj, "__class__", B, label="obj.__class__")
    assert type(obj) is B and _patch.broken() == []
    _patch.uninstall()
    assert type(obj) is A


def test_wrap_later_patches_a_module_when_it_is_first_imported(tmp_path: Path) -> None:
    """It defers the patch of a module that is not imported yet, through a post-import hook."""
    name = "agent_sandbox_deferred_target"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("def f():\n    return 1\n"))
    sys.path.insert(0, str(tmp_path))
    try:
        _patch.wrap_later(name, "f", _tag)
        assert name not in sys.modules
        module = __import__(name)
        assert module.f() == ("wrapped", 1)
        _patch.uninstall()
        assert module.f() == 1
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_a_missing_attribute_is_skipped() -> None:
    """It skips an optional C twin that this platform does not have."""
    _patch.wrap_later("os", "no_such_function_here", _tag)
    assert _patch.patches() == []
