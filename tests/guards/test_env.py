"""The environment guard, end to end: host secrets are refused by name, never shown."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agent_sandbox import Policy, Sandbox

CANARY_NAME = "AGENT_SANDBOX_TEST_CANARY"  # planted by tests/conftest.py


@pytest.fixture(scope="module")
def session() -> Iterator[object]:
    os.environ.setdefault(CANARY_NAME, "canary-7f3a9c1e")
    os.environ["AGENT_SANDBOX_PASSED_VAR"] = "visible-value"
    policy = Policy(
        name="env-test",
        imports={"allow": ["os"]},
        env={"pass": ["AGENT_SANDBOX_PASSED_VAR"], "set": {"SET_BY_POLICY": "1"}},
        limits={"wall_seconds": 20},
    )
    sb = Sandbox(policy, warm=0)
    try:
        with sb.session("env") as s:
            yield s
    finally:
        sb.close()
        os.environ.pop("AGENT_SANDBOX_PASSED_VAR", None)


@pytest.mark.parametrize(
    "expression",
    [
        f"os.environ[{CANARY_NAME!r}]",
        f"os.environ.get({CANARY_NAME!r})",
        f"os.getenv({CANARY_NAME!r})",
        f"os.environb[{CANARY_NAME.encode()!r}]",
    ],
)
def test_blocks_reading_a_host_secret(session: object, expression: str) -> None:
    """It denies reading a host variable the policy does not pass, naming the rule `env`."""
    result = session.run(f"import os\n{expression}")  # type: ignore[attr-defined]
    assert "canary-7f3a9c1e" not in repr(result.value) + result.stdout
    assert result.error is not None and result.error.type.endswith("EnvDenied")
    assert result.error.rule == "env"
    assert [d.target for d in result.denials] == [CANARY_NAME]
    assert result.denials[0].hint == f'[[grant]]\nenv.pass = ["{CANARY_NAME}"]'


def test_a_missing_variable_is_just_unset(session: object) -> None:
    """It keeps "not set" distinct: a name the host does not have is an ordinary miss."""
    result = session.run(  # type: ignore[attr-defined]
        "import os\n"
        "try:\n    os.environ['SURELY_NOT_SET_ANYWHERE_42']\n    r = 'found'\n"
        "except KeyError as e:\n    r = type(e).__name__\n"
        "[r, os.environ.get('SURELY_NOT_SET_ANYWHERE_42', 'default')]"
    )
    assert result.value == ["KeyError", "default"] and result.denials == ()


def test_passed_and_set_variables_are_readable(session: object) -> None:
    """It lets passed and policy-set variables through."""
    result = session.run(  # type: ignore[attr-defined]
        "import os\n[os.environ['AGENT_SANDBOX_PASSED_VAR'], os.getenv('SET_BY_POLICY')]"
    )
    assert result.value == ["visible-value", "1"] and result.ok


def test_the_environment_holds_no_host_secret(session: object) -> None:
    """It leaves no host value in the worker's environment tables at all."""
    result = session.run(  # type: ignore[attr-defined]
        "import os, posix\nrepr(dict(os.environ)) + repr(posix.environ)"
    )
    assert "canary-7f3a9c1e" not in repr(result.value)


def test_blocks_proc_environ(session: object) -> None:
    """It denies `/proc/self/environ` and the parent's environ file (files rules)."""
    result = session.run(  # type: ignore[attr-defined]
        "import os\nout = []\n"
        "for p in ('/proc/self/environ', f'/proc/{os.getppid()}/environ'):\n"
        "    try:\n        out.append(open(p, 'rb').read())\n"
        "    except OSError as e:\n        out.append(type(e).__name__)\n"
        "out"
    )
    assert "canary-7f3a9c1e" not in repr(result.value)
    assert result.value == ["FileAccessDenied", "FileAccessDenied"]


def test_libraries_probing_host_names_are_not_refused(session: object) -> None:
    """It lets library code see a host-only variable as unset (no refusal charged)."""
    result = session.run("import os\nos.path.expanduser('~')")  # type: ignore[attr-defined]
    assert result.error is None and result.denials == ()
