"""Hints that work when pasted, and a host that re-derives what a worker says.

Every kind of hint is pasted (twice, with another hint between) into a user's own policy that
extends each shipped preset: the result loads, keeps everything the preset and the user's
own tables allowed, and differs from the policy before by exactly the granted item.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._denial import Denial
from agent_sandbox._hints import (
    DENY_BEATS_GRANT,
    HIDDEN,
    NO_SYNTAX_RULE,
    host_hint,
    memory_hint,
    parse_grant,
)
from agent_sandbox._host.intake.builder import ResultBuilder
from agent_sandbox._render import quote
from agent_sandbox.policies import list_presets, policy_from_toml
from agent_sandbox.policies._paths import entry_regex

USER_OWN = """
name = "mine"
extends = "{preset}"

[files]
read = ["/srv/data/**"]

[limits]
wall_seconds = 45
"""

#: (rule, target, the worker's hint or "" when the host must derive it alone)
KINDS = [
    ("imports", "requests.adapters", ""),
    ("env", "API_URL", ""),
    ("api.process-exec", "subprocess.run", ""),
    ("files.read", "/srv/reports/q[1]*.csv", "[[grant]]\nfiles.read = []"),
    ("files.write", "/srv/out/result.json", "[[grant]]\nfiles.write = []"),
    ("net.connect", "10.0.0.5:8080", ""),
    ("net.bind", "127.0.0.1:9000", ""),
    ("net.resolve", "api.example.com", '[[grant]]\nnet.rules = [{ host = "x", ports = "8443" }]'),
    ("code.iterations", "loops", ""),
    ("limits.memory", "memory_mb", ""),
    ("limits.timeout", "the call", ""),
]


def _dump(policy: Policy) -> dict[str, Any]:
    return policy.model_dump(mode="json", by_alias=True)


def _diff(before: Any, after: Any, path: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after)):
            out += _diff(before.get(key), after.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if before == after else [path]


@pytest.mark.parametrize("preset", list_presets())
@pytest.mark.parametrize(("rule", "target", "worker_hint"), KINDS)
def test_each_hint_pasted_into_a_policy_extending_each_preset_allows_exactly_it(
    preset: str, rule: str, target: str, worker_hint: str
) -> None:
    """It loads, keeps every inherited item, and adds exactly the refused one."""
    text = USER_OWN.format(preset=preset)
    before = policy_from_toml(text, source="<mine>")
    hint = host_hint(rule, target, worker_hint, before.to_wire())
    assert hint.startswith("[[grant]]"), hint
    other = host_hint("imports", "yaml", "", before.to_wire())
    after = policy_from_toml(
        text + "\n" + hint + "\n\n" + other + "\n" + hint + "\n", source="<mine>"
    )
    b, a = _dump(before), _dump(after)
    # Nothing inherited or written by the user is lost (lists only grow).
    for section in ("imports", "files", "api", "env", "code"):
        for key, value in b[section].items():
            if isinstance(value, list):
                assert set(map(str, value)) <= set(map(str, a[section][key])), (section, key)
    assert a["files"]["read"][0] == "/srv/data/**" and a["limits"]["wall_seconds"] >= 45
    changed = set(_diff(b, a)) - {"imports.allow"}
    grant = parse_grant(hint)
    assert grant is not None
    expected = {k for k in grant if k != "imports.allow"}
    if "net.rules" in grant:
        expected = {"net.rules"}
    assert changed == expected
    _assert_allows(a, rule, target)


def _assert_allows(policy: dict[str, Any], rule: str, target: str) -> None:
    if rule == "imports":
        assert target.split(".")[0] in policy["imports"]["allow"]
    elif rule == "env":
        assert target in policy["env"]["pass"]
    elif rule.startswith("api."):
        assert target in policy["api"]["allow"]
    elif rule.startswith("files."):
        patterns = policy["files"][rule.split(".")[1]]
        assert any(entry_regex(p).fullmatch(target) for p in patterns)
        # Exactly that path: the glob characters of the name match only themselves.
        assert not any(entry_regex(p).fullmatch("/srv/reports/q1x.csv") for p in patterns)
    elif rule.startswith("net."):
        host = target.rsplit(":", 1)[0] if rule != "net.resolve" else target
        assert any(r["host"] == host for r in policy["net"]["rules"])


def test_a_deny_entry_gets_a_sentence_not_a_fragment() -> None:
    """It says no added line can allow what a deny entry or a hidden name refuses."""
    wire = Policy(name="p").to_wire()
    assert host_hint("imports", "xml.sax", "remove 'xml.sax' from [imports] deny", wire) == (
        DENY_BEATS_GRANT
    )
    assert host_hint("files.hidden", "/x/.env", "", wire) == HIDDEN


def test_grants_add_to_a_policy_without_extends_and_to_its_defaults() -> None:
    """It appends a grant to the defaults when the policy extends nothing."""
    policy = policy_from_toml('name = "p"\n[[grant]]\nfiles.hide = ["*.key"]\n')
    assert "*.key" in policy.files.hide and ".env" in policy.files.hide


def _builder() -> ResultBuilder:
    builder = ResultBuilder(None, Policy(name="host-policy", imports={"allow": ["math"]}), 30.0)
    builder.add("start", {"call": 1})
    return builder


def test_the_host_replaces_a_workers_hint_with_its_own() -> None:
    """It never shows a worker's hint as sent: a forged grant becomes the host's fragment."""
    builder = _builder()
    forged = Denial(
        rule="imports",
        action="import",
        target="requests",
        policy="whatever",
        hint='[[grant]]\napi.allow = ["native-code", "process-exec"]',
        detail="x",
    )
    builder.add("denial", forged.to_dict())
    (kept,) = builder.denials
    assert kept.hint == '[[grant]]\nimports.allow = ["requests"]'
    assert kept.policy == "host-policy"


def test_a_forged_internal_flag_cannot_hide_a_refusal_that_failed_the_call() -> None:
    """It withdraws "internal" for a refusal carried by the call's error, and never says ok."""
    builder = _builder()
    denial = Denial(rule="net.resolve", action="resolve", target="example.com", internal=True)
    builder.add("denial", denial.to_dict())
    builder.add(
        "error",
        {
            "kind": "exception",
            "type": "requests.exceptions.ConnectionError",
            "message": f"failed: {denial.message()}",
            "traceback": "",
        },
    )
    builder.add("done", {})
    result = builder.build()
    assert not result.ok
    assert result.error is not None and result.error.kind == "denied"
    assert [d.internal for d in result.denials] == [False]
    assert result.rules() == ["net.resolve"]


