"""A smolagents step's code (`1+1`) through three executors, warm, in one run:

* `SandboxedExecutor` (this library's smolagents executor: a session behind the strongest
  kernel boundary here, `auto`);
* smolagents' own `LocalPythonExecutor` (its AST interpreter in the caller's process, no
  process or kernel boundary) - the peer, and the floor of the ratios;
* this library's LangChain tool (`SandboxedPythonTool.invoke` with a tool call on one thread's
  session), the same kind of boundary through another framework's tool interface;

and, for the tool-callback path, a step that calls one host tool (`lookup('x')`) through
`SandboxedExecutor` beside the same step in `LocalPythonExecutor`.

Each run interleaves the rows (`--calls` calls per row, in rounds of 20) so that load spikes
hit all alike, and prints each row's median per call and its ratio to smolagents' local
executor; the summary gives, over the runs, the median and the min-max range of each median
and ratio, each row's host CPU per call (`time.thread_time` of the calling thread: what the
caller's own code costs, which wall time on a loaded machine amplifies, since a caller that
spent more CPU before it wakes its worker is more often descheduled until the reply), and the
load average. No target: the figures are for the docs and the issue.

    .venv/bin/python benchmarks/bench_smolagents.py [--runs 5] [--calls 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from smolagents.local_python_executor import LocalPythonExecutor

from agent_sandbox import Policy
from agent_sandbox.adapters.langchain import SandboxedPythonTool
from agent_sandbox.adapters.smolagents import SandboxedExecutor
from agent_sandbox.testing import tool_call

ROUND = 20


def _lookup(key: str) -> str:
    return key.upper()


def _rows(
    policy: Policy,
) -> tuple[dict[str, Callable[[], object]], list[Callable[[], None]], str]:
    sandboxed = SandboxedExecutor(policy, warm=1)
    sandboxed.send_tools({"lookup": _lookup})
    local = LocalPythonExecutor(additional_authorized_imports=[])
    local.send_tools({"lookup": _lookup})  # type: ignore[dict-item]
    lc_tool = SandboxedPythonTool(policy=policy, warm=1, stream_output=False, session="tool")
    calls = iter(range(10**9))

    def lc() -> object:
        return lc_tool.invoke(tool_call("1+1", call_id=f"c{next(calls)}"))

    rows: dict[str, Callable[[], object]] = {
        "smolagents local executor (no boundary)": lambda: local("1+1"),
        "agent_sandbox SandboxedExecutor": lambda: sandboxed("1+1"),
        "agent_sandbox LangChain tool": lc,
        "local executor + 1 tool call": lambda: local("lookup('x')"),
        "SandboxedExecutor + 1 host tool call": lambda: sandboxed("lookup('x')"),
    }
    for fn in rows.values():  # warm every path once (first worker, first compile)
        for _ in range(3):
            fn()
    assert sandboxed("lookup('x')").output == "X"
    return rows, [sandboxed.cleanup, lc_tool.close], sandboxed.sandbox.boundary.name


def _one_run(
    rows: dict[str, Callable[[], object]], calls: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Each row's median wall time per call, and its median host CPU per call."""
    samples: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    clock, cpu_clock = time.perf_counter, time.thread_time
    for _ in range(max(1, calls // ROUND)):
        for name, fn in rows.items():
            for _ in range(ROUND):
                c0 = cpu_clock()
                t0 = clock()
                fn()
                samples[name].append(clock() - t0)
                cpu[name].append(cpu_clock() - c0)
    return (
        {name: statistics.median(values) for name, values in samples.items()},
        {name: statistics.median(values) for name, values in cpu.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    policy = Policy(name="bench-smolagents", tools={"allow": ["lookup"]})
    rows, closers, boundary = _rows(policy)
    floor = "smolagents local executor (no boundary)"
    tool_floor = "local executor + 1 tool call"
    results: list[dict[str, float]] = []
    cpus: list[dict[str, float]] = []
    try:
        print(f"boundary: {boundary} (auto); {args.runs} runs x {args.calls} calls per row")
        for run in range(args.runs):
            medians, cpu = _one_run(rows, args.calls)
            results.append(medians)
            cpus.append(cpu)
            parts = []
            for name, value in medians.items():
                base = tool_floor if "tool call" in name else floor
                parts.append(f"{name}: {value * 1e6:.0f} us ({value / medians[base]:.1f}x)")
            print(f"run {run + 1}: " + "; ".join(parts))
    finally:
        for close in closers:
            close()
    print("\nsummary (median [min-max] over the runs; ratio to smolagents' local executor):")
    for name in rows:
        base = tool_floor if "tool call" in name else floor
        values = [r[name] * 1e6 for r in results]
        ratios = [r[name] / r[base] for r in results]
        span = f"[{min(values):.0f}-{max(values):.0f}]"
        host = [c[name] * 1e6 for c in cpus]
        print(
            f"  {name:42s} {statistics.median(values):8.0f} us {span}"
            f"  {statistics.median(ratios):6.1f}x [{min(ratios):.1f}-{max(ratios):.1f}]"
            f"  host CPU {statistics.median(host):.0f} us [{min(host):.0f}-{max(host):.0f}]"
        )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
