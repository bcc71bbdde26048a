"""Objects mode end to end: values and exceptions cross from a real worker as their own
types, refusals name the rule, and the exception channel fails closed."""

from __future__ import annotations

import datetime
import decimal
import fractions
import json
import pathlib
import traceback
import uuid

import objects_types
import pytest

from agent_sandbox import FileAccessDenied, LimitExceeded, Policy, Sandbox
from agent_sandbox._errors import ChildException
from agent_sandbox._host.intake.builder import ResultBuilder
from agent_sandbox._host.intake.unpickle import Decoder


@pytest.fixture(scope="module")
def sess(objects_sandbox: Sandbox):
    with objects_sandbox.session("objects") as session:
        session.run(
            "import datetime, decimal, fractions, uuid, pathlib, collections\nimport objects_types"
        ).raise_error()
        yield session


def test_builtin_values_round_trip(sess) -> None:
    """It returns standard-library values as themselves, not as reprs."""
    result = sess.run(
        "{'d': decimal.Decimal('1.25'), 'f': fractions.Fraction(1, 3),"
        " 't': datetime.datetime(2024, 5, 6, 7, 8, tzinfo=datetime.timezone.utc),"
        " 'u': uuid.UUID(int=7), 'p': pathlib.PurePosixPath('/a/b'), 'b': b'\\x00\\xff',"
        " 's': {1, 2}, 'fs': frozenset({'x'}), 'c': complex(1, 2), 'r': range(3),"
        " 'od': collections.OrderedDict(a=1), 'dq': collections.deque([1, 2], 5),"
        " 'tuple': (1, (2, 3))}"
    )
    assert result.error is None, result.error
    value = result.unwrap()
    assert value["d"] == decimal.Decimal("1.25")
    assert value["f"] == fractions.Fraction(1, 3)
    assert value["t"] == datetime.datetime(2024, 5, 6, 7, 8, tzinfo=datetime.UTC)
    assert value["u"] == uuid.UUID(int=7)
    assert value["p"] == pathlib.PurePosixPath("/a/b")
    assert value["b"] == b"\x00\xff" and value["s"] == {1, 2} and value["tuple"] == (1, (2, 3))
    json.dumps(result.to_dict())  # still JSON-safe: objects become marked reprs
    assert result.to_dict()["value"]["d"] == {
        "__repr__": "Decimal('1.25')",
        "__type__": "decimal.Decimal",
    }


def test_policy_named_models_round_trip(sess) -> None:
    """It returns pydantic models, dataclasses, enums and named tuples from `result_types`."""
    value = sess.run(
        "[objects_types.Reading(sensor='a', value=1.5, when=datetime.datetime(2024, 1, 1)),"
        " objects_types.Point(1, 2), objects_types.FrozenPoint(3, 4),"
        " objects_types.Pair(1, 'x'), objects_types.Colour.GREEN]"
    ).unwrap()
    assert value == [
        objects_types.Reading(sensor="a", value=1.5, when=datetime.datetime(2024, 1, 1)),
        objects_types.Point(1, 2),
        objects_types.FrozenPoint(3, 4),
        objects_types.Pair(1, "x"),
        objects_types.Colour.GREEN,
    ]


def test_a_type_outside_the_allowlist_is_refused_with_the_rule(sess) -> None:
    """It denies a value of a type the policy does not name, naming the type and the fix."""
    result = sess.run("objects_types.not_a_model")
    assert result.error is not None and result.error.rule == "result.refused"
    assert [d.rule for d in result.denials] == ["result.refused"]
    assert "objects_types.not_a_model" in result.error.message
    assert sess.run("1 + 1").unwrap() == 2  # the worker survives


def test_a_class_defined_in_the_call_cannot_cross(sess) -> None:
    """It denies a class defined in the call itself, with a message saying what to do."""
    result = sess.run("class Local:\n    pass\nLocal()")
    assert result.error is not None
    assert "result_types" in result.error.message


def test_exception_crosses_as_its_own_type_with_the_worker_traceback(sess) -> None:
    """It re-raises the worker's exception as its own type, traceback spliced in."""
    result = sess.run(
        "def inner():\n    raise objects_types.AppError('missing', 3)\n"
        "def outer():\n    try:\n        inner()\n"
        "    except KeyError as e:\n        raise ValueError('wrapped') from e\nouter()"
    )
    objects_types.CONSTRUCTED.clear()
    with pytest.raises(ValueError, match="wrapped") as info:
        result.raise_error()
    cause = info.value.__cause__
    assert type(cause) is objects_types.AppError and cause.args == ("missing", 3)
    assert objects_types.CONSTRUCTED == []  # the host class's own __init__ never ran
    text = "".join(traceback.format_exception(info.value))
    assert 'File "<cell-' in text and "in inner" in text and "in outer" in text
    assert "_worker/" not in text and "guards" not in text  # the worker's own frames


