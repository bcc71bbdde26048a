"""Objects mode on Debian 12's own Python (3.11.2), whose Enum pickles through `getattr`.

The main suite runs on another 3.11 release; `scripts/setup.sh` builds `.venv-nonroot` on
`/usr/bin/python3`, and this test runs an Enum round trip there.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

DEBIAN_PY = Path(__file__).resolve().parents[3] / ".venv-nonroot" / "bin" / "python"

SCRIPT = """
from agent_sandbox import Policy, Sandbox
policy = Policy(name="enum", result_mode="objects", result_types=["uuid.SafeUUID"],
                imports={"allow": ["uuid"]})
with Sandbox(policy, warm=0) as sandbox:
    result = sandbox.run("import uuid\\n[uuid.SafeUUID.safe, uuid.SafeUUID.unknown]")
    print(result.ok, result.value, result.error)
"""


@pytest.mark.skipif(not DEBIAN_PY.exists(), reason=f"{DEBIAN_PY} is missing (scripts/setup.sh)")
def test_an_enum_member_crosses_on_debians_python() -> None:
    """It returns Enum members on a Python whose Enum reduces through getattr."""
    out = subprocess.run(
        [str(DEBIAN_PY), "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd="/tmp"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True [<SafeUUID.safe: 0>, <SafeUUID.unknown: None>] None"
