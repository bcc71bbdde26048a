"""Lifecycle soak: a burst, a cancel storm and agent kills, per provider; everything must be zero.

Run: `.venv/bin/python benchmarks/soak_lifecycle.py [--providers subprocess,bwrap] [--budget 600]`

Per provider available here, in one run:

* **burst**: 50 threads, each with its own session and 5 calls, default `max_sessions`;
  prints the time until all 250 results are in, and the errors (must be 0).
* **cancel storm**: 100 `session.arun` calls on one session, each cancelled after 0..39 event
  loop steps, each followed by a checking call; prints the checking calls that failed (0).
* **kills**: an agent process starts a session whose code makes a setsid double fork, then
  the agent is SIGKILLed (idle, mid-call) or exits without closing anything; prints the
  processes that survived it and the control directories left (0 and 0).
* **leftovers**: after `close()`, this process's control directories, marked processes and
  cgroups (0).

The whole run stops starting new scenarios once `--budget` seconds have passed. The machine
is shared: read the burst time as a rough figure, not a benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
import warnings

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.lifecycle import owner_tag
from agent_sandbox._tools.leftovers import agent_cgroups, control_dirs, marked, run_agent
from agent_sandbox.providers import get_provider

PROVIDERS = ("subprocess", "landlock", "unshare", "bwrap", "firejail")


def policy() -> Policy:
    # The opt-out is read only under provider "subprocess" (that row measures it), and
    # `visible_names` only under "landlock" (which takes no policy without it).
    return Policy(
        name="soak",
        imports={"allow": ["math"]},
        limits={"wall_seconds": 30},
        no_kernel_boundary="accepted",
        visible_names="accepted",
    )


def burst(provider: str) -> tuple[float, int]:
    errors: list[BaseException] = []
    # Finished sessions free their slots once idle past evict_idle: later threads wait.
    sb = Sandbox(policy(), provider=provider, session_wait=300)

    def one(i: int) -> None:
        try:
            session = sb.session(f"b{i}")
            for j in range(5):
                result = session.run(f"x = {j}\nx * 2")
                if not result.ok:
                    raise RuntimeError(str(result.error))
        except BaseException as exc:  # every failure is counted
            errors.append(exc)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    elapsed = time.monotonic() - t0
    sb.close()
    for exc in errors[:3]:
        print(f"    burst error: {exc!r}")
    return elapsed, len(errors)


async def _storm(provider: str) -> int:
    failures = 0
    rng = random.Random(15)
    with Sandbox(policy(), provider=provider, warm=0) as sb:
        session = sb.session("storm")
        await session.arun("n = 0")
        for _ in range(100):
            task = asyncio.ensure_future(session.arun("n += 1\nn"))
            for _ in range(rng.randrange(40)):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            try:
                check = await asyncio.wait_for(session.arun("'ok'"), 30)
                if check.value != "ok":
                    failures += 1
            except BaseException:  # a hang or an error is a failure
                failures += 1
    return failures


def kill_scenario(provider: str, moment: str) -> tuple[int, int]:
    """The agent of `agent_sandbox._tools.leftovers` (the one `tests/providers/test_no_orphans.py`
    runs), ended at `moment`: the processes and control directories that outlived it."""
    left = run_agent(provider, moment)
    if left.ready != "READY":
        print(f"    {moment}: the agent did not get ready: {left.ready[:200]}")
    return len(left.named) + len(left.marked), len(left.dirs)


def leftovers() -> int:
    tag = owner_tag()
    return len(control_dirs(tag)) + len(marked(tag)) + len(agent_cgroups(tag))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--budget", type=float, default=900.0)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    start = time.monotonic()
    totals = {"errors": 0, "survivors": 0, "leftovers": 0}
    print(f"{'provider':<11} {'burst s':>8} {'errors':>7} {'storm':>6}", end="")
    print(f" {'survivors':>10} {'left':>5}")
    for name in args.providers.split(","):
        if time.monotonic() - start > args.budget:
            print(f"{name:<11} (budget spent)")
            continue
        probe = get_provider(name).probe()
        if not probe.available:
            print(f"{name:<11} unavailable: {probe.reason}")
            continue
        elapsed, errors = burst(name)
        storm = asyncio.run(_storm(name))
        survivors = 0
        left = 0
        for moment in ("idle", "running", "exit"):
            procs, dirs = kill_scenario(name, moment)
            survivors += procs
            left += dirs
        left += leftovers()
        totals["errors"] += errors + storm
        totals["survivors"] += survivors
        totals["leftovers"] += left
        print(f"{name:<11} {elapsed:>8.2f} {errors:>7} {storm:>6} {survivors:>10} {left:>5}")
    print(
        f"total: errors {totals['errors']}, survivors {totals['survivors']}, "
        f"leftovers {totals['leftovers']} ({time.monotonic() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
