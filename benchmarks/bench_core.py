"""Core benchmark: worker cold start, warm round trip, pool acquire, and the transport layers.

Run: `.venv/bin/python benchmarks/bench_core.py [--rounds N]`

Everything is measured in one run on this machine, beside its floors (fork, a bare
`python -S -c pass`) and baselines (plain in-process `exec`, one fresh `python -c` per call).
The machine is shared and noisy: read medians and ratios, not single numbers.
Targets (issue 2): warm round trip <= 1 ms median; cold worker ready <= 60 ms; acquire from a
warm pool <= 2 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers import get_provider


def measure(fn: Callable[[], object], rounds: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(name: str, samples: list[float], base: float | None = None) -> str:
    med = statistics.median(samples)
    text = (
        f"{name:44} median {med * 1000:8.3f} ms   min {min(samples) * 1000:8.3f}   "
        f"max {max(samples) * 1000:8.3f}"
    )
    if base:
        text += f"   x{med / base:6.1f} vs floor"
    return text


def fork_floor() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--cold-rounds", type=int, default=21)
    args = parser.parse_args()

    # `visible_names` is read only under landlock (its rows), which takes no policy without it.
    policy = Policy(name="bench", imports={"allow": ["math"]}, visible_names="accepted")
    provider = get_provider("subprocess")
    print(f"python {sys.version.split()[0]} at {sys.executable}; {os.cpu_count()} cores")
    print("-- floors and baselines")
    fork = measure(fork_floor, args.cold_rounds)
    print(row("fork + exit + wait", fork))
    bare = measure(
        lambda: subprocess.run([sys.executable, "-S", "-c", "pass"], check=True), args.cold_rounds
    )
    print(row("python -S -c pass", bare))
    naive = measure(
        lambda: subprocess.run(
            [sys.executable, "-I", "-c", "print(1+1)"], check=True, capture_output=True
        ),
        args.cold_rounds,
    )
    print(row("baseline: fresh `python -I -c` per call", naive))
    ns: dict[str, object] = {}
    plain = measure(lambda: exec("1+1", ns), args.rounds)
    print(row("baseline: in-process exec('1+1')", plain))

    print("-- agent_sandbox (subprocess provider)")

    def cold() -> None:
        worker = WorkerProcess.start(policy, provider)
        worker.discard()

    cold_samples = measure(cold, args.cold_rounds, warmup=2)
    print(row("cold start: worker started and handshaken", cold_samples, statistics.median(bare)))

    from agent_sandbox._host.templates import WorkerTemplate

    template_samples: dict[str, list[float]] = {}
    for name in ("subprocess", "landlock"):
        chosen = get_provider(name)
        if not chosen.probe().available:
            print(f"cold start from a template ({name}): provider unavailable here")
            continue
        t0 = time.perf_counter()
        template = WorkerTemplate.start(policy, chosen)
        first = time.perf_counter() - t0

        def forked(p: object = chosen, t: WorkerTemplate = template) -> None:
            worker = WorkerProcess.start(policy, p, template=t)  # type: ignore[arg-type]
            worker.discard()

        template_samples[name] = measure(forked, args.cold_rounds, warmup=2)
        template.close()
        print(
            row(
                f"cold start forked from a template ({name})",
                template_samples[name],
                statistics.median(bare),
            )
        )
        print(f"{'  (the template itself, once per pool)':44} {first * 1000:8.1f} ms")

    with Sandbox(policy, warm=0) as sb:
        session = sb.session("bench")
        session.run("0")
        warm = measure(lambda: session.run("1+1"), args.rounds, warmup=20)
        print(row("warm round trip: session.run('1+1')", warm))
        out = measure(lambda: session.run("print('x' * 100)"), args.rounds, warmup=5)
        print(row("warm round trip with 100 B of stdout", out))
        worker = session.worker
        assert worker is not None and worker.client is not None
        path, token = worker.client.path, worker.token
        try:
            import httpx

            client = httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=10)
            headers = {"authorization": f"Bearer {token}"}

            def via_httpx() -> None:
                with client.stream(
                    "POST", "http://worker/run", json={"code": "1+1"}, headers=headers
                ) as resp:
                    for _ in resp.iter_bytes():
                        pass

            layer = measure(via_httpx, args.rounds, warmup=20)
            print(row("layer check: same call via httpx Client.stream", layer))
            client.close()
        except ImportError:
            print("layer check: httpx not installed")

    with Sandbox(policy, warm=1) as sb:
        sb.warm_up()
        pool = sb._pool
        acquires = []
        for _ in range(min(args.cold_rounds, 15)):
            pool.fill()
            t0 = time.perf_counter()
            worker = pool.acquire()
            acquires.append(time.perf_counter() - t0)
            worker.discard()
        print(row("acquire from a warm pool", acquires))
        stateless = []
        for _ in range(min(args.cold_rounds, 15)):
            pool.fill()
            t0 = time.perf_counter()
            sb.run("1+1")
            stateless.append(time.perf_counter() - t0)
        print(row("stateless sandbox.run('1+1') from a warm pool", stateless))

    print("-- summary against targets")
    print(f"warm round trip   {statistics.median(warm) * 1000:.3f} ms (target <= 1 ms)")
    print(
        f"cold worker ready {statistics.median(cold_samples) * 1000:.1f} ms started directly, "
        + ", ".join(
            f"{statistics.median(v) * 1000:.1f} ms forked ({k})"
            for k, v in template_samples.items()
        )
        + " (target <= 60 ms)"
    )
    print(f"warm pool acquire {statistics.median(acquires) * 1000:.3f} ms (target <= 2 ms)")
    print(
        f"vs a fresh python per call: x{statistics.median(naive) / statistics.median(warm):.0f} "
        "faster warm"
    )


if __name__ == "__main__":
    main()
