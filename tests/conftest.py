"""Shared fixtures. Every test that starts a worker closes it (the fixtures do)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox import Policy, Sandbox

# Secrets planted in the test process's environment: a worker must never see them.
os.environ.setdefault("AGENT_SANDBOX_TEST_CANARY", "canary-7f3a9c1e")

# The tests leave nothing in the user's home: CrewAI keeps settings and a database per
# project directory under ~/.config and ~/.local/share, matplotlib a font cache, and the
# library its probe cache under $XDG_CACHE_HOME. The session (and every process it starts)
# gets a home of its own, removed when the session ends.
_HOME = tempfile.mkdtemp(prefix="agent-sandbox-tests-home-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
os.environ["HOME"] = _HOME
os.environ["XDG_CONFIG_HOME"] = os.path.join(_HOME, ".config")
os.environ["XDG_DATA_HOME"] = os.path.join(_HOME, ".local", "share")
os.environ["XDG_CACHE_HOME"] = os.path.join(_HOME, ".cache")
os.environ["MPLCONFIGDIR"] = os.path.join(_HOME, ".config", "matplotlib")

# Tests never reach the internet: LangChain's own LangSmith tracer stays off, and any client
# built from the environment points at a closed loopback port. Trace tests hand their tracer
# a recording client (tests/adapters/test_refusal_traces.py).
for _name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING"):
    os.environ[_name] = "false"
os.environ["LANGSMITH_ENDPOINT"] = os.environ["LANGCHAIN_ENDPOINT"] = "http://127.0.0.1:9"


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


@pytest.fixture(scope="session", autouse=True)
def _no_crewai_lock_files_left() -> Iterator[None]:
    """CrewAI leaves a `crewai:<md5>.lock` file in the temp dir for every lock it takes; the
    ones this test session made are removed at its end (tests leave nothing behind)."""
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("crewai:*.lock"))
    yield
    for path in set(tmp.glob("crewai:*.lock")) - before:
        try:
            if path.stat().st_uid == os.getuid():  # (another user's run may share the temp dir)
                path.unlink()
        except FileNotFoundError:
            pass


@pytest.fixture(autouse=True)
def _probe_cache_switch_restored() -> Iterator[None]:
    """`agent-sandbox doctor` run in-process switches the probe cache off for the rest of
    its process (`_probe_cache.probe_afresh`); a test that does so must not switch it off
    for the tests after it."""
    from agent_sandbox.providers import _probe_cache

    before = _probe_cache._afresh
    yield
    _probe_cache._afresh = before
