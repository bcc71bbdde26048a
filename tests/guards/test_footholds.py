"""The escape matrix, continued: the footholds of issue 12, end to end in real workers.

Each attack runs twice: under the explicit `subprocess` opt-out, where the Python layer is
the only layer, and under the default provider (a kernel boundary on this machine); the
verdict asserted is the Python layer's or the host's own (the rule named), so the tests
measure those layers, not the kernel's. The code layer is switched off except where the
attack is the issue's own, under a shipped preset. Rows the layers cannot close are strict
xfails with the reason; docs/guards.md lists each row.
"""

from __future__ import annotations

import re
import sqlite3
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox.policies import resolve_policy

CANARY = "canary-foothold-5d1b"

#: The explicit opt-out (the Python layer alone) and the default provider (no key).
OPT_OUT = {"provider": "subprocess", "no_kernel_boundary": "accepted"}
PROVIDERS = [
    pytest.param(OPT_OUT, id="subprocess-opt-out"),
    pytest.param({}, id="default"),
]


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder outside every policy here, with a canary file and a canary database."""
    folder = tmp_path_factory.mktemp("foothold-secret")
    (folder / "canary.txt").write_text(CANARY)
    connection = sqlite3.connect(folder / "canary.db")
    with connection:
        connection.execute("create table s(x)")
        connection.execute("insert into s values (?)", (CANARY,))
    connection.close()
    return folder


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(request.param)


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    made: list[Sandbox] = []
    try:
        yield made
    finally:
        for sb in made:
            sb.close()


def sandbox(made: list[Sandbox], provider: dict[str, Any], **fields: Any) -> Sandbox:
    fields.setdefault("name", "foothold")
    fields.setdefault("code", {"enabled": False})
    fields.setdefault("limits", {"wall_seconds": 30})
    sb = Sandbox(Policy(**provider, **fields), warm=0)
    made.append(sb)
    return sb


def run(target: Any, code: str) -> Any:
    """Run `code` (dedented) on a Sandbox or a session."""
    return target.run(textwrap.dedent(code))


def leaked(result: Any) -> bool:
    return CANARY in repr(result.value) + result.stdout + result.stderr


def by_the_authorizer(result: Any) -> bool:
    """Whether SQLite's authorizer (the file guard's) refused the statement: SQLite says
    `not authorized` (`authorization denied` for VACUUM INTO); a file the kernel kept from
    SQLite says `unable to open database`, so a kernel denial is never credited to the
    Python layer."""
    error = result.error
    return (
        error is not None
        and error.type == "sqlite3.DatabaseError"
        and error.message in ("not authorized", "authorization denied")
    )


def refused_imports(result: Any) -> list[str]:
    return [d.target for d in result.denials if d.rule == "imports" and not d.internal]


# -- a module reached as an attribute of an allowed module --------------------------------------


PURE = {"allow": ["typing", "random", "json", "math", "collections"]}


def test_blocks_typing_sys_foothold(sandboxes: list[Sandbox], provider: dict[str, Any]) -> None:
    """It judges `typing.sys` like `import sys`: refused where `sys` is not allowed."""
    result = run(sandbox(sandboxes, provider, imports=PURE), "import typing\ntyping.sys.modules")
    assert result.value is None
    assert result.error and result.error.rule == "imports"
    assert refused_imports(result) == ["sys"]
    assert "typing.sys" in result.denials[0].detail


def test_blocks_random_os_foothold(sandboxes: list[Sandbox], provider: dict[str, Any]) -> None:
    """It judges `random._os` like `import os`."""
    result = run(sandbox(sandboxes, provider, imports=PURE), "import random\nrandom._os.getcwd()")
    assert result.error and result.error.rule == "imports"
    assert refused_imports(result) == ["os"]


def test_blocks_os_sys_foothold(sandboxes: list[Sandbox], provider: dict[str, Any]) -> None:
    """It judges `os.sys` like `import sys` although `os` itself is allowed."""
    sb = sandbox(sandboxes, provider, imports={"allow": ["os"]})
    result = run(sb, "import os\nos.sys.modules")
    assert result.error and result.error.rule == "imports"
    assert refused_imports(result) == ["sys"]


def test_blocks_numpy_ctypeslib_ctypes_foothold(
    sandboxes: list[Sandbox], provider: dict[str, Any]
) -> None:
    """It judges `numpy.ctypeslib.ctypes` like `import ctypes` (numpy.* stays allowed)."""
    pytest.importorskip("numpy")
    sb = sandbox(sandboxes, provider, imports={"allow": ["numpy"]})
    result = run(sb, "import numpy\nnumpy.ctypeslib.ctypes.CDLL")
    assert result.error and result.error.rule == "imports"
    assert refused_imports(result) == ["ctypes"]


def test_blocks_the_foothold_through_vars_and_dir(
    sandboxes: list[Sandbox], provider: dict[str, Any]
) -> None:
    """It leaves refused modules out of `vars()` and `dir()` of an allowed module."""
    sb = sandbox(sandboxes, provider, imports=PURE)
    result = run(
        sb, "import typing\n['sys' in vars(typing), 'sys' in dir(typing), 'List' in vars(typing)]"
    )
    assert result.value == [False, False, True]


def test_allowed_modules_reached_as_attributes_stay_usable(
    sandboxes: list[Sandbox], provider: dict[str, Any]
) -> None:
    """It leaves a package's own submodules and allowed modules usable as before."""
    pytest.importorskip("numpy")
    sb = sandbox(sandboxes, provider, imports={"allow": ["os", "numpy", "json", "importlib"]})
    result = run(
        sb,
        """
        import os, json, importlib
        import numpy as np
        from os import path
        import numpy.linalg as la
        json = importlib.reload(json)
        [os.path.join('a', 'b'), path.basename('/x/y'), float(la.norm([3, 4])),
         float(np.linalg.norm([6, 8])), json.dumps([1]), type(np).__name__ != 'module',
         isinstance(np, type(os))]
        """,
    )
    assert result.error is None, result.error
    assert result.value == ["a/b", "y", 5.0, 10.0, "[1]", True, True]
    assert refused_imports(result) == []


