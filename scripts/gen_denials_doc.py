"""Regenerate docs/denials.md from agent_sandbox._denial.RULES (the one catalogue)."""

from pathlib import Path

from agent_sandbox import RULES

HEAD = """# Denials and their rule names

A denial is data before it is an exception: `Denial(rule, action, target, policy, hint,
detail, learned, internal)`; `learned` marks a would-be denial of learning mode, `internal` a
refusal a library raised and handled itself (kept for the operator, not a failure). `rule` is a stable dotted name; grep for it in a policy and here. The
exception raised inside user code subclasses both `SandboxDenied` and the builtin class
ordinary code expects (`PermissionError`, `FileNotFoundError`, `ModuleNotFoundError`,
`ConnectionRefusedError`, `KeyError`, `SyntaxError`). The worker records every denial before
raising, so `RunResult.denials` is complete even when the code swallows the exception.

The text a model reads names the rule, the target, the policy and the policy line that would
allow it:

```
[imports] import 'requests' refused by policy 'pure-computation'. To allow it, add to the
policy: [imports] allow = [..., "requests"]
```

Generated from `agent_sandbox/_denial.py` by `scripts/gen_denials_doc.py`.

| rule | meaning |
|---|---|
"""


def main() -> None:
    rows = "".join(f"| `{rule}` | {text} |\n" for rule, text in sorted(RULES.items()))
    path = Path(__file__).resolve().parents[1] / "docs" / "denials.md"
    path.write_text(HEAD + rows)


if __name__ == "__main__":
    main()
