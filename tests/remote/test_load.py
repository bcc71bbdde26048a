"""The bounded loopback load test (`benchmarks/bench_remote.py`), small: P processes, each
with its own `LocalClaimBackend`, T threads each opening its own session and making K calls.
Issue 21's target: zero errors and nothing left behind (the figures are the benchmark's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from .conftest import Certs

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_remote.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_remote", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_small_load_test_has_no_errors_and_leaves_nothing(certs: Certs) -> None:
    bench = _bench()
    paths = {"ca": certs.ca, "server": certs.server, "client": certs.client}
    out = bench.load_test(paths, 2, 2, 3)
    assert out["children"] == [0, 0]
    assert out["errors"] == [] and out["capacity"] == 0
    assert len(out["claim"]) == 4 and len(out["call"]) == 12  # every session made its calls
    assert out["left"] == []
