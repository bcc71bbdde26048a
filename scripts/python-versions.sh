#!/usr/bin/env bash
# Print the Python versions the package declares (its classifiers, one a line): the versions
# CI runs the suite on (.ci/run) and mypy checks against (scripts/check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
sed -n 's/^ *"Programming Language :: Python :: \(3\.[0-9]*\)",$/\1/p' pyproject.toml
