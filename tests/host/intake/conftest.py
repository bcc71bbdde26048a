"""Fixtures for the objects-mode tests: a small pickle assembler and an objects-mode sandbox.

`objects_types` (this folder) is importable by the host and, through an extra import root,
by the worker, so the same pydantic models and dataclasses exist on both sides.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Iterator

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host import startup

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import objects_types  # noqa: E402,F401 - loaded in the host: the decoder never imports

# -- a tiny pickle assembler (protocol 5 opcodes) -----------------------------------------------


def s(text: str) -> bytes:
    """SHORT_BINUNICODE / BINUNICODE."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw
    return b"X" + struct.pack("<I", len(raw)) + raw


def g(module: str, name: str) -> bytes:
    """STACK_GLOBAL module.name."""
    return s(module) + s(name) + b"\x93"


def i(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)


def stream(*parts: bytes, proto: int = 5) -> bytes:
    """PROTO, the parts, STOP."""
    return bytes([0x80, proto]) + b"".join(parts) + b"."


MARK, TUPLE, TUPLE1, TUPLE2, REDUCE, BUILD = b"(", b"t", b"\x85", b"\x86", b"R", b"b"
EMPTY_DICT, EMPTY_LIST, SETITEM, APPEND, MEMOIZE, NEWOBJ = b"}", b"]", b"s", b"a", b"\x94", b"\x81"
NONE, POP = b"N", b"0"


def binget(index: int) -> bytes:
    return b"h" + bytes([index])


# -- an objects-mode sandbox whose worker can import objects_types ------------------------------


@pytest.fixture(scope="module")
def objects_policy() -> Policy:
    return Policy(
        name="test-objects",
        result_mode="objects",
        result_types=["objects_types.*"],
        imports={
            "allow": [
                "objects_types",
                "pydantic",
                "dataclasses",
                "enum",
                "typing",
                "datetime",
                "decimal",
                "fractions",
                "uuid",
                "pathlib",
                "collections",
            ],
        },
        limits={"wall_seconds": 20, "result_bytes": 200_000},
    )


@pytest.fixture(scope="module")
def objects_sandbox(objects_policy: Policy) -> Iterator[Sandbox]:
    original = startup.import_roots
    startup.import_roots = lambda: (*original(), HERE)  # type: ignore[assignment]
    sb = Sandbox(objects_policy, warm=0)
    try:
        yield sb
    finally:
        sb.close()
        startup.import_roots = original  # type: ignore[assignment]
