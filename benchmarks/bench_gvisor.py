"""gVisor beside bwrap and qemu in the same run: a warm pool's first result, a warm call, the
memory of an idle session, and (with `--suite`) the containment suite's outcome.

Per provider, each figure repeated `--repeat` times (medians and ranges):

* first result from a warm pool: a `Sandbox` whose pool holds one ready worker (`warm=1`,
  filled before the clock starts), then `run("1+1")` until its result is in;
* warm call: `1+1` on one session's worker, `--calls` times, after a first call, on a
  worker up for `--settle` seconds (as a pool's worker waits before its first use); and the
  same on a worker just started ("first second"): gVisor's vDSO clock is ready about one
  second after the sandbox boots (its timekeeper calibrates against the host's clock), and
  until then each clock read, and each lock the interpreter takes (CPython 3.11 reads the
  monotonic clock on every lock acquisition), is a system call trapped by the Sentry;
* idle PSS per session: the PSS (/proc/<pid>/smaps_rollup) of every host process of one idle
  session (bwrap and its init and the worker; runsc, its gofer, the Sentry and its stubs;
  QEMU and its host relay), averaged over `--sessions` sessions of one sandbox (PSS shares
  runsc's and QEMU's text among sessions, so more sessions give a lower figure per session);
* `--suite`: `pytest tests/providers/test_containment.py -k <provider>`'s counts.

The targets of issue 35 are printed beside gVisor's figures: first result within 100 ms,
a warm call within 3x bwrap's, idle PSS within 50 MiB.

    .venv/bin/python benchmarks/bench_gvisor.py [--repeat 5] [--calls 21] [--suite]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.limits import _descendants
from agent_sandbox.providers import get_provider

PROVIDERS = ("bwrap", "gvisor", "qemu")
FIRST_TARGET_MS = 100.0
WARM_RATIO_TARGET = 3.0
PSS_TARGET_MB = 50.0


def _policy(name: str) -> Policy:
    limits = {"memory_mb": 512} if name == "qemu" else {}
    return Policy(name="bench-gvisor", provider=name, limits=limits)


def first_from_warm_pool(name: str) -> float:
    """ms from `run("1+1")` to its result, on a pool holding one ready worker."""
    with Sandbox(_policy(name), warm=1) as sb:
        sb.warm_up()
        t0 = time.perf_counter()
        result = sb.run("1+1")
        elapsed = (time.perf_counter() - t0) * 1000
        assert result.value == 2, result.error
        return elapsed


def warm_calls(name: str, calls: int, settle: float = 0.0) -> float:
    """Median ms of `1+1` on one session's warm worker, up for at least `settle` s."""
    with Sandbox(_policy(name), warm=0) as sb:
        session = sb.session("warm")
        assert session.run("1+1").value == 2
        time.sleep(settle)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            result = session.run("1+1")
            times.append((time.perf_counter() - t0) * 1000)
            assert result.value == 2, result.error
        return statistics.median(times)


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def idle_pss_mb(name: str, sessions: int) -> float:
    """MiB of PSS per idle session: every host process under each session's launcher."""
    with Sandbox(_policy(name), warm=0, max_sessions=sessions + 1) as sb:
        held = [sb.session(f"idle{i}") for i in range(sessions)]
        for session in held:
            assert session.run("x = 1").ok
        time.sleep(0.5)
        total = 0
        for session in held:
            worker = session.worker
            assert worker is not None and worker.proc is not None
            top = worker.proc.pid
            total += sum(_pss_kb(pid) for pid in [top, *(p for p, _ in _descendants(top))])
        return total / sessions / 1024


def suite(name: str) -> str:
    """The containment suite's counts under `name` (passed, xfailed, skipped, failed)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/providers/test_containment.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            f"[{name}]",
        ],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        check=False,
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-200:]
    counts = re.findall(r"(\d+) (passed|failed|xfailed|xpassed|skipped|error)", last)
    return ", ".join(f"{n} {k}" for n, k in counts) or last


def _fmt(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.1f}{unit} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=21)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--settle", type=float, default=1.5)
    parser.add_argument("--suite", action="store_true")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    args = parser.parse_args()
    names = []
    for name in args.providers.split(","):
        probe = get_provider(name).probe()
        if probe.available:
            names.append(name)
        else:
            print(f"{name}: unavailable here ({probe.reason})")
    for name in names:
        get_provider(name).prepare(_policy(name))  # a first use's one-time build, untimed
    first: dict[str, list[float]] = {n: [] for n in names}
    warm: dict[str, list[float]] = {n: [] for n in names}
    fresh: dict[str, list[float]] = {n: [] for n in names}
    pss: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeat):
        for name in names:  # interleaved, so load spikes hit every provider alike
            first[name].append(first_from_warm_pool(name))
            warm[name].append(warm_calls(name, args.calls, args.settle))
            fresh[name].append(warm_calls(name, args.calls))
            pss[name].append(idle_pss_mb(name, args.sessions))
    suites = {n: suite(n) for n in names} if args.suite else {}
    print(
        f"\nper provider: median (min-max) over {args.repeat} repeats; warm call: median of "
        f"{args.calls} calls per repeat, on a worker up {args.settle:g} s and on a new one "
        f"(its first second); idle PSS: per session, {args.sessions} sessions; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    header = (
        f"{'provider':10} {'first result, warm pool':>26} {'warm 1+1':>22} "
        f"{'warm 1+1, first second':>24} {'idle PSS':>22}"
    )
    if suites:
        header += "  containment suite"
    print(header)
    for name in names:
        line = (
            f"{name:10} {_fmt(first[name], ' ms'):>26} {_fmt(warm[name], ' ms'):>22} "
            f"{_fmt(fresh[name], ' ms'):>24} {_fmt(pss[name], ' MiB'):>22}"
        )
        if suites:
            line += f"  {suites[name]}"
        print(line)
    if "gvisor" in names:
        g_first = statistics.median(first["gvisor"])
        g_pss = statistics.median(pss["gvisor"])
        platform = get_provider("gvisor").probe().details.get("platform")
        print(
            f"\ngvisor (platform {platform}) targets: first result {g_first:.1f} ms (target "
            f"{FIRST_TARGET_MS:.0f}); idle PSS {g_pss:.1f} MiB (target {PSS_TARGET_MB:.0f})"
        )
        if "bwrap" in names:
            for label, table in (("warm call", warm), ("warm call, first second", fresh)):
                ratios = [g / b for g, b in zip(table["gvisor"], table["bwrap"], strict=True)]
                print(
                    f"gvisor {label} / bwrap's, per repeat: median "
                    f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
                    f"(target {WARM_RATIO_TARGET:.0f}x)"
                )


if __name__ == "__main__":
    main()
