"""The C prescan of plain-data pickles and the C base64 decoder (`agent_sandbox/_host/intake/_fastscan.c`) against
their Python references: the C side may only say "accepted" (or return bytes) where the
Python side accepts (and returns the same bytes); on everything else it says "not sure".

Checked on valid streams of random plain data (where it must also actually accept, or the
fast path would be dead), on the same streams mutated byte by byte, truncated and spliced,
and on crafted hostile streams (hash flooding, deep nesting, memo abuse, unbalanced marks,
lengths past the end, bad UTF-8, budgets at their edge)."""

from __future__ import annotations

import base64
import binascii
import os
import pickle
import random
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_sandbox._errors import UnpickleRefused
from agent_sandbox._host.intake.unpickle import Decoder
from agent_sandbox._host.intake.unpickle_classes import Allowlist
from agent_sandbox._host.intake.unpickle_prescan import Budgets, prescan, python_prescan

_fastscan = pytest.importorskip(
    "agent_sandbox._host.intake._fastscan", reason="the C extension is not built (pip install -e .)"
)

SETTINGS = settings(
    max_examples=int(os.environ.get("FASTSCAN_EXAMPLES", "300")),
    deadline=None,
    # function_scoped_fixture: `b64_loop` only sets a flag for the whole test
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
P61 = (1 << 61) - 1


def _args(b: Budgets) -> tuple[int, ...]:
    return (b.max_bytes, b.max_opcodes, b.max_depth, b.max_memo, b.max_int_bytes, b.max_same_hash)


def python_accepts(data: bytes, budgets: Budgets) -> bool:
    try:
        python_prescan(data, Allowlist(), budgets)
    except UnpickleRefused:
        return False
    return True


def check(data: bytes, budgets: Budgets | None = None) -> bool:
    """The C answer, after checking it never accepts what Python refuses."""
    budgets = budgets or Budgets()
    fast = _fastscan.prescan_data(data, *_args(budgets))
    if fast:
        assert python_accepts(data, budgets), f"C accepted what Python refuses: {data!r:.300}"
    return bool(fast)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=80)
)
_keys = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_data = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(_keys, inner, max_size=6)
        | st.sets(_keys, max_size=6)
        | st.frozensets(_keys, max_size=6)
        | st.tuples(inner, inner)
        | st.lists(inner, max_size=3).map(tuple)
    ),
    max_leaves=30,
)


@SETTINGS
@given(value=_data, protocol=st.sampled_from([4, 5]))
def test_valid_plain_data_is_accepted_by_both(value: Any, protocol: int) -> None:
    data = pickle.dumps(value, protocol=protocol)
    assert python_accepts(data, Budgets())
    assert check(data) or _has_tuple_key(value)
    assert prescan(data) == set()


def _declined_key(k: Any) -> bool:
    """Keys the C prescan leaves to Python: tuples, and ints wider than 64 bits."""
    return isinstance(k, tuple) or (type(k) is int and not -(2**63) <= k < 2**63)


def _has_tuple_key(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_declined_key(k) for k in value) or any(
            _has_tuple_key(v) for v in value.values()
        )
    if isinstance(value, (set, frozenset)):
        return any(_declined_key(k) for k in value)
    if isinstance(value, (list, tuple)):
        return any(_has_tuple_key(v) for v in value)
    return False


@SETTINGS
@given(
    value=_data,
    protocol=st.sampled_from([4, 5]),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 10_000),
    mode=st.sampled_from(["replace", "insert", "delete", "truncate"]),
)
def test_mutated_streams_never_accepted_by_c_alone(
    value: Any, protocol: int, edits: list[tuple[int, int]], cut: int, mode: str
) -> None:
    data = bytearray(pickle.dumps(value, protocol=protocol))
    for at, byte in edits:
        i = at % (len(data) + 1)
        if mode == "replace" and i < len(data):
            data[i] = byte
        elif mode == "insert":
            data.insert(i, byte)
        elif mode == "delete" and i < len(data):
            del data[i]
    if mode == "truncate":
        del data[cut % (len(data) + 1) :]
    check(bytes(data))


