"""Shared fixtures. Every test that starts a worker closes it (the fixtures do)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agent_sandbox import Policy, Sandbox

# Secrets planted in the test process's environment: a worker must never see them.
os.environ.setdefault("AGENT_SANDBOX_TEST_CANARY", "canary-7f3a9c1e")


@pytest.fixture
def policy() -> Policy:
    """A small policy for core tests (standard-library basics, short limits)."""
    return Policy(
        name="test-core",
        imports={"allow": ["math", "json", "time", "os", "sys", "threading", "signal", "asyncio"]},
        api={"allow": ["process-control"]},
        limits={"wall_seconds": 10, "output_bytes": 100_000},
    )


@pytest.fixture
def sandbox(policy: Policy) -> Iterator[Sandbox]:
    sb = Sandbox(policy, warm=0)
    try:
        yield sb
    finally:
        sb.close()
