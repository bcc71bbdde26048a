"""The sandbox works for an unprivileged user, not only for root.

Everything else in the suite runs as root, where file permissions never refuse anything. This
module runs the core as uid 65534 through `setpriv`, using the environment that
`scripts/setup.sh` builds on Debian's Python outside root's home.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NONROOT_PY = REPO / ".venv-nonroot" / "bin" / "python"


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to uid 65534"
    if not shutil.which("setpriv"):
        return "setpriv is not installed"
    if not NONROOT_PY.exists():
        return f"{NONROOT_PY} is missing (run scripts/setup.sh as root)"
    probe = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            str(NONROOT_PY),
            "-c",
            "import agent_sandbox; print(agent_sandbox.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd="/tmp",
    )
    if probe.returncode != 0:
        return f"uid 65534 cannot import agent_sandbox from {REPO}: {probe.stderr.strip()[-200:]}"
    return None


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "")

SCRIPT = r"""
import json, os
from agent_sandbox import Policy, Sandbox
out = {"uid": os.getuid()}
policy = Policy(name="nonroot", imports={"allow": ["os", "time"]}, limits={"wall_seconds": 5})
with Sandbox(policy, warm=0) as sb:
    s = sb.session()
    r = s.run("import os\nx = 2\n(os.getuid(), x * 21)")
    out["value"] = r.value
    out["again"] = s.run("x").value
    t = s.run("import time\ntime.sleep(30)", timeout=1)
    out["timeout"] = t.error.rule if t.error else None
    out["after"] = s.run("1").state_lost
print(json.dumps(out))
"""


def test_runs_as_an_unprivileged_user() -> None:
    """It starts workers, keeps sessions and enforces timeouts as uid 65534."""
    proc = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "env",
            "HOME=/tmp",
            str(NONROOT_PY),
            "-c",
            SCRIPT,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/tmp",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["uid"] == 65534
    assert out["value"] == [65534, 42]
    assert out["again"] == 2
    assert out["timeout"] == "limits.timeout"
    assert out["after"] is True


KERNEL_SCRIPT = r"""
import json, sys
from agent_sandbox import Policy, ProviderUnavailable, Sandbox
provider, canary = sys.argv[1], sys.argv[2]
import warnings
warnings.simplefilter("ignore")
policy = Policy(name="danger-nonroot-kernel", provider=provider, imports={"allow": ["os", "ctypes"]},
                api={"allow": ["native-code"]}, code={"enabled": False})
try:
    sb = Sandbox(policy, warm=0)
except ProviderUnavailable as exc:
    print(json.dumps({"unavailable": str(exc)}))
    raise SystemExit(0)
with sb:
    # ctypes walks around the Python guards: only the kernel can refuse this read.
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"fd = libc.open({canary!r}.encode(), os.O_RDONLY)\n"
        "data = os.read(fd, 100).decode() if fd >= 0 else ''\n"
        "[os.getuid(), data]"
    )
    r = sb.run(code)
    print(json.dumps({"value": r.value, "stack": list(r.stack),
                      "error": r.error.message if r.error else None}))
"""


@pytest.mark.parametrize("provider", ["landlock", "bwrap", "unshare"])
def test_kernel_providers_hold_for_an_unprivileged_user(provider: str, tmp_path: Path) -> None:
    """It denies a native read of a world-readable canary as uid 65534 (the kernel refuses,
    not file permissions)."""
    canary = Path("/tmp") / f"agent-sandbox-nonroot-canary-{provider}"
    canary.write_text("canary-nonroot-51c2")
    canary.chmod(0o644)  # readable by uid 65534: only the sandbox can refuse it
    try:
        proc = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "env",
                "HOME=/tmp",
                str(NONROOT_PY),
                "-c",
                KERNEL_SCRIPT,
                provider,
                str(canary),
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd="/tmp",
        )
    finally:
        canary.unlink()
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unavailable" in out:
        pytest.skip(out["unavailable"])
    assert "canary-nonroot-51c2" not in proc.stdout
    assert out["value"] is not None, out
    assert out["value"][1] == ""
    assert out["stack"][0] == provider