@SETTINGS
@given(
    value=_data,
    max_depth=st.integers(0, 6),
    max_memo=st.integers(0, 6),
    max_same_hash=st.integers(0, 4),
    max_int_bytes=st.integers(0, 9),
    max_opcodes=st.integers(0, 60),
)
def test_tight_budgets_agree(
    value: Any,
    max_depth: int,
    max_memo: int,
    max_same_hash: int,
    max_int_bytes: int,
    max_opcodes: int,
) -> None:
    budgets = Budgets(
        max_depth=max_depth,
        max_memo=max_memo,
        max_same_hash=max_same_hash,
        max_int_bytes=max_int_bytes,
        max_opcodes=max_opcodes,
    )
    data = pickle.dumps(value, protocol=5)
    fast = check(data, budgets)
    if python_accepts(data, budgets) and not _has_tuple_key(value):
        assert fast


def test_random_bytes_after_a_header() -> None:
    rng = random.Random(19)
    alphabet = bytes(range(256))
    plain_ops = (
        b"\x8c\x94G.\x95X\x8dhjKMJ\x8a\x8bCB\x8e\x96(N\x88\x89]}\x8f)aseu\x90\x91t\x85\x86\x870"
    )
    for _ in range(20_000):
        n = rng.randrange(0, 40)
        pool = plain_ops if rng.random() < 0.7 else alphabet
        body = bytes(rng.choice(pool) for _ in range(n))
        check(b"\x80" + bytes([rng.choice((4, 5))]) + body)


def _stream(ops: bytes, proto: int = 5) -> bytes:
    return b"\x80" + bytes([proto]) + ops + b"."


