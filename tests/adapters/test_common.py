"""Framework-free adapter logic: the generated description and how a result is presented."""

from __future__ import annotations

import subprocess
import sys

from agent_sandbox import Denial, Policy, RunError, RunResult
from agent_sandbox._host.result import Image
from agent_sandbox.adapters import describe_policy
from agent_sandbox.adapters._common import image_blocks, outcome


def test_description_lists_network_hosts_files_and_state():
    p = Policy(
        name="fetcher",
        imports={"allow": ["json"]},
        net={"rules": [{"host": "api.example.com", "ports": 443}]},
        files={"write": ["/data/out"], "read": ["/data/in"]},
        code={"names": ["print", "len"], "deny_names": ["input"]},
        limits={"wall_seconds": 7},
    )
    d = describe_policy(p, session="none")
    assert "Network: only api.example.com:443" in d
    assert "/data/out" in d and "Read also: /data/in" in d
    assert "7 s per call" in d and "do not persist" in d
    assert "only these names: print, len" in d and "never: input" in d
    assert "Imports allowed: json." in d


def test_description_with_no_imports_and_tool_sessions():
    d = describe_policy(Policy(name="bare"), session="tool")
    assert "none (builtins only)" in d and "persist between calls." in d


def denial(rule: str = "imports", learned: bool = False) -> Denial:
    return Denial(
        rule=rule,
        action="import",
        target="socket",
        policy="p",
        hint='[imports] allow = ["socket"]',
        learned=learned,
    )


def test_refusal_text_names_rule_target_and_fix_and_truncates_partial_output():
    result = RunResult(
        stdout="x" * 5000,
        error=RunError(kind="denied", type="ImportDenied", message="m", rule="imports"),
        denials=(denial(),),
    )
    out = outcome(result)
    assert out.is_error and out.kind == "denied" and out.rule == "imports"
    assert "[imports]" in out.text and '"socket"' in out.text and "allow" in out.text
    assert "4600 more characters not shown" in out.text


def test_caught_and_learned_denials_are_reported_in_ordinary_output():
    result = RunResult(stdout="fallback\n", denials=(denial(), denial("env", learned=True)))
    out = outcome(result)
    assert not out.is_error and out.rules == ("imports", "env")
    assert "code caught the error" in out.text and "Learning mode" in out.text


def test_crash_and_internal_failures_are_errors_with_clear_text():
    crash = outcome(
        RunResult(
            error=RunError(
                kind="crashed",
                type="WorkerCrashed",
                message="killed by SIGKILL",
                rule="worker.crashed",
            )
        )
    )
    assert crash.is_error and "fresh interpreter" in crash.text
    internal = outcome(RunResult(error=RunError(kind="internal", type="X", message="boom")))
    assert internal.is_error and "failed internally (X: boom)" in internal.text
    assert internal.retryable and crash.retryable


def test_a_closed_sandbox_is_not_offered_a_retry():
    """It tells the model a closed sandbox will not run code again (not "try once more"),
    and marks the failure not retryable (CrewAI's `ToolFailure.retryable`)."""
    from agent_sandbox import SandboxClosed
    from agent_sandbox.adapters._common import internal_failure

    for result in (
        RunResult(
            error=RunError(
                kind="internal",
                type="SandboxClosed",
                message="the sandbox was closed while the call was running",
            )
        ),
        internal_failure(SandboxClosed("the sandbox is closed")),
    ):
        out = outcome(result)
        assert out.is_error and out.kind == "internal" and not out.retryable
        assert out.text.startswith("The sandbox is closed (")
        assert "do not call it again" in out.text
        assert "try once more" not in out.text and "failed internally" not in out.text


def test_value_and_images():
    result = RunResult(value=[1, 2], images=(Image("a.png", "image/png", "QUJD"),))
    out = outcome(result)
    assert "[1, 2]" in out.text and "a.png" in out.text
    assert image_blocks(result) == [{"type": "image", "base64": "QUJD", "mime_type": "image/png"}]


def test_adapter_package_imports_no_framework():
    """It keeps crewai and langchain out of `agent_sandbox.adapters` (sandboxed works without)."""
    code = (
        "import sys\n"
        "from agent_sandbox.adapters import sandboxed, describe_policy\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('crewai', 'langchain_core', 'langchain')]\n"
        "assert not bad, bad\n"
        "print('clean')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert out.stdout.strip() == "clean", out.stderr


def test_description_states_the_tools_own_time_limit():
    """It tells the model the limit that will apply: the tool's timeout over the policy's."""
    policy = Policy(name="p", limits={"wall_seconds": 120, "cpu_seconds": 90})
    assert "120 s per call" in describe_policy(policy)
    d = describe_policy(policy, timeout=5)
    assert "5 s per call" in d and "120 s per call" not in d and "90 s of CPU" in d
