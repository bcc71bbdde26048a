"""Refused calls keep nothing per call on the host: counted, never timed.

A long run of refused calls on one session is read in three windows of calls, and each window
is judged by how much live memory it added. The middle value of the three decides: a per-call
cost shows in every window, while a one-time allocation of another thread (a pool refill)
lands in at most one.

Two counts, because neither alone is enough:

* live pymalloc blocks (`sys.getallocatedblocks()`, tracemalloc off): every object Python keeps
  is at least one block, so keeping one object per call (a 60-byte string) shows as 1.0 per
  call; buffers over 512 bytes are not blocks, hence
* traced bytes (tracemalloc on), for large buffers. Not the measure for small objects here:
  tracemalloc keeps a reference of its own to every distinct file name of a frame in which it
  saw an allocation, and every refused call's rebuilt traceback has a frame named after its
  cell (`<cell-N>`, a new name per call). That is about 60 bytes per call that tracemalloc
  itself holds (the blocks come back at `tracemalloc.stop()`; with tracemalloc off the count
  is 0), which is what the "~60 B per refused call, allocated in framing._decode" seen in
  tracemalloc diffs was.

The canary keeps one decoded event per call (what a cache or a tally keyed by what the worker
sent would do) and must be caught by the block count: the measure can fail.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.intake import framing

WINDOW = 150


def _policy() -> Policy:
    return Policy(
        name="retention-test",
        imports={"allow": ["math"]},
        limits={"wall_seconds": 20},
        no_kernel_boundary="accepted",
    )


@pytest.fixture(scope="module")
def session() -> Iterator[Callable[[], None]]:
    with Sandbox(_policy(), provider="subprocess", warm=0) as sb:
        s = sb.session("retention")

        def refused_call() -> None:
            result = s.run("import socket")
            assert result.error is not None and result.error.rule == "imports"

        # First-use costs happen here: imports, compiled patterns, and a bounded warm-up (about
        # 300 strings over the first few hundred refused calls, held below Python: no Python
        # object refers to them, and the count per call falls to 0.00 by the 600th call).
        for _ in range(600):
            refused_call()
        yield refused_call


def _per_call(measure: Callable[[], int], call: Callable[[], None]) -> list[float]:
    growth = []
    for _window in range(3):
        gc.collect()
        before = measure()
        for _ in range(WINDOW):
            call()
        gc.collect()
        growth.append((measure() - before) / WINDOW)
    return growth


def _middle(values: list[float]) -> float:
    return sorted(values)[1]


def test_refused_calls_keep_no_object_per_call(session: Callable[[], None]) -> None:
    """It keeps no Python object per refused call: live blocks grow by less than 0.5 per
    call (keeping one string per call is 1.0, one decoded event 2 or more)."""
    assert not tracemalloc.is_tracing()
    blocks = _per_call(sys.getallocatedblocks, session)
    assert _middle(blocks) < 0.5, f"live blocks added per refused call, by window: {blocks}"


def test_refused_calls_keep_no_buffer_per_call(session: Callable[[], None]) -> None:
    """It keeps no buffer per refused call: traced memory grows by less than 200 bytes per
    call (about 60 of them are tracemalloc's own reference to each call's `<cell-N>` name;
    keeping a call's result is several KB)."""
    tracemalloc.start(1)
    try:
        traced = _per_call(lambda: tracemalloc.get_traced_memory()[0], session)
    finally:
        tracemalloc.stop()
    assert _middle(traced) < 200, f"traced bytes added per refused call, by window: {traced}"


def test_canary_one_kept_event_per_call_is_counted(
    session: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block count catches a retention of one decoded event per refused call (the
    canary keeps them in a list, as a cache of what the worker sent would)."""
    kept: list[object] = []
    real = framing._DECODE

    def keeping(text: str) -> object:
        value = real(text)
        if isinstance(value, dict) and "duration" in value:  # the `done` event: one per call
            kept.append(value)
        return value

    monkeypatch.setattr(framing, "_DECODE", keeping)
    blocks = _per_call(sys.getallocatedblocks, session)
    assert len(kept) == 3 * WINDOW
    assert _middle(blocks) >= 1.0, f"the canary's retention was not counted: {blocks}"