def _int(v: int) -> bytes:
    raw = v.to_bytes((v.bit_length() + 8) // 8 or 1, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


HOSTILE = {
    "hash flood with multiples of 2**61-1": _stream(
        b"}(" + b"".join(_int(i * P61) + b"N" for i in range(70)) + b"u"
    ),
    "hash flood, ints and bools and floats share hash 1": _stream(
        b"}("
        + b"".join(
            _int(1) + b"N" + b"\x88N" + b"G" + struct.pack(">d", 1.0) + b"N" for _ in range(25)
        )
        + b"u"
    ),
    "hash flood with -1 and -2 (both hash -2)": _stream(
        b"}(" + b"".join(_int(-1) + b"N" + _int(-2) + b"N" for _ in range(40)) + b"u"
    ),
    "hash flood in a frozenset": _stream(
        b"(" + b"".join(_int(i * P61) for i in range(70)) + b"\x91"
    ),
    "hash flood across SETITEM calls through the memo": _stream(
        b"}\x94" + b"".join(b"0h\x00" + _int(i * P61) + b"Ns" for i in range(70))
    ),
    "nesting deeper than the budget": _stream(b"]" * 120 + b"a" * 119),
    "nesting through the memo": _stream(b"]\x94" + b"h\x00a" * 150),
    "MARKs nested too deep": _stream(b"(" * 101 + b"1" * 101 + b"N"),
    "GET of an unset memo entry": _stream(b"h\x05"),
    "LONG_BINGET out of range": _stream(b"N\x94j\xff\xff\xff\xff"),
    "MEMOIZE on an empty segment": _stream(b"(\x94N"),
    "unbalanced stack at STOP": _stream(b"NN"),
    "a MARK left open": _stream(b"(N"),
    "bytes after STOP": _stream(b"N") + b"N",
    "no STOP": b"\x80\x05N",
    "BINBYTES past the end": _stream(b"B\xff\xff\xff\x7f"),
    "BINUNICODE8 huge length": _stream(b"\x8d" + b"\xff" * 8),
    "LONG4 negative length": _stream(b"\x8b\xff\xff\xff\xff"),
    "LONG4 over max_int_bytes": _stream(
        b"\x8b" + (70_000).to_bytes(4, "little") + b"\x01" * 70_000
    ),
    "FRAME longer than the stream": _stream(b"\x95" + (10**6).to_bytes(8, "little") + b"N"),
    "overlong UTF-8": _stream(b"\x8c\x02\xc0\xaf"),
    "UTF-8 past U+10FFFF": _stream(b"\x8c\x04\xf4\x90\x80\x80"),
    "truncated UTF-8": _stream(b"\x8c\x02\xe2\x82"),
    "APPEND to a dict": _stream(b"}Na"),
    "SETITEM on a list": _stream(b"]NNs"),
    "ADDITEMS to a frozenset": _stream(b"(\x91(N\x90"),
    "SETITEMS with an odd count": _stream(b"}(NNNu"),
    "TUPLE3 on two items": _stream(b"NN\x87"),
    "POP_MARK without a MARK": _stream(b"N1"),
    "a global": b"\x80\x05\x8c\x02os\x8c\x06system\x93\x8c\x02id\x85R.",
    "REDUCE on a tuple": _stream(b")N\x85R"),
    "protocol 2": b"\x80\x02N.",
    "text opcodes": b"\x80\x05I1\n.",
    "PUT": _stream(b"Np\x00\n"),
    "persistent id": _stream(b"NQ"),
    "NaN keys (hash per object)": _stream(
        b"}(" + b"".join(b"G" + struct.pack(">d", float("nan")) + b"N" for _ in range(70)) + b"u"
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_crafted_hostile_streams_are_not_accepted_by_c(name: str) -> None:
    data = HOSTILE[name]
    assert not python_accepts(data, Budgets()) or name.startswith("NaN")
    assert not _fastscan.prescan_data(data, *_args(Budgets()))
    if not name.startswith("NaN"):
        with pytest.raises(UnpickleRefused):
            prescan(data)


def test_lone_surrogates_are_refused_as_in_python() -> None:
    """It denies a string that is not text (a lone surrogate, as surrogatepass encodes it):
    the C scan leaves it to the Python scan, which refuses it, so no host code ever holds a
    string that cannot be encoded."""
    data = _stream(b"\x8c\x03\xed\xa0\x80")
    assert not python_accepts(data, Budgets())
    assert not _fastscan.prescan_data(data, *_args(Budgets()))
    with pytest.raises(UnpickleRefused, match="lone surrogate"):
        prescan(data)
    # The code points around the surrogates stay text (U+D7FF, U+E000).
    for ok in ("\ud7ff", "\ue000"):
        data = _stream(b"\x8c\x03" + ok.encode())
        assert python_accepts(data, Budgets())
        assert _fastscan.prescan_data(data, *_args(Budgets()))


def test_int_hashes_match_python() -> None:
    """The C side counts ints by the numeric hash; equal hashes must collide in C too."""
    for v in (0, 1, -1, -2, P61, -P61, P61 - 1, P61 + 1, 2**63 - 1, -(2**63), 2**62, 12345):
        ops = b"}(" + b"".join(_int(v) + b"N" for _ in range(3)) + b"u"
        budgets = Budgets(max_same_hash=2)
        assert not _fastscan.prescan_data(_stream(ops), *_args(budgets))
        assert not python_accepts(_stream(ops), budgets)
        # a different int with the same hash (v +- 2**61-1, in 64 bits) collides too
        w = next(w for w in (v + P61, v - P61) if -(2**63) <= w < 2**63 and hash(w) == hash(v))
        ops = b"}(" + _int(v) + b"N" + _int(w) + b"N" + b"u"
        budgets = Budgets(max_same_hash=1)
        assert hash(v) == hash(w)
        assert not _fastscan.prescan_data(_stream(ops), *_args(budgets))


@SETTINGS
@given(raw=st.binary(max_size=200))
def test_base64_of_bytes_decodes_like_binascii(raw: bytes) -> None:
    text = base64.b64encode(raw).decode()
    assert _fastscan.b64decode(text) == raw


@SETTINGS
@given(
    text=st.text(
        alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n -_.\x00é",
        max_size=40,
    )
)
def test_base64_never_accepts_what_binascii_refuses(text: str) -> None:
    fast = _fastscan.b64decode(text)
    if fast is None:
        return
    assert fast == binascii.a2b_base64(text.encode("ascii"), strict_mode=True)


def test_decoder_refuses_bad_base64_as_before() -> None:
    decoder = Decoder(objects=True)
    for bad in ("QQ=", "Q===", "QQ==QQ==", "=QQQ", "QQ Q=", "QUJD\n", "é"):
        assert _fastscan.b64decode(bad) is None
        with pytest.raises(UnpickleRefused):
            decoder.decode_value({"encoding": "pickle-b64", "pickle": bad})
    value = {"k": [1.5, 2, "x"]}
    text = base64.b64encode(pickle.dumps(value, protocol=5)).decode()
    assert decoder.decode_value({"encoding": "pickle-b64", "pickle": text}) == value


# -- the vector base64 loop and the one-blob decoder (decode_blob) --------------------------


@pytest.fixture(params=["vector", "scalar"])
def b64_loop(request: pytest.FixtureRequest) -> Any:
    """Each base64 test runs with the AVX2 loop (where the CPU has it) and without."""
    before = _fastscan.vector()
    on = _fastscan.vector(request.param == "vector")
    if request.param == "vector" and not on:
        pytest.skip("this CPU has no AVX2: the scalar loop is the only one")
    yield request.param
    _fastscan.vector(before)


#: Characters a mutation may put into base64 text: the alphabet's neighbours in every
#: nibble class the vector check sorts by, padding, whitespace and non-ASCII.
_B64_NOISE = "+/09AZaz=\n \x00\x7f@[`{:-_.,*\x80é€"


def _mutate_text(text: str, edits: list[tuple[int, int]], mode: str) -> str:
    chars = list(text)
    for at, pick in edits:
        i = at % (len(chars) + 1)
        ch = _B64_NOISE[pick % len(_B64_NOISE)]
        if mode == "replace" and i < len(chars):
            chars[i] = ch
        elif mode == "insert":
            chars.insert(i, ch)
        elif mode == "delete" and i < len(chars):
            del chars[i]
    return "".join(chars)


def _strict(text: str) -> bytes | None:
    try:
        return binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return None


@SETTINGS
@given(raw=st.binary(min_size=0, max_size=3000))
def test_long_base64_decodes_like_binascii(b64_loop: str, raw: bytes) -> None:
    """Long enough for the vector loop (32 characters a block), every tail length."""
    text = base64.b64encode(raw).decode()
    assert _fastscan.b64decode(text) == raw


@SETTINGS
@given(
    raw=st.binary(min_size=24, max_size=1500),
    edits=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), min_size=1, max_size=3),
    mode=st.sampled_from(["replace", "insert", "delete"]),
)
def test_mutated_long_base64_never_accepted_alone(
    b64_loop: str, raw: bytes, edits: list[tuple[int, int]], mode: str
) -> None:
    text = _mutate_text(base64.b64encode(raw).decode(), edits, mode)
    fast = _fastscan.b64decode(text)
    if fast is not None:
        assert fast == _strict(text)


def test_every_bad_character_is_refused_at_every_position_of_a_block(b64_loop: str) -> None:
    """Each byte value outside the alphabet, at each position of a 32-character block (the
    vector check) and of the scalar tail."""
    raw = bytes(range(256)) * 2
    text = base64.b64encode(raw).decode()
    alphabet = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
    for byte in range(128):
        if byte in alphabet:
            continue
        for i in range(0, 96):
            bad = text[:i] + chr(byte) + text[i + 1 :]
            assert _fastscan.b64decode(bad) is None, (byte, i)
            assert _fastscan.decode_blob(bad, 10**6, 10**6, 10**6) is None


def _blob_budgets(b: Budgets) -> tuple[int, int, int]:
    return (b.max_bytes, b.max_opcodes, b.max_memo)


def check_blob(text: str, budgets: Budgets | None = None) -> bool:
    """decode_blob's answer, after checking that it only answers where the whole ordinary
    path (strict base64, the Python prescan, the C prescan, pickle) gives the same value."""
    budgets = budgets or Budgets()
    out = _fastscan.decode_blob(text, *_blob_budgets(budgets))
    if out is None:
        return False
    raw = _strict(text)
    assert raw is not None, f"decode_blob accepted bad base64: {text!r:.200}"
    assert python_accepts(raw, budgets), f"decode_blob accepted what Python refuses: {raw!r:.300}"
    assert _fastscan.prescan_data(raw, *_args(budgets))
    expected = pickle.loads(raw)
    assert type(out) is type(expected) and out == expected
    assert type(out) in (bytes, bytearray)
    return True


_blobs = st.binary(max_size=2000) | st.binary(max_size=2000).map(bytearray)


@SETTINGS
@given(value=_blobs, protocol=st.sampled_from([4, 5]))
def test_blob_decodes_every_bytes_pickle(
    b64_loop: str, value: bytes | bytearray, protocol: int
) -> None:
    text = base64.b64encode(pickle.dumps(value, protocol=protocol)).decode()
    # bytearray before protocol 5 is a global call (builtins.bytearray): not a blob.
    assert check_blob(text) == (type(value) is bytes or protocol == 5)


def test_blob_decodes_every_offset_and_length(b64_loop: str) -> None:
    """Every payload length around the vector block and the 3-byte group, with and without
    a FRAME and a MEMOIZE (the payload starts at a different offset in each)."""
    for size in [*range(0, 120), *range(250, 270), *range(65_530, 65_545)]:
        payload = bytes((i * 7 + size) % 256 for i in range(size))
        for op in (b"C", b"B", b"\x8e", b"\x96"):
            if op == b"C" and size > 255:
                continue
            width = {b"C": 1, b"B": 4, b"\x8e": 8, b"\x96": 8}[op]
            body = op + size.to_bytes(width, "little") + payload
            for memo in (b"", b"\x94"):
                for frame in (False, True):
                    ops = body + memo + b"."
                    head = b"\x95" + len(ops).to_bytes(8, "little") if frame else b""
                    text = base64.b64encode(b"\x80\x05" + head + ops).decode()
                    assert check_blob(text), (size, op, memo, frame)


@SETTINGS
@given(
    value=_blobs,
    edits=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 255)), min_size=1, max_size=4),
    tail=st.booleans(),
    cut=st.integers(0, 10_000),
    mode=st.sampled_from(["replace", "insert", "delete", "truncate", "append"]),
)
def test_mutated_blob_pickles_never_decoded_alone(
    b64_loop: str,
    value: bytes | bytearray,
    edits: list[tuple[int, int]],
    tail: bool,
    cut: int,
    mode: str,
) -> None:
    """Header, length fields and trailer mutated (the positions are counted from the end
    when `tail`): decode_blob answers only where the ordinary path agrees."""
    data = bytearray(pickle.dumps(value, protocol=5))
    for at, byte in edits:
        i = at % (len(data) + 1)
        if tail:
            i = len(data) - i
        if mode == "replace" and i < len(data):
            data[i] = byte
        elif mode == "insert":
            data.insert(i, byte)
        elif mode == "delete" and i < len(data):
            del data[i]
    if mode == "truncate":
        del data[cut % (len(data) + 1) :]
    if mode == "append":
        data += bytes(b for _, b in edits)
    check_blob(base64.b64encode(bytes(data)).decode())


