"""docs/learning.md pins each claim to a test: every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_test_the_learning_doc_names_exists() -> None:
    """It finds each `test_...` named in docs/learning.md among the tests of tests/tools/learn."""
    doc = (ROOT / "docs" / "learning.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", doc))
    source = "\n".join(
        p.read_text() for p in (ROOT / "tests" / "tools" / "learn").glob("test_*.py")
    )
    defined = set(re.findall(r"^def (test_[a-z0-9_]+)\(", source, re.M))
    assert named, "the doc names no test"
    assert named <= defined, sorted(named - defined)
