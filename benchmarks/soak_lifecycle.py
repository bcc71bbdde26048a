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
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from agent_sandbox import Policy, Sandbox
from agent_sandbox._guardian import OWNER_ENV, owner_tag
from agent_sandbox._lifecycle import control_dir_prefix
from agent_sandbox.providers import get_provider
from agent_sandbox.providers._limits import hierarchy_bases

PROVIDERS = ("subprocess", "landlock", "unshare", "bwrap", "firejail")

AGENT = r"""
import sys, threading, time, warnings
from agent_sandbox import Policy, Sandbox
provider, marker, moment = sys.argv[1:4]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    policy = Policy(name="danger-soak", imports={"allow": ["*"]},
                    api={"allow": ["native-code", "process-control"]},
                    code={"enabled": False}, limits={"wall_seconds": 60, "processes": 16},
                    no_kernel_boundary="accepted")
FORK = '''
import ctypes
libc = ctypes.CDLL(None)
pid = libc.fork()
if pid == 0:
    libc.setsid()
    if libc.fork() == 0:
        libc.prctl(15, MARKER, 0, 0, 0)
        while True:
            libc.sleep(1000)
    libc._exit(0)
libc.waitpid(pid, None, 0)
print("forked", flush=True)
'''.replace("MARKER", repr(marker.encode()))
sb = Sandbox(policy, provider=provider, warm=1)
def say():
    sys.stdout.write("READY\n"); sys.stdout.flush()
if moment == "running":
    def on_event(kind, data):
        if kind == "stdout" and "forked" in str(data):
            say()
    threading.Thread(target=lambda: sb.session("a").run(FORK + "libc.sleep(1000)",
                     on_event=on_event), daemon=True).start()
else:
    assert sb.session("a").run(FORK).ok
    for i in range(3):
        threading.Thread(target=lambda i=i: sb.session(f"s{i}").run("1"), daemon=True).start()
    say()
    if moment == "exit":
        sys.exit(0)
time.sleep(600)
"""


def policy() -> Policy:
    # The opt-out is read only under provider "subprocess" (that row measures it).
    return Policy(
        name="soak",
        imports={"allow": ["math"]},
        limits={"wall_seconds": 30},
        no_kernel_boundary="accepted",
    )


def burst(provider: str) -> tuple[float, int]:
    errors: list[BaseException] = []
    sb = Sandbox(policy(), provider=provider)

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


def _comm(marker: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if Path(f"/proc/{name}/comm").read_text().strip() == marker:
                    out.append(int(name))
            except OSError:
                pass
    return out


def _marked(tag: str) -> list[int]:
    mark = f"{OWNER_ENV}={tag}".encode() + b"\0"
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                env = Path(f"/proc/{name}/environ").read_bytes()
            except OSError:
                continue
            if (b"\0" + env).find(b"\0" + mark) >= 0:
                out.append(int(name))
    return out


def kill_scenario(provider: str, moment: str) -> tuple[int, int]:
    marker = "asbx" + secrets.token_hex(5)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, provider, marker, moment],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    tag = owner_tag(agent.pid)
    try:
        line = agent.stdout.readline() if agent.stdout else ""
        if line.strip() != "READY":
            print(f"    {moment}: the agent did not get ready")
        if moment != "exit":
            agent.send_signal(signal.SIGKILL)
        agent.wait(60)
        deadline = time.monotonic() + 15
        while True:
            procs = set(_comm(marker)) | set(_marked(tag))
            dirs = [
                n
                for n in os.listdir(tempfile.gettempdir())
                if n.startswith(f"agent-sandbox-{tag}-")
            ]
            if not (procs or dirs) or time.monotonic() > deadline:
                return len(procs), len(dirs)
            time.sleep(0.05)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        if agent.stdout:
            agent.stdout.close()
        for pid in set(_comm(marker)) | set(_marked(tag)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def leftovers() -> int:
    prefix = control_dir_prefix()
    dirs = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)]
    groups = [
        n
        for base in hierarchy_bases()
        for n in os.listdir(base)
        if n.startswith(f"agent-sandbox-{os.getpid()}-")
    ]
    return len(dirs) + len(_marked(owner_tag())) + len(groups)


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
