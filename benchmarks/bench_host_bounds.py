"""The host's memory while a compromised worker floods it, against the cap (issue 12).

Run: `.venv/bin/python benchmarks/bench_host_bounds.py [--rounds N] [--provider NAME]`

Each round, user code with the Python layer out of its way (introspection granted, code
layer off) calls the worker server's own event emitter and tries to push 1 GB of stdout
(16384 events of 64 KiB) past the worker's own output budget. The host must stop reading
at `limits.output_bytes`, kill the worker and answer `limits.output`. Measured: the growth
of the host's peak resident size (VmHWM, reset through /proc/self/clear_refs before each
round) over its size just before the call, against the cap. A second row floods with one
result of 1.3 million empty objects (4 MB of text that would decode to ~90 MB); a third
sends the costliest result the host still accepts (130 000 two-letter strings, near the budget
of the default 4 MB `result_bytes`), which the host decodes and keeps.
Target: the growth stays below the cap plus 16 MB. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

from agent_sandbox import Policy, Sandbox

EMITTER = """
import sys
_f = sys._getframe()
while "emit" not in _f.f_locals:
    _f = _f.f_back
emit = _f.f_locals["emit"]
"""
FLOOD = EMITTER + "chunk = 'x' * 65536\nfor _ in range(16 * 1024):\n    emit('stdout', chunk)\n"
BIG_RESULT = EMITTER + "emit('result', {'value': [{}] * 1_300_000})\n"
#: The largest result the host still accepts at the default `result_bytes` (4 MB): its value
#: budget is 133 000 separators and openers, spent here on the costliest kind, short strings.
ACCEPTED = EMITTER + (
    "type(_f.f_locals['self'])._outcome = lambda self, value, failure, filename: (\n"
    "    'result', {'value': ['ab'] * 130_000})\n"
)
MiB = 1024 * 1024


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def one_round(sandbox: Sandbox, code: str) -> tuple[int, float, str]:
    session = sandbox.session("flood")
    session.run("1")  # a live worker before the measure
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    t0 = time.perf_counter()
    result = session.run(code)
    elapsed = time.perf_counter() - t0
    grown = status("VmHWM") - before
    rule = result.error.rule if result.error else "ok"
    return grown, elapsed, str(rule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--provider", default=None, help="default: the policy's own")
    parser.add_argument("--cap", type=int, default=200_000, help="limits.output_bytes")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        policy = Policy(
            name="danger-bench-flood",
            imports={"allow": ["*"]},
            api={"allow": ["introspection", "native-code"]},
            code={"enabled": False},
            limits={"wall_seconds": 120, "output_bytes": args.cap, "memory_mb": 2048},
        )
    with Sandbox(policy, provider=args.provider, warm=0) as sandbox:
        provider = sandbox.session("flood").run("1").provider
        print(
            f"provider {provider}; {args.rounds} rounds; host RSS before: "
            f"{status('VmRSS') / MiB:.1f} MiB"
        )
        for name, code, cap in (
            ("1 GB stdout flood", FLOOD, args.cap),
            ("result of 1.3M objects", BIG_RESULT, policy.limits.result_bytes),
            ("accepted: 130k strings", ACCEPTED, policy.limits.result_bytes),
        ):
            rows = [one_round(sandbox, code) for _ in range(args.rounds)]
            grown = statistics.median(r[0] for r in rows)
            worst = max(r[0] for r in rows)
            seconds = statistics.median(r[1] for r in rows)
            rules = sorted({r[2] for r in rows})
            target = cap + 16 * MiB
            print(
                f"{name:24} host peak RSS growth median {grown / MiB:6.2f} MiB "
                f"(max {worst / MiB:6.2f}) vs cap {cap / MiB:5.2f} MiB, target < "
                f"{target / MiB:5.2f} MiB: {'met' if worst < target else 'MISSED'}; "
                f"call {seconds * 1000:6.1f} ms; answer {', '.join(rules)}"
            )


if __name__ == "__main__":
    main()
