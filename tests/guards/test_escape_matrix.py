"""The escape matrix, end to end in real workers: one test per attack, judged by effects.

Rows the Python layer blocks pass; rows it cannot block by design are strict xfails that
say why (closing one fails the suite, and docs/guards.md must change with it). The code
layer is switched off here so each row measures the guards alone; docs/guards.md says which
other layer (code layer, OS provider) stops each row too.
"""

from __future__ import annotations

import os
import pickle
import socket
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox

CANARY = "canary-matrix-3c7e"
ALLOWED = [
    "os", "sys", "io", "socket", "_socket", "subprocess", "ctypes", "pickle", "_pickle",
    "importlib", "threading", "pathlib", "json", "gc",
]  # fmt: skip


@pytest.fixture(scope="module")
def secret_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("matrix-secret")
    (folder / "canary.txt").write_text(CANARY)
    return folder


@pytest.fixture(scope="module")
def session(secret_dir: Path) -> Iterator[Any]:
    """One worker under a policy that imports a lot but grants no file, network or call.

    The matrix measures the Python layer alone, so it runs under the explicit opt-out from
    a kernel boundary (a kernel provider would stop several rows on its own).
    """
    policy = Policy(
        name="matrix",
        provider="subprocess",
        no_kernel_boundary="accepted",
        imports={"allow": ALLOWED},
        code={"enabled": False},
        limits={"wall_seconds": 20},
    )
    sb = Sandbox(policy, warm=0)
    try:
        with sb.session("matrix") as s:
            s.run(f"SECRET = {str(secret_dir / 'canary.txt')!r}\nSECRET_DIR = {str(secret_dir)!r}")
            yield s
    finally:
        sb.close()


def run(session: Any, code: str) -> Any:
    return session.run(textwrap.dedent(code))


def leaked(result: Any) -> bool:
    return CANARY in repr(result.value) + result.stdout + result.stderr


# -- 1. read or write a file outside the policy -------------------------------------------------


def test_blocks_reading_a_secret_file(session: Any) -> None:
    """It denies reading a file outside `files.read`."""
    result = run(session, "open(SECRET).read()")
    assert not leaked(result) and result.error and result.error.rule == "files.read"


def test_blocks_writing_outside_scratch(session: Any, secret_dir: Path) -> None:
    """It denies creating a file outside the scratch directory."""
    run(session, "open(SECRET_DIR + '/planted.txt', 'w').write('x')")
    assert not (secret_dir / "planted.txt").exists()


def test_blocks_symlink_swap(session: Any) -> None:
    """It denies a read through a link planted in scratch (decided on the resolved path)."""
    result = run(
        session,
        """
        import os
        if os.path.lexists('swap'):
            os.remove('swap')
        os.symlink(SECRET_DIR, 'swap')
        open('swap/canary.txt').read()
        """,
    )
    assert not leaked(result) and result.error and result.error.rule == "files.read"


# -- 2. open a socket or exfiltrate ------------------------------------------------------------


