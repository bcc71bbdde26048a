#!/usr/bin/env bash
# Set up everything agent_sandbox's demo and tests need on a fresh Debian 12 machine:
# the OS sandboxes (bubblewrap, firejail, libseccomp, gVisor's runsc) when running as root, and a
# virtualenv at .venv with the package and its extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  command -v bwrap >/dev/null || need+=(bubblewrap)
  command -v firejail >/dev/null || need+=(firejail firejail-profiles)
  ldconfig -p | grep -q libseccomp.so.2 || need+=(libseccomp2)
  # The qemu provider: QEMU, a static busybox for the guest's /init, strip for the image.
  command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
  [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 || need+=(busybox-static)
  command -v strip >/dev/null || need+=(binutils)
  # The gvisor provider: runsc (gVisor's user-space kernel), run rootless.
  command -v runsc >/dev/null || need+=(runsc)
  kernels=/var/cache/agent-sandbox/qemu
  if [ ${#need[@]} -gt 0 ] || ! ls "$kernels"/linux-image-*-amd64_*.deb >/dev/null 2>&1; then
    apt-get update -qq
  fi
  if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]} with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
  # The qemu provider's guest kernel: Debian's generic kernel package, kept (not installed)
  # where `agent-sandbox qemu build` and the qemu tests look for it.
  if ! ls "$kernels"/linux-image-*-amd64_*.deb >/dev/null 2>&1; then
    kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null \
      | sed -n 's/.*Depends: \(linux-image-.*-amd64\)$/\1/p' | head -n1)
    mkdir -p "$kernels"
    if [ -z "$kpkg" ] || ! (cd "$kernels" && apt-get download -qq "$kpkg" >/dev/null 2>&1); then
      echo "setup: could not fetch the qemu guest kernel; the qemu provider and its tests will skip" >&2
    fi
  fi
fi
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
# Resolve pyenv shims to the real interpreter (the worker must never start through a shim).
PY=$("$PY" -c 'import sys; print(sys.executable)')
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.agent-sandbox-installed
# The editable install also compiles the C extensions next to their sources (guards/,
# agent_sandbox/_host/intake/, agent_sandbox/_worker/: where they are imported from); it does
# not recompile by itself when a .c file changes, so a newer source reinstalls too.
# pip's and setuptools' chatter goes to .venv/setup.log; it is printed only when a step fails.
log=.venv/setup.log
quiet() { "$@" >>"$log" 2>&1 || { cat "$log" >&2; echo "setup: failed: $*" >&2; return 1; }; }
# The editable install is a tree of links to the files (setup.py): a module added or removed
# needs it made again, so the list of files is part of the stamp.
files=$(find agent_sandbox adapters guards providers policies \( -name '*.py' -o -name '*.toml' \
  -o -name '*.c' -o -name py.typed \) -not -path '*/__pycache__/*' | LC_ALL=C sort | cksum)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ -n "$(find guards agent_sandbox -name '*.c' -newer "$stamp")" ] \
   || [ "$(cat "$stamp")" != "$files" ]; then
  : >"$log"
  # The first install takes a minute or two (the extras pull in LangChain and CrewAI): say
  # so, and say each step, instead of staying silent.
  start=$SECONDS
  echo "setup: installing agent_sandbox and its extras into .venv (a minute or two the first time; log: $log)" >&2
  quiet .venv/bin/python -m pip install -q --upgrade pip
  # This project was once installed as `agent-sandbox`, a name that belongs to an unrelated
  # project on the package index; an old install of either would shadow ours.
  if .venv/bin/python -m pip show -q agent-sandbox >/dev/null 2>&1; then
    quiet .venv/bin/python -m pip uninstall -y -q agent-sandbox
  fi
  echo "setup: pip is up to date; installing the package and its extras..." >&2
  # pip's own lines go to the log (not -q), and a line every 15 s says how long it has run
  # and the step pip is at ("Collecting crewai", "Installing collected packages"), so the
  # minute is never silent. The ticker ends with the install, failed or not.
  ( trap 'kill "$nap" 2>/dev/null; exit 0' TERM
    while :; do
      sleep 15 & nap=$!
      wait "$nap"
      at=$(grep -E '^(Collecting|Downloading|Building|Installing|Successfully)' "$log" \
        | tail -n1 | cut -c1-70 || true)
      echo "setup: still installing ($((SECONDS - start)) s)${at:+: $at}" >&2
    done ) &
  ticker=$!
  rc=0
  quiet .venv/bin/python -m pip install --progress-bar off \
    -e ".[dev,langchain,crewai,smolagents,seccomp,remote,k8s]" || rc=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  [ "$rc" = 0 ] || exit "$rc"
  echo "$files" >"$stamp"
  echo "setup: installed in $((SECONDS - start)) s" >&2
fi
