#!/usr/bin/env bash
# Install, then run the demo: a LangChain agent and a CrewAI crew using SandboxedPythonTool,
# offline with scripted models (no network, no API key).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# CrewAI writes settings and a key under the home directory (~/.config/crewai,
# ~/.local/share/crewai) and lock files in the temporary directory: the demo gives it a
# temporary home and temporary directory of its own, removed at the end.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/home" "$scratch/tmp"
HOME=$scratch/home TMPDIR=$scratch/tmp .venv/bin/agent-sandbox demo "$@"
