"""Code-layer benchmark: checked and rewritten code against plain `exec`, in one run.

Run: `.venv/bin/python benchmarks/bench_code.py [--rounds N] [--runs 3] [--worker]`

1. Run time of three snippets (a 200k-iteration loop, a recursive function, a
   comprehension-heavy snippet), each at module level as a model writes it, once compiled
   plainly and once after `check_code` (check + rewrite). Rounds alternate between the two so
   machine noise hits both alike. Target (issue 8): <= 1.5x plain.
2. The cost of `check_code` (parse + check + rewrite) and of the check alone on a 313-line
   snippet, against `ast.parse` alone, repeated `--runs` times. Target (issue 19): the check
   alone <= 2 ms (median) in every run. Each run prints wall and CPU time (the process's own
   CPU time, which other jobs on a shared machine disturb less) and the ratio to `ast.parse`.
3. With `--worker`: the warm round trip of `1+1` in a session, code layer on and off.

The machine is shared and noisy: read medians and ratios, not single numbers.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from agent_sandbox.guards import _code_budget
from agent_sandbox.guards._code_budget import check_code
from agent_sandbox.guards._code_check import compile_rules, find_violations

LOOP = """
total = 0
for i in range(200_000):
    if i % 3:
        total += i * 2
    else:
        total -= 1
"""

RECURSIVE = """
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)

