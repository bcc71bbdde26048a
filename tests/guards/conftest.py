"""Fixtures for the guard tests.

`armed(...)` installs the guards in this test process for one policy and returns a harness
whose `run(code)` executes `code` as a user cell (file name `<cell-N>`) inside `arming()`;
the guards are always uninstalled afterwards, so global state is restored. End-to-end rows
use real workers through `Sandbox` (closed by the fixtures).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._denial import Denial
from agent_sandbox._host.launch import import_roots, package_dirs
from agent_sandbox._worker import audit
from agent_sandbox.guards._install import Guards, install_guards


class Harness:
    """Guards installed in-process for one policy; `run()` executes code as user code."""

    def __init__(self, policy: Policy, scratch: str) -> None:
        self.policy = policy
        self.scratch = scratch
        self.namespace: dict[str, Any] = {"__name__": "__main__"}
        boot = {
            "policy": policy.to_wire(),
            "scratch": scratch,
            "sys_path": [*import_roots(), *(p for p in sys.path if p)],
            "package_dirs": package_dirs(),
            "host_env_names": sorted(os.environ),
        }
        self.calls = 0
        self.guards: Guards = install_guards(boot, self.namespace)

    def run(self, code: str) -> Any:
        """Execute `code` as a cell, armed; returns the namespace's `result` if set."""
        self.calls += 1
        compiled = compile(code, f"<cell-{self.calls}>", "exec", dont_inherit=True)
        audit.take()
        with self.guards.arming():
            exec(compiled, self.namespace)
        return self.namespace.get("result")

    def denials(self) -> list[Denial]:
        return audit.take()


@pytest.fixture
def armed() -> Iterator[Callable[..., Harness]]:
    """A factory: `armed(name=..., files=..., ...)` -> Harness; uninstalled at teardown."""
    made: list[Harness] = []
    scratch_dirs: list[str] = []
    saved_cwd = os.getcwd()

    def make(policy: Policy | None = None, **fields: Any) -> Harness:
        control = tempfile.mkdtemp(prefix="guard-test-")
        scratch = os.path.join(control, "scratch")
        os.mkdir(scratch)
        scratch_dirs.append(control)
        fields.setdefault("name", "guard-test")
        harness = Harness(policy if policy is not None else Policy(**fields), scratch)
        made.append(harness)
        return harness

    try:
        yield make
    finally:
        # Back to a directory that exists first: the test's own may be removed by now.
        os.chdir(saved_cwd)
        for harness in made:
            harness.guards.uninstall()
        audit.take()
        import shutil

        for control in scratch_dirs:
            shutil.rmtree(control, ignore_errors=True)


@pytest.fixture
def sandbox_factory() -> Iterator[Callable[..., Sandbox]]:
    """`sandbox_factory(policy)` -> Sandbox with no warm workers; all closed at teardown."""
    made: list[Sandbox] = []

    def make(policy: Policy | str) -> Sandbox:
        sb = Sandbox(policy, warm=0)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            sb.close()