@SETTINGS
@given(
    value=_blobs,
    edits=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), min_size=1, max_size=3),
    mode=st.sampled_from(["replace", "insert", "delete"]),
)
def test_mutated_blob_text_never_decoded_alone(
    b64_loop: str, value: bytes | bytearray, edits: list[tuple[int, int]], mode: str
) -> None:
    text = base64.b64encode(pickle.dumps(value, protocol=5)).decode()
    check_blob(_mutate_text(text, edits, mode))


@SETTINGS
@given(
    value=_blobs,
    max_bytes=st.integers(0, 2100),
    max_opcodes=st.integers(0, 5),
    max_memo=st.integers(0, 2),
    memo=st.booleans(),
)
def test_blob_tight_budgets_agree(
    b64_loop: str,
    value: bytes | bytearray,
    max_bytes: int,
    max_opcodes: int,
    max_memo: int,
    memo: bool,
) -> None:
    budgets = Budgets(max_bytes=max_bytes, max_opcodes=max_opcodes, max_memo=max_memo)
    data = pickle.dumps(value, protocol=5)
    if not memo:
        data = data.replace(b"\x94.", b".") if data.endswith(b"\x94.") else data
    text = base64.b64encode(data).decode()
    fast = check_blob(text, budgets)
    if python_accepts(data, budgets):
        assert fast


