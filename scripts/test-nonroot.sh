#!/usr/bin/env bash
# The whole test suite again, as an unprivileged user (uid 65534) on Debian's own
# /usr/bin/python3 (3.11.2, whose Enum pickles through getattr), from a virtualenv inside the
# checkout (.venv-nonroot, with the test extras), at a normal user's `ulimit -n 1024`. CI runs
# it after scripts/test.sh (.ci/run).
# Needs root (to switch users) and a checkout that other users can read; the user gets a
# temporary home, removed at the end, and writes nothing in the checkout. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "test-nonroot: run as root (it switches to uid 65534)" >&2; exit 2; }
as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
"${as_user[@]}" test -r pyproject.toml -a -x tests || {
  echo "test-nonroot: uid 65534 cannot read $PWD; put the checkout where other users can" >&2
  exit 2
}
env_dir=$PWD/.venv-nonroot
log=$env_dir/setup.log
stamp=$env_dir/.installed-tests
if [ ! -x "$env_dir/bin/python" ]; then
  /usr/bin/python3 -m venv "$env_dir" 2>/dev/null || {
    rm -rf "$env_dir"
    apt-get update -qq >/dev/null && apt-get install -y -qq python3-venv >/dev/null
    /usr/bin/python3 -m venv "$env_dir"
  }
fi
# pip's output goes to the log, shown only when the install fails. The editable install also
# builds the C extensions (guards/_fastimport, _host/intake/_fastscan, _worker/_nsfork) with
# Debian's headers (the same 3.11 ABI as .venv's).
# The editable install is a tree of links to the files (setup.py): a module added or removed
# needs it made again, so the list of files is part of the stamp.
files=$(find agent_sandbox adapters guards providers policies \( -name '*.py' -o -name '*.toml' \
  -o -name '*.c' -o -name py.typed \) -not -path '*/__pycache__/*' | LC_ALL=C sort | cksum)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
   || [ setup.py -nt "$stamp" ] || [ -n "$(find guards agent_sandbox -name '*.c' -newer "$stamp")" ] \
   || [ "$(cat "$stamp")" != "$files" ]
then
  "$env_dir/bin/python" -m pip install -q -e ".[dev,langchain,crewai,smolagents,seccomp,remote,k8s]" >"$log" 2>&1 \
    || { cat "$log" >&2; exit 1; }
  echo "$files" >"$stamp"
fi
# The user cannot write the checkout's bytecode caches: write them now, as root (workers run
# with -B and would otherwise compile every module from source at each start).
"$env_dir/bin/python" -m compileall -q -j 0 agent_sandbox adapters guards providers policies \
  >/dev/null
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
chown 65534:65534 "$home"
# A normal user's descriptor limit (root's is higher here): what the library and the suite
# must live within (issue 29). Set for the user's run only, in a subshell.
# Root's requirements less what uid 65534 cannot have here: KVM (/dev/kvm is root's),
# cgroups (no delegated subtree) and firejail (a normal user needs an entry in
# /etc/firejail/firejail.users, a machine's setting this script does not change).
required=${AGENT_SANDBOX_REQUIRE_NONROOT-${AGENT_SANDBOX_REQUIRE:+bwrap,unshare,landlock,seccomp,gvisor,tls,deps}}
(
  ulimit -n 1024
  "${as_user[@]}" env HOME="$home" PATH="$env_dir/bin:/usr/bin:/bin" \
    AGENT_SANDBOX_REQUIRE="$required" \
    "$env_dir/bin/python" -m pytest -p no:cacheprovider "$@"
)
