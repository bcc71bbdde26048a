"""The suite cannot pass by accident: checks of the tests themselves and of CI's wiring.

- every strict xfail names the exception it expects (`raises=`), so a broken attack does
  not read as "gap documented";
- a skip for want of something CI requires fails there (`AGENT_SANDBOX_REQUIRE`,
  tests/conftest.py), and CI names every provider and dependency;
- a URL in a test that could be fetched names loopback or a documentation address only;
- the declared Python versions, CI's legs and mypy's versions are one list.
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REQUIREMENTS, SHARED_DIR, missing_required, provider_shares

ROOT = Path(__file__).resolve().parents[2]
TEST_FILES = sorted(p for p in (ROOT / "tests").rglob("*.py") if "__pycache__" not in p.parts)


def _xfail_calls(tree: ast.AST) -> list[ast.Call]:
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "xfail":
                calls.append(node)
    return calls


def test_every_xfail_names_the_exception_it_expects() -> None:
    """Every `pytest.mark.xfail` in tests/ has `raises=`; no test calls `pytest.xfail()`
    (which ends a test before its attack runs)."""
    missing = []
    for path in TEST_FILES:
        for call in _xfail_calls(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            is_mark = isinstance(call.func, ast.Attribute) and (
                isinstance(call.func.value, ast.Attribute) and call.func.value.attr == "mark"
            )
            if not is_mark:
                missing.append(f"{where}: pytest.xfail() called")
            elif not any(k.arg == "raises" for k in call.keywords):
                missing.append(f"{where}: xfail without raises=")
    assert missing == []


@pytest.mark.parametrize(
    ("reason", "wanted", "missing"),
    [
        ("provider 'bwrap' unavailable here: no bwrap", {"bwrap"}, ["bwrap"]),
        ("bwrap unavailable here: user namespaces are off", {"bwrap", "unshare"}, ["bwrap"]),
        ("no kernel provider works here", {"landlock"}, ["landlock"]),
        ("qemu provider: missing tools: busybox-static", {"qemu"}, ["qemu"]),
        ("could not import 'trustme': No module named 'trustme'", {"tls", "deps"}, ["tls", "deps"]),
        ("no pids cgroup here: RLIMIT_NPROC does not bound uid 0", {"cgroups"}, ["cgroups"]),
        ("provider 'bwrap' unavailable here: no bwrap", set(), []),
        ("not root: permissions, not the sandbox, keep /etc/shadow unreadable", {"bwrap"}, []),
        ("sys.monitoring.use_tool_id does not exist on this Python", set(REQUIREMENTS), []),
    ],
)
def test_a_skip_for_a_required_thing_is_recognised(
    reason: str, wanted: set[str], missing: list[str]
) -> None:
    """It maps a skip's reason to the required things it says are missing, and no more."""
    assert missing_required(reason, frozenset(wanted)) == missing


def test_ci_requires_every_provider_and_dependency() -> None:
    """`.ci/run` requires every name the hook knows (a new provider must be added there)."""
    text = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"AGENT_SANDBOX_REQUIRE=\$\{AGENT_SANDBOX_REQUIRE-([\w,]+)\}", text)
    assert match is not None
    assert set(match.group(1).split(",")) == set(REQUIREMENTS)


#: Addresses a test may fetch: loopback and the documentation ranges (RFC 5737, 3849).
_FETCHABLE = re.compile(r"^(127\.|192\.0\.2\.|198\.51\.100\.|203\.0\.113\.|\[?::1|\[?2001:db8:)")


def test_urls_in_tests_name_loopback_or_documentation_addresses() -> None:
    """No test names a URL with an address off the machine outside the documentation
    ranges: were containment gone, the request would go nowhere real."""
    url = re.compile(r"(?:https?|socks5h?)://(\[[0-9a-fA-F:]+\]|\d{1,3}(?:\.\d{1,3}){3})")
    found = []
    for path in TEST_FILES:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for address in url.findall(line):
                if not _FETCHABLE.match(address):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {address}")
    assert found == []


def test_declared_pythons_are_what_ci_runs_and_mypy_checks() -> None:
    """requires-python, the classifiers, CI's legs and mypy's versions are one list."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = subprocess.run(
        ["bash", str(ROOT / "scripts" / "python-versions.sh")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    classifiers = [
        c.rsplit(" ", 1)[1]
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert listed == classifiers and listed
    low, high = listed[0], listed[-1]
    upper = f"3.{int(high.split('.')[1]) + 1}"
    assert project["requires-python"] == f">={low},<{upper}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/python-versions.sh" in ci and "scripts/test-python.sh" in ci
    assert 'AGENT_SANDBOX_TEST_SHARE="$((i + 1))/${#others[@]}"' in ci
    assert "scripts/python-versions.sh" in (ROOT / "scripts" / "check.sh").read_text()


def test_the_legs_sharing_the_provider_matrix_run_every_file_once() -> None:
    """The shares CI's other Pythons take of tests/providers (AGENT_SANDBOX_TEST_SHARE) hold
    every file exactly once, in about equal numbers of tests, the same on every run."""
    counts = {
        f"{SHARED_DIR}{p.name}": len(p.read_text().splitlines())  # any weights will do
        for p in sorted((ROOT / SHARED_DIR).glob("test_*.py"))
    }
    assert len(counts) > 10
    for n in (1, 2, 3):
        shares = provider_shares(counts, n)
        assert len(shares) == n and set().union(*shares) == set(counts)
        assert sum(len(s) for s in shares) == len(counts)
        sizes = sorted(sum(counts[f] for f in s) for s in shares)
        assert sizes[-1] - sizes[0] <= max(counts.values())
        assert shares == provider_shares(dict(reversed(counts.items())), n)
