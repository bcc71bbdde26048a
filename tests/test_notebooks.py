"""The notebooks in `notebooks/` execute offline, cell by cell; a failing cell fails the test."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CREWAI = importlib.util.find_spec("crewai") is not None


def _params() -> list[object]:
    out: list[object] = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        marks = []
        if "crewai" in path.stem:
            marks = [
                pytest.mark.crewai,
                pytest.mark.skipif(not CREWAI, reason="crewai is not installed"),
            ]
        out.append(pytest.param(path, id=path.stem, marks=marks))
    return out


def test_the_three_notebooks_exist():
    names = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    assert {"quickstart_langchain", "crewai", "policies_and_refusals"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", _params())
def test_notebook_runs_offline(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("langchain.agents")
    # The kernel inherits this environment: no telemetry, a private HOME for CrewAI.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CREWAI_STORAGE_DIR", str(tmp_path / "crewai"))
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("CREWAI_TRACING_ENABLED", "false")
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    # The notebooks make their policy files and CrewAI's storage with `tempfile.mkdtemp()`, as
    # a reader would: the kernel's temporary directory is one of the test's own, removed at
    # its end (short, under /tmp: worker sockets live there too).
    kernel_tmp = tempfile.mkdtemp(prefix="agent-sandbox-nb-")
    monkeypatch.setenv("TMPDIR", kernel_tmp)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    try:
        client.execute()  # raises CellExecutionError naming the failing cell
    finally:
        shutil.rmtree(kernel_tmp, ignore_errors=True)
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    assert os.environ.get("HOME") == str(tmp_path)
