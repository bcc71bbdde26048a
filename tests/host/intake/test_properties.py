"""Property tests (hypothesis) for what the host reads from a worker: the prescan and
find_class, the SSE parser, and the event decoder. Malformed, truncated, oversized and
hostile input ends in a clear refusal (`UnpickleRefused` / `TransportError`), never in code
execution, a hang or a crash of the parent."""

from __future__ import annotations

import base64
import datetime
import decimal
import pickle
import re
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_sandbox._errors import MessageTooLarge, TransportError, UnpickleRefused
from agent_sandbox._host.intake.builder import ResultBuilder
from agent_sandbox._host.intake.framing import SSEParser
from agent_sandbox._host.intake.unpickle import Decoder, load_restricted
from agent_sandbox._host.intake.unpickle_classes import Allowlist
from agent_sandbox._host.intake.unpickle_prescan import Budgets
from agent_sandbox._wire import encode_event

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_EVENTS: list[str] | None = None
_WATCH = ("import", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "open")


def _hook(event: str, args: Any) -> None:
    if _EVENTS is not None and event in _WATCH:
        _EVENTS.append(event)


sys.addaudithook(_hook)


def _quiet(fn: Any, *args: Any) -> Any:
    """Call fn with the audit watch on; fail on any import, process or file open."""
    global _EVENTS
    _EVENTS = []
    try:
        return fn(*args)
    finally:
        events, _EVENTS = _EVENTS, None
        assert events == [], f"decoding caused {events}"


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.decimals(allow_nan=False, allow_infinity=False, places=3).map(decimal.Decimal)
    | st.datetimes(timezones=st.just(datetime.UTC) | st.none())
    | st.dates()
    | st.timedeltas()
)
hashable = st.none() | st.integers() | st.text(max_size=10) | st.binary(max_size=10)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=5)
        | st.dictionaries(hashable, inner, max_size=5)
        | st.frozensets(hashable, max_size=5)
        | st.sets(hashable, max_size=5)
    ),
    max_leaves=25,
)


@SETTINGS
@given(values)
def test_allowlisted_values_always_round_trip(value: Any) -> None:
    """Any value built from allowlisted types decodes to an equal value."""
    data = pickle.dumps(value, protocol=5)
    assert _quiet(load_restricted, data) == value


@SETTINGS
@given(st.binary(max_size=300))
def test_arbitrary_bytes_are_refused_or_decoded_quietly(data: bytes) -> None:
    """Random bytes end in a value or an UnpickleRefused; nothing else escapes."""
    try:
        _quiet(load_restricted, data, Allowlist(), Budgets(max_bytes=10_000))
    except UnpickleRefused:
        pass


@SETTINGS
@given(values, st.data())
def test_mutated_pickles_are_refused_or_decoded_quietly(value: Any, data: st.DataObject) -> None:
    """Valid streams with bytes flipped, cut, inserted or hostile opcodes spliced in end in
    a value or an UnpickleRefused."""
    raw = bytearray(pickle.dumps(value, protocol=5))
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, max(0, len(raw) - 1)))
        action = data.draw(st.sampled_from(["flip", "cut", "insert", "gadget"]))
        if action == "flip" and raw:
            raw[where] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del raw[where:]
        elif action == "insert":
            raw[where:where] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            raw[where:where] = data.draw(
                st.sampled_from(
                    [
                        b"\x8c\x05posix\x8c\x06system\x93",
                        b"R",
                        b"b",
                        b"\x81",
                        b"\x94",
                        b"h\x00",
                        b"(",
                        b"t",
                        b"0",
                        b"1",
                        b"s",
                        b"a",
                        b"e",
                        b"u",
                        b"\x90",
                        b"\x91",
                        b"\x92",
                        b"\x95" + b"\xff" * 8,
                    ]
                )
            )
    try:
        _quiet(load_restricted, bytes(raw))
    except UnpickleRefused:
        pass


@SETTINGS
@given(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.<>:0123456789 ", max_size=30),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.<>:0123456789 ", max_size=30),
)
def test_find_class_only_returns_allowlisted_globals(module: str, name: str) -> None:
    """find_class resolves only allowlist entries and imports nothing, whatever the names."""
    from conftest import g, s, stream

    data = stream(g(module, name), s("x"), b"\x85R")
    try:
        _quiet(load_restricted, data, Allowlist(["objects_types.*"]))
    except UnpickleRefused:
        pass


def _events() -> st.SearchStrategy[list[tuple[str, Any]]]:
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=15,
    )
    kinds = st.sampled_from(
        ["stdout", "stderr", "denial", "image", "result", "error", "notice", "done", "files"]
    )
    return st.lists(st.tuples(kinds, json_values), max_size=6)


@SETTINGS
@given(_events(), st.lists(st.integers(0, 400), max_size=6))
def test_sse_parser_reassembles_any_split(events: list[tuple[str, Any]], cuts: list[int]) -> None:
    """The parser yields the same events however the stream is cut into chunks."""
    raw = b"".join(encode_event(k, d) for k, d in events)
    parser = SSEParser(1_000_000)
    out = []
    start = 0
    for cut in sorted(c for c in cuts if c < len(raw)):
        out += parser.feed(raw[start:cut])
        start = cut
    out += parser.feed(raw[start:])
    assert out == [(k, d) for k, d in events] and parser.pending() == 0


