"""Cold start of a worker to ready, per provider, beside a bare interpreter in the same run.

"Ready" means `WorkerProcess.start()` returned: the provider built and launched the worker,
the worker read its boot configuration, applied its limits and in-worker restrictions,
installed its guards and answered the handshake. Each provider runs with its default stack
(Landlock and seccomp stacked where they work); `--layers` adds the namespace providers
without the stacked layers. Prints median, min and max in milliseconds, and the median's
ratio to `python -S -c pass`.

    .venv/bin/python benchmarks/bench_providers.py [--runs 21] [--layers]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from agent_sandbox import Policy
from agent_sandbox._process import WorkerProcess
from agent_sandbox.providers import get_provider
from agent_sandbox.providers._base import Provider
from agent_sandbox.providers._bwrap import BwrapProvider
from agent_sandbox.providers._firejail import FirejailProvider
from agent_sandbox.providers._unshare import UnshareProvider

TARGET_MS = 80.0
TARGETED = {"landlock", "unshare", "bwrap"}


def time_ms(fn: Callable[[], object], runs: int) -> list[float]:
    fn()  # warm the page cache and any per-process probe cache
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def bare_python() -> None:
    subprocess.run([sys.executable, "-S", "-c", "pass"], check=True)


def worker_start(provider: Provider, policy: Policy) -> Callable[[], None]:
    def start() -> None:
        w = WorkerProcess.start(policy, provider)
        w.close()

    return start


def wrapper_only(provider: Provider, policy: Policy) -> Callable[[], None]:
    """The provider's own cost: its launch plan with `python -S -c pass` as the worker."""
    import json
    import os
    import socket
    import tempfile

    from agent_sandbox._process import import_roots, package_dirs
    from agent_sandbox.providers._base import WorkerSpec, worker_argv

    control = tempfile.mkdtemp(prefix="bench-providers-")
    os.mkdir(os.path.join(control, "scratch"), 0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    listener.set_inheritable(True)
    spec = WorkerSpec(
        python=sys.executable,
        boot_script=os.path.abspath(__file__),
        scratch=os.path.join(control, "scratch"),
        control_dir=control,
        listen_fd=listener.fileno(),
        boot_fd=read_end,
        sys_path=import_roots(),
        package_dirs=package_dirs(),
        env={},
        prefix=sys.prefix,
        base_prefix=sys.base_prefix,
    )
    plan = provider.build(policy, spec)
    real, bare = list(worker_argv(spec)), [sys.executable, "-S", "-c", "pass"]
    argv = list(plan.argv)
    if argv[-len(real) :] == real:
        argv[-len(real) :] = bare
    else:  # the unshare launcher carries the worker's argv in its JSON configuration
        config = json.loads(argv[-1])
        config["argv"] = bare
        argv[-1] = json.dumps(config)
    plan = type(plan)(**{**plan.__dict__, "argv": tuple(argv), "worker_setup": {}})

    def launch() -> None:
        with open(os.devnull, "wb") as log:
            provider.launch(plan, log).wait()

    return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--layers", action="store_true", help="also namespaces without stacking")
    args = parser.parse_args()
    policy = Policy(name="bench")
    rows: list[tuple[str, str, list[float]]] = [
        ("python -S -c pass", "", time_ms(bare_python, args.runs))
    ]
    candidates: list[tuple[str, Provider]] = [
        (name, get_provider(name)) for name in ("subprocess", "landlock", "unshare", "bwrap")
    ]
    candidates.append(("firejail", FirejailProvider()))
    if args.layers:
        candidates += [
            ("unshare (no stack)", UnshareProvider(stack=False)),
            ("bwrap (no stack)", BwrapProvider(stack=False)),
        ]
    for label, provider in candidates:
        probe = provider.probe()
        if not probe.available:
            print(f"{label:24} skipped: {probe.reason}")
            continue
        w = WorkerProcess.start(policy, provider)
        stack = "+".join(w.plan.stack) if w.plan else ""
        w.close()
        rows.append((label, stack, time_ms(worker_start(provider, policy), args.runs)))
    base = statistics.median(rows[0][2])
    print(f"\n{'provider':24} {'stack':28} {'median':>8} {'min':>8} {'max':>8} {'x bare':>7}")
    for label, stack, samples in rows:
        med = statistics.median(samples)
        flag = ""
        if label.split(" ")[0] in TARGETED and "(" not in label:
            flag = "  ok" if med <= TARGET_MS else f"  over the {TARGET_MS:g} ms target"
        print(
            f"{label:24} {stack:28} {med:8.1f} {min(samples):8.1f} {max(samples):8.1f} "
            f"{med / base:7.1f}{flag}"
        )
    print(f"\n{args.runs} runs each, milliseconds; one warm-up run not counted.")
    print("\nThe providers' own cost: each launch plan with `python -S -c pass` as the worker")
    for label, provider in candidates:
        if provider.probe().available and provider.name != "subprocess":
            samples = time_ms(wrapper_only(provider, policy), args.runs)
            med = statistics.median(samples)
            print(
                f"{label:24} {med:8.1f} {min(samples):8.1f} {max(samples):8.1f}   "
                f"+{med - base:.1f} ms over bare"
            )


if __name__ == "__main__":
    main()
