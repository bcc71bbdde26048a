"""The gadget corpus: hostile pickles a worker could send as a result. Each must be refused
by the host's restricted unpickler before it runs anything.

The oracle is the effect: each gadget tries to create a canary file (or set a flag) in the
host; the file must not exist afterwards. An audit hook also records any import, process
start or exec during the decode.
"""

from __future__ import annotations

import copyreg
import functools
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    APPEND,
    BUILD,
    EMPTY_DICT,
    EMPTY_LIST,
    MARK,
    MEMOIZE,
    NEWOBJ,
    REDUCE,
    SETITEM,
    TUPLE,
    TUPLE1,
    TUPLE2,
    binget,
    g,
    i,
    s,
    stream,
)

from agent_sandbox import Policy, PolicyError
from agent_sandbox._errors import UnpickleRefused
from agent_sandbox._host.intake.unpickle import load_restricted
from agent_sandbox._host.intake.unpickle_classes import Allowlist
from agent_sandbox._host.intake.unpickle_prescan import Budgets

_EVENTS: list[str] | None = None
_WATCH = (
    "import",
    "os.system",
    "subprocess.Popen",
    "os.exec",
    "os.posix_spawn",
    "exec",
    "compile",
    "open",
)


def _hook(event: str, args: Any) -> None:
    if _EVENTS is not None and event in _WATCH:
        _EVENTS.append(event)


sys.addaudithook(_hook)


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "a gadget ran in the host"


def refused(data: bytes, allow: Allowlist | None = None, budgets: Budgets | None = None) -> str:
    """Decode `data`; assert it was refused with nothing imported, run or opened."""
    global _EVENTS
    _EVENTS = []
    try:
        with pytest.raises(UnpickleRefused) as info:
            load_restricted(data, allow or Allowlist(), budgets)
        events, _EVENTS = _EVENTS, None
    finally:
        _EVENTS = None
    assert events == [], f"the decoder caused {events}"
    return str(info.value)


class _Reduce:
    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def test_refuses_os_system_via_posix(canary: Path) -> None:
    """It denies `os.system`, which pickles under its C twin `posix.system`."""
    data = pickle.dumps(_Reduce(os.system, f"touch {canary}"), protocol=5)
    assert b"posix" in data
    assert "posix.system" in refused(data)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("posix", "system"),
        ("nt", "system"),
        ("os", "system"),
        ("os", "popen"),
        ("_posixsubprocess", "fork_exec"),
        ("subprocess", "Popen"),
        ("subprocess", "check_output"),
        ("_socket", "socket"),
        ("socket", "create_connection"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("builtins", "__import__"),
        ("builtins", "open"),
        ("builtins", "type"),
        ("__builtin__", "eval"),
        ("functools", "partial"),
        ("_functools", "reduce"),
        ("operator", "attrgetter"),
        ("_operator", "methodcaller"),
        ("copyreg", "_reconstructor"),
        ("pickle", "loads"),
        ("_pickle", "loads"),
        ("marshal", "loads"),
        ("ctypes", "CDLL"),
        ("importlib", "import_module"),
        ("runpy", "run_path"),
        ("sys", "modules"),
        ("types", "FunctionType"),
        ("codecs", "decode"),
        ("shutil", "rmtree"),
        ("webbrowser", "open"),
    ],
)
def test_refuses_named_gadget(module: str, name: str, canary: Path) -> None:
    """It denies every gadget global by name, each C twin included, before calling it."""
    data = stream(g(module, name), s(f"touch {canary}"), TUPLE1, REDUCE)
    assert f"{module}.{name}" in refused(data)


def test_refuses_getattr_import_os_system(canary: Path) -> None:
    """It denies `getattr(__import__('os'), 'system')('...')` built from opcodes."""
    data = stream(
        g("builtins", "getattr"),
        g("builtins", "__import__"),
        s("os"),
        TUPLE1,
        REDUCE,
        s("system"),
        TUPLE2,
        REDUCE,
        s(f"touch {canary}"),
        TUPLE1,
        REDUCE,
    )
    refused(data)


def test_refuses_functools_partial(canary: Path) -> None:
    """It denies a `functools.partial(os.system, ...)` value."""
    refused(pickle.dumps(functools.partial(os.system, f"touch {canary}"), protocol=5))


