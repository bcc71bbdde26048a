"""Nothing outlives the agent, under every provider, at every moment of a worker's life.

Each test runs an *agent* as a child process of the test (a small script using
`agent_sandbox`). Its sandboxed code makes a setsid double fork with ctypes (so no Python
guard is involved) and names the grandchild with a random marker (`PR_SET_NAME`). The test
then ends the agent (SIGKILL to that one child pid, or a normal exit without `close()`)
and looks for any survivor: a process named with the marker, or a process started with the
agent's owner mark (a worker, a launcher, a template), plus the agent's control
directories in the temp dir. The survivors are looked for until a bound passes (the
guardian cleans up asynchronously); none may remain.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent_sandbox._guardian import OWNER_ENV, owner_tag

from .conftest import skip_unless_available

PROVIDERS = ("subprocess", "landlock", "unshare", "bwrap", "firejail")

AGENT = r"""
import sys, threading, time, warnings
from agent_sandbox import Policy, Sandbox
provider, marker, moment = sys.argv[1:4]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    policy = Policy(
        name="danger-orphans",
        imports={"allow": ["*"]},
        api={"allow": ["native-code", "process-control"]},
        code={"enabled": False},
        limits={"wall_seconds": 60, "processes": 16},
        # Only read with provider "subprocess": that row runs under the explicit opt-out.
        no_kernel_boundary="accepted",
    )
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
def say(text):
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
if moment == "idle":
    assert sb.session("a").run(FORK).ok
    say("READY")
elif moment == "running":
    def on_event(kind, data):
        if kind == "stdout" and "forked" in str(data):
            say("READY")
    threading.Thread(
        target=lambda: sb.session("a").run(FORK + "libc.sleep(1000)", on_event=on_event),
        daemon=True,
    ).start()
elif moment == "starting":
    assert sb.session("a").run(FORK).ok
    for i in range(4):
        threading.Thread(target=lambda i=i: sb.session(f"s{i}").run("1"), daemon=True).start()
    time.sleep(0.02 * int(sys.argv[4]))
    say("READY")
elif moment == "closing":
    assert sb.session("a").run(FORK).ok
    threading.Thread(target=sb.close, daemon=True).start()
    say("READY")
elif moment == "exit":
    # A normal exit right after a call, nothing closed: the pool's refill is under way.
    assert sb.session("a").run(FORK).ok
    for i in range(3):
        threading.Thread(target=lambda i=i: sb.session(f"s{i}").run("1"), daemon=True).start()
    say("READY")
    sys.exit(0)
time.sleep(600)
"""


def _comm_survivors(marker: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            comm = Path(f"/proc/{name}/comm").read_text().strip()
        except OSError:
            continue
        if comm == marker:
            out.append(int(name))
    return out


def _marked(tag: str) -> list[int]:
    mark = f"{OWNER_ENV}={tag}".encode() + b"\0"
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if (b"\0" + env).find(b"\0" + mark) >= 0:
            out.append(int(name))
    return out


def _dirs(tag: str) -> list[str]:
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"agent-sandbox-{tag}-")]


def _run_agent(provider: str, moment: str, extra: str = "0") -> None:
    skip_unless_available(provider)
    marker = "asbx" + secrets.token_hex(5)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, provider, marker, moment, extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tag = ""
    try:
        tag = owner_tag(agent.pid)
        line = agent.stdout.readline() if agent.stdout else ""
        assert line.strip() == "READY", (line, agent.stderr.read() if agent.stderr else "")
        if moment not in ("exit", "closing"):  # (those may have ended it already)
            assert _comm_survivors(marker), "the double fork did not run"
        if moment != "exit":
            agent.send_signal(signal.SIGKILL)  # this one child process only
        agent.wait(30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = (_comm_survivors(marker), _marked(tag), _dirs(tag))
            if not any(left):
                break
            time.sleep(0.05)
        assert left == ([], [], []), f"survivors after the agent ended: {left}"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        if agent.stdout:
            agent.stdout.close()
        if agent.stderr:
            agent.stderr.close()
        # Never leave a survivor behind even when the test fails (only processes we made).
        for pid in _comm_survivors(marker) + (_marked(tag) if tag else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("moment", ["idle", "running", "closing", "exit"])
def test_nothing_outlives_a_killed_agent(provider: str, moment: str) -> None:
    """It ends the worker, its launcher and the code's setsid double fork when the agent is
    SIGKILLed while a worker is idle, running a call or being closed, and when the agent
    exits normally without closing anything; no control directory stays."""
    _run_agent(provider, moment)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("delay", [0, 1, 3])
def test_nothing_outlives_an_agent_killed_while_workers_start(provider: str, delay: int) -> None:
    """It ends workers that were being started when the agent was SIGKILLed."""
    _run_agent(provider, "starting", str(delay))
