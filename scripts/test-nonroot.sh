#!/usr/bin/env bash
# Run the test suite as an unprivileged user (uid 65534) on Debian's /usr/bin/python3, from a
# virtualenv inside the checkout (.venv-nonroot, with the test extras). Needs root (to switch
# users) and a checkout other users can read. Not yet called by .ci/run: see issue 17.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "test-nonroot: run as root (it switches to uid 65534)" >&2; exit 2; }
env_dir=$PWD/.venv-nonroot
log=$env_dir/setup.log
if [ ! -x "$env_dir/bin/python" ]; then /usr/bin/python3 -m venv "$env_dir"; fi
if [ ! -f "$env_dir/.installed-dev" ] || [ pyproject.toml -nt "$env_dir/.installed-dev" ]; then
  "$env_dir/bin/python" -m pip install -q -e ".[dev,langchain,crewai,seccomp]" >"$log" 2>&1 \
    || { cat "$log" >&2; exit 1; }
  touch "$env_dir/.installed-dev" "$env_dir/.installed"
fi
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
chown 65534:65534 "$home"
setpriv --reuid=65534 --regid=65534 --clear-groups \
  env HOME="$home" PATH="$env_dir/bin:/usr/bin:/bin" \
  "$env_dir/bin/python" -m pytest -p no:cacheprovider "$@"