@SETTINGS
@given(st.binary(max_size=400), st.integers(0, 400))
def test_sse_parser_refuses_garbage_with_transport_error(raw: bytes, cut: int) -> None:
    """Arbitrary bytes end in events or a TransportError (never another exception)."""
    parser = SSEParser(256)
    try:
        _quiet(parser.feed, raw[:cut])
        _quiet(parser.feed, raw[cut:])
    except TransportError:
        pass


def test_sse_parser_refuses_an_oversized_event_without_a_terminator() -> None:
    """It denies an event larger than the cap, even before the event ends."""
    parser = SSEParser(1000)
    with pytest.raises(MessageTooLarge, match="result_bytes"):
        for _ in range(20):
            parser.feed(b"event: stdout\ndata: " + b"x" * 100)


def test_sse_parser_is_linear_in_a_trickled_stream() -> None:
    """A worker trickling a large event byte by byte costs the parser linear time (the scan
    resumes where it stopped), so it cannot stall the host."""
    parser = SSEParser(10_000_000)
    payload = b'event: stdout\ndata: "' + b"x" * 200_000 + b'"\n\n'
    events = []
    for offset in range(0, len(payload), 7):
        events += parser.feed(payload[offset : offset + 7])
    assert events == [("stdout", "x" * 200_000)]


@SETTINGS
@given(_events())
def test_event_decoder_never_raises(events: list[tuple[str, Any]]) -> None:
    """Any sequence of well-framed events builds a RunResult whose error raises as a host
    Exception (never SystemExit/KeyboardInterrupt) and whose to_dict() is JSON; an event the
    host's judge refuses is a TransportError, never anything else."""
    import json

    builder = ResultBuilder(Decoder(objects=True))
    builder.add("start", {"call": 1})
    for kind, data in events:
        try:
            _quiet(builder.add, kind, data)
        except TransportError:  # the host's judge refused it: the worker would be killed
            break
    result = builder.build()
    json.dumps(result.to_dict())
    try:
        result.raise_error()
    except Exception:
        pass


exception_payloads = st.fixed_dictionaries(
    {
        "descriptor": st.fixed_dictionaries(
            {
                "module": st.sampled_from(["builtins", "objects_types", "os", "nowhere", "", 5]),
                "qualname": st.sampled_from(
                    [
                        "ValueError",
                        "SystemExit",
                        "AppError",
                        "system",
                        "<locals>.X",
                        "a.b.c",
                        "",
                        None,
                    ]
                ),
                "bases": st.lists(
                    st.sampled_from(
                        ["builtins.KeyError", "builtins.OSError", "builtins.BaseException", "x"]
                    ),
                    max_size=3,
                ),
                "message": st.text(max_size=30) | st.integers(),
                "denials": st.lists(
                    st.dictionaries(st.sampled_from(["rule", "target", "x"]), st.text(max_size=5)),
                    max_size=2,
                ),
            }
        ),
        "traceback": st.none()
        | st.recursive(
            st.none(),
            lambda nxt: st.fixed_dictionaries(
                {
                    "tb_frame": st.fixed_dictionaries(
                        {
                            "f_globals": st.dictionaries(
                                st.sampled_from(["__name__", "x"]), st.text(max_size=5), max_size=2
                            ),
                            "f_locals": st.just({})
                            | st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
                            "f_code": st.fixed_dictionaries(
                                {
                                    "co_filename": st.text(max_size=10),
                                    "co_name": st.text(max_size=10) | st.integers(),
                                }
                            ),
                            "f_lineno": st.integers(-5, 10**9),
                        }
                    ),
                    "tb_lineno": st.integers(-5, 10**9) | st.booleans(),
                    "tb_next": nxt,
                }
            ),
            max_leaves=5,
        ),
        "rich": st.just({})
        | st.fixed_dictionaries(
            {"pickle": st.binary(max_size=60).map(lambda b: base64.b64encode(b).decode())}
        )
        | st.fixed_dictionaries({"pickle": st.text(max_size=20)})
        | st.fixed_dictionaries({"refused": st.text(max_size=20)}),
        "suppress_context": st.booleans(),
    }
)


@SETTINGS
@given(exception_payloads)
def test_hostile_exception_payloads_fail_closed(payload: dict[str, Any]) -> None:
    """Any exception payload becomes an Exception in the host (the right type, a stand-in,
    or none), never SystemExit, never an import, never a crash."""
    builder = ResultBuilder(Decoder(objects=True))
    builder.add("start", {"call": 1})
    _quiet(
        builder.add,
        "error",
        {"kind": "exception", "type": "X", "message": "m", "exception": payload},
    )
    error = builder.error
    assert error is not None
    if error.exception is not None:
        assert isinstance(error.exception, Exception)
        tb = error.child_traceback
        while tb is not None:
            assert isinstance(tb.tb_lineno, int)
            tb = tb.tb_next


@SETTINGS
@given(st.text(alphabet=st.characters(exclude_categories=()), max_size=30))
def test_any_text_crosses_the_wire_including_lone_surrogates(text: str) -> None:
    """Text the code prints (lone surrogates included) crosses in one event, instead of
    failing its encoding in the worker and vanishing (found by this test); the host keeps
    it as text: each lone surrogate becomes U+FFFD, everything else is unchanged."""
    event = encode_event("stdout", {text: text})
    shown = re.sub("[\ud800-\udfff]", "\ufffd", text)
    assert SSEParser(100_000).feed(event) == [("stdout", {shown: shown})]
    shown.encode("utf-8")
