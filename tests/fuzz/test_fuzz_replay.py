"""The normal suite's short, bounded fuzz run: every harness in `harnesses.py` replays its
committed corpus (`corpus/NAME/`: the issue's reproducers, seeds and the inputs long runs
kept) in this process, a few seconds in total. Long runs: `scripts/fuzz-long.sh`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harnesses  # noqa: E402


@pytest.mark.parametrize("name", sorted(harnesses.HARNESSES))
def test_corpus_replays_clean(name: str) -> None:
    """Every committed input of the harness runs without a defect (a crash, a forbidden
    audit event or a failed differential oracle raises here)."""
    files = sorted((HERE / "corpus" / name).iterdir())
    assert files, f"no corpus for {name}"
    for path in files:
        harnesses.HARNESSES[name](path.read_bytes())


def test_the_replay_holds_the_issue_reproducers() -> None:
    """The corpus carries the issue's frame-split, flood and blow-up reproducers."""
    import hostile

    corpus = {p.read_bytes() for p in (HERE / "corpus" / "unpickle").iterdir()}
    for data in (
        hostile.SMALLEST_FRAME_SPLIT,
        hostile.fraction_from_string(),
        hostile.build_on_class(),
        hostile.frame_in_frame(),
        hostile.shared_tuple_key(6),
    ):
        assert data in corpus
