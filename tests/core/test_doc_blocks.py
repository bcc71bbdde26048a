"""Every Python and TOML block in the README and docs/ runs or loads as written.

A block that cannot run as written (it stands for the user's own agent, file or cluster) is
marked by an HTML comment on the line before its fence: `<!-- placeholder: why -->`. Python
blocks run in a fresh interpreter in an empty directory; TOML blocks load as policies.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent_sandbox.policies import policy_from_toml

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"(?:^<!-- placeholder: (?P<why>[^>]*) -->\n)?^```(?P<lang>python|toml)\n(?P<body>.*?)^```",
    re.S | re.M,
)


def _blocks(lang: str) -> list[tuple[str, str, str | None]]:
    out = []
    for path in FILES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match["lang"] == lang:
                line = text.count("\n", 0, match.start("body")) + 1
                out.append((f"{path.relative_to(ROOT)}:{line}", match["body"], match["why"]))
    return out


def _ids(value: object) -> str:
    return value if isinstance(value, str) and ".md:" in value else "-"


@pytest.mark.parametrize(
    ("where", "code", "why"),
    _blocks("python"),
    ids=_ids,
)
def test_python_block_runs(where: str, code: str, why: str | None, tmp_path: Path) -> None:
    """It runs the block in a fresh interpreter and it exits 0."""
    if why is not None:
        assert why.strip(), f"{where}: a placeholder says why"
        pytest.skip(f"placeholder: {why}")
    script = tmp_path / "block.py"  # a file, so sandboxed() can read a function's source
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, f"{where}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize(
    ("where", "text", "why"),
    _blocks("toml"),
    ids=_ids,
)
def test_toml_block_loads(where: str, text: str, why: str | None) -> None:
    """It loads the block as a policy."""
    if why is not None:
        pytest.skip(f"placeholder: {why}")
    policy_from_toml(text, source=where)


MODEL_TEXT = re.compile(
    r"^```python\n(?P<code>.*?)^```\n(?:(?!```).)*?"
    r"^<!-- model-text: (?P<policy>[\w-]+) -->\n```\n(?P<text>.*?)^```",
    re.S | re.M,
)


def _model_texts() -> list[tuple[str, str, str, str]]:
    out = []
    for path in FILES:
        text = path.read_text()
        for match in MODEL_TEXT.finditer(text):
            line = text.count("\n", 0, match.start("text")) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            out.append((where, match["policy"], match["code"], match["text"]))
    return out


def test_docs_show_model_texts() -> None:
    """It finds the marked samples of model text (the code-layer doc's refusal among them)."""
    assert any(where.startswith("docs/code-layer.md") for where, *_ in _model_texts())


@pytest.mark.parametrize(("where", "policy", "code", "expected"), _model_texts(), ids=_ids)
def test_a_sample_of_model_text_is_what_the_model_reads(
    where: str, policy: str, code: str, expected: str
) -> None:
    """It runs the Python block before a `<!-- model-text: POLICY -->` sample under that
    preset and compares the tool's text (`outcome(...).text`) with the sample, exactly."""
    from agent_sandbox import Sandbox
    from agent_sandbox.adapters._common import outcome

    with Sandbox(policy, warm=0) as sandbox:
        shown = outcome(sandbox.run(code)).text
    assert shown == expected.rstrip("\n"), f"{where}: the model reads\n{shown}"