def test_refuses_subprocess_popen_value(canary: Path) -> None:
    """It denies a reduce to `subprocess.Popen`."""
    data = pickle.dumps(_Reduce(subprocess.Popen, ["touch", str(canary)]), protocol=5)
    assert "subprocess" in refused(data)


def test_refuses_reduce_chain_calling_a_built_object() -> None:
    """It denies a REDUCE whose callable is the result of an earlier REDUCE (a call chain)."""
    data = stream(g("builtins", "range"), i(3), TUPLE1, REDUCE, s("x"), TUPLE1, REDUCE)
    assert "not an allowed global" in refused(data)


def test_refuses_reduce_chain_through_the_memo() -> None:
    """It denies calling an object fetched back from the memo (the same chain, hidden)."""
    data = stream(
        g("builtins", "range"),
        i(3),
        TUPLE1,
        REDUCE,
        MEMOIZE,
        b"0",
        binget(0),
        TUPLE1,
        b"0",
        binget(0),
        s("x"),
        TUPLE1,
        REDUCE,
    )
    refused(data)


def test_refuses_copyreg_reconstructor(canary: Path) -> None:
    """It denies `copyreg._reconstructor`, which calls any base's __init__ on any class."""
    data = stream(
        g("copyreg", "_reconstructor"),
        g("builtins", "ValueError"),
        g("builtins", "ValueError"),
        s("x"),
        TUPLE2 + b"\x85"[:0],
        REDUCE,
    )
    refused(data)


def test_refuses_copyreg_extension_registry(canary: Path) -> None:
    """It denies EXT1/EXT2/EXT4: the copyreg extension registry names globals by number."""
    copyreg.add_extension("posix", "system", 0x7A)
    try:
        data = bytes([0x80, 5, 0x82, 0x7A]) + s(f"touch {canary}") + TUPLE1 + REDUCE + b"."
        assert "EXT1" in refused(data)
    finally:
        copyreg.remove_extension("posix", "system", 0x7A)


def test_refuses_build_on_a_class() -> None:
    """It denies BUILD (the __setstate__ path) on a global: that would setattr on a host class."""
    data = stream(g("builtins", "ValueError"), EMPTY_DICT, s("__reduce__"), s("x"), SETITEM, BUILD)
    assert "BUILD on a global" in refused(data)
    assert ValueError.__dict__.get("__reduce__") != "x"


def test_refuses_setstate_with_dunder_attributes() -> None:
    """It denies BUILD state that sets a dunder attribute such as `__class__` on an instance."""
    data = stream(
        g("builtins", "ValueError"),
        s("x"),
        TUPLE1,
        REDUCE,
        EMPTY_DICT,
        s("__class__"),
        g("builtins", "KeyError"),
        SETITEM,
        BUILD,
    )
    assert "__class__" in refused(data)


def test_refuses_setstate_slot_dunders() -> None:
    """It denies `(None, {'__class__': ...})` slot state, the setattr form of BUILD."""
    data = stream(
        g("uuid", "UUID"),
        b")",
        NEWOBJ,
        b"N",
        EMPTY_DICT,
        s("__class__"),
        i(1),
        SETITEM,
        TUPLE2,
        BUILD,
    )
    refused(data)


def test_refuses_builtin_types_called_with_sizes() -> None:
    """It denies `bytearray(10**12)` and `Fraction('1e999999999')`: allowed types, hostile args."""
    refused(stream(g("builtins", "bytearray"), i(2**31 - 1), TUPLE1, REDUCE))
    refused(stream(g("fractions", "Fraction"), s("1e999999999"), TUPLE1, REDUCE))
    refused(stream(g("decimal", "Decimal"), i(1), TUPLE1, REDUCE))


def test_refuses_names_that_are_not_literal_strings() -> None:
    """It denies STACK_GLOBAL whose names were computed (a built object, not a literal)."""
    data = stream(s("posix"), g("builtins", "str"), s("system"), TUPLE1, REDUCE, b"\x93")
    refused(data)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os.path", "os.system"),
        ("posix ", "system"),
        ("\u043eS", "system"),  # Cyrillic o
        ("builtins", "__builtins__.eval"),
        ("subprocess.os", "system"),
        ("objects_types", "pydantic.main.BaseModel.__subclasses__"),
        ("objects_types", "not_a_model"),
        ("objects_types", "<locals>.X"),
        ("__main__", "main"),
    ],
)
def test_refuses_nested_and_obfuscated_names(module: str, name: str) -> None:
    """It denies dotted, padded, homoglyph and attribute-walk names, even in an allowed module."""
    data = stream(g(module, name), s("x"), TUPLE1, REDUCE)
    refused(data, Allowlist(["objects_types.*"]))


