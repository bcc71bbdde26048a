"""Peers measured beside agent_sandbox in the same run, when they are installed.

* smolagents' `LocalPythonExecutor`: an AST interpreter in the caller's process (no process
  or kernel boundary);
* langchain's Python REPL (`langchain_experimental.utilities.PythonREPL`): `exec` in the
  caller's process;
* pysandboxes: a `@sandbox` function called in its sandbox process (partial mode), under a
  rules file written here (the function's directory read-only, its module importable,
  `os-sandbox=<provider>`).

None of them is a dependency of agent_sandbox: `pip install -e '.[bench]'` installs them in a
development environment. A peer that is not installed is skipped with a message saying how to
install it; one that fails is reported and skipped.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator

PEER_MODULE = "bench_peer_fn"
PEER_SOURCE = "from pysandboxes import sandbox\n\n\n@sandbox\ndef two():\n    return 1 + 1\n"


def skipped(peer: str, package: str) -> str:
    return (
        f"  (peer {peer}: {package} is not installed; `pip install {package}` or "
        "`pip install -e '.[bench]'` to measure it)"
    )


def smolagents_call() -> Callable[[], object] | None:
    """`1+1` through one warm `LocalPythonExecutor`; None when smolagents is missing."""
    try:
        from smolagents.local_python_executor import LocalPythonExecutor
    except ImportError:
        print(skipped("smolagents", "smolagents"))
        return None
    executor = LocalPythonExecutor(additional_authorized_imports=[])
    executor.send_tools({})
    return lambda: executor("1+1")


def langchain_repl_call() -> Callable[[], object] | None:
    """`print(1+1)` through one `PythonREPL`; None when langchain-experimental is missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from langchain_experimental.utilities import PythonREPL
    except ImportError:
        print(skipped("langchain REPL", "langchain-experimental"))
        return None
    repl = PythonREPL()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        repl.run("0")  # its one-time warning
    return lambda: repl.run("print(1+1)")


def pysandboxes_dir(provider: str) -> str | None:
    """A temporary directory holding the peer's module and rules file (the caller removes
    it); None when pysandboxes is missing."""
    try:
        import pysandboxes  # noqa: F401
    except ImportError:
        print(skipped("pysandboxes", "pysandboxes"))
        return None
    work = tempfile.mkdtemp(prefix="bench-pysandboxes-")
    with open(os.path.join(work, f"{PEER_MODULE}.py"), "w") as fh:
        fh.write(PEER_SOURCE)
    with open(os.path.join(work, ".py-sandboxes"), "w") as fh:
        fh.write(
            f"expose-ro=.\npython-import={PEER_MODULE}\npy-sandbox=true\nos-sandbox={provider}\n"
        )
    return work


#: A fresh process's first result through pysandboxes (run with the directory as cwd).
PYSANDBOXES_FIRST_RESULT = (
    "import sys\n"
    "sys.path.insert(0, '')\n"
    "from pysandboxes import sandboxes\n"
    f"import {PEER_MODULE}\n"
    "with sandboxes():\n"
    f"    assert {PEER_MODULE}.two() == 2\n"
)


@contextlib.contextmanager
def pysandboxes_call(provider: str = "landlock") -> Iterator[Callable[[], object] | None]:
    """A warm `@sandbox` call returning 1+1 inside `with sandboxes()`; None when pysandboxes
    is missing or fails to start."""
    work = pysandboxes_dir(provider)
    if work is None:
        yield None
        return
    old_cwd = os.getcwd()
    os.chdir(work)
    sys.path.insert(0, work)
    # Its daemon's shutdown logs an assertion from a background task, after the block ends:
    # not ours to report (asyncio's log stays quiet for the rest of the benchmark).
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    try:
        from pysandboxes import sandboxes

        module = importlib.import_module(PEER_MODULE)
        with sandboxes():
            try:
                assert module.two() == 2
            except Exception as exc:
                print(f"  (peer pysandboxes: failed: {type(exc).__name__}: {exc})"[:200])
                yield None
                return
            yield module.two
    finally:
        os.chdir(old_cwd)
        with contextlib.suppress(ValueError):
            sys.path.remove(work)
        sys.modules.pop(PEER_MODULE, None)
        shutil.rmtree(work, ignore_errors=True)
