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
    from agent_sandbox.guards import _fastscan
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