def test_refuses_memo_tricks() -> None:
    """It denies PUT with a huge index (a memo the size of RAM) and GET of an unset entry."""
    assert "LONG_BINPUT" in refused(stream(b"N", b"r\xff\xff\xff\x7f"))
    assert "never stored" in refused(stream(b"h\x05"))
    assert "BINPUT" in refused(stream(b"N", b"q\x00"))


def test_refuses_text_and_old_protocols(canary: Path) -> None:
    """It denies the classic `cos\\nsystem` GLOBAL form and any stream before protocol 4."""
    classic = f"cposix\nsystem\n(S'touch {canary}'\ntR.".encode()
    refused(classic)
    refused(pickle.dumps([1, 2], protocol=2))
    refused(stream(b"cposix\nsystem\n", s("x"), TUPLE1, REDUCE))


def test_refuses_persistent_ids_and_buffers() -> None:
    """It denies BINPERSID and out-of-band buffers (they hand control to host callbacks)."""
    assert "BINPERSID" in refused(stream(s("x"), b"Q"))
    assert "NEXT_BUFFER" in refused(stream(b"\x97"))


def test_refuses_bytes_after_stop_and_truncation() -> None:
    """It denies trailing bytes after STOP and streams cut short."""
    good = pickle.dumps({"a": 1}, protocol=5)
    refused(good + b"\x80\x05N.")
    for cut in range(1, len(good)):
        refused(good[:cut])


def test_refuses_huge_streams() -> None:
    """It denies a stream over the byte budget before reading an opcode of it."""
    data = pickle.dumps(b"x" * 5000, protocol=5)
    assert "cap" in refused(data, budgets=Budgets(max_bytes=1000))


def test_refuses_deep_streams() -> None:
    """It denies nesting past the depth budget (lists in lists, and MARK in MARK)."""
    deep: Any = []
    for _ in range(150):
        deep = [deep]
    assert "deeper" in refused(pickle.dumps(deep, protocol=5))
    assert "deeper" in refused(stream(MARK * 500, TUPLE * 500))
    assert "deeper" in refused(stream(EMPTY_LIST + MEMOIZE + (binget(0) + APPEND) * 200))


def test_refuses_many_globals() -> None:
    """It denies more distinct globals than the budget allows."""
    names = ["ValueError", "KeyError", "TypeError", "OSError", "IndexError", "LookupError"]
    data = stream(*(g("builtins", n) + b"0" for n in names), b"N")
    assert "globals" in refused(data, budgets=Budgets(max_globals=4))


def test_refuses_memo_flood() -> None:
    """It denies more memo entries than the budget allows."""
    data = stream(b"N" + MEMOIZE * 100)
    assert "memo" in refused(data, budgets=Budgets(max_memo=50))


def test_refuses_huge_integers_and_lengths() -> None:
    """It denies a LONG4 past the integer budget and a length that claims more than is there."""
    refused(stream(b"\x8b" + (70_000).to_bytes(4, "little") + b"\x01" * 70_000))
    refused(stream(b"\x8e" + (2**62).to_bytes(8, "little") + b"abc"))
    refused(stream(b"\x8b" + (-5).to_bytes(4, "little", signed=True)))


def test_refuses_hash_flooding() -> None:
    """It denies a dict whose int keys all share one hash (quadratic insertion in the host)."""
    modulus = sys.hash_info.modulus
    keys = {k * modulus: 0 for k in range(1, 200)}
    assert len({hash(k) for k in keys}) == 1
    assert "hash" in refused(pickle.dumps(keys, protocol=5))


def test_decoder_never_imports_a_named_module() -> None:
    """It denies a type from a module the policy names but the host has not loaded, and
    does not import it."""
    assert "objects_never_loaded" not in sys.modules
    data = stream(g("objects_never_loaded", "Model"), b")", NEWOBJ)
    assert "not loaded" in refused(data, Allowlist(["objects_never_loaded.*"]))
    assert "objects_never_loaded" not in sys.modules


