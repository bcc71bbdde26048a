"""Crafted hostile pickles for the host's readers, one builder per attack class (issue 30).

Each builder takes a size knob and returns the bytes; the tests in
`tests/host/intake/test_one_reading.py` and `test_linear_cost.py` run them, and
`tests/fuzz/corpus/` holds the small ones for the fuzz replay.
"""

from __future__ import annotations

import pickletools
import struct

PROTO5 = b"\x80\x05"
STOP = b"."


def frame(size: int) -> bytes:
    return b"\x95" + struct.pack("<Q", size)


def short_str(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 256
    return b"\x8c" + bytes([len(raw)]) + raw


# -- one reading of the bytes: a FRAME whose end falls inside an opcode ------------------------

#: PROTO 5, FRAME(4), BININT -77, STOP: the BININT's argument crosses the frame's end.
SMALLEST_FRAME_SPLIT = bytes.fromhex("80059504000000000000004ab3ffffff2e")


def frame_split(hidden: bytes) -> bytes:
    """A stream that a linear reader reads as a string and a bytes value and a file-fed unpickler
    reads as the opcodes `hidden`.

    FRAME(4) holds SHORT_BINUNICODE, its length 3 and two bytes: a linear reader (both
    prescans, `pickle.loads`) takes those two and one more as the value, then a second
    SHORT_BINBYTES whose payload is `hidden`, then TUPLE2 and STOP. CPython's unpickler fed
    from a file reads the length inside the frame, finds the payload crossing the frame's
    end, drops the frame's last two bytes and reads three fresh ones after it: it is two
    bytes ahead of the linear reader, at the first byte of `hidden`, which it executes.
    """
    assert len(hidden) < 256
    return (
        PROTO5
        + frame(4)
        + b"\x8c\x03ab"  # SHORT_BINUNICODE 3: 'ab' in the frame, the third byte after it
        + b"x"
        + b"C"
        + bytes([len(hidden)])
        + hidden
        + b"\x86"  # TUPLE2
        + STOP
    )


def _fraction_global() -> bytes:
    return short_str("fractions") + short_str("Fraction") + b"\x93"


def fraction_from_string(text: str = "1e5") -> bytes:
    """The issue's first reproducer, rebuilt: what a file-fed unpickler runs is
    `fractions.Fraction(text)` (the allowlist takes two ints only)."""
    return frame_split(b"0" + _fraction_global() + short_str(text) + b"\x85R" + STOP)


def build_on_class() -> bytes:
    """The issue's second reproducer, rebuilt: what a file-fed unpickler runs is BUILD on
    the class `fractions.Fraction` with the slot state {'pwned': 'yes'} (a setattr on a
    host class)."""
    state = b"N}" + short_str("pwned") + short_str("yes") + b"s\x86"
    return frame_split(b"0" + _fraction_global() + state + b"b" + STOP)


def frame_in_frame() -> bytes:
    """A FRAME inside a frame (CPython never writes one): FRAME(12) holding FRAME(1)."""
    return PROTO5 + frame(12) + frame(1) + b"N" + b"0" + b"N" + STOP


def shared_tuple_key(width: int, levels: int = 8) -> bytes:
    """A dict whose key is `levels` nested tuples, each of `width` copies of the one below
    it (memo references): the stream grows as width*levels, the expanded key as
    width**levels (the issue's 157-byte stream held the host 3.7 s)."""
    out = bytearray(PROTO5 + b"K\x01\x85\x940")  # (1,) in memo 0, popped
    for level in range(1, levels):
        out += b"("
        for _ in range(width):
            out += b"h" + bytes([level - 1])  # BINGET
        out += b"t\x940"
    out += b"}h" + bytes([levels - 1]) + b"Ns" + STOP
    return bytes(out)


def int_keys_one_slot(count: int) -> bytes:
    """A dict of `count` int keys with distinct hashes that the C prescan's old public
    scramble (`h * 0x9E3779B97F4A7C15 >> 32`) put in one slot of every table size: each
    insertion walked the whole chain (the issue: 79 s with the GIL held at the cap)."""
    inverse = pow(0x9E3779B97F4A7C15, -1, 1 << 64)
    limit = (1 << 61) - 1
    out = bytearray(PROTO5 + b"}(")
    made = 0
    x = 0
    while made < count:
        x += 1
        h = (x * inverse) & ((1 << 64) - 1)  # h * M == x: bits 32..63 clear
        value = h - (1 << 64) if h >> 63 else h
        if not -limit < value < limit or value == -1:
            continue
        out += b"\x8a\x08" + value.to_bytes(8, "little", signed=True) + b"N"
        made += 1
    out += b"u" + STOP
    return bytes(out)


# -- re-framing: the generator of the one-reading differential -----------------------------------


def ops(data: bytes) -> list[tuple[int, int, bytes]]:
    """(start, end, opcode byte) of each opcode as a linear reader sees it (FRAMEs kept)."""
    out = []
    positions = [pos for _, _, pos in pickletools.genops(data)] + [len(data)]
    for k, (op, _arg, pos) in enumerate(pickletools.genops(data)):
        out.append((pos, positions[k + 1], bytes([data[pos]])))
        assert op.code.encode("latin-1") == out[-1][2]
    return out


def reframe(data: bytes, cuts: list[tuple[int, int]]) -> bytes:
    """`data` without its FRAMEs, then a FRAME(length) inserted before each chosen opcode
    (`cuts`: opcode index, frame length; lengths may end inside an opcode or past others)."""
    body = [(s, e, b) for s, e, b in ops(data) if b != b"\x95"]
    chunks = [data[s:e] for s, e, _ in body]
    frames = dict(cuts)
    out = bytearray()
    for k, chunk in enumerate(chunks):
        if k in frames and k > 0:  # never before PROTO
            out += b"\x95" + struct.pack("<Q", frames[k])
        out += chunk
    return bytes(out)


def repeated_build_state(keys: int, builds: int) -> bytes:
    """One exception instance given the same memoized state dict of `keys` string keys
    `builds` times (BUILD leaves its target on the stack): each BUILD re-checks and
    re-applies every key, so the work is keys * builds from a stream of keys + builds."""
    out = bytearray(PROTO5 + short_str("builtins") + short_str("ValueError") + b"\x93)R")
    out += b"}("
    for k in range(keys):
        out += short_str(f"k{k}") + b"N"
    out += b"u\x94"  # the state, memo 0, left on the stack: BUILD it once
    out += b"b"
    out += b"h\x00b" * (builds - 1)
    out += STOP
    return bytes(out)


def repeated_copying_call(items: int, calls: int) -> bytes:
    """`collections.deque(seq)` called `calls` times on one memoized list of `items` ints:
    each call copies the list, so the value is items * calls from a stream of
    items + calls."""
    out = bytearray(PROTO5 + b"](")
    out += b"K\x01" * items
    out += b"e\x94"  # the list, memo 0
    out += b"0"  # popped: fetched back below
    out += b"]"  # the result: a list of deques
    out += short_str("collections") + short_str("deque") + b"\x93\x94"  # memo 1
    out += b"0("
    for _ in range(calls):
        out += b"h\x01h\x00\x85R"
    out += b"e" + STOP
    return bytes(out)