def test_blob_random_opcode_soup(b64_loop: str) -> None:
    rng = random.Random(1919)
    ops = b"\x95CB\x8e\x96\x94.N(]\x8c"
    for _ in range(20_000):
        n = rng.randrange(0, 30)
        body = bytes(
            rng.choice(ops) if rng.random() < 0.5 else rng.randrange(256) for _ in range(n)
        )
        check_blob(base64.b64encode(b"\x80" + bytes([rng.choice((4, 5))]) + body).decode())


def test_blob_refuses_what_is_not_one_blob(b64_loop: str) -> None:
    budgets = _blob_budgets(Budgets())
    for value in (None, 1, "text", [b"x"], (b"x",), {b"k": b"v"}, b"x" * 5000 + b"y"):
        if isinstance(value, bytes):
            continue
        text = base64.b64encode(pickle.dumps(value, protocol=5)).decode()
        assert _fastscan.decode_blob(text, *budgets) is None
    two = b"\x80\x05C\x01xC\x01y\x86."  # two blobs in a tuple
    assert _fastscan.decode_blob(base64.b64encode(two).decode(), *budgets) is None
    assert _fastscan.decode_blob("", *budgets) is None
    assert _fastscan.decode_blob("gAVDAXgu" + "=", *budgets) is None
    with pytest.raises(TypeError):
        _fastscan.decode_blob(b"gAVDAXgu", *budgets)


