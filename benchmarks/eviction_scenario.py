"""Eviction under conversations: how many later calls lose their state, and the call latency.

Run: `.venv/bin/python benchmarks/eviction_scenario.py [--conversations 100] [--calls 5]
[--gap 0.2] [--max-sessions 16] [--repeat 3] [--provider NAME] [--session-wait 30]`

Each of `--conversations` threads holds one session: its first call sets `turn = 0`, then it
makes `--calls - 1` more calls, `--gap` seconds apart, each `turn += 1; turn`. A later call
whose result says `state_lost` (or whose `turn` is wrong) lost its conversation's state. The
same scenario runs with the default `evict_idle` (a session is evicted only when idle that
long and a start is waiting) and, as the peer in the same run, with `evict_idle=0.05` (the
old rule: any session idle 50 ms was a victim). Printed per setting and run: later calls
that lost state, `CapacityError`s, p50 / p99 of every call's latency and the wall time; then
the medians and ranges over the runs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import warnings

from agent_sandbox import CapacityError, Policy, Sandbox


def policy() -> Policy:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Policy(name="eviction", limits={"wall_seconds": 30}, no_kernel_boundary="accepted")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def scenario(args: argparse.Namespace, evict_idle: float | None) -> dict[str, float]:
    lost = [0]
    capacity = [0]
    errors: list[BaseException] = []
    latencies: list[float] = []
    firsts: list[float] = []
    guard = threading.Lock()
    extra = {} if evict_idle is None else {"evict_idle": evict_idle}
    sb = Sandbox(
        policy(),
        provider=args.provider,
        max_sessions=args.max_sessions,
        session_wait=args.session_wait,
        **extra,
    )

    def call(session: object, code: str, first: bool = False) -> object:
        t0 = time.monotonic()
        result = session.run(code)  # type: ignore[attr-defined]
        with guard:
            latencies.append(time.monotonic() - t0)
            if first:
                firsts.append(time.monotonic() - t0)
        return result

    def conversation(i: int) -> None:
        try:
            session = sb.session(f"c{i}")
            call(session, "turn = 0", first=True)
            for turn in range(1, args.calls):
                time.sleep(args.gap)
                result = call(session, "turn += 1\nturn")
                if result.state_lost or result.value != turn:  # type: ignore[attr-defined]
                    with guard:
                        lost[0] += 1
        except CapacityError:
            with guard:
                capacity[0] += 1
        except BaseException as exc:  # counted and shown
            errors.append(exc)

    t0 = time.monotonic()
    try:
        threads = [
            threading.Thread(target=conversation, args=(i,)) for i in range(args.conversations)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sb.close()
    return {
        "lost": lost[0],
        "later_calls": args.conversations * (args.calls - 1),
        "capacity": capacity[0],
        "errors": len(errors),
        "p50": percentile(latencies, 0.50),
        "p99": percentile(latencies, 0.99),
        "first_p99": percentile(firsts, 0.99),
        "wall": time.monotonic() - t0,
        "evict_idle": sb.evict_idle,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--gap", type=float, default=0.2)
    parser.add_argument("--max-sessions", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--provider", default=None)
    parser.add_argument("--session-wait", type=float, default=30.0)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"default": [], "evict_idle=0.05": []}
    for _ in range(args.repeat):
        for label, setting in (("default", None), ("evict_idle=0.05", 0.05)):
            r = scenario(args, setting)
            runs[label].append(r)
            print(
                f"{label:16} evict_idle={r['evict_idle']:g}s lost {r['lost']:.0f}/"
                f"{r['later_calls']:.0f} later calls, CapacityError {r['capacity']:.0f}, "
                f"errors {r['errors']:.0f}, p50 {r['p50']:.3f}s p99 {r['p99']:.3f}s "
                f"(first calls' p99 {r['first_p99']:.3f}s), "
                f"wall {r['wall']:.1f}s",
                flush=True,
            )
    for label, rs in runs.items():
        parts = []
        for key in ("lost", "capacity", "p50", "p99", "wall"):
            values = [r[key] for r in rs]
            mid, low, high = statistics.median(values), min(values), max(values)
            parts.append(f"{key} median {mid:.3g} [{low:.3g}-{high:.3g}]")
        print(f"summary {label}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
