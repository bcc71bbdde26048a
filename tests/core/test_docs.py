"""Docs that are pinned to the code: every policy key and every rule name is documented."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from agent_sandbox import RULES
from agent_sandbox.policies import Policy

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        if name in ("source", "sources"):  # where it was loaded from: set by the loader
            continue
        key = field.alias or name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.extend(_fields(annotation, f"{prefix}{key}."))
        else:
            out.append(key)
    return out


@pytest.mark.parametrize("key", sorted(set(_fields(Policy))))
def test_every_policy_key_is_documented(key: str) -> None:
    """It mentions every key of the policy model in docs/policies.md."""
    assert f"`{key}`" in (DOCS / "policies.md").read_text(), key


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_is_documented(rule: str) -> None:
    """It lists every rule name in docs/denials.md."""
    assert f"`{rule}`" in (DOCS / "denials.md").read_text(), rule


def test_the_rule_table_is_the_catalogue() -> None:
    """docs/denials.md's rule table is what scripts/gen_denials_doc.py makes from RULES, and
    the generator leaves the hand-written prose around it alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_denials_doc", DOCS.parent / "scripts" / "gen_denials_doc.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = (DOCS / "denials.md").read_text()
    assert gen.render(doc) == doc, "run scripts/gen_denials_doc.py"
    stale = doc.replace("| `net.bind` |", "| `net.bind` | stale |\n| `net.old` |", 1)
    assert gen.render(stale) == doc
