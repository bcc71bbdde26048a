"""A fresh agent process: `import agent_sandbox`, and a first result under `auto`, beside a fresh
`python -I -c` in the same run.

Each round starts, interleaved, three fresh interpreters:

* floor: `python -I -c "print(1+1)"`;
* `import agent_sandbox` (what a program pays before it uses anything);
* the first result: `Sandbox(Policy(name=...))` under the default provider (`auto`),
  `run("1+1")`, close, with the providers' trial probes remembered from an earlier process
  (`providers/_probe_cache.py`, in the user's cache directory);
* the same with the probes run afresh (`AGENT_SANDBOX_PROBE_CACHE=off`), what every process
  paid before they were remembered.

Prints the medians per run and, over the runs, the median and min-max of the ratios to the
floor, with the load average. Target (issue 19): the first result <= 5x the floor.

    .venv/bin/python benchmarks/bench_fresh.py [--runs 3] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

TARGET = 5.0
FIRST_RESULT = (
    "from agent_sandbox import Policy, Sandbox\n"
    "with Sandbox(Policy(name='fresh'), warm=0) as sb:\n"
    "    assert sb.run('1+1').value == 2\n"
)
COMMANDS = {
    "floor: python -I -c": [sys.executable, "-I", "-c", "print(1+1)"],
    "import agent_sandbox": [sys.executable, "-c", "import agent_sandbox"],
    "first result (auto)": [sys.executable, "-c", FIRST_RESULT],
    "first result, probes afresh": [sys.executable, "-c", FIRST_RESULT],
}
#: Extra environment per command.
ENV = {"first result, probes afresh": {"AGENT_SANDBOX_PROBE_CACHE": "off"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; {os.cpu_count()} cores; load {os.getloadavg()}")
    ratios: dict[str, list[float]] = {name: [] for name in COMMANDS if "floor" not in name}
    for name, argv in COMMANDS.items():  # warm the page cache (and remember the probes)
        subprocess.run(
            argv, check=True, capture_output=True, env={**os.environ, **ENV.get(name, {})}
        )
    for run in range(1, args.runs + 1):
        samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for _ in range(args.rounds):
            for name, argv in COMMANDS.items():
                env = {**os.environ, **ENV.get(name, {})}
                t0 = time.perf_counter()
                subprocess.run(argv, check=True, capture_output=True, env=env)
                samples[name].append(time.perf_counter() - t0)
        medians = {name: statistics.median(v) for name, v in samples.items()}
        base = medians["floor: python -I -c"]
        line = f"run {run}: floor {base * 1000:.1f} ms"
        for name in ratios:
            ratios[name].append(medians[name] / base)
            line += f" | {name} {medians[name] * 1000:.1f} ms x{medians[name] / base:.2f}"
        print(line, f"| load {os.getloadavg()[0]:.2f}")
    print("-- summary: / fresh `python -I -c`, median [min-max] over runs")
    for name, values in ratios.items():
        text = f"{name:28} x{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"
        if name == "first result (auto)":
            text += f"  target <= {TARGET}x met in {sum(v <= TARGET for v in values)}/{len(values)}"
        print(text)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
