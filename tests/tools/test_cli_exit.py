"""The command line's exit statuses, `--version`, and errors under `--json` (README table)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from agent_sandbox._errors import DIST_NAME, install_hint

CLI = [sys.executable, "-m", "agent_sandbox"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


def test_version_names_the_distribution() -> None:
    """It prints the distribution's name and version."""
    try:
        version = metadata.version(DIST_NAME)
    except metadata.PackageNotFoundError:
        pytest.skip(f"this environment predates the {DIST_NAME} name: run scripts/setup.sh")
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"{DIST_NAME} {version}"


@pytest.mark.parametrize(
    "args",
    [
        ("run",),
        ("run", "--timeout", "-1", "-c", "1"),
        ("run", "--timeout", "nan", "-c", "1"),
        ("no-such-command",),
        ("run", "--no-such-flag", "-c", "1"),
    ],
)
def test_a_usage_error_is_64_not_the_refusal_status(args: tuple[str, ...]) -> None:
    """A usage error exits 64, never 2 (2 means a refusal or a limit)."""
    out = run_cli(*args)
    assert out.returncode == 64, out.stderr
    assert "error:" in out.stderr


def test_a_refusal_is_2_and_a_raise_is_1() -> None:
    """The code's own outcome keeps its statuses."""
    assert run_cli("run", "-c", "open('/etc/passwd')").returncode == 2
    assert run_cli("run", "-c", "1/0").returncode == 1


def test_an_unreadable_file_is_66_and_a_bad_policy_78(tmp_path: Path) -> None:
    """Input that cannot be read and a policy that does not load have their own statuses."""
    assert run_cli("run", str(tmp_path / "missing.py")).returncode == 66
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nno_such_key = 1\n')
    out = run_cli("run", "--policy", str(bad), "-c", "1")
    assert out.returncode == 78, out.stderr
    assert "no_such_key" in out.stderr


def test_errors_under_json_are_json(tmp_path: Path) -> None:
    """Under --json a failure outside the code is one JSON object on stdout."""
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nno_such_key = 1\n')
    out = run_cli("run", "--json", "--policy", str(bad), "-c", "1")
    assert out.returncode == 78
    error = json.loads(out.stdout)["error"]
    assert error["type"] == "PolicyError" and error["exit_status"] == 78
    assert "no_such_key" in error["message"]


def test_an_adapter_without_its_extra_names_the_install() -> None:
    """Importing an adapter without its framework says which extra to install."""
    code = (
        "import sys\n"
        "sys.modules['langchain_core'] = None\n"
        "try:\n"
        "    import agent_sandbox.adapters.langchain\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert install_hint("langchain") in out.stdout, out.stderr
    assert DIST_NAME == "agent-sandbox-kit"


def test_policy_mistakes_get_one_line_naming_the_fix(tmp_path: Path) -> None:
    """Typos get a did-you-mean; wrong types, `pkg.*` and a bad `extends` name their line."""
    cases = {
        'name = "x"\n[limits]\nwal = 1\n': "3: [limits.wal] unknown key; did you mean `wall_seconds`?",
        'name = "x"\nextnds = "data-analysis"\n': "2: [extnds] unknown key; did you mean `extends`?",
        'name = "x"\n[limits]\nwall_seconds = "60"\n': "3: [limits.wall_seconds]",
        'name = "x"\n[imports]\nallow = ["pandas.*"]\n': "write 'pandas'",
        'name = "x"\nextends = "data-analysys"\n': "2: [extends] 'data-analysys' is not a shipped",
    }
    for i, (text, expected) in enumerate(cases.items()):
        path = tmp_path / f"p{i}.toml"
        path.write_text(text)
        out = run_cli("policy", "check", str(path))
        assert out.returncode == 78, out
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert f"{path}:{expected}" in out.stderr or expected in out.stderr, out.stderr
        assert out.stderr.count(f"{path}") == 1, out.stderr


def test_a_child_policy_does_not_inherit_its_parents_description(tmp_path: Path) -> None:
    """A child that adds a net rule does not say "no network" in the parent's words."""
    child = tmp_path / "child.toml"
    child.write_text(
        'name = "child"\nextends = "data-analysis"\n[[net.rules]]\nhost = "127.0.0.1"\nports = "80"\n'
    )
    out = run_cli("policy", "explain", str(child))
    assert out.returncode == 0
    assert "no network" not in out.stdout
    assert "write: $SCRATCH, (nothing else)" in out.stdout
