"""The public API is declared, sorted and complete; the packaging matches the folders."""

from __future__ import annotations

import importlib
import pkgutil
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_PACKAGES = [
    "agent_sandbox",
    "agent_sandbox.policies",
    "agent_sandbox.providers",
    "agent_sandbox.guards",
    "agent_sandbox.adapters",
]


@pytest.mark.parametrize("name", PUBLIC_PACKAGES)
def test_all_is_sorted_and_complete(name: str) -> None:
    """It lists every public name of the package in a sorted __all__."""
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    public = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, type(importlib))
    }
    public.discard("annotations")
    public |= set(getattr(module, "_LAZY", ()))  # names loaded on first use (PEP 562)
    assert set(exported) == public, f"{name}: __all__ differs from the public names"


def _private_modules(package: str) -> list[str]:
    module = importlib.import_module(package)
    return [
        f"{package}.{m.name}"
        for m in pkgutil.iter_modules(module.__path__)
        if m.name.startswith("_") and not m.name.startswith("__")
    ]


@pytest.mark.parametrize("name", [m for p in PUBLIC_PACKAGES for m in _private_modules(p)])
def test_every_private_module_declares_all(name: str) -> None:
    """It gives every private module an __all__ (boot and entry scripts excepted)."""
    if name.endswith(("_worker_boot", "_ns_launch", "__main__")):
        pytest.skip("entry scripts export nothing")
    if name.endswith(("langchain", "crewai")):
        pytest.skip("framework modules are imported only with their extra")
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # an optional dependency that is not installed
        pytest.skip(f"{name}: {exc}")
    assert hasattr(module, "__all__"), f"{name} has no __all__"


def test_packages_in_pyproject_match_the_folders() -> None:
    """It lists every folder as a package in pyproject, so the wheel leaves none out."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools_cfg = config["tool"]["setuptools"]
    packages = set(setuptools_cfg["packages"])
    mapping = setuptools_cfg["package-dir"]
    assert set(mapping) == packages
    on_disk = set()
    for name, folder in mapping.items():
        base = ROOT / folder
        assert (base / "__init__.py").is_file(), f"{folder} is not a package"
        on_disk.add(name)
        for sub in base.iterdir():
            if sub.is_dir() and (sub / "__init__.py").exists():
                on_disk.add(f"{name}.{sub.name}")
    assert packages == on_disk
    for folder in ("agent_sandbox", "adapters", "guards", "providers", "policies"):
        assert folder in mapping.values()


def test_no_top_level_guards_or_providers_module() -> None:
    """It installs nothing under a top-level `guards` or `providers` name."""
    for name in ("guards", "providers", "adapters", "policies"):
        spec = importlib.util.find_spec(name)
        assert spec is None or "site-packages" not in str(spec.origin), name


def test_core_import_does_not_pull_frameworks() -> None:
    """It keeps langchain and crewai out of the core's import path."""
    import subprocess
    import sys

    code = (
        "import sys, agent_sandbox, agent_sandbox.adapters\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('crewai', 'langchain_core', 'langchain')]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
