"""A `Denial` is a frozen value written over `__slots__` (not a dataclass: the worker imports
it before its handshake, and `dataclasses` brings `inspect` into every worker's start)."""

from __future__ import annotations

import copy
import pickle

import pytest

from agent_sandbox._denial import BETWEEN_CALLS, DURING_CALL, Denial


def _denial(**changes: object) -> Denial:
    return Denial("files.read", "read", "/etc/passwd", "p", **changes)  # type: ignore[arg-type]


def test_a_denial_takes_its_fields_by_position_and_name_with_their_defaults() -> None:
    d = Denial("files.read", "read", "/etc/passwd")
    assert (d.policy, d.hint, d.detail, d.learned, d.internal) == ("", "", "", False, False)
    assert (d.count, d.origin, d.last) == (1, DURING_CALL, None)
    assert Denial(rule="imports", action="import", target="x", count=3).count == 3


def test_a_denial_compares_hashes_and_prints_by_its_fields() -> None:
    assert _denial() == _denial() and hash(_denial()) == hash(_denial())
    assert _denial() != _denial(count=2)
    assert _denial() != ("files.read", "read", "/etc/passwd")
    assert repr(_denial()).startswith("Denial(rule='files.read', action='read', target=")
    assert "last=None)" in repr(_denial())


def test_a_denial_is_frozen() -> None:
    d = _denial()
    with pytest.raises(AttributeError):
        d.rule = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del d.rule
    with pytest.raises(AttributeError):
        d.extra = 1  # type: ignore[attr-defined]


def test_replace_returns_a_changed_copy_and_refuses_unknown_fields() -> None:
    d = _denial()
    changed = d.replace(origin=BETWEEN_CALLS, last=d)
    assert (changed.origin, changed.last, changed.rule) == (BETWEEN_CALLS, d, "files.read")
    assert d.origin == DURING_CALL
    with pytest.raises(TypeError):
        d.replace(nope=1)


def test_a_denial_survives_copy_pickle_and_match() -> None:
    d = _denial(last=_denial(count=1), count=2)
    assert copy.copy(d) == d and copy.deepcopy(d) == d
    assert pickle.loads(pickle.dumps(d)) == d
    match d:
        case Denial("files.read", "read", target):
            assert target == "/etc/passwd"
        case _:
            pytest.fail("no match")
    assert Denial.from_dict(d.to_dict()) == d