def test_decoder_takes_the_blob_path_and_keeps_its_refusals(b64_loop: str) -> None:
    decoder = Decoder(objects=True, max_bytes=10_000)
    value = bytes(range(256)) * 20
    text = base64.b64encode(pickle.dumps(value, protocol=5)).decode()
    assert decoder.decode_value({"encoding": "pickle-b64", "pickle": text}) == value
    big = base64.b64encode(pickle.dumps(b"x" * 20_000, protocol=5)).decode()
    with pytest.raises(UnpickleRefused):
        decoder.decode_value({"encoding": "pickle-b64", "pickle": big})
    bad = text[:100] + "!" + text[101:]
    with pytest.raises(UnpickleRefused):
        decoder.decode_value({"encoding": "pickle-b64", "pickle": bad})


# -- frames: the C paths follow the one-reading rule (issue 30) -----------------------------------


def _hostile() -> Any:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fuzz"))
    import hostile

    return hostile


@SETTINGS
@given(
    value=_data,
    protocol=st.sampled_from([4, 5]),
    cuts=st.lists(
        st.tuples(st.integers(0, 60), st.integers(0, 300) | st.integers(0, 12)), max_size=5
    ),
)
def test_reframed_streams_never_accepted_by_c_alone(
    value: Any, protocol: int, cuts: list[tuple[int, int]]
) -> None:
    """Valid plain data re-framed at random (frames ending inside opcodes, nested, past
    others): the C prescan accepts only what the Python prescan accepts."""
    check(_hostile().reframe(pickle.dumps(value, protocol=protocol), cuts))


def test_c_refuses_the_frame_split_reproducers() -> None:
    """It denies, in C too, every stream whose FRAME ends inside an opcode or holds one."""
    h = _hostile()
    for data in (
        h.SMALLEST_FRAME_SPLIT,
        h.fraction_from_string(),
        h.build_on_class(),
        h.frame_in_frame(),
    ):
        assert not check(data)
        assert not python_accepts(data, Budgets())


def test_blob_declines_a_frame_ending_inside_its_opcode(b64_loop: str) -> None:
    """It denies, in decode_blob, a FRAME whose end falls inside the bytes opcode's header
    or payload (the issue's "frame shorter than a bytes opcode's header"): for every frame
    length, decode_blob answers exactly when the frame ends between two opcodes, and then
    the Python path agrees (`check_blob`)."""
    for op, width in ((b"C", 1), (b"B", 4), (b"\x8e", 8), (b"\x96", 8)):
        for memo in (b"", b"\x94"):
            ops = op + (5).to_bytes(width, "little") + b"hello" + memo + b"."
            bounds = {0, 1 + width + 5, len(ops)} | ({1 + width + 5 + 1} if memo else set())
            for length in range(len(ops) + 1):
                data = b"\x80\x05\x95" + length.to_bytes(8, "little") + ops
                text = base64.b64encode(data).decode()
                assert check_blob(text) == (length in bounds), (op, memo, length)
