#!/usr/bin/env bash
# Quality gates: ruff lint, ruff format check, mypy --strict over every folder, against every
# Python version the package declares.
# It checks a tree of symlinks that lays the folders out under their import name
# (agent_sandbox/guards -> guards/), so it does not depend on how this environment installed
# the package; tests/core/test_editable_install.py checks that a user's mypy sees the package
# through `pip install -e .` (a strict editable install, see setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check agent_sandbox adapters guards providers policies tests benchmarks
"$PY" -m ruff format --check agent_sandbox adapters guards providers policies tests benchmarks
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/agent_sandbox"
for f in agent_sandbox/*.py agent_sandbox/py.typed; do ln -s "$PWD/$f" "$tree/agent_sandbox/"; done
for d in agent_sandbox/*/; do
  if [ -f "$d/__init__.py" ]; then ln -s "$PWD/${d%/}" "$tree/agent_sandbox/"; fi
done
for d in adapters guards providers policies; do ln -s "$PWD/$d" "$tree/agent_sandbox/$d"; done
# Against every Python the package declares (scripts/python-versions.sh): the standard
# library's stubs differ between them (`_thread.start_joinable_thread`, `sys.monitoring`).
for version in $(bash scripts/python-versions.sh); do
  (cd "$tree" && "$OLDPWD/$PY" -m mypy --config-file "$OLDPWD/pyproject.toml" \
    --python-version "$version" -p agent_sandbox)
done
# What a user's type checker sees of the documented calls (tests/typing/user_calls.py).
(cd "$tree" && MYPYPATH="$tree" "$OLDPWD/$PY" -m mypy --config-file "$OLDPWD/pyproject.toml" \
  "$OLDPWD/tests/typing/user_calls.py")
