#!/usr/bin/env bash
# Agents of this library running beside the test suite, each checking every call
# (scripts/neighbours.py). CI starts them before the suite and stops them after (.ci/run):
#
#   scripts/neighbours.sh start DIR [AGENTS] [IN_PID_NAMESPACE]   # default 4 agents, 2 of them
#   scripts/neighbours.sh stop DIR     # stops them, prints the summary; exit 1 if a call failed
#
# An agent in a pid namespace of its own is started with `unshare --pid --fork --mount-proc`
# (as a container would), which needs root; each agent is a session leader of its own
# (setsid), so nothing it does to its process group reaches the caller. Their output goes to
# DIR/agent-<i>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: neighbours.sh start|stop DIR}
dir=${2:?usage: neighbours.sh start|stop DIR}
py=${PYTHON:-$PWD/.venv/bin/python}
case $cmd in
start)
  agents=${3:-4}
  in_ns=${4:-2}
  mkdir -p "$dir"
  rm -f "$dir/stop" "$dir"/agent-*.json
  echo "$agents" >"$dir/count"
  : >"$dir/pids"
  for i in $(seq 0 $((agents - 1))); do
    if [ "$i" -lt "$in_ns" ]; then
      setsid unshare --pid --fork --mount-proc --kill-child "$py" scripts/neighbours.py agent "$dir" "$i" 1 \
        >"$dir/agent-$i.log" 2>&1 </dev/null &
    else
      setsid "$py" scripts/neighbours.py agent "$dir" "$i" 0 >"$dir/agent-$i.log" 2>&1 </dev/null &
    fi
    echo $! >>"$dir/pids"
  done
  ;;
stop)
  touch "$dir/stop"
  # Each agent ends its current call (at most its wall limit) and writes its summary.
  for _ in $(seq 1 240); do
    alive=0
    while read -r pid; do kill -0 "$pid" 2>/dev/null && alive=1; done <"$dir/pids"
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  while read -r pid; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "neighbours: agent $pid did not stop; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done <"$dir/pids"
  "$py" scripts/neighbours.py report "$dir"
  ;;
*)
  echo "usage: neighbours.sh start|stop DIR" >&2
  exit 2
  ;;
esac
