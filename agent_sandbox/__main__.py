"""`python -m agent_sandbox` is the `agent-sandbox` command."""

from agent_sandbox._tools.cli import main

raise SystemExit(main())
