"""Where a fresh agent process's first result spends its time, phase by phase.

Each run starts a fresh interpreter that runs `benchmarks/bench_fresh.py`'s first result
(`Sandbox(Policy(name=...))` under `auto`, `run("1+1")`, close) with a clock between its
steps, and prints the median of each phase over the runs, in milliseconds:

* `start`: from the spawn to the script's first line (the interpreter and `site`);
* `import agent_sandbox`, `import Policy` (pydantic and the policy models), `import Sandbox`
  (the host's modules), `Policy()`, `Sandbox()` (the boundary's resolution), `run` (the
  first worker's start and the call), `close`;
* `atexit`: the package's exit hooks (the pools, the clean-up, the guardian's wait);
* `exit`: from the last exit hook to the process's end (the interpreter's finalization);
* `cpu own` and `cpu children`: the process's CPU time and that of the children it reaped
  (the guardian; bwrap, killed with the worker before it reaps it, counts only its own),
  read in its last exit hook.

    .venv/bin/python benchmarks/fresh_phases.py [--runs 11] [--python PATH]

`--python` measures another checkout's interpreter (run from a neutral directory, so that
`-c` does not import the current folder's package).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import atexit, json, os, resource, sys, time
T = [("begin", time.monotonic())]
def _mark(name):
    T.append((name, time.monotonic()))
def _report():
    _mark("atexit")
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = resource.getrusage(resource.RUSAGE_SELF)
    out = {"marks": T, "cpu own": own.ru_utime + own.ru_stime,
           "cpu children": kids.ru_utime + kids.ru_stime}
    os.write(2, ("PHASES " + json.dumps(out) + "\\n").encode())
atexit.register(_report)  # first registered: runs after the package's exit hooks
import agent_sandbox; _mark("import agent_sandbox")
from agent_sandbox import Policy; _mark("import Policy")
from agent_sandbox import Sandbox; _mark("import Sandbox")
policy = Policy(name="fresh"); _mark("Policy()")
sb = Sandbox(policy, warm=0); _mark("Sandbox()")
assert sb.run("1+1").value == 2; _mark("run")
sb.close(); _mark("close")
"""


def one(python: str) -> dict[str, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [python, "-c", CHILD], capture_output=True, text=True, check=True, cwd="/"
    )
    t1 = time.monotonic()
    line = next(x for x in proc.stderr.splitlines() if x.startswith("PHASES "))
    data = json.loads(line.removeprefix("PHASES "))
    marks = data["marks"]
    phases = {"start": marks[0][1] - t0}
    for (_, before), (name, at) in itertools.pairwise(marks):
        phases[name] = at - before
    phases["exit"] = t1 - marks[-1][1]
    phases["total"] = t1 - t0
    phases["cpu own"] = data["cpu own"]
    phases["cpu children"] = data["cpu children"]
    return phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    print(f"python {args.python}; {os.cpu_count()} cores; load {os.getloadavg()}")
    one(args.python)  # warm the page cache and the probe file
    samples = [one(args.python) for _ in range(args.runs)]
    for name in samples[0]:
        values = [s[name] * 1000 for s in samples]
        print(
            f"{name:22} {statistics.median(values):7.1f} ms  [{min(values):.1f}-{max(values):.1f}]"
        )
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
