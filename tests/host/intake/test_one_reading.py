"""One reading of a pickle's bytes (issue 30): the opcodes the prescan judges are the opcodes
the restricted unpickler executes, in the same order.

CPython's unpickler fed from a file keeps a FRAME's bytes in a buffer; when an opcode's
argument crosses the frame's end it drops the buffer's rest and reads fresh bytes after it,
so a stream with such a frame is two programs: the one a linear reader (both prescans,
`pickle.loads`) sees and the one a file-fed unpickler runs. Both prescans now refuse an
opcode crossing a frame's end and a FRAME inside a frame (CPython's pickler writes neither),
and the unpickler reads from an exact reader over the judged buffer (`unpickle._Reader`).

The reproducers come from `tests/fuzz/hostile.py`; each test first shows that the attack is
real (a plain file-fed unpickler, with a recording `find_class`, reaches the hidden
global), then that the host refuses it and nothing was built.
"""

from __future__ import annotations

import fractions
import io
import os
import pickle
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_sandbox._errors import UnpickleRefused
from agent_sandbox._host.intake import unpickle
from agent_sandbox._host.intake.unpickle import load_restricted
from agent_sandbox._host.intake.unpickle_classes import BUILTIN_TYPES, REDUCE, Allowlist
from agent_sandbox._host.intake.unpickle_prescan import Budgets, python_prescan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fuzz"))
import hostile

try:
    from agent_sandbox._host.intake import _fastscan
except ImportError:  # pragma: no cover - the C extension is optional
    _fastscan = None  # type: ignore[assignment]

