#!/usr/bin/env bash
# The test suite on one Python version other than .venv's (scripts/test.sh runs that one): `scripts/test-python.sh 3.13 [pytest arguments]`. The interpreter is python3.X on
# PATH or a pyenv build ($PYENV_ROOT/versions/3.X.*); it is resolved past pyenv's shims (a
# worker never starts through a shim). A virtualenv inside the checkout (.venv-3.X) gets the
# package and the same extras as .venv, reinstalled when the files change (as setup.sh does).
# A missing interpreter or an extra that does not install fails: CI runs every version
# the package declares (.ci/run), so none is skipped in silence.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test-python.sh 3.X [pytest arguments]}
shift
# The first candidate that runs (a pyenv shim of a version not selected does not).
py=
for candidate in "$(command -v "python$version" || true)" \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/"python$version"; do
  [ -x "$candidate" ] || continue
  py=$("$candidate" -c 'import sys; print(sys.executable)' 2>/dev/null) && break
  py=
done
[ -n "$py" ] || { echo "test-python: no python$version here (PATH or pyenv)" >&2; exit 1; }
# A version the package does not declare (yet) is installed past requires-python, and said so.
pip_flags=()
if ! bash scripts/python-versions.sh | grep -qx "$version"; then
  echo "test-python: $version is not declared in pyproject.toml; installing past requires-python" >&2
  pip_flags=(--ignore-requires-python)
fi
env_dir=.venv-$version
log=$env_dir/setup.log
stamp=$env_dir/.agent-sandbox-installed
[ -x "$env_dir/bin/python" ] || "$py" -m venv "$env_dir"
files=$(find agent_sandbox adapters guards providers policies \( -name '*.py' -o -name '*.toml' \
  -o -name '*.c' -o -name py.typed \) -not -path '*/__pycache__/*' | LC_ALL=C sort | cksum)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ -n "$(find guards agent_sandbox -name '*.c' -newer "$stamp")" ] \
   || [ "$(cat "$stamp")" != "$files" ]; then
  : >"$log"
  { "$env_dir/bin/python" -m pip install -q --upgrade pip \
      && "$env_dir/bin/python" -m pip install -q "${pip_flags[@]}" \
        -e ".[dev,langchain,crewai,smolagents,seccomp,remote,k8s]"
  } >>"$log" 2>&1 || { cat "$log" >&2; echo "test-python: install on $version failed" >&2; exit 1; }
  echo "$files" >"$stamp"
fi
exec "$env_dir/bin/pytest" -p no:cacheprovider "$@"
