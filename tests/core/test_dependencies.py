"""Every third-party import of the package is a declared dependency of the core, or of the
extra that the importing module belongs to.

The imports are read with `ast` (those inside functions included, those under
`if TYPE_CHECKING:` left out: they never run) from every module of the package and of the
folders mapped into it, as `test_layout.py` reads them. An import is matched to the
distribution that provides it through the installed metadata.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location("_layout", ROOT / "tests/core/test_layout.py")
assert _spec is not None and _spec.loader is not None
_layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layout)

#: The extras a module belongs to: it may import what they declare. A module not listed may
#: import the core's dependencies only.
EXTRAS_OF = {
    "agent_sandbox.adapters.langchain": {"langchain"},
    "agent_sandbox.adapters.crewai": {"crewai"},
    "agent_sandbox.adapters.smolagents": {"smolagents"},
    # NOTE: the offline demo drives the three frameworks; `agent-sandbox demo` says which
    # extra is missing when one is.
    "agent_sandbox._tools.demo": {"langchain", "crewai", "smolagents"},
    "agent_sandbox.providers._seccomp": {"seccomp"},
    "agent_sandbox._host.intake.remote_transport": {"remote"},
    "agent_sandbox._host.remote.k8s": {"k8s"},
    # `agent-sandbox k8s manifests` writes YAML.
    "agent_sandbox._tools.cli_worker": {"k8s"},
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return _norm(match.group(1))


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {_requirement_name(r) for r in PROJECT["dependencies"]}
EXTRAS = {
    extra: {_requirement_name(r) for r in requirements}
    for extra, requirements in PROJECT["optional-dependencies"].items()
}
_PROVIDERS = importlib.metadata.packages_distributions()


def _distributions(top: str) -> set[str]:
    """The distributions that install the top-level module `top` (its own name when none
    installed here: then it must be declared under that name)."""
    return {_norm(d) for d in _PROVIDERS.get(top, [top])}


def _third_party_imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, imports in _layout.RUNTIME.items():
        tops = {
            m.split(".")[0]
            for m in imports
            if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "agent_sandbox"
        }
        if tops:
            out[name] = tops
    return out


IMPORTS = _third_party_imports()


def test_the_table_names_real_modules_and_extras() -> None:
    """It keeps the table of extras to modules that exist and extras that pyproject declares."""
    assert set(EXTRAS_OF) <= set(_layout.MODULES)
    assert set().union(*EXTRAS_OF.values()) <= set(EXTRAS)


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_every_third_party_import_is_declared(module: str) -> None:
    """It finds each third-party module the package imports among the dependencies of the
    core or of the extras the importing module belongs to (a transitive dependency of a
    declared one is not enough: its version is not ours to assume)."""
    allowed = set(CORE)
    for extra in EXTRAS_OF.get(module, ()):
        allowed |= EXTRAS[extra]
    undeclared = {top: sorted(_distributions(top)) for top in IMPORTS[module]}
    undeclared = {top: dists for top, dists in undeclared.items() if not set(dists) & allowed}
    assert undeclared == {}, (
        f"{module} imports {undeclared}: declare it in pyproject.toml (the core's "
        f"dependencies, or an extra listed for the module in EXTRAS_OF)"
    )
