"""Fixtures for the learning-mode tests: learned records and a policy file on disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agent_sandbox import Denial, Policy, load_policy

BASE_TOML = """\
name = "tool"
description = "a tool under learning"

[imports]
allow = ["math", "json"]

[env]
pass = ["LANG"]

[limits]
wall_seconds = 20
"""


@pytest.fixture
def learned() -> Callable[..., Denial]:
    """Build a learning-mode record: `learned("files.read", "/data/x.csv")`."""

    def make(rule: str, target: str, action: str = "use", detail: str = "") -> Denial:
        return Denial(rule, action, target, policy="tool", detail=detail, learned=True)

    return make


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    """A policy file in its own directory (`tmp_path/policies/tool.toml`)."""
    folder = tmp_path / "policies"
    folder.mkdir()
    path = folder / "tool.toml"
    path.write_text(BASE_TOML, encoding="utf-8")
    return path


@pytest.fixture
def policy(policy_file: Path) -> Policy:
    return load_policy(policy_file)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A stand-in home directory (`tmp_path/home/user`)."""
    path = tmp_path / "home" / "user"
    path.mkdir(parents=True)
    return path
