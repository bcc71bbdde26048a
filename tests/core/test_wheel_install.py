"""A normal (non-editable) install carries every package and runs a worker.

The editable install maps the folders through an import hook; a wheel lays them out under
`agent_sandbox/`. A sub-package missing from pyproject's list would be left out of the wheel
silently, so this builds the wheel (offline, no build isolation) and runs it.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode != 0:
        pytest.skip(f"cannot build a wheel offline here: {build.stderr.strip()[-300:]}")
    wheel = next(out.glob("*.whl"))
    target = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def test_wheel_holds_every_package_and_the_presets(unpacked: Path) -> None:
    """It ships guards, providers, policies (with presets), adapters and the worker entry."""
    root = unpacked / "agent_sandbox"
    for sub in ("guards", "providers", "policies", "adapters"):
        assert (root / sub / "__init__.py").is_file(), sub
    assert (root / "_worker_boot.py").is_file()
    assert sorted(p.name for p in (root / "policies" / "presets").glob("*.toml")) == [
        "data-analysis.toml",
        "pure-computation.toml",
    ]


def test_a_wheel_install_runs_a_worker(unpacked: Path) -> None:
    """It runs a sandboxed call from the wheel's files, not from the source checkout."""
    site = sysconfig.get_paths()["purelib"]
    code = (
        "import sys\n"
        f"sys.path[:0] = [{str(unpacked)!r}, {site!r}]\n"
        "import agent_sandbox\n"
        f"assert agent_sandbox.__file__.startswith({str(unpacked)!r}), agent_sandbox.__file__\n"
        "from agent_sandbox import Sandbox\n"
        "with Sandbox('pure-computation', warm=0) as sb:\n"
        "    r = sb.run('import math\\nmath.factorial(5)')\n"
        "print(r.value, r.error)\n"
    )
    # -S: no site, so the editable install's import hook cannot map agent_sandbox to REPO.
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120, cwd="/tmp"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "120 None"
