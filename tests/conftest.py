"""Shared fixtures. Every test that starts a worker closes it (the fixtures do)."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox import Policy, Sandbox

# -- What CI requires ---------------------------------------------------------------------
# .ci/run names the providers and dependencies it requires in AGENT_SANDBOX_REQUIRE
# (comma-separated). A test that would be skipped because one of them is missing fails
# instead, so a CI host without user namespaces, bwrap or a dev dependency cannot turn the
# containment matrix into skips and stay green. Unset (a developer's machine) nothing changes.

#: Every name AGENT_SANDBOX_REQUIRE may hold.
REQUIREMENTS = frozenset(
    {
        "bwrap",
        "unshare",
        "landlock",
        "seccomp",
        "firejail",
        "gvisor",
        "qemu",
        "cgroups",
        "tls",
        "deps",
    }
)
_KERNEL = ("bwrap", "unshare", "landlock", "firejail", "gvisor")
#: A skip's reason (searched, case-insensitive) -> what it says is missing.
MISSING_PATTERNS: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), things)
    for pattern, things in (
        (r"\bbwrap\b.*\bunavailable|provider 'bwrap' unavailable|lacks bwrap", ("bwrap",)),
        (r"\bunshare\b.*(unavailable|not installed)|provider 'unshare' unavailable", ("unshare",)),
        (
            r"\blandlock\b.*unavailable|provider 'landlock' unavailable|lacks.*landlock",
            ("landlock",),
        ),
        (r"\bfirejail\b.*unavailable|provider 'firejail' unavailable", ("firejail",)),
        (
            r"\bgvisor\b.*unavailable|provider 'gvisor' unavailable|\brunsc\b.*(missing|not installed|not found)",
            ("gvisor",),
        ),
        (r"\bseccomp\b.*(unavailable|not installed|lacks)|pyseccomp|lacks.*seccomp", ("seccomp",)),
        (r"^qemu provider:|provider 'qemu' unavailable", ("qemu",)),
        (r"no kernel provider works here|no namespace provider is available", _KERNEL),
        (r"no (pids|memory|cpu) cgroup|no cgroup v2|cgroup controller", ("cgroups",)),
        (r"trustme|\bhttpx\b|\btls\b", ("tls",)),
        (r"could not import|cannot be imported|extension is not built", ("deps",)),
    )
)


def required() -> frozenset[str]:
    """What this run requires (AGENT_SANDBOX_REQUIRE); an unknown name is an error."""
    names = frozenset(n.strip() for n in os.environ.get("AGENT_SANDBOX_REQUIRE", "").split(","))
    names -= {""}
    unknown = names - REQUIREMENTS
    if unknown:
        raise pytest.UsageError(
            f"AGENT_SANDBOX_REQUIRE names {sorted(unknown)}; known: {sorted(REQUIREMENTS)}"
        )
    return names


def missing_required(reason: str, wanted: frozenset[str]) -> list[str]:
    """The required things a skip with `reason` says are missing (empty: a fair skip)."""
    found: list[str] = []
    for pattern, things in MISSING_PATTERNS:
        if pattern.search(reason):
            found.extend(t for t in things if t in wanted and t not in found)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """The same for a whole module skipped at import (`pytest.importorskip` at its top)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    wanted = required()
    if not (wanted and report.skipped and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2])
    missing = missing_required(reason, wanted)
    if missing:
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped for want of {', '.join(missing)}, which this run "
            f"requires (AGENT_SANDBOX_REQUIRE={os.environ['AGENT_SANDBOX_REQUIRE']}): {reason}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A skip for want of something AGENT_SANDBOX_REQUIRE names becomes a failure."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    wanted = required()
    if not (wanted and report.skipped and not hasattr(report, "wasxfail")):
        return
    excinfo = call.excinfo
    if excinfo is None or not excinfo.errisinstance(pytest.skip.Exception):
        return
    reason = str(excinfo.value.msg if hasattr(excinfo.value, "msg") else excinfo.value)
    missing = missing_required(reason, wanted)
    if missing:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped for want of {', '.join(missing)}, which this run requires "
            f"(AGENT_SANDBOX_REQUIRE={os.environ['AGENT_SANDBOX_REQUIRE']}): {reason}"
        )


# -- Sharing the provider matrix between CI's legs ------------------------------------------
# CI runs the whole suite on the first declared Python (root and normal user), and on each
# other declared Python everything again except the provider matrix, whose files it deals
# between those Pythons (.ci/run): AGENT_SANDBOX_TEST_SHARE=i/n keeps, under tests/providers,
# only the files of share i of n. Unset (a developer's machine) nothing changes.

#: The directory whose files the legs share, as pytest's node ids begin.
SHARED_DIR = "tests/providers/"


def provider_shares(counts: dict[str, int], n: int) -> list[set[str]]:
    """`counts` (a file -> the tests collected from it) dealt into `n` shares of about the
    same number of tests: the largest file first, each to the share with the fewest so far
    (ties to the lower share; files of one size by name), so runs that collect the same files
    deal them alike, and together the shares hold every file once."""
    shares: list[set[str]] = [set() for _ in range(n)]
    sizes = [0] * n
    for name in sorted(counts, key=lambda f: (-counts[f], f)):
        low = min(range(n), key=lambda k: (sizes[k], k))
        shares[low].add(name)
        sizes[low] += counts[name]
    return shares


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """AGENT_SANDBOX_TEST_SHARE=i/n: the provider matrix's files of share i only."""
    share = os.environ.get("AGENT_SANDBOX_TEST_SHARE", "")
    if not share:
        return
    found = re.fullmatch(r"([1-9][0-9]*)/([1-9][0-9]*)", share)
    if found is None or int(found[1]) > int(found[2]):
        raise pytest.UsageError(
            f"AGENT_SANDBOX_TEST_SHARE={share!r}: give i/n with 1 <= i <= n (share i of n)"
        )
    counts: dict[str, int] = {}
    for item in items:
        name = item.nodeid.split("::", 1)[0]
        if name.startswith(SHARED_DIR):
            counts[name] = counts.get(name, 0) + 1
    mine = provider_shares(counts, int(found[2]))[int(found[1]) - 1]
    kept, dropped = [], []
    for item in items:
        name = item.nodeid.split("::", 1)[0]
        (kept if not name.startswith(SHARED_DIR) or name in mine else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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


def pytest_sessionstart(session: pytest.Session) -> None:
    """Give the run Python's own SIGINT handler when it inherited SIGINT ignored (a shell
    without job control starts its background commands so, and Python then installs no
    handler). The Ctrl-C tests (test_lifecycle, test_ns_templates) send SIGINT and expect
    KeyboardInterrupt, as an interactive caller would get it; the worker sets its own."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


class GrowOnRead:
    """A writer that appends to a host file right after the host's first read of it (through
    `agent_sandbox._host.files`, which places uploads): a file that changes while it is read.
    `arm(path)` installs it; `grew` says whether the writer ran (the test's own oracle)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.grew = False

    def arm(self, path: Path) -> None:
        from agent_sandbox._host import files as host_files

        real_read = os.read

        def read_then_grow(fd: int, n: int) -> bytes:
            data = real_read(fd, n)
            if not self.grew:
                self.grew = True
                with open(path, "ab") as fh:
                    fh.write(b"more rows\n")
            return data

        self._monkeypatch.setattr(host_files.os, "read", read_then_grow)


@pytest.fixture
def grow_on_read(monkeypatch: pytest.MonkeyPatch) -> GrowOnRead:
    """See `GrowOnRead`; undone with the test's `monkeypatch`."""
    return GrowOnRead(monkeypatch)
