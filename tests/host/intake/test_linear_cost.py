"""No crafted pickle costs the host more than linear work in its size (issue 30).

One test per blow-up class the fuzzing found, each with a crafted stream at size N and 4N:
the work (hash lanes computed, hash-table probe steps) and the peak memory the prescan
takes must grow by a bounded factor, never by the class's old power. Counted, not timed:
the figures in docs/objects.md come from `tests/fuzz/measure_blowups.py`.
"""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox._errors import UnpickleRefused
from agent_sandbox._host.intake import unpickle_prescan
from agent_sandbox._host.intake.unpickle import load_restricted
from agent_sandbox._host.intake.unpickle_prescan import Budgets, python_prescan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fuzz"))
import hostile

try:
    from agent_sandbox._host.intake import _fastscan
except ImportError:  # pragma: no cover - the C extension is optional
    _fastscan = None  # type: ignore[assignment]


def _peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        try:
            fn()
        except UnpickleRefused:
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_shared_tuple_keys_cost_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """It denies the exponential blow-up of a dict key made of nested tuples shared through
    the memo: each tuple's hash is computed once from its items' hashes, so the lanes
    hashed grow with the stream (N to 4N: at most 4.5x), not with width**8."""
    lanes = [0]
    real = unpickle_prescan._tuple_hash

    def counting(items: list[int]) -> int:
        lanes[0] += len(items)
        return real(items)

    monkeypatch.setattr(unpickle_prescan, "_tuple_hash", counting)
    work, size, memory = [], [], []
    for width in (64, 256):
        data = hostile.shared_tuple_key(width)
        lanes[0] = 0
        assert python_prescan(data) == set()  # accepted: plain data, hashed in full
        work.append(lanes[0])
        size.append(len(data))
        memory.append(_peak(lambda d=data: python_prescan(d)))
    assert work[0] > 0
    assert size[1] / size[0] < 4.1
    assert work[1] / work[0] <= 4.5  # the old expansion: 4**8 = 65536x
    assert memory[1] / memory[0] <= 4.5


def test_the_computed_tuple_hash_is_pythons() -> None:
    """The prescan's tuple hash (computed from item hashes) equals `hash()` of the tuple,
    so a real hash flood of tuple keys is still counted."""
    from agent_sandbox._host.intake.unpickle_prescan import _tuple_hash

    def lanes(t: tuple[Any, ...]) -> int:
        return _tuple_hash([lanes(x) if isinstance(x, tuple) else hash(x) for x in t])

    for t in [(), (1,), (-1,), (1, "a", (2.5, None, True)), ((1, 2), (3, (4,))), (2**61,)]:
        assert lanes(t) == hash(t)


def test_tuple_key_hash_flood_is_still_refused() -> None:
    """It denies a dict whose distinct tuple keys share one hash: (-1,) and (-2,) hash the
    same (hash(-1) == hash(-2)), and so do all products of such pairs."""
    keys = []
    for k in range(80):
        bits = [(-1 if (k >> b) & 1 else -2) for b in range(7)]
        keys.append(
            b"(" + b"".join(b"J" + v.to_bytes(4, "little", signed=True) for v in bits) + b"t"
        )
    data = hostile.PROTO5 + b"}(" + b"".join(k + b"N" for k in keys) + b"u" + hostile.STOP
    with pytest.raises(UnpickleRefused, match="hash flooding"):
        load_restricted(data)


@pytest.mark.skipif(_fastscan is None, reason="the C extension is not built")
def test_c_hash_table_flood_costs_linear_probes() -> None:
    """It denies the C prescan's hash-table flood: int keys whose hashes the old public
    scramble put in one slot of every table size cost each insertion the whole chain.
    With per-process keyed slots and a 64-step probe cap, probe steps grow at most
    linearly (N to 4N keys: at most 4.5x, with at most 64 steps per key)."""
    b = Budgets()
    args = (b.max_bytes, b.max_opcodes, b.max_depth, b.max_memo, b.max_int_bytes, b.max_same_hash)
    steps, memory = [], []
    for count in (20_000, 80_000):
        data = hostile.int_keys_one_slot(count)
        before = _fastscan.probes()
        answer = _fastscan.prescan_data(data, *args)
        steps.append(_fastscan.probes() - before)
        assert steps[-1] <= 64 * count
        memory.append(_peak(lambda d=data: _fastscan.prescan_data(d, *args)))
        if not answer:  # "not sure": the Python scan decides, linearly too
            python_prescan(data)
    assert steps[1] <= 4.5 * max(steps[0], count)
    assert memory[1] / memory[0] <= 4.5


