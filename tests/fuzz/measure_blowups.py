"""Time and memory of each blow-up class of issue 30 at a given size (default: the default
result cap, 4,000,000 bytes), for docs/objects.md and the issue's closing note:

    .venv/bin/python tests/fuzz/measure_blowups.py [--bytes N] [--repeat R]

Per class: the stream's size, the prescan's answer, CPU seconds (median and range over R
runs, `time.process_time`) and the peak traced memory (one run under tracemalloc).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile

from agent_sandbox._errors import UnpickleRefused
from agent_sandbox._host.intake.unpickle import load_restricted
from agent_sandbox._host.intake.unpickle_prescan import Budgets, python_prescan

try:
    from agent_sandbox.guards import _fastscan
except ImportError:
    _fastscan = None  # type: ignore[assignment]


def _classes(cap: int) -> dict[str, tuple[bytes, Callable[[bytes], str]]]:
    b = Budgets(max_bytes=cap)

    def c_prescan(data: bytes) -> str:
        if _fastscan is None:
            return "no C extension"
        args = (b.max_bytes, b.max_opcodes, b.max_depth, b.max_memo, b.max_int_bytes)
        return (
            "C accepted" if _fastscan.prescan_data(data, *args, b.max_same_hash) else "C not sure"
        )

    def restricted(data: bytes) -> str:
        try:
            load_restricted(data, None, b)
            return "accepted"
        except UnpickleRefused as exc:
            return f"refused: {exc.reason[:60]}"

    def python(data: bytes) -> str:
        try:
            python_prescan(data, None, b)
            return "accepted"
        except UnpickleRefused as exc:
            return f"refused: {exc.reason[:60]}"

    # 7 levels of `width` BINGETs (2 bytes each), within the opcode budget
    width = max(1, min((cap - 40) // 14, (b.max_opcodes - 64) // 7 - 3))
    keys = max(1, (cap - 10) // 11)  # LONG1 8 bytes + NONE
    return {
        "shared tuple key (Python prescan)": (hostile.shared_tuple_key(width), python),
        "one-slot int keys (C prescan)": (hostile.int_keys_one_slot(keys), c_prescan),
        "one-slot int keys (whole decode)": (hostile.int_keys_one_slot(keys), restricted),
        "one state dict BUILT again (decode)": (
            hostile.repeated_build_state(max(1, cap // 20), max(1, cap // 6)),
            restricted,
        ),
        "deque(shared list) again (decode)": (
            hostile.repeated_copying_call(max(1, (cap - 100) // 4), max(1, (cap - 100) // 12)),
            restricted,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=4_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default="", help="run only the classes whose name has this")
    args = parser.parse_args()
    for name, (data, run) in _classes(args.bytes).items():
        if args.only not in name:
            continue
        times = []
        answer = ""
        for _ in range(args.repeat):
            start = time.process_time()
            answer = run(data)
            times.append(time.process_time() - start)
        tracemalloc.start()
        run(data)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(
            f"{name:36} {len(data):>9} B  {answer:28.28}  cpu median {statistics.median(times):.3f}s "
            f"(range {min(times):.3f}-{max(times):.3f}, n={len(times)})  peak {peak / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