def test_blocks_exfiltration_to_a_loopback_listener(session: Any) -> None:
    """It denies a connect no rule allows; the listener receives nothing."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = run(
            session, f"import socket\nsocket.create_connection(('127.0.0.1', {port})).sendall(b'x')"
        )
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.error and result.error.rule == "net.connect"


def test_blocks_dns_lookup_of_an_unlisted_host(session: Any) -> None:
    """It denies resolving a name no rule names (no DNS query is made)."""
    result = run(session, "import socket\nsocket.getaddrinfo('exfil.example.com', 443)")
    assert result.error and result.error.rule == "net.resolve"


# -- 3. execute a process or native code -------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['touch', MARKER])",
        "import os\nos.system('touch ' + MARKER)",
        "import os\nos.execv('/usr/bin/touch', ['touch', MARKER])",
        "import ctypes\nctypes.CDLL('libc.so.6').system(('touch ' + MARKER).encode())",
    ],
)
def test_blocks_process_and_native_execution(session: Any, tmp_path: Path, code: str) -> None:
    """It denies process execution and loading libc; the marker is never created."""
    marker = tmp_path / "marker"
    result = run(session, f"MARKER = {str(marker)!r}\n{code}")
    assert not marker.exists()
    assert result.error and result.error.rule in ("api.process-exec", "api.native-code")


# -- 4. read a secret --------------------------------------------------------------------------


def test_blocks_reading_a_host_secret_variable(session: Any) -> None:
    """It denies a host variable the policy does not pass, by name."""
    os.environ.setdefault("AGENT_SANDBOX_TEST_CANARY", "canary-7f3a9c1e")
    result = run(session, "import os\nos.environ['AGENT_SANDBOX_TEST_CANARY']")
    assert "canary-7f3a9c1e" not in repr(result.value)
    assert result.error and result.error.rule == "env"


# -- 5. import a forbidden module --------------------------------------------------------------


def test_blocks_importing_a_module_the_worker_already_loaded() -> None:
    """It denies `import socket` under pure-computation although the transport loaded it."""
    with Sandbox("pure-computation", warm=0) as sb:
        result = sb.run("import socket\nsocket.socket")
    assert result.error and result.error.rule == "imports"


def test_blocks_relative_import_into_the_worker(session: Any) -> None:
    """It judges a relative import by its absolute name."""
    result = run(session, "__package__ = 'agent_sandbox._worker'\nfrom . import audit\naudit")
    assert result.error and result.error.rule == "imports"
    run(session, "__package__ = None")


# -- 6. disarm the guard or reach an original ---------------------------------------------------


def test_replacing_a_wrapper_is_reported_and_the_worker_discarded() -> None:
    """It reports `guard.tampered` and replaces the worker after a wrapper is swapped."""
    policy = Policy(name="tamper", imports={"allow": ["os"]}, code={"enabled": False})
    with Sandbox(policy, warm=0) as sb, sb.session("t") as s:
        first = s.run("import os\nos.stat = lambda *a, **k: None\nmarker = 1")
        second = s.run("'marker' in globals()")
    assert "guard.tampered" in [d.rule for d in first.denials]
    assert second.worker_id != first.worker_id and second.value is False


def test_removing_the_import_finder_leaves_the_next_import_guarded(session: Any) -> None:
    """It puts the finder back before the next import when user code removed it."""
    result = run(
        session,
        """
        import sys, importlib
        sys.meta_path[:] = [f for f in sys.meta_path if 'agent_sandbox' not in repr(f)]
        import json.tool
        try:
            __import__('sys').modules['builtins'].__import__('xml.dom.minidom')
            outcome = 'imported'
        except ModuleNotFoundError:
            outcome = 'refused'
        [outcome, repr(sys.meta_path[0])]
        """,
    )
    assert result.value == ["refused", "<agent_sandbox import guard>"]


def test_blocks_reading_the_fast_imports_state_through_gc_referents(session: Any) -> None:
    """It denies `gc.get_referents(__import__)`: the C fast import has no attributes, and the
    collector's view of it (its slow path, allowed names, module table) is refused."""
    result = run(session, "import gc\n[type(o).__name__ for o in gc.get_referents(__import__)]")
    assert result.value is None
    assert result.error and result.error.rule == "api.introspection"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="by design: the class hierarchy hands out the immutable C type _io.FileIO, whose "
    "constructor cannot be patched (the code layer refuses __subclasses__, the OS layer "
    "holds the file system)",
)
def test_escape_with_the_class_hierarchy_walk(session: Any) -> None:
    """It denies reading a file through a class found by walking object.__subclasses__()."""
    result = run(
        session,
        """
        fileio = [c for c in object.__subclasses__() if c.__name__ == '_IOBase'][0]
        fileio = [c for c in fileio.__subclasses__() if c.__name__ == '_RawIOBase'][0]
        fileio = [c for c in fileio.__subclasses__() if c.__name__ == 'FileIO'][0]
        fileio(SECRET).read().decode()
        """,
    )
    assert not leaked(result)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="by design: every wrapper keeps its original (__wrapped__); hiding it would not "
    "survive introspection (the OS layer is the boundary)",
)
def test_escape_with_a_wrappers_closure_original(session: Any, tmp_path: Path) -> None:
    """It denies running a process through the original kept by the os.system wrapper."""
    marker = tmp_path / "marker"
    run(session, f"import os\nos.system.__wrapped__('touch {marker}')")
    assert not marker.exists()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="by design: ctypes.pythonapi is a handle on the whole process, created when ctypes "
    "is imported; its symbols (libc's system) are looked up without a patchable call",
)
def test_escape_with_ctypes_pythonapi(session: Any, tmp_path: Path) -> None:
    """It denies calling libc's system through ctypes.pythonapi."""
    marker = tmp_path / "marker"
    run(session, f"import ctypes\nctypes.pythonapi.system(b'touch {marker}')")
    assert not marker.exists()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="by design: pickle.Unpickler is the immutable C type _pickle.Unpickler; its load "
    "cannot be patched without breaking the subclassing restricted unpicklers need",
)
def test_escape_with_the_unpickler_c_type(session: Any) -> None:
    """It denies deserialization through pickle.Unpickler(...).load()."""
    payload = pickle.dumps({"loaded": CANARY})
    result = run(session, f"import io, pickle\npickle.Unpickler(io.BytesIO({payload!r})).load()")
    assert not leaked(result)


def test_blocks_taking_a_forbidden_module_from_the_module_table(session: Any) -> None:
    """It judges a module taken from `sys.modules` (through the view of an allowed `sys`)
    like an import of it: selectors, loaded by the worker's transport, is refused."""
    result = run(session, "import sys\nsys.modules['selectors'].__name__")
    assert result.value != "selectors"
    assert result.error and result.error.rule == "imports"
    assert [d.target for d in result.denials] == ["selectors"]


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="by design: user code is told from library code by its code object's file name, "
    "and a code object can be rebuilt under any name (the code layer refuses __code__)",
)
def test_escape_by_spoofing_a_library_file_name(session: Any) -> None:
    """It denies frame introspection from user code that renamed its code object."""
    result = run(
        session,
        """
        import sys, json
        code = (lambda: sys._getframe(0)).__code__.replace(co_filename=json.__file__)
        type(lambda: 0)(code, globals())().f_code.co_name
        """,
    )
    assert result.value != "<lambda>"


