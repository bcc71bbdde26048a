"""The TOML writer: every policy it writes loads back into the same policy."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_sandbox.policies import Policy, list_presets, policy_from_toml, resolve_policy
from agent_sandbox.policies._toml import policy_to_toml, toml_string


def _same(a: Policy, b: Policy) -> bool:
    return a.model_dump(by_alias=True) == b.model_dump(by_alias=True)


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_round_trips(name: str) -> None:
    """It writes each shipped policy so that it loads back equal, fingerprint included."""
    policy = resolve_policy(name)
    again = policy_from_toml(policy.to_toml())
    assert _same(policy, again)
    assert again.fingerprint() == policy.fingerprint()


def test_a_policy_with_every_section_round_trips() -> None:
    """It writes nested tables, the array of net rules, env values and empty lists."""
    policy = Policy(
        name="every-section",
        description='quotes " and \\ and a\nnewline and \u00e9',
        provider="auto",
        mode="learn",
        files={
            "read": ["/data/in"],
            "write": ["$SCRATCH", "/data/out"],
            "deny": ["/data/in/x"],
            "hide": [],
        },
        net={
            "rules": [
                {"host": "127.0.0.1", "ports": "80,443"},
                {"action": "deny", "host": "10.0.0.0/8", "direction": "any", "protocol": "any"},
            ]
        },
        imports={"allow": ["json", "xml.etree"], "deny": ["pickle"]},
        env={"pass": ["LANG", "LC_*"], "set": {"A B": "x\x01y", "MPLBACKEND": "Agg"}},
        api={"allow": ["subprocess.run"], "deny": ["process-control"]},
        code={"budgets": {"max_iterations": 5}},
        limits={"wall_seconds": 1.5, "memory_mb": 64},
    )
    text = policy_to_toml(policy)
    assert _same(policy_from_toml(text), policy)
    assert "[[net.rules]]" in text and "[code.budgets]" in text and "[env.set]" in text


def test_comments_mark_items_and_the_header_is_a_comment_block() -> None:
    """It puts a trailing comment on a marked list item and a comment block on top."""
    policy = Policy(name="c", imports={"allow": ["json", "subprocess"]})
    text = policy_to_toml(
        policy,
        header="line one\nline two",
        comments={("imports.allow", "subprocess"): "RISKY: runs programs"},
    )
    assert text.startswith("# line one\n# line two\n")
    assert '"subprocess", # RISKY: runs programs' in text
    assert _same(policy_from_toml(text), policy)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_any_string_is_escaped_into_a_valid_toml_string(value: str) -> None:
    """It escapes quotes, backslashes and control characters so TOML reads the same text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates cannot be written to a UTF-8 file at all
    assert tomllib.loads(f"k = {toml_string(value)}")["k"] == value
