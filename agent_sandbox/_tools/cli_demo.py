"""`agent-sandbox demo`: offline agents (LangChain, CrewAI, and smolagents when installed)
using one sandboxed policy."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="run two offline scripted agents that get a call refused (no network, no API key)",
    )
    demo.add_argument(
        "--only",
        choices=("langchain", "crewai", "smolagents"),
        default=None,
        help="run one framework only",
    )
    demo.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from agent_sandbox._errors import install_hint
    from agent_sandbox._tools.cli import Style
    from agent_sandbox._tools.demo import run_demo

    only = args.only
    missing = [
        name
        for name, module in (
            ("langchain", "langchain.agents"),
            ("crewai", "crewai"),
            ("smolagents", "smolagents"),
        )
        if (only == name or (only is None and name != "smolagents"))
        and importlib.util.find_spec(module.split(".")[0]) is None
    ]
    if missing:
        style = Style(sys.stderr)
        extras = ",".join(missing)
        print(
            style.red(f"error: the demo needs {', '.join(missing)}: {install_hint(extras)}"),
            file=sys.stderr,
        )
        return 1
    transcripts = run_demo(sys.stdout, only=only)
    refused = all(any(kind == "refused" for kind, _ in t.lines) for t in transcripts)
    return 0 if refused and all(t.answer for t in transcripts) else 1
