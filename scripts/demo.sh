#!/usr/bin/env bash
# Install, then run the demo: a LangChain agent and a CrewAI crew using SandboxedPythonTool,
# offline with scripted models (no network, no API key).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/agent-sandbox demo "$@"