def test_the_old_scramble_put_every_crafted_key_in_one_slot() -> None:
    """The crafted keys really are the attack: under the old scramble
    (h * 0x9E3779B97F4A7C15 >> 32, masked) every one lands in slot 0 of a 2**21 table."""
    data = hostile.int_keys_one_slot(500)
    values = [
        int.from_bytes(data[k + 2 : k + 10], "little", signed=True)
        for k in range(4, len(data) - 2, 11)
    ]
    assert len(set(values)) == 500
    for v in values:
        h = v & ((1 << 64) - 1)
        assert ((h * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) >> 32 & ((1 << 21) - 1) == 0


@pytest.mark.parametrize(
    "build", [hostile.repeated_build_state, hostile.repeated_copying_call], ids=["build", "call"]
)
def test_shared_arguments_passed_again_and_again_are_refused(
    build: Callable[[int, int], bytes],
) -> None:
    """It denies the quadratic copy of one memoized value handed to a constructor or BUILD
    over and over (`deque(shared)` per call, one state dict per BUILD): the items handed
    over are counted against `max_copied`, so the host's work is bounded by the budget,
    whatever the sharing; a small such stream still loads."""
    load_restricted(build(200, 200))
    small = Budgets(max_copied=100_000)
    with pytest.raises(UnpickleRefused, match="hand over more than") as refused:
        load_restricted(build(1000, 1000), None, small)
    assert refused.value.budget == "max_copied"
    scan = unpickle_prescan._Scan(build(1000, 1000), unpickle_prescan.Allowlist(), small)
    with pytest.raises(UnpickleRefused):
        scan.run()
    assert scan.copied <= small.max_copied + 1001  # stopped at the first charge over it


def test_streams_without_sharing_stay_far_below_the_copy_budget() -> None:
    """What CPython's pickler writes for values with many constructor calls hands over
    fewer items than twice its size, so `max_copied` (2x the default cap) never refuses
    a stream that does not pass one value again and again."""
    import collections
    import datetime
    import decimal
    import fractions
    import pickle

    value = [
        (
            fractions.Fraction(k, 7),
            decimal.Decimal(f"{k}.5"),
            datetime.datetime(2020, 1, 1 + k % 28),
            collections.deque(range(k % 50)),
            collections.OrderedDict((str(j), j) for j in range(k % 20)),
            ValueError("x" * (k % 100), k),
        )
        for k in range(2000)
    ]
    data = pickle.dumps(value, protocol=5)
    scan = unpickle_prescan._Scan(data, unpickle_prescan.Allowlist(), Budgets())
    scan.run()
    assert 0 < scan.copied <= 2 * len(data)


# -- the call's deadline inside long parses ----------------------------------------------------


class _StepClock:
    """A clock that moves one second per read: the deadline is counted in looks, not waited."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads)


def test_the_deadline_stops_a_long_prescan_part_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """It denies a long objects-mode result the host's time past the call's deadline: the
    Python prescan looks at the deadline every DEADLINE_EVERY opcodes and stops at the first
    look past it, so a stream of any size costs at most one stretch past the deadline."""
    clock = _StepClock()
    monkeypatch.setattr(unpickle_prescan, "_clock", clock)
    data = hostile.long_pickle_with_globals(100_000)  # about 500,000 opcodes
    scan = unpickle_prescan._Scan(data, unpickle_prescan.Allowlist(), Budgets(), deadline=3.0)
    with pytest.raises(unpickle_prescan.DeadlinePassed, match="scanning the result's pickle"):
        scan.run()
    assert clock.reads == 3 and scan.checks == 3  # stopped at the third look, the first past it
    # ... after 3 stretches of opcodes, far from the stream's end (at most 8 bytes an opcode).
    with pytest.raises(unpickle_prescan.DeadlinePassed) as passed:
        clock.reads = 0
        load_restricted(data, None, Budgets(), deadline=3.0)
    at = int(str(passed.value).rsplit("at byte ", 1)[1].rstrip(")"))
    assert at <= 3 * unpickle_prescan.DEADLINE_EVERY * 8 < len(data) // 4
    # Without a deadline, or before it, the same stream loads.
    assert len(load_restricted(data, None, Budgets())) == 100_000


def test_the_deadline_stops_the_build_at_its_next_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """It denies the build (the C unpickler) time past the deadline: the reader it pulls
    its frames from looks at the deadline on every read."""
    from agent_sandbox._host.intake.unpickle import _Reader

    clock = _StepClock()
    monkeypatch.setattr(unpickle_prescan, "_clock", clock)
    reader = _Reader(b"\x80\x05N.", deadline=2.0)
    assert reader.read(2) == b"\x80\x05"  # the first look: before the deadline
    with pytest.raises(TimeoutError):
        reader.read(1)


def test_a_result_decoded_past_the_deadline_ends_the_call_as_a_timeout(
    monkeypatch: pytest.MonkeyPatch, objects_sandbox: Any
) -> None:
    """It denies a worker's result the host's time past the call's deadline, end to end:
    the decode stops, the call ends with `limits.timeout` and the worker is killed (its
    variables are lost), as when the call itself runs too long. The host's clock for the
    decode is made to be past the deadline as soon as the result arrives."""
    with objects_sandbox.session("deadline") as session:
        session.run("import fractions\nkept = 1").raise_error()
        monkeypatch.setattr(unpickle_prescan, "_clock", lambda: float("inf"))
        result = session.run("[fractions.Fraction(k, 7) for k in range(2000)]")
        monkeypatch.undo()
        assert result.error is not None and result.error.rule == "limits.timeout"
        assert result.value is None
        after = session.run("kept")
        assert after.error is not None and "kept" in after.error.message  # a fresh worker


# -- JSON events -------------------------------------------------------------------------------


def test_an_unterminated_string_of_escapes_costs_one_pass() -> None:
    """It denies the quadratic count of a JSON event's values: with more separators than the
    budget the count removes strings with a regular expression, and each `"` of an
    unterminated `"\\"\\"...` used to start a match that ran to the end and failed. Now a
    match never fails: one match covers the whole run (the work is one pass), and the old
    pattern's failure is shown."""
    import re

    from agent_sandbox._wire import _JSON_STRING, json_values

    old = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
    for pairs in (1000, 4000):
        data = hostile.escaped_quote_run(pairs, commas=2000)
        run = data.index(b'"')
        assert old.match(data, run) is None  # the old pattern failed here, at every `"`
        matches = list(_JSON_STRING.finditer(data))
        assert len(matches) == 1 and matches[0].span() == (run, len(data))
        assert json_values(data, 1000) == 2002
    memory = [
        _peak(lambda p=p: json_values(hostile.escaped_quote_run(p, 2000), 1000))
        for p in (100_000, 400_000)
    ]
    assert memory[1] / memory[0] <= 4.5


def test_an_unterminated_string_never_hides_values_of_valid_json() -> None:
    """The exact count is unchanged for valid JSON (strings with escapes, separators inside
    strings), and an unterminated string is invalid JSON, which the decoder refuses."""
    import json

    from agent_sandbox._wire import json_values

    value = ["a,b", {'k\\"[': ["\\", "x{y", 1]}, '"', 2.5, None]
    text = json.dumps(value).encode()
    blank = json.dumps(["", {"": ["", "", 1]}, "", 2.5, None]).encode()  # strings emptied
    assert json_values(text, 0) == sum(blank.count(c) for c in b",[{") + 1 == 10
    with pytest.raises(ValueError):
        json.loads(hostile.escaped_quote_run(10, commas=3))


def _host_parser() -> Any:
    from agent_sandbox._host.intake.events import HostBounds
    from agent_sandbox._host.intake.framing import SSEParser
    from agent_sandbox._wire import value_budget

    bounds = HostBounds()
    caps = bounds.kind_caps()
    return SSEParser(bounds.max_event_bytes(), caps, value_budget(caps["result"][0]))


@pytest.mark.parametrize("kind", ["stdout", "image", "counts", "host_call"])
def test_events_of_empty_objects_are_refused_before_decoding(kind: str) -> None:
    """It denies the memory blow-up of decoding many small JSON values from an event that
    is not an outcome (a 6 MB stdout event of `{}` decoded to about 160 MB): output must be
    one JSON string, every other kind is counted against one value per 32 bytes of its cap
    before it is decoded; the host's peak memory grows with the event, at most its size
    again (N to 4N: at most 4.5x)."""
    from agent_sandbox._errors import TransportError
    from agent_sandbox._host.intake.events import HostBounds
    from agent_sandbox._wire import value_budget

    over = value_budget(HostBounds().kind_caps()[kind][0]) + 1000
    sizes = (over, 4 * over) if kind != "stdout" else (200, 800)
    peaks = []
    for count in sizes:
        data = hostile.sse_event(kind, hostile.empty_objects(count))
        parser = _host_parser()
        with pytest.raises(TransportError, match=r"JSON values|not one JSON string"):
            parser.feed(data)
        peaks.append(_peak(lambda d=data: _feed_quietly(d)))
        assert peaks[-1] <= 2 * len(data) + 64 * 1024
    assert peaks[1] / peaks[0] <= 4.5


def _feed_quietly(data: bytes) -> None:
    from agent_sandbox._errors import TransportError

    try:
        _host_parser().feed(data)
    except TransportError:
        pass


def test_honest_events_still_decode_under_the_value_budgets() -> None:
    """Output with every kind of character, an image and a host-tool request as the worker
    and the code send them decode as before."""
    import json

    text = json.dumps('print,[{"x"}]\n\u2028\ud800' * 1000).encode()
    image = json.dumps({"name": "a.png", "mime": "image/png", "data": "QUJD" * 10_000})
    call = json.dumps({"tool": "t", "args": {"rows": [[k, str(k)] for k in range(1000)]}})
    events = _host_parser().feed(
        hostile.sse_event("stdout", text)
        + hostile.sse_event("image", image.encode())
        + hostile.sse_event("host_call", call.encode())
    )
    assert [kind for kind, _ in events] == ["stdout", "image", "host_call"]
    assert events[0][1].startswith("print,[")