def test_blocks_the_issues_foothold_under_pure_computation(
    provider: dict[str, Any], secret: Path
) -> None:
    """It refuses the issue's own attack under the shipped preset (code layer on): an
    allowed module hands out `sys`, whose module table holds the guards' state."""
    policy = resolve_policy("pure-computation").merged(provider)
    with Sandbox(policy, warm=0) as sb:
        result = run(
            sb,
            f"""
            import typing
            sys = typing.sys
            state = sys.modules['agent_sandbox.guards._state'].state
            state.armed = False
            data = open({str(secret / "canary.txt")!r}).read()
            state.armed = True
            data
            """,
        )
    assert not leaked(result)
    assert result.error and result.error.rule == "imports"
    assert refused_imports(result) == ["sys"]


# -- the arming state, checked by the host -------------------------------------------------------

#: The guards' own package is granted here, so the arming state is within reach without any
#: foothold: what is measured is the host's count, not the import guard.
INTERNALS = {"allow": ["agent_sandbox.guards"]}


def test_catches_armed_flip_and_restore(
    sandboxes: list[Sandbox], provider: dict[str, Any], secret: Path
) -> None:
    """It catches the flag cleared and set back within one call, before the output is handed
    back: the call's output is withheld and the session's next call gets a fresh worker."""
    sb = sandbox(sandboxes, provider, imports=INTERNALS)
    with sb.session("s") as session:
        session.run("marker = 1")
        result = run(
            session,
            f"""
            from agent_sandbox.guards._state import state
            state.armed = False
            try:
                data = open({str(secret / "canary.txt")!r}).read()
            except OSError as exc:
                data = repr(exc)
            state.armed = True
            print(data)
            data
            """,
        )
        after = session.run("'marker' in globals()")
    assert not leaked(result)
    assert result.error and result.error.rule == "guard.tampered"
    # The code's clear and restore are two writes; the guards' own arming around the call adds
    # to the count (how many depends on timing), so the count is checked as a floor.
    written = re.search(r"written (\d+) times", result.error.message)
    assert written and int(written.group(1)) >= 2, result.error.message
    assert result.stdout == "" and result.value is None
    assert after.value is False and after.worker_id != result.worker_id


def test_catches_a_flag_left_off(
    sandboxes: list[Sandbox], provider: dict[str, Any], secret: Path
) -> None:
    """It catches the flag cleared and left off until the call ends."""
    sb = sandbox(sandboxes, provider, imports=INTERNALS)
    result = run(
        sb,
        f"""
        from agent_sandbox.guards._state import state
        state.armed = False
        print(open({str(secret / "canary.txt")!r}).read())
        """,
    )
    assert not leaked(result)
    assert result.error and result.error.rule == "guard.tampered"


