"""Time from SIGKILL of an agent (its guardian switched off) until no process of it is left.

Usage: python benchmarks/keeper_bound.py PROVIDER MOMENT N  (MOMENT: idle, forked, running).
The sandboxed code makes a setsid double fork (`_tools/leftovers.py`); the clock starts at
the SIGKILL and stops once no process carries its marker or the agent's owner mark.
"""

import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from agent_sandbox._host.guardian import sweep, tag_of_pid
from agent_sandbox._host.limits import hierarchy_bases
from agent_sandbox._tools.leftovers import NO_GUARDIAN, ORPHAN_AGENT, marked, named

provider, moment, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
times = []
for _ in range(n):
    marker = "asbx" + secrets.token_hex(5)
    agent = subprocess.Popen(
        [sys.executable, "-c", NO_GUARDIAN + ORPHAN_AGENT, provider, marker, moment, "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = agent.stdout.readline()
    tag = tag_of_pid(agent.pid)
    assert line.strip() == "READY", line
    while not named(marker):
        time.sleep(0.005)
    t0 = time.monotonic()
    agent.send_signal(signal.SIGKILL)
    while named(marker) or marked(tag):
        if time.monotonic() - t0 > 10:
            break
        time.sleep(0.002)
    times.append(time.monotonic() - t0)
    agent.wait()
    agent.stdout.close()
    for pid in set(named(marker)) | set(marked(tag)):
        os.kill(pid, signal.SIGKILL)
sweep(hierarchy_bases(), tempfile.gettempdir())
ms = sorted(t * 1000 for t in times)
print(
    f"{provider} {moment}: n={n} median {statistics.median(ms):.0f} ms, "
    f"range {ms[0]:.0f}-{ms[-1]:.0f} ms"
)
