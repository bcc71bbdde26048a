#!/usr/bin/env bash
# Install what the tests need, run the quality gates, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
.venv/bin/pytest "$@"