def test_decoder_never_runs_module_getattr() -> None:
    """It denies a name a module provides only through `__getattr__`, without calling it."""
    calls: list[str] = []
    module = types.ModuleType("objects_lazy")
    module.__getattr__ = lambda name: calls.append(name) or os.system  # type: ignore[attr-defined]
    sys.modules["objects_lazy"] = module
    try:
        refused(stream(g("objects_lazy", "Thing"), b")", NEWOBJ), Allowlist(["objects_lazy.*"]))
        refused(stream(g("objects_lazy", "Thing"), b")", NEWOBJ), Allowlist(["objects_lazy.Thing"]))
    finally:
        del sys.modules["objects_lazy"]
    assert calls == []


def test_policy_cannot_allow_a_gadget() -> None:
    """It denies a policy that names a gadget or `__main__` in `result_types`."""
    for entry in ("posix.system", "functools.partial", "os.*", "__main__.*", "builtins.eval"):
        with pytest.raises((PolicyError, ValueError), match=r"gadget|__main__"):
            Policy(result_types=[entry])
    Policy(result_types=["objects_types.*", "objects_types.Point"])


def test_a_plain_unpickler_would_have_run_the_gadget(tmp_path: Path) -> None:
    """The corpus is live: the same posix.system stream runs under plain pickle.loads (in a
    child process), so the refusals above are what stands between it and the host."""
    target = tmp_path / "RAN"
    data = pickle.dumps(_Reduce(os.system, f"touch {target}"), protocol=5)
    code = "import pickle,sys; pickle.loads(sys.stdin.buffer.read())"
    subprocess.run([sys.executable, "-c", code], input=data, check=True, timeout=30)
    assert target.exists()


def test_refuses_more_opcodes_than_the_budget() -> None:
    """It denies a stream with more opcodes than the opcode budget (a slow-prescan flood)."""
    data = stream(b"N" + b"0N" * 200)
    assert "opcodes" in refused(data, budgets=Budgets(max_opcodes=100))


# -- names a pickler gives a global defined in a private module ---------------------------------


def _with_module(data: bytes, old: str, new: str) -> bytes:
    """`data` (protocol 4, one frame) with its global's module `old` written as `new`."""
    before = b"\x8c" + bytes([len(old)]) + old.encode()
    assert data[2:3] == b"\x95" and data.count(before) == 1
    body = data[11:].replace(before, b"\x8c" + bytes([len(new)]) + new.encode())
    return data[:3] + len(body).to_bytes(8, "little") + body


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_a_pure_path_crosses_under_either_name_a_python_pickles_it(module: str) -> None:
    """It rebuilds a pure path named as 3.11-3.12 pickle it (`pathlib`) and as 3.13 does
    (`pathlib._local`), whichever the host runs: a worker and a host on different Pythons
    agree."""
    from pathlib import PurePosixPath

    data = pickle.dumps(PurePosixPath("/x"), 4)
    data = _with_module(data, PurePosixPath.__module__, module)
    assert module.encode() + b"\x94\x8c\rPurePosixPath" in data
    assert load_restricted(data, Allowlist()) == PurePosixPath("/x")


def test_a_global_from_a_private_module_is_refused_and_allowed_by_its_public_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It names a refused global defined in a private module as users write it, then where
    it is defined (3.13 pickles `pathlib.PosixPath` as `pathlib._local.PosixPath`), hints the
    public name, and a policy naming the public name admits it; a public name that holds
    another object is not taken for it."""
    public, private = types.ModuleType("pubpkg"), types.ModuleType("pubpkg._impl")

    class Thing:
        pass

    class Other:
        pass

    for cls in (Thing, Other):
        cls.__module__, cls.__qualname__ = "pubpkg._impl", cls.__name__
        setattr(private, cls.__name__, cls)
    public.Thing, public.Other = Thing, int  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pubpkg", public)
    monkeypatch.setitem(sys.modules, "pubpkg._impl", private)
    data = pickle.dumps(Thing(), 4)
    text = refused(data)
    assert "pubpkg.Thing (defined as pubpkg._impl.Thing) is not in the objects allowlist" in text
    assert 'result_types = ["pubpkg.Thing"]' in text
    assert type(load_restricted(data, Allowlist(["pubpkg.Thing"]))) is Thing
    assert type(load_restricted(data, Allowlist(["pubpkg._impl.Thing"]))) is Thing
    text = refused(pickle.dumps(Other(), 4), Allowlist(["pubpkg.Other"]))
    assert "pubpkg._impl.Other is not in the objects allowlist" in text
