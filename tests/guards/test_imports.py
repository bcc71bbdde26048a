"""The import guard: direct imports of user code are judged, the finder stays at the head."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._errors import ImportDenied
from agent_sandbox.guards import _imports


def attempt(guard: Any, body: str) -> Any:
    guard.run(
        f"try:\n{textwrap.indent(body, '    ')}\nexcept Exception as exc:\n    result = type(exc).__name__\n"
    )
    return guard.namespace.get("result")


@pytest.fixture
def packages(tmp_path: Path) -> Iterator[Path]:
    """`granted_pkg` (allowed) imports `helper_mod` (not allowed) at import time."""
    (tmp_path / "granted_pkg").mkdir()
    (tmp_path / "granted_pkg" / "__init__.py").write_text(
        "import helper_mod\nVALUE = helper_mod.X\n"
    )
    (tmp_path / "granted_pkg" / "sub.py").write_text("Y = 2\n")
    (tmp_path / "helper_mod.py").write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("granted_pkg", "granted_pkg.sub", "helper_mod"):
            sys.modules.pop(name, None)


def test_blocks_importing_a_module_outside_the_allowlist(armed: Callable[..., Any]) -> None:
    """It denies an import the policy does not allow, as a ModuleNotFoundError."""
    guard = armed(imports={"allow": ["json"]})
    assert attempt(guard, "import xml.dom.minidom\nresult = 'imported'") == "ImportDenied"
    assert issubclass(ImportDenied, ModuleNotFoundError)
    denial = guard.denials()[-1]
    assert denial.rule == "imports" and denial.target == "xml.dom.minidom"
    assert denial.hint == '[[grant]]\nimports.allow = ["xml"]'


def test_blocks_a_module_loaded_before_arming(armed: Callable[..., Any]) -> None:
    """It denies `socket` even though the process already loaded it."""
    assert "socket" in sys.modules
    guard = armed(imports={"allow": ["json"]})
    assert attempt(guard, "import socket\nresult = socket.socket") == "ImportDenied"
    assert attempt(guard, "from socket import socket\nresult = socket") == "ImportDenied"


def test_try_import_falls_back(armed: Callable[..., Any]) -> None:
    """It lets `try: import x / except ImportError` code take its fallback."""
    guard = armed(imports={"allow": ["json"]})
    guard.run(
        "try:\n    import socket\n    result = 'fast'\nexcept ImportError:\n    result = 'fallback'"
    )
    assert guard.namespace["result"] == "fallback"


def test_allows_granted_packages_and_their_internal_imports(
    armed: Callable[..., Any], packages: Path
) -> None:
    """It allows a granted package's own imports but not the same module imported directly."""
    guard = armed(imports={"allow": ["granted_pkg"]})
    assert attempt(guard, "import granted_pkg\nresult = granted_pkg.VALUE") == 1
    assert attempt(guard, "from granted_pkg import sub\nresult = sub.Y") == 2
    assert attempt(guard, "import helper_mod\nresult = 'reached'") == "ImportDenied"


def test_deny_beats_allow(armed: Callable[..., Any]) -> None:
    """It lets `imports.deny` beat `imports.allow`."""
    guard = armed(imports={"allow": ["xml"], "deny": ["xml.sax"]})
    assert attempt(guard, "import xml.dom\nresult = 1") == 1
    assert attempt(guard, "import xml.sax\nresult = 2") == "ImportDenied"
    assert guard.denials()[-1].hint == "remove 'xml.sax' from [imports] deny"


def test_blocks_relative_import_into_the_worker(armed: Callable[..., Any]) -> None:
    """It judges a relative import by its absolute name (`from . import audit`)."""
    guard = armed(imports={"allow": ["json"]})
    body = "__package__ = 'agent_sandbox._worker'\nfrom . import audit\nresult = audit"
    assert attempt(guard, body) == "ImportDenied"
    assert guard.denials()[-1].target == "agent_sandbox._worker.audit"


def test_blocks_importlib_import_module(armed: Callable[..., Any]) -> None:
    """It judges `importlib.import_module`, for fresh and already-loaded modules."""
    guard = armed(imports={"allow": ["importlib"]})
    assert (
        attempt(guard, "import importlib\nresult = importlib.import_module('socket')")
        == "ImportDenied"
    )
    body = "import importlib\nresult = importlib.import_module('.minidom', 'xml.dom')"
    assert attempt(guard, body) == "ImportDenied"
    assert guard.denials()[-1].target == "xml.dom.minidom"


def test_a_displaced_finder_is_put_back_before_the_next_import(
    armed: Callable[..., Any], packages: Path
) -> None:
    """It moves the finder back to `sys.meta_path[0]` when another finder overtook it."""
    guard = armed(imports={"allow": ["sys", "granted_pkg"]})

    class Overtaker:
        def find_spec(self, *args: Any) -> None:
            return None

    sys.meta_path.insert(0, Overtaker())
    sys.meta_path.remove(_imports.finder())
    assert attempt(guard, "import granted_pkg\nresult = 'ok'") == "ok"
    assert sys.meta_path[0] is _imports.finder()
    assert guard.guards.tamper_check() == []
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, Overtaker)]


def test_the_finder_judges_imports_that_bypass_the_user_import(armed: Callable[..., Any]) -> None:
    """It denies a fresh module imported through the real `builtins.__import__`."""
    guard = armed(imports={"allow": ["builtins"]})
    sys.modules.pop("xml.dom.minidom", None)
    body = "import builtins\nresult = builtins.__import__('xml.dom.minidom')"
    assert attempt(guard, body) == "ImportDenied"


@pytest.mark.slow
def test_frameworks_and_a_wrapt_post_import_hook_leave_the_guard_deciding() -> None:
    """It still decides imports after langchain_core, httpx and wrapt load and wrapt
    registers a post-import hook (which inserts its own finder at sys.meta_path[0])."""
    policy = Policy(
        name="frameworks",
        imports={"allow": ["langchain_core", "httpx", "wrapt", "sys", "importlib", "json"]},
        limits={"wall_seconds": 60},
        code={"enabled": False},
    )
    code = textwrap.dedent(
        """
        import sys, importlib, langchain_core, httpx, wrapt
        wrapt.register_post_import_hook(lambda module: None, "csv")
        sys.meta_path.insert(0, wrapt.importer.ImportHookFinder())
        overtaken = type(sys.meta_path[0]).__name__
        import json.tool  # a fresh, allowed import: the audit hook puts the guard back first
        head = type(sys.meta_path[0]).__name__
        try:
            importlib.import_module("xml.dom.minidom")
            outcome = "imported"
        except ModuleNotFoundError:
            outcome = "refused"
        try:
            import csv
            csv_outcome = "imported"
        except ModuleNotFoundError:
            csv_outcome = "refused"
        [overtaken, head, outcome, csv_outcome]
        """
    )
    with Sandbox(policy, warm=0) as sb:
        result = sb.run(code)
    assert result.error is None, result.error
    overtaken, head, outcome, csv_outcome = result.value
    assert overtaken == "ImportHookFinder"
    assert head == "GuardFinder"
    assert outcome == "refused" and csv_outcome == "refused"
    assert {d.target for d in result.denials} == {"xml.dom.minidom", "csv"}
