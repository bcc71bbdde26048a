"""Cold start of a worker to ready, per provider, beside a bare interpreter in the same run.

"Ready" means `WorkerProcess.start()` returned: the provider built and launched the worker,
the worker read its boot configuration, applied its limits and in-worker restrictions,
installed its guards and answered the handshake. Each provider runs with its default stack
(Landlock and seccomp stacked where they work); `--layers` adds the namespace providers
without the stacked layers. Prints median, min and max in milliseconds, and the median's
ratio to `python -S -c pass`. A last table times parts of a start: the worker's imports
from bytecode and from source (as when its caches were stale), and a launcher's shell
joining the worker's cgroups (one migration) against the same shell alone.

A second part (issue 19; `--pools-only` runs it alone) puts the pools side by side, each
figure repeated `--repeat` times (medians and the range of the ratio over the repeats):

* a burst: 20 new sessions of one sandbox at once, each running `1+1`, until every result
  is in, for the template pools (`subprocess`, `landlock`) and `auto` (bwrap here, whose pool
  forks from a template inside the sandbox), beside 20 fork+exit in this process;
* what one forked worker costs: its CPU and minor page faults, its init's (a namespace
  template's PID 1) and the template's own CPU per worker, over ten sessions made one after
  the other;
* a from-scratch start of each namespace provider against a bare `python -S -c pass`, after
  the worker's imports alone against the same (the floor of any start from scratch);
* the memory of an idle session (PSS of its worker and the launchers above it, from
  /proc/<pid>/smaps_rollup; for a worker forked from a namespace template, its init) per
  provider, the template (once per pool) apart, with the part above the worker, and its
  ratio to the 6 MB target. Its file-backed part (the interpreter's and the extensions'
  pages) is printed apart too: PSS shares those pages among every process that maps them,
  the machine's other Python processes included, so the figure is lower on a busy machine
  (0.2-0.5 MB measured) and a quiet run gives the fair, higher one; the anonymous part
  depends only on the sandbox's own processes.

    .venv/bin/python benchmarks/bench_providers.py [--runs 21] [--layers]
    .venv/bin/python benchmarks/bench_providers.py --pools-only [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.pool import WorkerPool
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


BURST = 20
BURST_TARGET = 1.3
SCRATCH_TARGET = 4.0
PSS_TARGET_KB = 6 * 1024
_POOLS = ("subprocess", "landlock", "auto")
_FRESH = ("unshare", "bwrap")


def _policy_for(name: str) -> Policy:
    if name == "subprocess":
        return Policy(name="bench-pools", provider="subprocess", no_kernel_boundary="accepted")
    # `visible_names` is read only under landlock, which takes no policy without it.
    return Policy(name="bench-pools", provider=name, visible_names="accepted")


def fork_burst(n: int = BURST) -> float:
    """n fork+exit+wait in this process (ms): the floor of starting n processes."""
    t0 = time.perf_counter()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return (time.perf_counter() - t0) * 1000


def session_burst(name: str, n: int = BURST) -> tuple[float, str]:
    """n new sessions of one sandbox at once, each `1+1`, until all results are in (ms).

    The pool's template (when it has one) is started first: it is paid once per pool."""
    with Sandbox(_policy_for(name), warm=0, max_sessions=n + 1) as sb:
        _start_template(sb)
        assert sb.run("1+1").value == 2
        template = sb._pool._template
        kind = template.kind if template is not None else "none"
        errors: list[Any] = []
        barrier = threading.Barrier(n + 1)

        def one(i: int) -> None:
            barrier.wait()
            result = sb.session(f"s{i}").run("1+1")
            if result.value != 2:
                errors.append(result.error)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for thread in threads:
            thread.start()
        barrier.wait()
        t0 = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = (time.perf_counter() - t0) * 1000
        assert not errors, errors[:3]
        stack = "+".join(sb.boundary.stack) if hasattr(sb, "boundary") else name
        return elapsed, f"{stack} (template: {kind})"


def _start_template(sb: Sandbox) -> None:
    """Start the pool's template now (where it has one): a pool's first worker otherwise
    starts from scratch with the template behind it, and these figures are of a pool."""
    pool = sb._pool
    if isinstance(pool, WorkerPool):
        pool.template()


