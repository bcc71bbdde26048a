"""What a worker starts from: current bytecode and import roots the parent chose.

Bytecode: workers run with `-B` inside read-only views, so they cannot write `__pycache__`,
and most of their modules are never imported by the parent. `package_dirs()` refreshes the
caches once per parent process; without that, each worker start compiled about a dozen
modules (`benchmarks/bench_providers.py` times the difference).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent_sandbox import Sandbox
from agent_sandbox._host.launch import BOOT_SCRIPT, import_roots, package_dirs, refresh_bytecode

# Imports a worker makes before its handshake (see `_worker.setup.prepare`).
WORKER_MODULES = [
    "agent_sandbox._worker.server",
    "agent_sandbox._worker.setup",
    "agent_sandbox.guards._install",
    "agent_sandbox.guards._code_budget",
    "agent_sandbox._worker._inworker",
]

_CHILD = """
import importlib.machinery, importlib.util, json, sys
boot_script, dirs, modules = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path[:] = json.loads(sys.argv[4])
spec = importlib.util.spec_from_file_location("worker_boot", boot_script)
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
boot._map_packages(dirs)
compiled = []
original = importlib.machinery.SourceFileLoader.source_to_code
def recording(self, data, path, *args, **kwargs):
    compiled.append(path)
    return original(self, data, path, *args, **kwargs)
importlib.machinery.SourceFileLoader.source_to_code = recording
for name in modules:
    importlib.import_module(name)
print(json.dumps(compiled))
"""


def _pyc_is_current(source: Path) -> bool:
    cached = Path(importlib.util.cache_from_source(str(source), optimization=""))
    if not cached.exists():
        return False
    header = cached.read_bytes()[:16]
    flags = int.from_bytes(header[4:8], "little")
    if flags:  # hash-based: current by construction of compileall
        return True
    return int.from_bytes(header[8:12], "little") == int(source.stat().st_mtime) & 0xFFFFFFFF


def test_package_dirs_leaves_every_worker_module_with_current_bytecode(tmp_path: Path) -> None:
    # A copy of the packages without any cache, as in a fresh clone.
    copies = {}
    for name, folder in package_dirs().items():
        dest = tmp_path / name
        shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        copies[name] = str(dest)
    assert not any(_pyc_is_current(p) for d in copies.values() for p in Path(d).rglob("*.py"))
    refresh_bytecode(tuple(sorted(copies.values())))
    stale = [
        str(p) for d in copies.values() for p in Path(d).rglob("*.py") if not _pyc_is_current(p)
    ]
    assert stale == []


def test_worker_start_up_imports_compile_nothing_from_source() -> None:
    dirs = package_dirs()
    child = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-B",
            "-c",
            _CHILD,
            BOOT_SCRIPT,
            json.dumps(dirs),
            json.dumps(WORKER_MODULES),
            json.dumps(list(import_roots())),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    compiled = json.loads(child.stdout)
    ours = [p for p in compiled if any(p.startswith(d + os.sep) for d in dirs.values())]
    assert ours == []


def test_import_roots_leave_out_directories_everyone_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It never hands the worker a shared directory such as /tmp (a parent script there)."""
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    private.mkdir(mode=0o755)
    monkeypatch.setattr(sys, "path", [*sys.path, str(shared), str(private)])
    roots = import_roots()
    assert str(private) in roots
    assert str(shared) not in roots


def test_a_refreshed_folder_is_stamped_and_a_changed_source_is_compiled_again(
    tmp_path: Path,
) -> None:
    """It stamps a folder whose caches are all current (a later process checks one `stat`
    per source), and a source changed after the stamp gets its cache compiled again."""
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "a.py").write_text("A = 1\n")
    (folder / "b.py").write_text("B = 2\n")
    refresh_bytecode.__wrapped__((str(folder),))
    stamps = list((folder / "__pycache__").glob("agent-sandbox-fresh.*.stamp"))
    assert len(stamps) == 1
    assert _pyc_is_current(folder / "a.py") and _pyc_is_current(folder / "b.py")
    (folder / "a.py").write_text("A = 'changed'\n")
    os.utime(folder / "a.py", ns=(0, 10**18))
    assert not _pyc_is_current(folder / "a.py")
    refresh_bytecode.__wrapped__((str(folder),))
    assert _pyc_is_current(folder / "a.py")