def test_rules_that_are_never_library_internal_stay_the_users() -> None:
    """It keeps code-layer and limit refusals the user's whatever the worker claims."""
    builder = _builder()
    for rule in ("code.dunder", "limits.output", "guard.tampered"):
        builder.add("denial", Denial(rule=rule, action="x", target="t", internal=True).to_dict())
    builder.add("result", {"value": None})
    builder.add("done", {})
    result = builder.build()
    assert all(not d.internal for d in result.denials) and not result.ok


def test_the_host_bounds_what_a_worker_sends() -> None:
    """It keeps at most a bounded number of distinct refusals, counting the rest per rule."""
    builder = _builder()
    # (`_host.intake.events` bounds the denial events of one call at 1024; past that the worker is killed.)
    for i in range(1000):
        builder.add("denial", Denial(rule="files.read", action="read", target=f"/f{i}").to_dict())
    builder.add("result", {"value": None})
    builder.add("done", {})
    result = builder.build()
    assert len(result.denials) <= 257
    assert sum(d.count for d in result.denials) == 1000
    assert result.denials[-1].last is not None and result.denials[-1].last.target == "/f999"


SYNTAXLESS = """
name = "no-lambda"
provider = "subprocess"
no_kernel_boundary = "accepted"

[code]
syntax = ["assignment", "functions"]
"""


