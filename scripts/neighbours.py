"""Neighbours: agents of this library that run beside the test suite and check every call.

Many agents on one machine is the ordinary case (issue 29): a run of the suite must not
disturb them, and they must not disturb it. `scripts/neighbours.sh start DIR` starts N of
these agents (some in a pid namespace of their own, as a container gives); each loops
until `DIR/stop` exists, and checks that every one of its calls succeeded:

- a session call that counts (`n += 1`): the value must be one more than the last,
  and the call ok, not `state_lost` (a worker killed under it loses the counter);
- a stateless call (`sum(range(1000))`) whose value must be 499500.

Each agent writes `DIR/agent-<i>.json` (rewritten after every call, so an agent killed
from outside still leaves what it saw) with its counts and its first failures, then
`"finished": true` when it stopped on request. `report` sums them and exits 1 when any
call failed or any agent did not finish.

    python scripts/neighbours.py agent DIR INDEX PIDNS
    python scripts/neighbours.py report DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: Seconds between calls: neighbours are ordinary agents, not a load generator.
PAUSE = 0.25
#: How many failures an agent keeps verbatim in its summary.
KEEP = 20


def _write(path: Path, summary: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(path)


def agent(directory: Path, index: int, pidns: bool) -> int:
    from agent_sandbox import Sandbox

    out = directory / f"agent-{index}.json"
    stop = directory / "stop"
    summary: dict[str, Any] = {
        "agent": index,
        "pid": os.getpid(),
        "pidns": pidns,
        "calls": 0,
        "failures": 0,
        "failed": [],
        "finished": False,
    }

    def fail(kind: str, detail: str) -> None:
        summary["failures"] += 1
        if len(summary["failed"]) < KEEP:
            summary["failed"].append({"at": time.time(), "kind": kind, "detail": detail[:500]})

    _write(out, summary)
    with Sandbox("pure-computation", warm=1) as sb:
        session = sb.session(f"neighbour-{index}")
        expected = 0  # the session's counter as this agent last saw it (0: start it again)
        while not stop.exists():
            expected += 1
            counter = "n = 1\nn" if expected == 1 else "n += 1\nn"
            for kind, code in (("session", counter), ("stateless", "sum(range(1000))")):
                summary["calls"] += 1
                want = expected if kind == "session" else 499500
                try:
                    result = session.run(code) if kind == "session" else sb.run(code)
                except Exception as exc:  # a failure too, never the end of the agent
                    fail(kind, f"raised {type(exc).__name__}: {exc}")
                    expected = 0 if kind == "session" else expected
                    continue
                if not result.ok or result.value != want or result.state_lost:
                    fail(
                        kind,
                        f"value={result.value!r} want={want} ok={result.ok} "
                        f"state_lost={result.state_lost} error={result.error!r} "
                        f"notices={result.notices!r}",
                    )
                    expected = 0 if kind == "session" else expected
            _write(out, summary)
            time.sleep(PAUSE)
    summary["finished"] = True
    _write(out, summary)
    return 0


def report(directory: Path) -> int:
    agents = [json.loads(p.read_text()) for p in sorted(directory.glob("agent-*.json"))]
    expected = int((directory / "count").read_text()) if (directory / "count").exists() else 0
    calls = sum(a["calls"] for a in agents)
    failures = sum(a["failures"] for a in agents)
    unfinished = [a["agent"] for a in agents if not a["finished"]]
    missing = max(0, expected - len(agents))
    pidns = sum(1 for a in agents if a["pidns"])
    print(
        f"neighbours: {len(agents)} agents ({pidns} in their own pid namespace), "
        f"{calls} calls, {failures} failed, {len(unfinished) + missing} did not finish"
    )
    for a in agents:
        for f in a["failed"]:
            print(f"  agent {a['agent']} (pidns={a['pidns']}): {f['kind']}: {f['detail']}")
    if unfinished or missing:
        print(f"  unfinished agents: {unfinished}, never started: {missing}")
    return 1 if failures or unfinished or missing or not agents else 0


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[1] == "agent":
        return agent(Path(argv[2]), int(argv[3]), argv[4] == "1")
    if len(argv) == 3 and argv[1] == "report":
        return report(Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