result = fib(22)
"""

COMPREHENSIONS = """
data = [(i % 97, i * 0.5) for i in range(60_000)]
squares = [x * x for x, _ in data if x % 2]
by_key = {k: v for k, v in data}
unique = {x for x, _ in data}
total = sum(v for _, v in data)
nested = [[a + b for b in range(20)] for a in range(500)]
"""

SNIPPETS = {"200k loop": LOOP, "recursive fib(22)": RECURSIVE, "comprehensions": COMPREHENSIONS}

BLOCK = '''
class Account{n}:
    """A small class with a few methods."""

    def __init__(self, owner, balance=0.0):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError(f"bad amount {{amount!r}}")
        self.balance += amount
        self.history.append(("deposit", amount))
        return self.balance

    def report(self):
        lines = [f"{{kind:>10}} {{value:8.2f}}" for kind, value in self.history]
        return "\\n".join(lines) or "(empty)"


def summarise{n}(rows):
    totals = {{}}
    for name, value in rows:
        totals[name] = totals.get(name, 0) + value
    best = max(totals.items(), key=lambda kv: kv[1]) if totals else None
    try:
        mean = sum(totals.values()) / len(totals)
    except ZeroDivisionError:
        mean = 0.0
    return {{"best": best, "mean": round(mean, 3), "count": len(totals)}}
'''


def big_snippet(lines: int = 300) -> str:
    """At least `lines` lines of ordinary code: classes, methods, loops, f-strings, try/except."""
    out = ["import math", "import statistics", ""]
    n = 0
    while len(out) < lines:
        out.extend(BLOCK.format(n=n).splitlines())
        n += 1
    return "\n".join(out) + "\n"


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(source: str, rounds: int) -> tuple[float, float, float]:
    """(plain median, checked median, ratio of the minimums) for one snippet."""
    plain = compile(source, "<plain>", "exec")
    policy: dict[str, Any] = {}
    rules = compile_rules(policy)
    checked = compile(check_code(source, policy, "<checked>"), "<checked>", "exec")

    def run_plain() -> None:
        exec(plain, {"__name__": "__main__"})

    def run_checked() -> None:
        _code_budget.start_call(rules, set_depth=False)
        exec(checked, {"__name__": "__main__"})

    run_plain()
    run_checked()
    a: list[float] = []
    b: list[float] = []
    for i in range(rounds):
        if i % 2:
            a.append(timed(run_plain))
            b.append(timed(run_checked))
        else:
            b.append(timed(run_checked))
            a.append(timed(run_plain))
    return statistics.median(a), statistics.median(b), min(b) / min(a)


def samples(fn: Callable[[], object], rounds: int) -> list[float]:
    fn()
    return [timed(fn) for _ in range(rounds)]


def cpu_samples(fn: Callable[[], object], rounds: int) -> list[float]:
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return out


def median_of(fn: Callable[[], object], rounds: int) -> float:
    fn()
    return statistics.median(timed(fn) for _ in range(rounds))


def peer_rows(rounds: int) -> None:
    """The same snippets in a peer run on this machine in the same run, when it is installed:
    smolagents' LocalPythonExecutor, an AST interpreter (not a security boundary either)."""
    try:
        from smolagents.local_python_executor import LocalPythonExecutor
    except ImportError:
        print("  (peer: smolagents is not installed; `pip install smolagents` to compare)")
        return
    for name, source in SNIPPETS.items():
        plain = median_of(lambda src=source: exec(src, {}), max(3, rounds // 3))

        def run_peer(src: str = source) -> None:
            executor = LocalPythonExecutor(additional_authorized_imports=[])
            executor.send_tools({})
            executor(src)

        try:
            peer = median_of(run_peer, max(3, rounds // 3))
        except Exception as exc:  # a peer that cannot run a snippet is reported, not fatal
            print(f"  {name:20} peer smolagents: failed ({type(exc).__name__}: {exc})"[:120])
            continue
        print(
            f"  {name:20} plain {plain * 1000:8.2f} ms   smolagents {peer * 1000:9.2f} ms"
            f"   ratio {peer / plain:6.1f}x  (peer)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--runs", type=int, default=3, help="runs of the check's timing")
    parser.add_argument("--worker", action="store_true", help="also time the warm round trip")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; rounds {args.rounds}; medians\n")
    print("1. run time, checked+rewritten vs plain exec (target <= 1.5x)")
    for name, source in SNIPPETS.items():
        plain, checked, best = compare(source, args.rounds)
        print(
            f"  {name:20} plain {plain * 1000:8.2f} ms   checked {checked * 1000:8.2f} ms"
            f"   ratio {checked / plain:5.2f}x   (ratio of minimums {best:5.2f}x)"
        )

    peer_rows(args.rounds)

    text = big_snippet()
    tree = ast.parse(text)
    nodes = len(list(ast.walk(tree)))
    n = args.rounds * 3
    print(f"\n2. check of a {text.count(chr(10))}-line snippet ({nodes} nodes); median and min")
    print(f"   load average {os.getloadavg()}")
    check_runs: list[tuple[float, float, float]] = []
    for run in range(1, args.runs + 1):
        parse = samples(lambda: ast.parse(text), n)
        check = samples(lambda: find_violations(tree, {}), n)
        check_cpu = cpu_samples(lambda: find_violations(tree, {}), n)
        full = samples(lambda: check_code(text, {}, "<big>"), n)
        tiny = samples(lambda: check_code("1+1", {}, "<tiny>"), n * 10)
        print(f"  run {run}")
        for label, values in (
            ("ast.parse alone", parse),
            ("check alone (target <= 2 ms)", check),
            ("check alone, CPU time", check_cpu),
            ("check_code: parse+check+rewrite", full),
            ("check_code('1+1')", tiny),
        ):
            print(
                f"    {label:34} {statistics.median(values) * 1000:8.3f} ms"
                f"   min {min(values) * 1000:8.3f} ms"
            )
        check_runs.append(
            (
                statistics.median(check),
                statistics.median(check_cpu),
                statistics.median(check) / statistics.median(parse),
            )
        )
    walls = [r[0] * 1000 for r in check_runs]
    cpus = [r[1] * 1000 for r in check_runs]
    ratios = [r[2] for r in check_runs]
    met = sum(w <= 2.0 for w in walls)
    wall_list = ", ".join(f"{w:.2f}" for w in walls)
    cpu_list = ", ".join(f"{c:.2f}" for c in cpus)
    print(
        f"\n-- summary (issue 19): check of the {text.count(chr(10))}-line snippet, median per run:"
        f" wall {wall_list} ms; CPU {cpu_list}"
        f" ms; / ast.parse x{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        f"; target <= 2 ms met in {met} of {len(walls)} runs"
    )
    print(f"   load average {os.getloadavg()}")

    if args.worker:
        from agent_sandbox import Policy, Sandbox

        print("\n3. warm round trip of `1+1` in a session")
        for label, enabled in (("code layer on ", True), ("code layer off", False)):
            policy = Policy(name=f"bench-code-{int(enabled)}", code={"enabled": enabled})
            with Sandbox(policy, warm=0) as sb:
                session = sb.session("bench")
                trip = median_of(lambda s=session: s.run("1+1"), args.rounds * 5)
                session.close()
            print(f"  {label}                   {trip * 1000:8.3f} ms")


if __name__ == "__main__":
    main()