# -- 7. mutate the rules -----------------------------------------------------------------------


def test_blocks_rewriting_the_policy_file(tmp_path: Path) -> None:
    """It denies writing the policy file although its folder is writable."""
    policy_file = tmp_path / "tool.toml"
    text = f'name = "tool"\n[files]\nwrite = ["{tmp_path}"]\n[code]\nenabled = false\n'
    policy_file.write_text(text)
    with Sandbox(str(policy_file), warm=0) as sb:
        result = sb.run(f"open({str(policy_file)!r}, 'a').write('[api]')")
    assert policy_file.read_text() == text
    assert result.error and result.error.rule == "files.write"


def test_blocks_reaching_the_compiled_rules_through_the_module_table(session: Any) -> None:
    """It refuses the guards' own modules through `sys.modules` (they are not allowed)."""
    result = run(
        session,
        """
        import sys
        files = sys.modules['agent_sandbox.guards._files']
        files._rules.read.prefixes += ('/',)
        open(SECRET).read()
        """,
    )
    assert not leaked(result)
    assert result.error and result.error.rule == "imports"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="by design: the compiled rules are plain Python objects in the worker's memory; a "
    "wrapper's function globals (__globals__, refused by the code layer) still lead to them, "
    "and changing them is not counted the way the arming flag is (the OS layer holds)",
)
def test_escape_by_mutating_the_compiled_rules(session: Any) -> None:
    """It denies a read after user code widened the compiled file rules."""
    result = run(
        session,
        """
        files = open._self_wrapper.__globals__
        files['_rules'].read.prefixes += ('/',)
        files['_decisions'].clear()
        for table in files['_fast'].values():
            table.clear()
        open(SECRET).read()
        """,
    )
    assert not leaked(result)


# -- 8. attack the channel between parent and worker -------------------------------------------


def test_blocks_connecting_to_the_workers_control_socket(session: Any) -> None:
    """It denies connecting to the worker's own control socket (file rules on its path)."""
    result = run(
        session,
        """
        import os, socket
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.path.join(os.path.dirname(os.getcwd()), 'ctl.sock'))
        """,
    )
    assert result.error and result.error.rule == "files.write"


def test_blocks_reading_the_worker_log(session: Any) -> None:
    """It denies reading the worker's log in the control directory."""
    result = run(
        session, "import os\nopen(os.path.join(os.path.dirname(os.getcwd()), 'worker.log')).read()"
    )
    assert result.error and result.error.rule == "files.read"


def test_the_token_is_not_in_the_environment_or_argv(session: Any) -> None:
    """It keeps the per-worker token out of what user code can read directly."""
    result = run(session, "import os, sys\n[sorted(os.environ), sys.argv]")
    names, argv = result.value
    assert not any("TOKEN" in n.upper() for n in names)
    assert len(argv) == 2 and argv[1].isdigit()


# -- 9. poison learning mode --------------------------------------------------------------------


def test_learning_records_the_resolved_target_of_a_planted_link(secret_dir: Path) -> None:
    """It records the real target of a link planted in scratch, not the innocent link path."""
    policy = Policy(name="learn", mode="learn", imports={"allow": ["os"]}, code={"enabled": False})
    with Sandbox(policy, warm=0) as sb:
        result = sb.run(
            f"import os\nos.symlink({str(secret_dir)!r}, 'innocent')\nopen('innocent/canary.txt').read()"
        )
    targets = {d.target for d in result.denials if d.rule == "files.read"}
    assert str(secret_dir / "canary.txt") in targets
    assert all(d.learned for d in result.denials)


def test_learning_mode_never_widens_the_policy(secret_dir: Path) -> None:
    """It leaves the policy as it was: an enforcing run afterwards still denies."""
    learn = Policy(name="learn2", mode="learn", code={"enabled": False})
    before = learn.fingerprint()
    with Sandbox(learn, warm=0) as sb:
        sb.run(f"open({str(secret_dir / 'canary.txt')!r}).read()")
    assert learn.fingerprint() == before
    with Sandbox(learn.merged({"mode": "enforce"}), warm=0) as sb:
        result = sb.run(f"open({str(secret_dir / 'canary.txt')!r}).read()")
    assert not leaked(result) and result.error and result.error.rule == "files.read"


# -- pickle ------------------------------------------------------------------------------------


def test_blocks_a_hostile_pickle(session: Any, tmp_path: Path) -> None:
    """It denies pickle.loads of a stream that would run os.system."""
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        payload = pickle.dumps(Payload())
    result = run(session, f"import pickle\npickle.loads({payload!r})")
    assert not marker.exists()
    assert result.error and result.error.rule == "api.deserialization"
