"""A normal (non-editable) install carries every package and runs a worker.

The editable install maps the folders through an import hook; a wheel lays them out under
`agent_sandbox/`. A sub-package missing from pyproject's list would be left out of the wheel
silently, so this builds the wheel (offline, no build isolation) and runs it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _newcomer() -> Any:
    """scripts/newcomer.py, whose `build_wheel` the newcomer script and this module share."""
    spec = importlib.util.spec_from_file_location("newcomer", REPO / "scripts" / "newcomer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    wheel = _newcomer().build_wheel(out)
    if isinstance(wheel, str):
        pytest.skip(f"cannot build a wheel offline here: {wheel.strip()[-300:]}")
    target = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def test_wheel_holds_every_package_and_the_presets(unpacked: Path) -> None:
    """It ships guards, providers, policies (with presets), adapters and the worker entry."""
    root = unpacked / "agent_sandbox"
    for sub in ("guards", "providers", "policies", "adapters"):
        assert (root / sub / "__init__.py").is_file(), sub
    assert (root / "_worker/boot.py").is_file()
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
