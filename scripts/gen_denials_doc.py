"""Rewrite the rule table of docs/denials.md from agent_sandbox._denial.RULES (the one
catalogue). Only the table is generated: the prose around it is written by hand, so this
replaces the rows under the `| rule | meaning |` header and leaves every other line as it is.
`tests/core/test_docs.py` fails when the committed table and the catalogue differ."""

from __future__ import annotations

import sys
from pathlib import Path

from agent_sandbox import RULES

DOC = Path(__file__).resolve().parents[1] / "docs" / "denials.md"
HEADER = "| rule | meaning |\n|---|---|\n"


def rows() -> str:
    return "".join(f"| `{rule}` | {text} |\n" for rule, text in sorted(RULES.items()))


def render(doc: str) -> str:
    """`doc` with its rule table replaced by the catalogue's (the table ends at the first
    line that is not a table row)."""
    start = doc.find(HEADER)
    if start < 0 or doc.find(HEADER, start + 1) >= 0:
        raise ValueError(f"{DOC}: expected exactly one table headed {HEADER.splitlines()[0]!r}")
    body = start + len(HEADER)
    end = body
    while doc.startswith("|", end):
        end = doc.index("\n", end) + 1
    return doc[:body] + rows() + doc[end:]


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print(
                f"{DOC} is out of step with RULES: run scripts/gen_denials_doc.py", file=sys.stderr
            )
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