def test_catches_replaced_tamper_check(
    sandboxes: list[Sandbox], provider: dict[str, Any], secret: Path
) -> None:
    """It catches a flip although user code replaced the worker's own tamper check and its
    disarming step: the host counts the writes itself."""
    sb = sandbox(sandboxes, provider, imports=INTERNALS)
    with sb.session("s") as session:
        result = run(
            session,
            f"""
            from agent_sandbox.guards import _install
            from agent_sandbox.guards._state import state
            _install.Guards.tamper_check = lambda self: []
            _install.Guards.exit = lambda self: None
            state.armed = False
            try:
                print(open({str(secret / "canary.txt")!r}).read())
            except OSError as exc:
                print(exc)
            """,
        )
        after = session.run("1")
    assert not leaked(result)
    assert result.error and result.error.rule == "guard.tampered"
    host = [d for d in result.denials if d.target == "the guards' arming state"]
    assert host and "the host read the worker's guard counter" in host[0].detail
    assert after.worker_id != result.worker_id


def test_catches_a_sealed_setting_written(
    sandboxes: list[Sandbox], provider: dict[str, Any]
) -> None:
    """It catches a write of a sealed setting (learning mode switched on from user code),
    even when the code swallows the refusal."""
    sb = sandbox(sandboxes, provider, imports=INTERNALS)
    result = run(
        sb,
        """
        from agent_sandbox.guards._state import state
        try:
            state.learn = True
        except AttributeError:
            pass
        'quiet'
        """,
    )
    assert result.error and result.error.rule == "guard.tampered"
    assert "sealed" in result.error.message and result.value is None


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="by design: a worker whose runner was replaced in an earlier call (here through "
    "frame attributes the code layer refuses) can make exactly the two counted writes the host "
    "expects and run the next call unguarded; the kernel boundary holds then",
)
def test_escape_by_replacing_the_runner(sandboxes: list[Sandbox], secret: Path) -> None:
    """It denies a read in the call after user code replaced the worker's runner."""
    sb = sandbox(sandboxes, OPT_OUT, imports={"allow": ["sys", *INTERNALS["allow"]]})
    with sb.session("s") as session:
        run(
            session,
            """
            import sys
            from agent_sandbox.guards._state import state
            try:
                1 / 0
            except ZeroDivisionError:
                frame = sys.exc_info()[2].tb_frame
            while frame is not None and not hasattr(frame.f_locals.get('self'), 'run_armed'):
                frame = frame.f_back
            runner = frame.f_locals['self']
            runner.run_armed = lambda fn, *a: (state.run_armed(lambda: None), fn(*a))[1]
            """,
        )
        result = session.run(f"open({str(secret / 'canary.txt')!r}).read()")
    assert not leaked(result)


# -- files the file guard did not see ------------------------------------------------------------

SQLITE = {"allow": ["sqlite3"]}


def test_blocks_sqlite_attach_read(
    sandboxes: list[Sandbox], provider: dict[str, Any], secret: Path
) -> None:
    """It refuses `ATTACH DATABASE` of a file outside the policy (SQLite's authorizer)."""
    result = run(
        sandbox(sandboxes, provider, imports=SQLITE),
        f"""
        import sqlite3
        db = sqlite3.connect(':memory:')
        db.execute("attach database '{secret / "canary.db"}' as other")
        db.execute('select x from other.s').fetchall()
        """,
    )
    assert not leaked(result)
    refused = [d for d in result.denials if d.rule.startswith("files.")]
    assert [d.target for d in refused] == [str(secret / "canary.db")]
    assert not refused[0].internal and not result.ok
    assert by_the_authorizer(result), result.error


def test_blocks_sqlite_vacuum_into_write(
    sandboxes: list[Sandbox], provider: dict[str, Any], tmp_path: Path
) -> None:
    """It refuses `VACUUM INTO` a file outside the policy; nothing is written."""
    target = tmp_path / "planted.db"
    result = run(
        sandbox(sandboxes, provider, imports=SQLITE),
        f"""
        import sqlite3
        db = sqlite3.connect(':memory:')
        db.execute('create table t(x)')
        db.execute("vacuum into '{target}'")
        """,
    )
    assert not target.exists()
    assert [d.rule for d in result.denials] == ["files.write"] and not result.ok
    assert by_the_authorizer(result), result.error