def _pss_kb(pid: int, field: str = "Pss:") -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def idle_pss(name: str, n: int = 4) -> tuple[float, float, float, float]:
    """PSS (kB) of one idle session: its worker and the launchers above it (a forked
    namespace worker's init), averaged over n idle sessions of one sandbox; the template's
    own PSS (0 without one); the part of the first that is the processes above the
    worker (launchers, init); and the part of the first that is file-backed."""
    from agent_sandbox._host.limits import _descendants

    with Sandbox(_policy_for(name), warm=0, max_sessions=n + 1) as sb:
        _start_template(sb)
        sessions = [sb.session(f"idle{i}") for i in range(n)]
        for session in sessions:
            assert session.run("x = 1").ok
        time.sleep(0.3)
        total = above = files = 0
        for session in sessions:
            worker = session.worker
            assert worker is not None and worker.proc is not None
            top = worker.proc.pid
            inner = worker.worker_pid() or top
            tree = [top, *(p for p, _ in _descendants(top))]
            below = {inner, *(p for p, _ in _descendants(inner))}
            total += sum(_pss_kb(pid) for pid in tree)
            files += sum(_pss_kb(pid, "Pss_File:") for pid in tree)
            above += sum(_pss_kb(pid) for pid in tree if pid not in below)
        template = sb._pool._template
        own = 0
        if template is not None and template.proc is not None:
            mine = {session.worker.proc.pid for session in sessions if session.worker}
            tree = [template.proc.pid, *(p for p, _ in _descendants(template.proc.pid))]
            # The template's own processes: those above the workers' trees.
            below = set()
            for top in mine:
                below |= {top, *(p for p, _ in _descendants(top))}
            own = sum(_pss_kb(pid) for pid in tree if pid not in below)
        return total / n, float(own), above / n, files / n


