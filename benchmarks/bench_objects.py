"""Objects-mode benchmark: what decoding a worker's result costs the host, in both modes.

Run: `.venv/bin/python benchmarks/bench_objects.py [--rounds N] [--runs 3] [--no-end-to-end]`

For each typical result (a dict of 10k numbers, a pandas DataFrame when pandas is
installed, a 1 MB bytes value, and the same bytes inside a dict) it measures, in one run,
the host-side decode of the event payload exactly as the worker sends it:

* `pickle.loads`  - the unsafe floor (what smolagents did): the raw pickle, no checks;
* `objects`       - `Decoder.decode_value`: base64 decode, symbolic prescan, allowlisted
                    C unpickler (the prescan alone is shown on its own line);
* `data-only`     - `json.loads` of the `result` event's JSON (`to_data()` of the value;
                    a DataFrame or bytes only cross there as a marked repr, so that line
                    measures less information, and says so).

Also one end-to-end call through a real worker per mode for the dict. The machine is shared
and noisy: read medians and ratios, not single numbers.
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import os
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.intake.unpickle import Decoder
from agent_sandbox._host.intake.unpickle_prescan import prescan
from agent_sandbox._worker.run import to_data


def measure(fn: Callable[[], object], rounds: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def paired(
    floor: Callable[[], object], fn: Callable[[], object], rounds: int
) -> tuple[list[float], list[float]]:
    """Both functions timed alternately, round by round, so load spikes hit both alike; the
    cyclic collector is run between rounds and paused within one (both build the same
    objects, and a collection landing in one of them measures the collector)."""
    for _ in range(2):
        floor()
        fn()
    a: list[float] = []
    b: list[float] = []
    try:
        for _ in range(rounds):
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            floor()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            gc.enable()
            a.append(t1 - t0)
            b.append(t2 - t1)
    finally:
        gc.enable()
    return a, b


def row(name: str, samples: list[float], base: float | None, note: str = "") -> str:
    med = statistics.median(samples)
    ratio = f"{med / base:7.1f}x" if base else "       "
    return f"  {name:<28} {med * 1e3:9.3f} ms  {ratio}  {note}"


def cases() -> list[tuple[str, Any, tuple[str, ...]]]:
    out: list[tuple[str, Any, tuple[str, ...]]] = [
        ("dict of 10k numbers", {f"k{i}": i * 1.5 for i in range(10_000)}, ()),
        ("1 MB bytes", b"\x00\x01" * 500_000, ()),
        # The same bytes inside a dict: not one blob, so the ordinary path (base64, prescan,
        # unpickler).
        ("dict holding 1 MB bytes", {"name": "x.png", "data": b"\x00\x01" * 500_000}, ()),
    ]
    try:
        import pandas as pd
    except ImportError:
        print("pandas is not installed: the DataFrame case is skipped")
        return out
    frame = pd.DataFrame(
        {"a": range(10_000), "b": [i * 0.5 for i in range(10_000)], "c": ["x", "y"] * 5_000}
    )
    raw = pickle.dumps(frame, protocol=5)
    # The policy names each global the DataFrame's pickle uses (trusted as given).
    names = sorted(_globals(raw))
    out.append((f"pandas DataFrame 10k x 3 (pandas {pd.__version__})", frame, tuple(names)))
    return out


def _globals(raw: bytes) -> set[str]:
    """The globals our own (trusted) DataFrame pickle names, recorded by a plain load."""
    found: set[str] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recorder(io.BytesIO(raw)).load()
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--runs", type=int, default=3, help="runs of the paired ratio")
    parser.add_argument("--no-end-to-end", action="store_true")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}")
    summary: list[str] = []
    for title, value, types in cases():
        raw = pickle.dumps(value, protocol=5)
        event = {"encoding": "pickle-b64", "pickle": base64.b64encode(raw).decode()}
        decoder = Decoder(objects=True, result_types=types, max_bytes=50_000_000)
        data_json = json.dumps({"value": to_data(value)}, separators=(",", ":"))
        assert decoder.decode_value(event) is not None
        print(f"\n{title}: pickle {len(raw):,} bytes, data-only JSON {len(data_json):,} bytes")
        if types:
            print(f"  result_types = {list(types)}")
        base = measure(lambda raw=raw: pickle.loads(raw), args.rounds)
        b = statistics.median(base)
        print(row("pickle.loads (unsafe floor)", base, None))
        print(
            row(
                "objects: prescan only",
                measure(lambda raw=raw, d=decoder: prescan(raw, d.allow, d.budgets), args.rounds),
                b,
            )
        )
        print(
            row(
                "objects: full decode",
                measure(lambda e=event, d=decoder: d.decode_value(e), args.rounds),
                b,
            )
        )
        ratios = []
        for _ in range(args.runs):
            floor_s, decode_s = paired(
                lambda raw=raw: pickle.loads(raw),
                lambda e=event, d=decoder: d.decode_value(e),
                args.rounds,
            )
            ratios.append(statistics.median(decode_s) / statistics.median(floor_s))
        summary.append(
            f"  {title[:40]:<40} full decode / pickle.loads, paired: median "
            f"x{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] over "
            f"{args.runs} runs (target <= 3x; met in {sum(r <= 3 for r in ratios)})"
        )
        lossy = "" if isinstance(value, dict) else "(a marked repr: not the value)"
        print(
            row(
                "data-only: json.loads",
                measure(lambda j=data_json: json.loads(j), args.rounds),
                b,
                lossy,
            )
        )
    print("\n-- summary (issue 19)")
    print("\n".join(summary))
    print(f"load average {os.getloadavg()}")
    if args.no_end_to_end:
        return
    print("\nend to end, one call returning the dict (warm session, median of rounds):")
    code = "{f'k{i}': i * 1.5 for i in range(10_000)}"
    for mode in ("data-only", "objects"):
        with (
            Sandbox(Policy(name=f"bench-{mode}", result_mode=mode), warm=0) as sb,
            sb.session() as sess,
        ):
            samples = measure(lambda s=sess: s.run(code).unwrap(), max(5, args.rounds // 3))
        print(row(f"{mode}: run + decode", samples, None))


if __name__ == "__main__":
    main()