def test_blocks_sqlite_attach_after_the_authorizer_is_replaced(
    sandboxes: list[Sandbox], provider: dict[str, Any], secret: Path
) -> None:
    """It keeps judging ATTACH after user code sets or clears its own authorizer."""
    result = run(
        sandbox(sandboxes, provider, imports=SQLITE),
        f"""
        import sqlite3
        db = sqlite3.connect(':memory:')
        db.set_authorizer(None)
        db.set_authorizer(lambda *a: sqlite3.SQLITE_OK)
        db.execute("attach database '{secret / "canary.db"}' as other")
        db.execute('select x from other.s').fetchall()
        """,
    )
    assert not leaked(result)
    assert [d.rule for d in result.denials] == ["files.write"]
    assert by_the_authorizer(result), result.error


def test_blocks_sqlite_uri_read(
    sandboxes: list[Sandbox], provider: dict[str, Any], secret: Path
) -> None:
    """It judges a `file:` URI given to `sqlite3.connect` by the path inside it."""
    result = run(
        sandbox(sandboxes, provider, imports=SQLITE),
        f"""
        import sqlite3
        sqlite3.connect('file:{secret / "canary.db"}?mode=ro', uri=True).execute(
            'select x from s').fetchall()
        """,
    )
    assert not leaked(result)
    assert result.error and result.error.rule == "files.read"


def test_sqlite_in_scratch_still_works(sandboxes: list[Sandbox], provider: dict[str, Any]) -> None:
    """It lets SQLite attach and vacuum into files in the scratch directory."""
    result = run(
        sandbox(sandboxes, provider, imports=SQLITE),
        """
        import sqlite3
        db = sqlite3.connect('main.db')
        db.execute("attach database 'other.db' as other")
        db.execute('create table other.t(x)')
        db.execute("insert into other.t values (7)")
        db.commit()
        db.execute("vacuum into 'copy.db'")
        db.execute('select x from other.t').fetchall()
        """,
    )
    assert result.error is None, result.error
    assert result.value == [[7]] and result.denials == ()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="by design: the authorizer is set through the immutable C type's method, which "
    "user code can call directly on the connection to clear it (the OS layer holds the files)",
)
def test_escape_by_clearing_the_sqlite_authorizer_through_the_c_type(
    sandboxes: list[Sandbox], secret: Path
) -> None:
    """It denies ATTACH after `sqlite3.Connection.set_authorizer(db, None)`."""
    result = run(
        sandbox(sandboxes, OPT_OUT, imports=SQLITE),
        f"""
        import sqlite3
        db = sqlite3.connect(':memory:')
        sqlite3.Connection.set_authorizer(db, None)
        db.execute("attach database '{secret / "canary.db"}' as other")
        db.execute('select x from other.s').fetchall()
        """,
    )
    assert not leaked(result)


# -- modules imported again -------------------------------------------------------------------------


@pytest.mark.parametrize("popped", [["ctypes"], ["ctypes", "_ctypes"]], ids=["ctypes", "_ctypes"])
def test_blocks_reimporting_ctypes_to_skip_the_native_code_check(
    sandboxes: list[Sandbox], provider: dict[str, Any], tmp_path: Path, popped: list[str]
) -> None:
    """It patches a fresh `ctypes` (and `_ctypes`) before the import returns."""
    marker = tmp_path / "marker"
    sb = sandbox(sandboxes, provider, imports={"allow": ["sys", "ctypes", "_ctypes"]})
    result = run(
        sb,
        f"""
        import sys
        import ctypes
        for name in {popped!r}:
            del sys.modules[name]
        import ctypes
        ctypes.CDLL('libc.so.6').system(b'touch {marker}')
        """,
    )
    assert not marker.exists()
    assert result.error and result.error.rule == "api.native-code"


@pytest.mark.parametrize("opener", ["_io.open", "_io.FileIO", "_io.open_code"])
def test_blocks_reimporting_io_for_unguarded_files(
    sandboxes: list[Sandbox], provider: dict[str, Any], secret: Path, opener: str
) -> None:
    """It patches a fresh `_io` (an extension module imported again is built from the
    original functions) before the import returns."""
    sb = sandbox(sandboxes, provider, imports={"allow": ["sys", "_io"]})
    result = run(
        sb,
        f"""
        import sys
        del sys.modules['_io']
        import _io
        {opener}({str(secret / "canary.txt")!r}).read()
        """,
    )
    assert not leaked(result)
    assert result.error and result.error.rule == "files.read"
