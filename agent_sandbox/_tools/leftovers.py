"""What an agent left behind: shared by the lifecycle tests and `benchmarks/soak_lifecycle.py`.

* `named(marker)`: processes whose name (`comm`) is `marker`.
* `marked(tag)`: processes started with an agent's owner mark (a worker, a launcher, a
  template), read from their environment.
* `control_dirs(tag)`, `agent_cgroups(tag)`: an agent's control directories and cgroups
  (`tag_of_pid(pid)` reads a live agent's owner token from the lock file it holds).
* `run_agent(...)`: runs `ORPHAN_AGENT` (an agent whose sandboxed code makes a setsid double
  fork with ctypes, so no Python guard is involved, and names the grandchild `marker`) as a
  child process, ends it at a chosen moment (SIGKILL to that one pid, or a normal exit),
  and returns what is left once a bound has passed (the guardian works asynchronously).
  Whatever it returns, it kills what it found (only processes of that agent).

Nothing here is imported by the library itself.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent_sandbox._host.guardian import DIR_PREFIX, OWNER_ENV, tag_of_pid

__all__ = [
    "NO_GUARDIAN",
    "ORPHAN_AGENT",
    "Left",
    "agent_cgroups",
    "control_dirs",
    "marked",
    "named",
    "run_agent",
]

#: argv: provider, marker, moment (idle, forked, running, starting, closing, exit), extra (a delay
#: in 20 ms steps for "starting"). It prints READY when the moment has come.
ORPHAN_AGENT = r"""
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
        # Only read with provider "landlock", which takes no policy without it.
        visible_names="accepted",
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
elif moment == "forked":
    # As "idle", in a worker forked by the pool's template (not started from scratch).
    assert sb.session("first").run("1").ok  # the pool's first worker starts from scratch
    assert sb._pool.template() is not None, "no template"
    session = sb.session("a")
    assert session.run("1").ok
    assert getattr(session.worker.proc, "_template", None) is not None, "not forked"
    assert session.run(FORK).ok
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

#: Prepended to the agent to switch its guardian off: what remains is the exit hook's work.
NO_GUARDIAN = "import agent_sandbox._host.lifecycle as L\nL.ensure_guardian = lambda: None\n"


def _pids() -> list[str]:
    return [name for name in os.listdir("/proc") if name.isdigit()]


def named(marker: str) -> list[int]:
    out = []
    for name in _pids():
        try:
            if Path(f"/proc/{name}/comm").read_text().strip() == marker:
                out.append(int(name))
        except OSError:
            pass
    return out


def marked(tag: str) -> list[int]:
    mark = f"{OWNER_ENV}={tag}".encode() + b"\0"
    out = []
    for name in _pids():
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if (b"\0" + env).find(b"\0" + mark) >= 0:
            out.append(int(name))
    return out


def control_dirs(tag: str) -> list[str]:
    prefix = f"{DIR_PREFIX}{tag}-"
    return sorted(n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix))


def agent_cgroups(tag: str) -> list[str]:
    from agent_sandbox._host.limits import hierarchy_bases

    return [
        name
        for base in hierarchy_bases()
        for name in os.listdir(base)
        if name.startswith(f"agent-sandbox-{tag}-")
    ]


@dataclasses.dataclass(frozen=True)
class Left:
    """What `run_agent` found after the agent ended (all empty when nothing outlived it)."""

    ready: str  # the agent's first line (READY) or its stderr when it never got ready
    forked: bool  # the code's double fork was seen running before the agent ended
    named: list[int]
    marked: list[int]
    dirs: list[str]
    #: How many processes with the agent's owner mark ran when the agent was ended (a
    #: worker behind its own kernel, gVisor's, forks inside it: only its runsc shows).
    before: int = 0
    tag: str = ""  # the agent's owner token ("" when it never made anything)

    def any(self) -> bool:
        return bool(self.named or self.marked or self.dirs)


def run_agent(
    provider: str, moment: str, extra: str = "0", *, guardian: bool = True, bound: float = 15
) -> Left:
    marker = "asbx" + secrets.token_hex(5)
    script = ORPHAN_AGENT if guardian else NO_GUARDIAN + ORPHAN_AGENT
    agent = subprocess.Popen(
        [sys.executable, "-c", script, provider, marker, moment, extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tag = ""
    try:
        line = agent.stdout.readline() if agent.stdout else ""
        tag = tag_of_pid(agent.pid) or ""  # held since its first worker: READY comes later
        if line.strip() != "READY":
            agent.kill()
            line += agent.stderr.read() if agent.stderr else ""
        forked = bool(named(marker))
        # The grandchild names itself after its parent exits, so READY may come first.
        settle = time.monotonic() + 5
        while (
            not forked
            and line.strip() == "READY"
            and moment in ("idle", "forked", "running", "starting")
        ):
            if time.monotonic() > settle:
                break
            time.sleep(0.02)
            forked = bool(named(marker))
        before = len(marked(tag))
        if moment != "exit":
            agent.send_signal(signal.SIGKILL)  # this one child process only
        agent.wait(60)
        deadline = time.monotonic() + bound
        while True:
            left = Left(
                line.strip(), forked, named(marker), marked(tag), control_dirs(tag), before, tag
            )
            if not left.any() or time.monotonic() > deadline:
                return left
            time.sleep(0.05)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        for stream in (agent.stdout, agent.stderr):
            if stream:
                stream.close()
        # Never leave a survivor behind (only processes this agent made).
        for pid in set(named(marker)) | set(marked(tag) if tag else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
