"""A fresh agent process: `import agent_sandbox`, and a first result under `auto`, beside a fresh
`python -I -c` in the same run.

Each round starts, interleaved, fresh interpreters:

* floor: `python -I -c "print(1+1)"`;
* pydantic and one model: a fresh process that imports pydantic and validates one
  one-field model, the least any process pays that builds a `Policy` (DESIGN.md: the
  policy is a pydantic model; LangChain's and CrewAI's tools are pydantic models too);
* `import agent_sandbox` (what a program pays before it uses anything);
* the first result: `Sandbox(Policy(name=...))` under the default provider (`auto`),
  `run("1+1")`, close, with the providers' trial probes remembered from an earlier process
  (`providers/_probe_cache.py`, in the user's cache directory);
* the same with the probes run afresh (`AGENT_SANDBOX_PROBE_CACHE=off`), what every process
  paid before they were remembered;

and, when pysandboxes is installed (`benchmarks/_peers.py`; skipped with a message
otherwise), a fresh process's first result through a pysandboxes `@sandbox` call under
`landlock`, given against the floor and against agent_sandbox's first result.

Prints the medians per run and, over the runs, the median and min-max of the ratios to the
floor, with the load average. Target (issue 19): the first result <= 5x the floor.

    .venv/bin/python benchmarks/bench_fresh.py [--runs 3] [--rounds 7] [--no-peers]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import _peers

TARGET = 5.0
FIRST_RESULT = (
    "from agent_sandbox import Policy, Sandbox\n"
    "with Sandbox(Policy(name='fresh'), warm=0) as sb:\n"
    "    assert sb.run('1+1').value == 2\n"
)
#: What the policy model rests on (DESIGN.md: a pydantic model): pydantic and one model.
PYDANTIC_ONE_MODEL = (
    "from pydantic import BaseModel\nclass M(BaseModel):\n    x: int = 0\nassert M(x=1).x == 1\n"
)
COMMANDS = {
    "floor: python -I -c": [sys.executable, "-I", "-c", "print(1+1)"],
    "pydantic, one model": [sys.executable, "-c", PYDANTIC_ONE_MODEL],
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
    parser.add_argument("--no-peers", action="store_true", help="skip the peer row")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; {os.cpu_count()} cores; load {os.getloadavg()}")
    commands: dict[str, tuple[list[str], str | None]] = {
        name: (argv, None) for name, argv in COMMANDS.items()
    }
    peer_dir = None if args.no_peers else _peers.pysandboxes_dir("landlock")
    if peer_dir is not None:
        argv = [sys.executable, "-c", _peers.PYSANDBOXES_FIRST_RESULT]
        commands["peer pysandboxes (landlock)"] = (argv, peer_dir)
    try:
        run_all(commands, args.runs, args.rounds)
    finally:
        if peer_dir is not None:
            shutil.rmtree(peer_dir, ignore_errors=True)


def run_all(commands: dict[str, tuple[list[str], str | None]], runs: int, rounds: int) -> None:
    ratios: dict[str, list[float]] = {name: [] for name in commands if "floor" not in name}
    peer_vs_ours: list[float] = []
    envs = {name: {**os.environ, **ENV.get(name, {})} for name in commands}
    for name, (argv, cwd) in commands.items():  # warm the page cache, remember the probes
        subprocess.run(argv, check=True, capture_output=True, cwd=cwd, env=envs[name])
    for run in range(1, runs + 1):
        samples: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(rounds):
            for name, (argv, cwd) in commands.items():
                t0 = time.perf_counter()
                subprocess.run(argv, check=True, capture_output=True, cwd=cwd, env=envs[name])
                samples[name].append(time.perf_counter() - t0)
        medians = {name: statistics.median(v) for name, v in samples.items()}
        base = medians["floor: python -I -c"]
        line = f"run {run}: floor {base * 1000:.1f} ms"
        for name in ratios:
            ratios[name].append(medians[name] / base)
            line += f" | {name} {medians[name] * 1000:.1f} ms x{medians[name] / base:.2f}"
            if name.startswith("peer"):
                peer_vs_ours.append(medians[name] / medians["first result (auto)"])
        print(line, f"| load {os.getloadavg()[0]:.2f}")
    print("-- summary: / fresh `python -I -c`, median [min-max] over runs")
    for name, values in ratios.items():
        text = f"{name:28} x{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"
        if name == "first result (auto)":
            text += f"  target <= {TARGET}x met in {sum(v <= TARGET for v in values)}/{len(values)}"
        if name.startswith("peer") and peer_vs_ours:
            text += (
                f"  (/ agent_sandbox's first result: x{statistics.median(peer_vs_ours):.2f} "
                f"[{min(peer_vs_ours):.2f}-{max(peer_vs_ours):.2f}])"
            )
        print(text)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