def test_host_code_can_catch_by_builtin_base(sess) -> None:
    """It rebuilds an unknown class as a `ChildException[...]` that is still a LookupError."""
    result = sess.run("class Gone(LookupError):\n    pass\nraise Gone('nope')")
    with pytest.raises(LookupError) as info:
        result.raise_error()
    assert isinstance(info.value, ChildException)
    assert info.value.child_type == "__main__.Gone"
    assert "ChildException[__main__:Gone]" in type(info.value).__qualname__


def test_system_exit_in_the_worker_cannot_end_the_host(sess) -> None:
    """It denies SystemExit/KeyboardInterrupt from crossing as themselves."""
    for code in ("raise SystemExit(3)", "raise KeyboardInterrupt"):
        with pytest.raises(ChildException):
            sess.run(code).raise_error()


def test_a_refusal_crosses_as_its_denied_type(sess) -> None:
    """It re-raises a policy refusal as its SandboxDenied subclass, with the denial."""
    result = sess.run("open('/etc/shadow')")
    with pytest.raises(FileAccessDenied) as info:
        result.raise_error()
    assert info.value.denial.rule == "files.read"


def test_rich_form_refused_falls_back_to_the_descriptor(sess) -> None:
    """It rebuilds an exception whose state holds a refused type from its descriptor, and
    says so, instead of losing the exception."""
    result = sess.run("raise objects_types.PathError('bad path', pathlib.Path('/x'))")
    with pytest.raises(objects_types.PathError, match="bad path") as info:
        result.raise_error()
    assert not hasattr(info.value, "path")
    assert any("rebuilt from its descriptor" in n for n in result.notices)
    assert any("pathlib.PosixPath" in n for n in getattr(info.value, "__notes__", []))


def test_oversized_result_is_refused_in_the_worker_and_it_survives(sess) -> None:
    """It denies a result above `limits.result_bytes` with the cap and how to raise it."""
    sess.run("keep = 41")
    result = sess.run("b'x' * 300_000")
    assert result.error is not None and result.error.rule == "limits.result"
    assert "200000" in result.error.message and "result_bytes" in result.error.message
    with pytest.raises(LimitExceeded):
        result.raise_error()
    assert sess.run("keep + 1").unwrap() == 42  # same worker, state kept


def test_data_only_mode_never_unpickles() -> None:
    """It denies a pickle sent by a data-only worker without reading it."""
    builder = ResultBuilder(Decoder(objects=False))
    builder.add("start", {"call": 1})
    builder.add("result", {"encoding": "pickle-b64", "pickle": "gAVLAS4="})
    builder.add("done", {})
    result = builder.build()
    assert result.value is None and result.error is not None
    assert result.error.rule == "result.refused"


def test_data_only_mode_still_raises_the_right_type() -> None:
    """It rebuilds exceptions from their descriptors in the default data-only mode too."""
    with Sandbox(Policy(name="test-data-only"), warm=0) as sb:
        result = sb.run("def f():\n    raise KeyError('k')\nf()")
    with pytest.raises(KeyError) as info:
        result.raise_error()
    assert "in f" in "".join(traceback.format_exception(info.value))


def test_pickling_runs_user_code_armed(sess) -> None:
    """It denies what a value's `__reduce__` does while the worker pickles it: the guards
    are still armed during encoding."""
    result = sess.run(
        "class Sneaky:\n    def __reduce__(self):\n        open('/etc/shadow')\n"
        "        return (int, (1,))\nSneaky()"
    )
    assert "files.read" in [d.rule for d in result.denials]


def test_repr_runs_user_code_armed_in_data_only_mode() -> None:
    """It denies what a value's `__repr__` does while the worker encodes it as data."""
    with Sandbox(Policy(name="test-data-only-repr"), warm=0) as sb:
        result = sb.run(
            "class Sneaky:\n    def __repr__(self):\n        open('/etc/shadow')\n"
            "        return 'x'\nSneaky()"
        )
    assert "files.read" in [d.rule for d in result.denials]


async def test_async_calls_decode_objects_too(objects_policy: Policy) -> None:
    """It decodes objects and rebuilds exceptions on the asyncio path as well."""
    with Sandbox(objects_policy, warm=0) as sb:
        result = await sb.arun("import decimal\ndecimal.Decimal('2.5')")
        assert result.unwrap() == decimal.Decimal("2.5")
        failed = await sb.arun("raise KeyError('k')")
    with pytest.raises(KeyError):
        failed.raise_error()


def test_user_code_still_cannot_unpickle_in_objects_mode(objects_policy: Policy) -> None:
    """It denies `pickle.loads` to user code in objects mode: the framework's own pickling
    was bound before arming and is not charged to, nor granted by, the policy."""
    policy = objects_policy.merged({"imports": {"allow": ["pickle"]}})
    with Sandbox(policy, warm=0) as sb:
        result = sb.run("import pickle\npickle.loads(pickle.dumps(1))")
    assert result.error is not None and result.error.rule == "api.deserialization"