#: What a worker's start must not import (issue 19: a from-scratch start within 4x a bare
#: interpreter): `typing` (annotations only, under TYPE_CHECKING), `dataclasses` with
#: `inspect`, `dis` and `copy` under it (the worker's values are written over __slots__).
_NOT_AT_START = {"typing", "dataclasses", "inspect", "dis", "copy"}


def test_a_worker_start_and_first_call_import_no_typing_nor_dataclasses(
    sandbox: Sandbox,
) -> None:
    """It starts a worker under the default provider and lists, in its first call, the
    modules loaded: none of the ones the start-up does without."""
    result = sandbox.run("import sys\nsorted(sys.modules)")
    assert result.ok, result.error
    loaded = set(result.value)
    assert "agent_sandbox.guards._install" in loaded  # (the list is the worker's own)
    assert not _NOT_AT_START & loaded


_LIFE_CHILD = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("worker_boot", sys.argv[1])
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
boot._die_with_agent(int(sys.argv[2]))
signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
os.write(1, b"armed\\n")
while True:
    pass
"""


def _on_a_life_line(read_end: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LIFE_CHILD, BOOT_SCRIPT, str(read_end)],
        pass_fds=(read_end,),
        stdout=subprocess.PIPE,
    )
    os.close(read_end)
    return proc


def test_a_worker_on_a_life_line_ends_when_the_agents_end_closes() -> None:
    """It SIGKILLs a worker whose code never yields and blocks every signal it may, when
    the only write end of its life line closes (the agent gone, however it died: the kernel
    sends the signal, nothing in the worker runs for it); a worker whose agent was gone
    before it armed the line exits at once."""
    import signal

    read_end, write_end = os.pipe()
    proc = _on_a_life_line(read_end)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"armed\n"
        os.close(write_end)
        write_end = -1
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if write_end >= 0:
            os.close(write_end)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    read_end, write_end = os.pipe()
    os.close(write_end)
    proc = _on_a_life_line(read_end)
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (1, b"")


# Blocks every signal, then never returns: a sleep, not a Python loop, which the code
# layer's iteration budget (10 M) would end first on a fast interpreter (Debian's 3.11 runs
# 10 M iterations in about 0.45 s, inside the 0.5 s backstop below).
_NEVER_YIELDS = (
    "import signal, time\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\n"
    "print('looping', flush=True)\n"
    "time.sleep(3600)\n"
)


def test_a_call_no_host_ends_is_ended_by_the_workers_backstop() -> None:
    """It SIGKILLs the worker from inside (a kernel timer armed for the call) once a call
    outlives the time its request names (`backstop`: the wall limit left plus a grace),
    with nothing from the host: the host's client waits on, as a host that is gone or stuck
    would; the code never yields and blocks every signal."""
    import signal
    import threading
    import time

    from agent_sandbox import Policy, TransportError
    from agent_sandbox._host.process import WorkerProcess
    from agent_sandbox.providers._subprocess import SubprocessProvider

    w = WorkerProcess.start(
        Policy(name="t", imports={"allow": ["signal", "time"]}), SubprocessProvider()
    )
    try:
        assert w.client is not None and w.proc is not None
        looping = threading.Event()
        failures: list[BaseException] = []

        def call() -> None:
            body = {"code": _NEVER_YIELDS, "backstop": 0.5}
            deadline = time.monotonic() + 120  # (a hang guard only)
            try:
                w.client._exchange(  # type: ignore[union-attr]
                    "POST", "/run", body, deadline, lambda *e: looping.set()
                )
            except (TransportError, OSError) as exc:
                failures.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        assert looping.wait(60), "the call did not start"
        assert w.proc.wait(timeout=120) == -signal.SIGKILL
        caller.join(60)
        assert failures, "the call ended as if answered"
    finally:
        w.kill()
