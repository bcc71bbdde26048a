"""Cold start of a worker to ready, per provider, beside a bare interpreter in the same run.

"Ready" means `WorkerProcess.start()` returned: the provider built and launched the worker,
the worker read its boot configuration, applied its limits and in-worker restrictions,
installed its guards and answered the handshake. Each provider runs with its default stack
(Landlock and seccomp stacked where they work); `--layers` adds the namespace providers
without the stacked layers. Prints median, min and max in milliseconds, and the median's
ratio to `python -S -c pass`. A last table times parts of a start: the worker's imports
from bytecode and from source (as when its caches were stale), and a launcher's shell
joining the worker's cgroups (one migration) against the same shell alone.

    .venv/bin/python benchmarks/bench_providers.py [--runs 21] [--layers]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from agent_sandbox import Policy
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers import get_provider
from agent_sandbox.providers._base import Provider
from agent_sandbox.providers._bwrap import BwrapProvider
from agent_sandbox.providers._firejail import FirejailProvider
from agent_sandbox.providers._unshare import UnshareProvider

TARGET_MS = 80.0
_CLEANUP: list[str] = []
TARGETED = {"landlock", "unshare", "bwrap"}


def time_round_robin(fns: list[Callable[[], object]], runs: int) -> list[list[float]]:
    """Time every function `runs` times, interleaved, so that load spikes hit all alike."""
    for fn in fns:
        fn()  # warm the page cache and any per-process probe cache
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            out[i].append((time.perf_counter() - t0) * 1000)
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
    import marshal
    import socket
    import tempfile

    from agent_sandbox._host.launch import import_roots, package_dirs
    from agent_sandbox.providers._base import WorkerSpec, worker_argv

    control = tempfile.mkdtemp(prefix="bench-providers-")
    _CLEANUP.append(control)
    os.mkdir(os.path.join(control, "scratch"), 0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    read_end, _write_end = os.pipe()
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
    else:  # the unshare launcher carries the worker's argv in its (marshal) configuration
        config = marshal.loads(bytes.fromhex(argv[-1]))
        del config["boot"]  # (for a worker, its process C runs the boot script in place)
        config["argv"] = bare
        argv[-1] = marshal.dumps(config).hex()
    plan = type(plan)(**{**plan.__dict__, "argv": tuple(argv), "worker_setup": {}})

    def launch() -> None:
        with open(os.devnull, "wb") as log:
            provider.launch(plan, log).wait()

    return launch


def table(title: str, rows: list[tuple[str, str, list[float]]]) -> None:
    base = statistics.median(rows[0][2])
    print(f"\n{title}")
    print(f"{'':26} {'stack':28} {'median':>7} {'min':>7} {'max':>7} {'x bare':>7}")
    for label, stack, samples in rows:
        med = statistics.median(samples)
        print(
            f"{label:26} {stack:28} {med:7.1f} {min(samples):7.1f} {max(samples):7.1f} "
            f"{med / base:7.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--layers", action="store_true", help="also namespaces without stacking")
    args = parser.parse_args()
    policy = Policy(name="bench")
    candidates: list[tuple[str, Provider]] = [
        (name, get_provider(name)) for name in ("subprocess", "landlock", "unshare", "bwrap")
    ]
    candidates.append(("firejail", FirejailProvider()))
    if args.layers:
        candidates += [
            ("unshare (no stack)", UnshareProvider(stack=False)),
            ("bwrap (no stack)", BwrapProvider(stack=False)),
        ]
    usable: list[tuple[str, str, Provider]] = []
    for label, provider in candidates:
        probe = provider.probe()
        if not probe.available:
            print(f"{label:26} skipped: {probe.reason}")
            continue
        w = WorkerProcess.start(policy, provider)
        usable.append((label, "+".join(w.plan.stack) if w.plan else "", provider))
        w.close()

    fns = [bare_python, *(worker_start(p, policy) for _, _, p in usable)]
    samples = time_round_robin(fns, args.runs)
    rows = [("python -S -c pass", "", samples[0])]
    rows += [(label, stack, s) for (label, stack, _), s in zip(usable, samples[1:], strict=True)]
    table("Cold start of a worker to ready (ms)", rows)
    for label, _, s in rows[1:]:
        if label in TARGETED:
            verdict = "within" if statistics.median(s) <= TARGET_MS else "over"
            print(f"  {label}: {verdict} the {TARGET_MS:g} ms target")

    wrapped = [(label, stack, p) for label, stack, p in usable if p.name != "subprocess"]
    fns = [bare_python, *(wrapper_only(p, policy) for _, _, p in wrapped)]
    samples = time_round_robin(fns, args.runs)
    rows = [("python -S -c pass", "", samples[0])]
    rows += [(label, stack, s) for (label, stack, _), s in zip(wrapped, samples[1:], strict=True)]
    table("The providers' own cost: each launch plan running `python -S -c pass` (ms)", rows)
    start_up_parts(args.runs)
    print(f"\n{args.runs} runs each, interleaved; one warm-up run not counted.")
    import shutil

    for path in _CLEANUP:
        shutil.rmtree(path, ignore_errors=True)


# The worker's start-up imports, in a bare interpreter mapped the way `_worker.boot` maps it.
_IMPORT_WORKER = """
import importlib.util, json, sys
boot_script, dirs, roots = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
spec = importlib.util.spec_from_file_location("worker_boot", boot_script)
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
sys.path[:] = roots
boot._map_packages(dirs)
import agent_sandbox._worker.server, agent_sandbox._worker.setup
import agent_sandbox.guards._install, agent_sandbox.guards._code_budget
import os; os._exit(0)  # a worker never finalises its interpreter before it is ready
"""


def start_up_parts(runs: int) -> None:
    """What parts of a start cost: the worker's imports (from bytecode, and from source as
    when the caches were stale), and a launcher joining its cgroups before it execs."""
    import json
    import shutil
    import tempfile

    from agent_sandbox._host.launch import BOOT_SCRIPT, import_roots, package_dirs, refresh_bytecode
    from agent_sandbox.providers._limits import WorkerCgroups, cgroup_support

    dirs = package_dirs()
    fresh = tempfile.mkdtemp(prefix="bench-providers-src-")
    _CLEANUP.append(fresh)
    copies = {}
    for name, folder in dirs.items():
        copies[name] = os.path.join(fresh, name)
        shutil.copytree(folder, copies[name], ignore=shutil.ignore_patterns("__pycache__"))

    def imports(folders: dict[str, str], drop_cache: bool) -> Callable[[], None]:
        argv = [sys.executable, "-I", "-S", "-B", "-c", _IMPORT_WORKER, BOOT_SCRIPT]
        argv += [json.dumps(folders), json.dumps(list(import_roots()))]

        def run() -> None:
            if drop_cache:
                for folder in folders.values():
                    shutil.rmtree(os.path.join(folder, "__pycache__"), ignore_errors=True)
            subprocess.run(argv, check=True)

        return run

    refresh_bytecode(tuple(sorted(dirs.values())))
    labels = ["python -S -c pass", "worker imports, bytecode", "worker imports, from source"]
    fns = [bare_python, imports(dirs, False), imports(copies, True)]
    if cgroup_support()["hierarchies"]:

        def plain_sh() -> None:
            subprocess.run(["/bin/sh", "-c", "exec true"], check=True)

        def joining_sh() -> None:
            groups = WorkerCgroups.create(f"bench-{time.monotonic_ns()}", {"processes": 8})
            assert groups is not None
            try:
                subprocess.run(groups.joining_argv(["true"]), check=True)
            finally:
                groups.kill()
                groups.remove()

        labels += ["sh -c exec true", "the same, joining cgroups"]
        fns += [plain_sh, joining_sh]
    samples = time_round_robin(fns, runs)
    table(
        "Parts of a start (ms)", [(label, "", s) for label, s in zip(labels, samples, strict=True)]
    )


if __name__ == "__main__":
    main()
