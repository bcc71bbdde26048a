"""Quiet shutdown: an agent's interpreter exits without a word on stderr, and leaves nothing.

Each test runs a small agent script as a child process: it makes a sandbox (two warm
workers) and a session, then exits with the sandbox closed, not closed, with a call in
flight in another thread, or right after taking a warm worker (the pool's refill thread is
starting its replacement). The interpreter's exit must print nothing (no traceback from a
thread, no warning), and once it has exited no process started with its owner mark, no
control directory and no cgroup of it may be left (one second of grace: the exit hook is
synchronous).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from agent_sandbox._tools.leftovers import agent_cgroups, control_dirs, marked

from .conftest import skip_unless_available

AGENT = r"""
import logging, sys, threading
logging.getLogger("agent_sandbox").setLevel(logging.ERROR)  # the opt-out's warning
from agent_sandbox import Policy, Sandbox
provider, scenario = sys.argv[1:3]
policy = Policy(
    name="quiet",
    imports={"allow": ["time"]},
    limits={"wall_seconds": 60},
    no_kernel_boundary="accepted",  # read only under "subprocess"
    visible_names="accepted",  # read only under "landlock"
)
sb = Sandbox(policy, provider=provider, warm=2)
session = sb.session("a")
assert session.run("x = 1").ok
if scenario == "close":
    sb.close()
elif scenario == "in-flight":
    started = threading.Event()
    threading.Thread(
        target=session.run,
        args=("import time\nprint('go', flush=True)\ntime.sleep(60)",),
        kwargs={"on_event": lambda kind, data: started.set()},
        daemon=True,
    ).start()
    assert started.wait(30)
elif scenario == "refill":
    sb._pool.fill()
    sb._pool.acquire().discard()  # the refill thread is now starting a replacement
from agent_sandbox._host import lifecycle
print("DONE", lifecycle.owner_tag(), flush=True)
"""


@pytest.mark.parametrize("scenario", ["close", "no-close", "in-flight", "refill"])
@pytest.mark.parametrize("provider", ["subprocess", "bwrap"])
def test_the_agent_exits_quietly_and_leaves_nothing(provider: str, scenario: str) -> None:
    """It prints nothing on stderr at interpreter exit and leaves no marked process, control
    directory or cgroup, whether or not the sandbox was closed (three runs each)."""
    skip_unless_available(provider)
    for _ in range(3):
        agent = subprocess.Popen(
            [sys.executable, "-c", AGENT, provider, scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = agent.communicate(timeout=120)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
        word, _, tag = out.strip().partition(" ")
        assert (agent.returncode, word, err) == (0, "DONE", "")
        deadline = time.monotonic() + 1.0
        while True:
            left = (marked(tag), control_dirs(tag), agent_cgroups(tag))
            if not any(left) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert left == ([], [], []), f"left after the agent's exit: {left}"
