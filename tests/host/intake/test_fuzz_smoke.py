"""A short, bounded run of each atheris target (see fuzz_targets.py for long runs)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("atheris") is None,
    reason="atheris is not installed (pip install atheris; it needs a wheel or clang to build)",
)


@pytest.mark.parametrize("target", ["unpickle", "sse", "events", "decode"])
def test_fuzz_target_runs_clean(target: str, tmp_path: Path) -> None:
    """It survives a few thousand coverage-guided inputs with no crash, hang or forbidden
    audit event (libFuzzer exits non-zero and writes the input otherwise)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "seed").write_bytes(pickle.dumps({"a": [1, 2.5, "x"]}, protocol=5))
    (corpus / "blob").write_bytes(pickle.dumps(bytes(range(256)), protocol=5) + b"\x01")
    (corpus / "event").write_bytes(b'event: stdout\ndata: "hi"\n\nevent: done\ndata: {}\n\n')
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "fuzz_targets.py"),
            target,
            "-runs=3000",
            "-timeout=10",
            f"-artifact_prefix={tmp_path}{os.sep}",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
