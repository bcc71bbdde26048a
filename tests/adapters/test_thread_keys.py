"""Thread ids to session keys (`adapters._common.thread_key`): type and value both count."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from agent_sandbox.adapters._common import thread_key

U = uuid.UUID("12345678-1234-5678-1234-567812345678")
#: Every type LangGraph's `configurable.thread_id` is given in practice (it is `Any`), in
#: pairs that `str()` used to merge.
IDS: list[Any] = [
    "1",
    1,
    True,
    1.0,
    b"1",
    "True",
    "b'1'",
    "(1, 'a')",
    (1, "a"),
    ("1", "a"),
    [1, "a"],
    ((1,), "a"),
    (),
    [],
    U,
    str(U),
    "thread#int:1",
    0,
    False,
    "0",
    -0.0,
    0.0,
]


def test_no_two_thread_ids_share_a_key() -> None:
    """It denies two distinct thread ids one session key, whatever their types."""
    keys = [thread_key(tid) for tid in IDS]
    assert len(set(keys)) == len(IDS), sorted(map(str, keys))


def test_a_string_thread_id_keeps_its_documented_key() -> None:
    assert thread_key("abc") == "thread:abc"
    assert thread_key(7) == "thread#int:7" and thread_key(U) == f"thread#uuid:{U}"


@pytest.mark.parametrize("tid", [None, ""])
def test_no_thread_id_is_a_stateless_call(tid: Any) -> None:
    assert thread_key(tid) is None


@pytest.mark.parametrize("tid", [object(), {"a": 1}, {1, 2}, 1j])
def test_a_thread_id_without_a_faithful_key_is_refused(tid: Any) -> None:
    """It refuses a thread id it cannot key faithfully, naming the type, never guessing."""
    with pytest.raises(TypeError, match=type(tid).__name__):
        thread_key(tid)


def test_the_same_id_always_gets_the_same_key() -> None:
    assert thread_key((1, U, "x")) == thread_key((1, uuid.UUID(str(U)), "x"))