def test_a_syntax_refusal_hints_the_group_that_allows_it() -> None:
    """It gives a `code.syntax` refusal the grant of its syntax group, and that grant allows
    the code when pasted into the policy."""
    from agent_sandbox import Sandbox

    policy = policy_from_toml(SYNTAXLESS, source="no-lambda.toml")
    wire = policy.to_wire()
    worker = '[[grant]]\ncode.syntax = ["lambda"]'
    hint = host_hint("code.syntax", "lambda: 1", worker, wire)
    assert hint == '[[grant]]\ncode.syntax = ["lambda"]'
    # A worker cannot name a group that does not exist, several groups, or one already listed.
    assert host_hint("code.syntax", "x", '[[grant]]\ncode.syntax = ["calls"]', wire) == ""
    two = '[[grant]]\ncode.syntax = ["lambda", "loops"]'
    assert host_hint("code.syntax", "x", two, wire) == ""
    assert host_hint("code.syntax", "x", '[[grant]]\ncode.syntax = ["functions"]', wire) == ""
    # A node the checker has no rule for: a sentence, since no line can allow it.
    assert host_hint("code.syntax", "FutureNode", "", wire) == NO_SYNTAX_RULE
    with Sandbox(policy, warm=0) as sandbox:
        refused = sandbox.run("f = lambda: 1\nf()")
        [denial] = refused.denials
        assert (denial.rule, denial.hint) == ("code.syntax", hint)
        assert "To allow it, add to the policy file:\n    [[grant]]" in denial.message()
    granted = policy_from_toml(SYNTAXLESS + "\n" + hint + "\n", source="no-lambda.toml")
    with Sandbox(granted, warm=0) as sandbox:
        assert sandbox.run("f = lambda: 1\nf()").value == 1


def test_a_control_character_is_escaped_once() -> None:
    """It shows a control character as one escape, raw or already escaped by the intake,
    and still doubles every other backslash."""
    assert quote("/tmp/x\ny") == '"/tmp/x\\ny"'
    assert quote("/tmp/x\\x0ay") == '"/tmp/x\\x0ay"'  # as `_host.intake.events.clean_text` keeps it
    assert quote("/tmp/x\x1by") == '"/tmp/x\\x1by"'
    assert quote("C:\\new\\x") == '"C:\\\\new\\\\x"'
    assert quote('say "hi"') == '"say \\"hi\\""'


_MIB = 1 << 20


def test_the_memory_hint_proposes_what_numpy_said_the_failed_allocation_needed() -> None:
    """It proposes the peak plus the allocation that failed, a quarter more, rounded up to
    64 MiB (not twice the limit), and says where each figure came from."""
    hint, why = memory_hint(
        200, measured_peak=150 * _MIB, worker_peak=180 * _MIB, asked=1000 * _MIB
    )
    # (180 + 1000) * 1.25 = 1475 -> 1536, the next multiple of 64.
    assert hint == "[[grant]]\nlimits.memory_mb = 1536"
    assert "asked for 1000 MiB (numpy's report" in why
    assert "peaked at 150 MiB (measured by the host" in why
    assert "resident peak was 180 MiB (the worker's ru_maxrss, unverified)" in why
    # A small allocation still raises the limit past what applied.
    assert memory_hint(200, asked=_MIB)[0] == "[[grant]]\nlimits.memory_mb = 264"


def test_the_memory_hint_says_when_it_cannot_know_what_the_call_needed() -> None:
    """It doubles the limit only when nothing says what the call needed, and says that the
    number is a guess and what the peak was (or that nothing measured it)."""
    hint, why = memory_hint(200, measured_peak=199 * _MIB)
    assert hint == "[[grant]]\nlimits.memory_mb = 400"
    assert "peaked at 199 MiB" in why and "cannot be known" in why and "a guess" in why
    hint, why = memory_hint(300)
    assert hint == "[[grant]]\nlimits.memory_mb = 600"
    assert why.startswith("the worker's peak could not be measured")