def _cpu_ms(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e6
    except OSError:
        return 0.0


def _minflt(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return 0
    return int(stat[stat.rfind(")") + 2 :].split()[7])


def worker_cost(name: str, n: int = 10) -> tuple[float, float, float, float, float]:
    """Per worker forked by the pool's template (medians over `n` sessions made one after
    the other, each after one call): the worker's CPU (ms) and minor faults, its init's
    (a namespace template's PID 1, whose count includes its life before the exec;
    0 for a plain template), and the template's own CPU per worker (its helpers' are not
    counted: they are reaped by it; with _worker/_nsfork.c the template forks no helper)."""
    from agent_sandbox._host.limits import _descendants

    with Sandbox(_policy_for(name), warm=0, max_sessions=n + 2) as sb:
        _start_template(sb)
        assert sb.run("1").ok
        template = sb._pool._template
        assert template is not None and template.proc is not None
        tree = [template.proc.pid, *(p for p, _ in _descendants(template.proc.pid))]
        before = sum(_cpu_ms(pid) for pid in tree)
        sessions = [sb.session(f"cost{i}") for i in range(n)]
        for session in sessions:
            assert session.run("x = 1").ok
        after = sum(_cpu_ms(pid) for pid in tree)
        rows = []
        for session in sessions:
            worker = session.worker
            assert worker is not None and worker.proc is not None
            inner = worker.worker_pid() or worker.proc.pid
            init = worker.proc.pid if inner != worker.proc.pid else 0
            rows.append(
                (
                    _cpu_ms(inner),
                    _minflt(inner),
                    _cpu_ms(init) if init else 0.0,
                    _minflt(init) if init else 0,
                )
            )
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    return medians[0], medians[1], medians[2], medians[3], (after - before) / n


def _ratio_range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def pools(repeat: int, runs: int) -> None:
    """The issue-19 figures, each repeated (see the module docstring)."""
    print(f"\nPools side by side, {repeat} repeats (load average {os.getloadavg()[0]:.2f})")
    available = [n for n in _POOLS if get_provider(n).probe().available]
    bursts: dict[str, list[float]] = {n: [] for n in available}
    labels: dict[str, str] = {}
    floors: list[float] = []
    for _ in range(repeat):
        floors.append(fork_burst())
        for name in available:
            elapsed, label = session_burst(name)
            bursts[name].append(elapsed)
            labels[name] = label
    print(f"\n{BURST} new sessions at once, all results (ms; median of {repeat}, min-max)")
    print(f"  {BURST} fork+exit (floor){'':22} {statistics.median(floors):8.1f}")
    for name in available:
        v = bursts[name]
        print(
            f"  {name:10} {labels[name]:32} {statistics.median(v):8.1f} ({min(v):.0f}-{max(v):.0f})"
        )
    if "auto" in bursts:
        for peer in ("subprocess", "landlock"):
            if peer in bursts:
                ratios = [a / b for a, b in zip(bursts["auto"], bursts[peer], strict=True)]
                verdict = "met" if statistics.median(ratios) <= BURST_TARGET else "NOT met"
                print(
                    f"  auto / {peer}: median {statistics.median(ratios):.2f}x, range "
                    f"{_ratio_range(ratios)} (target <= {BURST_TARGET}x: {verdict}; "
                    f"met in {sum(r <= BURST_TARGET for r in ratios)} of {repeat})"
                )

    print("\nWhat one forked worker costs, median of 10 sessions made one after the other")
    print("  (CPU from /proc/<pid>/schedstat, minor page faults from /proc/<pid>/stat)")
    for name in available:
        w_cpu, w_flt, init_cpu, init_flt, tmpl = worker_cost(name)
        print(
            f"  {name:10} worker {w_cpu:5.2f} ms, {w_flt:5.0f} faults; its init {init_cpu:5.2f}"
            f" ms, {init_flt:4.0f} faults; the template {tmpl:5.2f} ms"
        )

    fresh = [n for n in _FRESH if get_provider(n).probe().available]
    print(f"\nFrom-scratch start to ready vs bare `python -S -c pass` ({runs} runs x {repeat})")
    policy = Policy(name="bench")
    from agent_sandbox._host.launch import package_dirs

    ratios = []
    for _ in range(repeat):
        bare, imports = time_round_robin([bare_python, worker_imports(package_dirs())], runs)
        ratios.append(statistics.median(imports) / statistics.median(bare))
    print(
        f"  {'imports':10} the worker's imports alone, no sandbox and no set-up: "
        f"{statistics.median(ratios):.1f}x bare (range {_ratio_range(ratios)}): the floor "
        f"of any start from scratch"
    )
    for name in fresh:
        ratios, meds = [], []
        for _ in range(repeat):
            bare, start = time_round_robin(
                [bare_python, worker_start(get_provider(name), policy)], runs
            )
            ratios.append(statistics.median(start) / statistics.median(bare))
            meds.append(statistics.median(start))
        verdict = "met" if statistics.median(ratios) <= SCRATCH_TARGET else "NOT met"
        print(
            f"  {name:10} median {statistics.median(meds):6.1f} ms, "
            f"{statistics.median(ratios):.1f}x bare (range {_ratio_range(ratios)}; "
            f"target <= {SCRATCH_TARGET:g}x: {verdict})"
        )

    print(
        f"\nMemory of an idle session, PSS in MB (median of {repeat}; the template apart; "
        f"load average {os.getloadavg()[0]:.2f})"
    )
    bare_pss: list[float] = []
    for _ in range(repeat):
        proc = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(5)"])
        time.sleep(0.3)
        bare_pss.append(_pss_kb(proc.pid))
        proc.kill()
        proc.wait()
    print(f"  bare python -S{'':19} {statistics.median(bare_pss) / 1024:6.1f}")
    for name in [*available, *(n for n in fresh if n not in available)]:
        per, own, above, files = [], [], [], []
        for _ in range(repeat):
            a, b, c, d = idle_pss(name)
            per.append(a)
            own.append(b)
            above.append(c)
            files.append(d)
        ratios = [v / PSS_TARGET_KB for v in per]
        met = sum(r <= 1 for r in ratios)
        verdict = "met" if statistics.median(ratios) <= 1 else "NOT met"
        print(
            f"  {name:10} per session {statistics.median(per) / 1024:6.1f} "
            f"(range {min(per) / 1024:.1f}-{max(per) / 1024:.1f}; "
            f"above the worker {statistics.median(above) / 1024:.1f}; "
            f"file-backed {statistics.median(files) / 1024:.1f}); "
            f"template {statistics.median(own) / 1024:.1f}"
        )
        print(
            f"  {'':10} idle PSS / target: median {statistics.median(ratios):.2f}x of "
            f"{PSS_TARGET_KB / 1024:g} MB, range {_ratio_range(ratios)} "
            f"(target <= 1.00x: {verdict}; met in {met} of {repeat})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--layers", action="store_true", help="also namespaces without stacking")
    parser.add_argument("--repeat", type=int, default=3, help="repeats of the pool figures")
    parser.add_argument("--pools-only", action="store_true", help="only the pool figures")
    args = parser.parse_args()
    if args.pools_only:
        pools(args.repeat, min(args.runs, 11))
        return
    # `visible_names` is read only under landlock, which takes no policy without it.
    policy = Policy(name="bench", visible_names="accepted")
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
    pools(args.repeat, min(args.runs, 11))
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


def worker_imports(folders: dict[str, str], drop_cache: bool = False) -> Callable[[], None]:
    """A bare interpreter started as a worker is (`-I -S -B`) that imports what a worker
    imports before its handshake, and nothing else: no sandbox, no set-up, no socket."""
    import json
    import shutil

    from agent_sandbox._host.launch import BOOT_SCRIPT, import_roots

    argv = [sys.executable, "-I", "-S", "-B", "-c", _IMPORT_WORKER, BOOT_SCRIPT]
    argv += [json.dumps(folders), json.dumps(list(import_roots()))]

    def run() -> None:
        if drop_cache:
            for folder in folders.values():
                shutil.rmtree(os.path.join(folder, "__pycache__"), ignore_errors=True)
        subprocess.run(argv, check=True)

    return run


def start_up_parts(runs: int) -> None:
    """What parts of a start cost: the worker's imports (from bytecode, and from source as
    when the caches were stale), and a launcher joining its cgroups before it execs."""
    import shutil
    import tempfile

    from agent_sandbox._host.launch import package_dirs, refresh_bytecode
    from agent_sandbox._host.limits import WorkerCgroups, cgroup_support

    dirs = package_dirs()
    fresh = tempfile.mkdtemp(prefix="bench-providers-src-")
    _CLEANUP.append(fresh)
    copies = {}
    for name, folder in dirs.items():
        copies[name] = os.path.join(fresh, name)
        shutil.copytree(folder, copies[name], ignore=shutil.ignore_patterns("__pycache__"))

    refresh_bytecode(tuple(sorted(dirs.values())))
    labels = ["python -S -c pass", "worker imports, bytecode", "worker imports, from source"]
    fns = [bare_python, worker_imports(dirs, False), worker_imports(copies, True)]
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
