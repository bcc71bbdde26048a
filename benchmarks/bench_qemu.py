"""The qemu provider against bwrap, in the same run: start, first call, warm call, memory.

For each provider, interleaved round-robin so that load spikes hit both alike:

* start to ready: `WorkerProcess.start()` returned (under qemu: QEMU restored a clone of the
  template, the guest reseeded and forked the worker, which answered the handshake);
* restore to the first `1+1`: the start plus the first call (the issue's target: <= 0.25 s);
* a warm `1+1` round trip (target: <= 2x bwrap's);
* a new session's first `1+1` from a `Sandbox` whose warm pool holds a started worker
  (under qemu: a restored, set-up clone), taken after the pool has settled;
* the host memory of one idle worker: the RSS of every process of the worker's tree
  (QEMU's private pages plus the template pages it touched), and its private part; then,
  with three idle workers at once, each one's PSS (the template's page cache split between
  the clones) and private memory (target <= 80 MiB per idle session).

It also prints, from one traced start, where a qemu start goes (the host relay's timing
lines: QEMU launched and QMP answered, the port connected, the guest set up).

The image and template must exist (`agent-sandbox qemu build --memory 512`); the policy uses
512 MiB of guest RAM. Medians, min and max.

    .venv/bin/python benchmarks/bench_qemu.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers import get_provider
from agent_sandbox.providers._base import Provider
from agent_sandbox.providers.qemu.image import find_image
from agent_sandbox.providers.qemu.provider import QemuProvider, ensure_template, guest_ram_mb

MEMORY_MB = 512


def tree_rss_kib(root: int, fields: tuple[str, ...] = ("Rss:",)) -> int:
    """The summed `fields` of /proc/PID/smaps_rollup over `root` and its descendants (Rss by
    default; Private_Clean + Private_Dirty is what one more such worker costs, the
    template's page-cache pages it reads being shared by every clone)."""
    total = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith(fields):
                        total += int(line.split()[1])
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    todo.extend(int(p) for p in fh.read().split())
        except OSError:
            continue
    return total


def one_round(provider: Provider, policy: Policy, warm_calls: int) -> dict[str, float]:
    t0 = time.perf_counter()
    worker = WorkerProcess.start(policy, provider, start_timeout=60)
    t_ready = time.perf_counter() - t0
    try:
        first = worker.run("1+1")
        t_first = time.perf_counter() - t0
        assert first.value == 2, first.error
        warm = []
        for _ in range(warm_calls):
            t = time.perf_counter()
            worker.run("1+1")
            warm.append(time.perf_counter() - t)
        rss = tree_rss_kib(worker.pid) / 1024
        private = tree_rss_kib(worker.pid, ("Private_Clean:", "Private_Dirty:")) / 1024
    finally:
        worker.kill()
    return {
        "ready": t_ready * 1000,
        "first": t_first * 1000,
        "warm": statistics.median(warm) * 1000,
        "rss": rss,
        "private": private,
    }


def pooled_first(provider: str, policy: Policy) -> float:
    """A new session's first `1+1` (ms) once the sandbox's pool holds a started worker."""
    with Sandbox(policy, provider=provider, warm=1) as sb:
        sb.warm_up()
        time.sleep(1.0)  # the pool settles (the refill thread, the page cache)
        t = time.perf_counter()
        with sb.session("bench") as session:
            result = session.run("1+1")
            elapsed = time.perf_counter() - t
        assert result.value == 2, result.error
    return elapsed * 1000


def memory_of_three(provider: Provider, policy: Policy) -> tuple[float, float]:
    """PSS and private MiB per worker while three idle workers run at once (clones of one
    template share the page cache of its RAM file: PSS splits it between them)."""
    workers = []
    try:
        for _ in range(3):
            worker = WorkerProcess.start(policy, provider, start_timeout=60)
            worker.run("1+1")
            workers.append(worker)
        pss = [tree_rss_kib(w.pid, ("Pss:",)) / 1024 for w in workers]
        own = [tree_rss_kib(w.pid, ("Private_Clean:", "Private_Dirty:")) / 1024 for w in workers]
    finally:
        for worker in workers:
            worker.kill()
    return statistics.median(pss), statistics.median(own)


def fmt(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):8.1f} {unit} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warm-calls", type=int, default=21)
    args = parser.parse_args()
    qemu = QemuProvider()
    probe = qemu.probe()
    if not probe.available:
        print(f"qemu unavailable: {probe.reason}", file=sys.stderr)
        return 69
    image = find_image()
    assert image is not None
    ensure_template(image, guest_ram_mb(MEMORY_MB))
    policy = Policy(name="bench", limits={"memory_mb": MEMORY_MB})
    providers: list[tuple[str, Provider]] = [("qemu", qemu)]
    bwrap = get_provider("bwrap")
    if bwrap.probe().available:
        providers.append(("bwrap", bwrap))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in providers}
    for _name, provider in providers:
        one_round(provider, policy, 2)  # warm the page cache and the probes
    for _ in range(args.runs):
        for name, provider in providers:
            row = one_round(provider, policy, args.warm_calls)
            row["pooled"] = pooled_first(name, policy)
            results[name].append(row)
    print(
        f"qemu {probe.version} {probe.details.get('accel')}, {args.runs} runs, "
        f"guest RAM {MEMORY_MB} MiB"
    )
    print(
        f"{'':6} {'start to ready':>24} {'to first 1+1':>24} {'pooled session 1st':>24} "
        f"{'warm 1+1':>22} {'tree RSS':>22} {'tree private':>22}"
    )
    for name, rows in results.items():
        print(
            f"{name:6} {fmt([r['ready'] for r in rows], 'ms'):>24} "
            f"{fmt([r['first'] for r in rows], 'ms'):>24} "
            f"{fmt([r['pooled'] for r in rows], 'ms'):>24} "
            f"{fmt([r['warm'] for r in rows], 'ms'):>22} "
            f"{fmt([r['rss'] for r in rows], 'MiB'):>22} "
            f"{fmt([r['private'] for r in rows], 'MiB'):>22}"
        )
    for name, provider in providers:
        pss, own = memory_of_three(provider, policy)
        print(f"{name:6} three idle workers at once: {pss:.1f} MiB PSS, {own:.1f} MiB private each")
    if "bwrap" in results:
        q = statistics.median(r["warm"] for r in results["qemu"])
        b = statistics.median(r["warm"] for r in results["bwrap"])
        print(f"warm 1+1, qemu / bwrap: {q / b:.2f}x (target <= 2x)")
    first = statistics.median(r["first"] for r in results["qemu"])
    pooled = statistics.median(r["pooled"] for r in results["qemu"])
    print(
        f"qemu restore to first 1+1: {first / 1000:.3f} s without a pool, {pooled / 1000:.3f} s "
        "for a new session from the warm pool (target <= 0.25 s)"
    )
    traced = WorkerProcess.start(policy, QemuProvider(trace=True), start_timeout=60)
    try:
        traced.run("1+1")
        lines = [ln for ln in traced.log_tail().splitlines() if "agent-sandbox qemu:" in ln]
    finally:
        traced.kill()
    print("one traced start (host relay's clock):")
    for line in lines:
        print("  " + line.replace("agent-sandbox qemu: ", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