SETTINGS = settings(
    max_examples=int(os.environ.get("ONE_READING_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _c_accepts(data: bytes) -> bool:
    if _fastscan is None:
        return False
    b = Budgets()
    return bool(
        _fastscan.prescan_data(
            data, b.max_bytes, b.max_opcodes, b.max_depth, b.max_memo, b.max_int_bytes,
            b.max_same_hash,
        )
    )  # fmt: skip


class _Recorder(pickle.Unpickler):
    """A plain file-fed unpickler (what the host used) that builds nothing dangerous: every
    global resolves to a stand-in that records the call."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.globals: list[str] = []
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        self.globals.append(full)
        calls = self.calls

        class StandIn:
            def __new__(cls, *args: Any) -> Any:
                calls.append((full, args))
                return object.__new__(cls)

        return StandIn


def _hidden_run(data: bytes) -> _Recorder:
    rec = _Recorder(data)
    try:
        rec.load()
    except Exception:
        pass
    return rec


def _refused_by_both(data: bytes, what: str) -> None:
    assert not _c_accepts(data), "the C prescan accepted it"
    with pytest.raises(UnpickleRefused, match=what):
        python_prescan(data)
    with pytest.raises(UnpickleRefused, match=what):
        load_restricted(data)


def test_refuses_the_smallest_frame_disagreement() -> None:
    """It denies the 17-byte stream that two readers read differently: PROTO 5, FRAME(4),
    BININT -77, STOP (a linear reader gives -77, a file-fed one finds it truncated)."""
    data = hostile.SMALLEST_FRAME_SPLIT
    assert len(data) == 17
    assert pickle.loads(data) == -77  # linear
    with pytest.raises(pickle.UnpicklingError, match="truncated"):
        pickle.Unpickler(io.BytesIO(data)).load()  # file-fed: another program
    _refused_by_both(data, "crosses the end of its FRAME")


def test_refuses_frame_split_fraction_from_string() -> None:
    """It denies a FRAME whose end splits a string's length from its bytes, hiding
    `Fraction('1e5')` (a form the allowlist refuses) from a linear reader."""
    data = hostile.fraction_from_string("1e5")
    linear = pickle.loads(data)  # plain data, as the old prescans saw it
    assert linear[0] == "abx" and isinstance(linear[1], bytes)
    rec = _hidden_run(data)
    assert rec.calls == [("fractions.Fraction", ("1e5",))]  # the attack is real
    _refused_by_both(data, "crosses the end of its FRAME")


def test_refuses_frame_split_build_on_class() -> None:
    """It denies the frame split that runs BUILD on the class `fractions.Fraction` (a
    setattr on a host class: `Fraction.pwned = 'yes'`)."""
    data = hostile.build_on_class()
    rec = _hidden_run(data)
    assert rec.globals == ["fractions.Fraction"]  # the hidden program names the class
    _refused_by_both(data, "crosses the end of its FRAME")
    assert not hasattr(fractions.Fraction, "pwned")


def test_refuses_a_frame_inside_a_frame() -> None:
    """It denies a FRAME inside a frame (a file-fed unpickler re-buffers at it)."""
    _refused_by_both(hostile.frame_in_frame(), "FRAME inside a frame")


def test_accepts_what_cpython_writes_with_frames_and_large_bytes() -> None:
    """Frames CPython writes, including large bytes written outside any frame, still load."""
    value = {"big": b"x" * 200_000, "text": "y" * 100_000, "n": list(range(20_000))}
    for protocol in (4, 5):
        data = pickle.dumps(value, protocol=protocol)
        assert load_restricted(data) == value


def test_the_reader_must_be_consumed_to_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """It denies a stream the unpickler finishes before its end (a second check that the
    two readings agree): with the prescan switched off, a frame split whose hidden program
    is `POP NONE STOP` loads None, and the unconsumed rest is refused."""
    data = hostile.frame_split(b"0N.")
    monkeypatch.setattr(unpickle, "prescan", lambda *args: set())
    with pytest.raises(UnpickleRefused, match="read the stream differently"):
        load_restricted(data)
    reader = unpickle._Reader(data)
    assert unpickle._Unpickler(reader, Allowlist()).load() is None  # the hidden program ran
    assert reader.consumed < len(data)


# -- the differential: whatever the prescan accepts runs as genops reads it -----------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | st.binary(max_size=120)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.integers() | st.text(max_size=5), inner, max_size=5)
        | st.tuples(inner, inner)
        | st.sets(st.integers(), max_size=4)
        | st.builds(fractions.Fraction, st.integers(), st.integers(min_value=1))
    ),
    max_leaves=15,
)


class _Trace(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """The pure-Python unpickler on the same exact reader, recording each opcode it runs."""

    def __init__(self, data: bytes) -> None:
        super().__init__(unpickle._Reader(data))
        self.trace: list[bytes] = []
        self.dispatch = {
            code: self._recording(code, fn) for code, fn in pickle._Unpickler.dispatch.items()
        }

    def _recording(self, code: int, fn: Any) -> Any:
        def run(unpickler: Any) -> Any:
            self.trace.append(bytes([code]))
            return fn(unpickler)

        return run

    def find_class(self, module: str, name: str) -> Any:
        return Allowlist().lookup(f"{module}.{name}").obj


@SETTINGS
@given(
    value=_values,
    protocol=st.sampled_from([4, 5]),
    cuts=st.lists(
        st.tuples(st.integers(0, 60), st.integers(0, 400) | st.integers(0, 12)), max_size=6
    ),
)
def test_what_the_prescan_accepts_runs_as_it_was_judged(
    value: Any, protocol: int, cuts: list[tuple[int, int]]
) -> None:
    """Over valid pickles re-framed at random (frames ending between opcodes, inside them,
    past others, nested): whenever either prescan accepts, the restricted unpickler builds
    the value of the same opcodes read linearly, the pure-Python unpickler on the same
    reader runs exactly genops' opcodes in genops' order, and the reader ends at the end."""
    data = hostile.reframe(pickle.dumps(value, protocol=protocol), cuts)
    try:
        python_prescan(data)
        accepted = True
    except UnpickleRefused:
        accepted = False
    if _c_accepts(data):
        assert accepted, f"the C prescan accepted what the Python one refuses: {data!r:.200}"
    if not accepted:
        return
    linear = [b for _, _, b in hostile.ops(data)]
    tracer = _Trace(data)
    traced = tracer.load()
    assert tracer.trace == linear
    got = load_restricted(data)
    unframed = hostile.reframe(data, [])
    assert got == pickle.loads(unframed) == traced == value


def test_the_differential_sees_the_old_disagreement() -> None:
    """The differential's oracle fails on the issue's stream when the frame check is off
    (the trace stops short of genops' opcodes), so it can catch a regression."""
    data = hostile.SMALLEST_FRAME_SPLIT
    linear = [b for _, _, b in hostile.ops(data)]
    tracer = _Trace(data)
    with pytest.raises(pickle.UnpicklingError):
        tracer.load()
    assert tracer.trace != linear


# -- host state out of reach: every refused constructor form and BUILD on every global ------------

_ALLOWED_GLOBALS = sorted(k for k in BUILTIN_TYPES if "." in k)


def _g(name: str) -> bytes:
    module, _, qual = name.rpartition(".")
    return hostile.short_str(module) + hostile.short_str(qual) + b"\x93"


@pytest.mark.parametrize("name", _ALLOWED_GLOBALS)
def test_refuses_build_on_each_allowlisted_global(name: str) -> None:
    """It denies BUILD whose target is an allowlisted global itself (a class or a
    constant): a stream may give state only to an instance it built."""
    state = b"N}" + hostile.short_str("pwned") + hostile.short_str("yes") + b"s\x86"
    data = hostile.PROTO5 + _g(name) + state + b"b" + hostile.STOP
    with pytest.raises(UnpickleRefused, match="BUILD on a global"):
        load_restricted(data)
    assert not hasattr(BUILTIN_TYPES[name].obj, "pwned")


_REFUSED_FORMS: dict[str, list[bytes]] = {
    "fractions.Fraction": [
        hostile.short_str("1e999999999") + b"\x85",  # Fraction('1e999999999'): 10**999999999
        hostile.short_str("1/3") + b"\x85",
        b"G" + struct.pack(">d", 0.5) + b"\x85",
        b"J\x01\x00\x00\x00\x85",  # one int: Fraction(n) is fine in Python, not in the list
    ],
    "decimal.Decimal": [b"J\x01\x00\x00\x00\x85", b"G" + struct.pack(">d", 0.5) + b"\x85"],
    "builtins.complex": [hostile.short_str("1+2j") + b"\x85"],
    "builtins.range": [hostile.short_str("9") + b"\x85", b")"],
    "datetime.date": [b"J\x01\x00\x00\x00\x85", hostile.short_str("2020") + b"\x85"],
    "datetime.timedelta": [hostile.short_str("1") + b"\x85"],
}


@pytest.mark.parametrize(
    ("name", "args"),
    [(name, args) for name, forms in sorted(_REFUSED_FORMS.items()) for args in forms],
)
def test_refuses_each_constructor_form_outside_the_allowlist(name: str, args: bytes) -> None:
    """It denies REDUCE on an allowlisted class with argument shapes its entry does not
    list (e.g. Fraction from a string, which could compute 10**999999999 in the host)."""
    assert REDUCE in BUILTIN_TYPES[name].uses
    data = hostile.PROTO5 + _g(name) + args + b"R" + hostile.STOP
    with pytest.raises(UnpickleRefused, match="outside its allowed shapes"):
        load_restricted(data)


@pytest.mark.parametrize(
    "name", sorted(k for k, e in BUILTIN_TYPES.items() if "." in k and REDUCE not in e.uses)
)
def test_refuses_calling_a_global_the_allowlist_lists_as_a_value(name: str) -> None:
    """It denies REDUCE on a global allowed only as a value (`bytearray(10**12)`)."""
    data = hostile.PROTO5 + _g(name) + b"J\x01\x00\x00\x00\x85R" + hostile.STOP
    with pytest.raises(UnpickleRefused, match=r"may not be used for REDUCE|not an allowed"):
        load_restricted(data)
