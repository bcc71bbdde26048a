"""Step 1 of the restricted unpickler: the opcode prescan, before anything is built.

A symbolic run of the stream over an allowlist of opcode families, with budgets
(`Budgets`) on size, opcodes, nesting depth, memo entries, distinct globals and integer
size; it tracks what each stack slot holds (`_Val`) so that a global is used only as its
allowlist entry grants (`agent_sandbox._host.intake.unpickle_classes`), BUILD only targets
an instance built in the stream, and dict and set insertions are checked for hash flooding.
The flow is in `agent_sandbox._host.intake.unpickle`.

It is longer than 600 lines on purpose: it is the whole judgement of an objects-mode
stream (the opcode families, the frame rule, the budgets, the slot tracking), and a reviewer
checks each opcode's handling against the others in one place.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from agent_sandbox._errors import UnpickleRefused
from agent_sandbox._host.intake.unpickle_classes import (
    _DATA,
    _SCALARS,
    APPENDS,
    BUILD,
    NEWOBJ,
    NEWOBJ_EX,
    REDUCE,
    SETITEMS,
    Allowlist,
)

if TYPE_CHECKING:
    from agent_sandbox._host.intake.unpickle_classes import _Entry

try:  # the C prescan of plain-data streams and strict base64 (optional: setup.py)
    from agent_sandbox._host.intake import _fastscan
except ImportError:  # pragma: no cover - built by `pip install -e .`
    _fastscan = None  # type: ignore[assignment]

__all__ = ["Budgets", "DeadlinePassed", "check_deadline", "prescan"]

#: Opcodes the Python scan runs between two looks at the call's deadline (about 4 ms of
#: scanning here): a stream of any size is stopped within one such stretch of its deadline.
DEADLINE_EVERY = 4096
#: The clock the deadline is read from (the transport's: `time.monotonic`); tests count
#: its reads instead of waiting on it.
_clock = time.monotonic


class DeadlinePassed(TimeoutError):
    """The call's deadline passed while the host was still decoding what the worker sent.

    A `TimeoutError`, on purpose: the transport and the worker treat it as the call's
    wall-clock limit (`limits.timeout`): the reading stops, the worker is killed."""


def check_deadline(deadline: float | None, what: str) -> None:
    """Raise `DeadlinePassed` when `deadline` (a `time.monotonic` instant) is behind us."""
    if deadline is not None and _clock() >= deadline:
        raise DeadlinePassed(f"the call's deadline passed while the host was {what}")


# -- budgets ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Caps the prescan enforces before anything is built (each refusal names its budget)."""

    max_bytes: int = 4_000_000
    max_opcodes: int = 2_000_000
    max_depth: int = 100
    max_memo: int = 500_000
    max_globals: int = 256
    max_int_bytes: int = 65_536
    max_same_hash: int = 64
    #: Items and characters that constructor calls (REDUCE, NEWOBJ) and BUILD states hand
    #: over, summed over the stream. Without sharing this stays below twice the stream's
    #: size; a memoized list or state dict passed again and again (`deque(shared)` a
    #: million times, one state dict BUILT over and over) would make the host copy
    #: items * uses, quadratic in the stream, in the prescan and in the unpickler.
    max_copied: int = 8_000_000


# -- step 1: the prescan --------------------------------------------------------------------------


class _Val:
    """What one stack slot holds, as far as the prescan can tell."""

    __slots__ = ("const", "depth", "hash", "hashes", "keys", "kind", "n", "name")

    def __init__(self, kind: str, const: Any = None, name: str = "", depth: int = 0) -> None:
        self.kind = kind
        self.const = const  # the value for scalars; the items (list of _Val) for tuples
        self.name = name  # the global's name, for "global" and "obj"
        self.depth = depth
        self.keys: list[list[_Val]] | None = None  # a dict's key batches, checked at BUILD
        self.hashes: dict[int, int] | None = None
        self.hash: int | object | None = _UNSET  # the key's hash, once computed (`_key_hash`)
        self.n = 0  # items held (containers) or bytes (bytes values); see `_size`


_DEPTH = operator.attrgetter("depth")
_FLOODABLE = frozenset({"int", "float", "bool", "tuple"})


_UNSET = object()
_MASK = (1 << 64) - 1
_XXPRIME_1 = 11400714785074694791
_XXPRIME_2 = 14029467366897019727
_XXPRIME_5 = 2870177450012600261


def _tuple_hash(lanes: list[int]) -> int:
    """`hash(t)` of a tuple whose items hash to `lanes` (CPython's tuplehash, 64-bit)."""
    acc = _XXPRIME_5
    for lane in lanes:
        acc = (acc + (lane & _MASK) * _XXPRIME_2) & _MASK
        acc = ((acc << 31) | (acc >> 33)) & _MASK
        acc = (acc * _XXPRIME_1) & _MASK
    acc = (acc + (len(lanes) ^ (_XXPRIME_5 ^ 3527539))) & _MASK
    if acc == _MASK:
        return 1546275796
    return acc - (1 << 64) if acc >> 63 else acc


#: The tuple hash is computed from its items' hashes, each once (a tuple shared through the
#: memo is one `_Val`): expanding the tuple to hash it would cost its full, exponential size.
_HASH_TUPLES = sys.hash_info.width == 64 and hash((1, "a")) == _tuple_hash([1, hash("a")])


def _key_hash(v: _Val) -> int | None:
    """The hash of a hashable constant slot (a scalar, or a tuple of them), or None.

    Cached on the slot, so a structure shared through the memo is hashed once: the cost is
    linear in the stream, whatever the value's expanded size."""
    h = v.hash
    if h is not _UNSET:
        return h  # type: ignore[return-value]
    result: int | None = None
    if v.kind in _SCALARS:
        if v.const is not None or v.kind == "none":  # bytes over 64 bytes keep no value
            result = hash(v.const)
    elif v.kind == "tuple" and v.const is not None and _HASH_TUPLES:
        v.hash = None  # a tuple cannot hold itself, but stay finite if one did
        lanes = [_key_hash(x) for x in v.const]
        if all(lane is not None for lane in lanes):
            result = _tuple_hash(lanes)  # type: ignore[arg-type]
    v.hash = result
    return result


_PROTO = 0x80
_STATE_DUNDERS = frozenset(
    {"__dict__", "__pydantic_extra__", "__pydantic_fields_set__", "__pydantic_private__"}
)


class _Scan:
    """One symbolic run of a stream (see `prescan`)."""

    def __init__(
        self, data: bytes, allow: Allowlist, budgets: Budgets, deadline: float | None = None
    ) -> None:
        self.data = data
        self.allow = allow
        self.b = budgets
        self.deadline = deadline
        self.checks = 0  # looks at the deadline so far (tests count them)
        self.stack: list[_Val] = []
        self.meta: list[list[_Val]] = []
        self.memo: list[_Val] = []
        self.globals: set[str] = set()
        self.copied = 0

    def copy_cost(self, vals: Iterable[_Val], pos: int) -> None:
        """Charge what a call or BUILD hands over (shallow: items, characters, bytes)."""
        self.copied += 1 + sum(map(_size, vals))
        if self.copied > self.b.max_copied:
            raise self.refuse(
                f"calls and BUILD states hand over more than {self.b.max_copied} items "
                f"(shared values passed again and again)",
                pos,
                "max_copied",
            )

    def next_check(self, ops: int) -> int:
        """The opcode count at which `run` next looks at its budget and deadline."""
        budget = self.b.max_opcodes + 1 if self.b.max_opcodes < len(self.data) else sys.maxsize
        if self.deadline is None:
            return budget
        return min(budget, ops + DEADLINE_EVERY)

    def refuse(self, why: str, pos: int, budget: str | None = None) -> UnpickleRefused:
        return UnpickleRefused(f"{why} (at byte {pos})", budget=budget)

    def pop(self, pos: int) -> _Val:
        if not self.stack:
            raise self.refuse("stack underflow", pos)
        return self.stack.pop()

    def pop_mark(self, pos: int) -> list[_Val]:
        if not self.meta:
            raise self.refuse("a mark-consuming opcode without a MARK", pos)
        items = self.stack
        self.stack = self.meta.pop()
        return items

    def top(self, pos: int) -> _Val:
        if not self.stack:
            raise self.refuse("stack underflow", pos)
        return self.stack[-1]

    def push(self, v: _Val, pos: int) -> None:
        if v.depth > self.b.max_depth:
            raise self.refuse(f"nesting deeper than {self.b.max_depth}", pos, "max_depth")
        self.stack.append(v)

    def grow(self, target: _Val, items: list[_Val], pos: int) -> None:
        if items:
            deepest = max(map(_DEPTH, items)) + 1
            if deepest > target.depth:
                target.depth = deepest
        if target.depth > self.b.max_depth:
            raise self.refuse(f"nesting deeper than {self.b.max_depth}", pos, "max_depth")

    def count_hashes(self, target: _Val, keys: Iterable[_Val], pos: int) -> None:
        for k in keys:
            if k.kind not in _FLOODABLE:
                continue  # str and bytes hashes are salted per process: not craftable
            h = _key_hash(k)
            if h is None:
                continue
            if target.hashes is None:
                target.hashes = {}
            n = target.hashes.get(h, 0) + 1
            target.hashes[h] = n
            if n > self.b.max_same_hash:
                raise self.refuse(
                    f"more than {self.b.max_same_hash} keys share one hash (hash flooding)",
                    pos,
                    "max_same_hash",
                )

    def use(self, g: _Val, use: str, pos: int, args: list[_Val] | None = None) -> _Entry:
        if g.kind != "global":
            raise self.refuse(
                f"{use.upper()} on something that is not an allowed global "
                f"({g.kind}): only a vetted global may be called",
                pos,
            )
        entry = self.allow.lookup(g.name)
        if use not in entry.uses:
            raise UnpickleRefused(
                f"{g.name} may not be used for {use.upper()} (at byte {pos})", target=g.name
            )
        if args is not None and entry.args is not None and not entry.args(args):
            kinds = ", ".join(a.kind if a.kind != "obj" else a.name for a in args)
            raise UnpickleRefused(
                f"{g.name} called with arguments ({kinds}) outside its allowed shapes "
                f"(at byte {pos})",
                target=g.name,
            )
        return entry

    def check_state(self, state: _Val, pos: int, own_setstate: bool) -> None:
        if own_setstate:
            if state.kind not in _DATA:
                raise self.refuse(f"BUILD with a {state.kind} state", pos)
            return
        parts = [state]
        if state.kind == "tuple" and state.const is not None and len(state.const) == 2:
            parts = list(state.const)
        for part in parts:
            if part.kind == "none":
                continue
            if part.kind != "dict":
                raise self.refuse(f"BUILD with a {part.kind} state (a dict is expected)", pos)
            for batch in part.keys or ():
                for k in batch:
                    if k.kind != "str":
                        raise self.refuse(f"BUILD sets an attribute named by a {k.kind}", pos)
                    if k.const.startswith("__") and k.const not in _STATE_DUNDERS:
                        raise self.refuse(f"BUILD sets the attribute {k.const[:40]!r}", pos)

    def run(self) -> None:
        data = self.data
        n = len(data)
        b = self.b
        if n > b.max_bytes:
            raise UnpickleRefused(
                f"the pickle is {n} bytes, above the cap of {b.max_bytes} bytes", budget="max_bytes"
            )
        if n < 3 or data[0] != _PROTO or data[1] not in (4, 5):
            raise UnpickleRefused("the stream does not start with PROTO 4 or 5")
        pos = 2
        ops = 0
        unpack = struct.unpack_from
        stack_push = self.push
        memo = self.memo
        # One comparison per opcode: `next_check` is the next opcode count at which the
        # opcode budget or the call's deadline (every DEADLINE_EVERY opcodes) is looked at.
        # Every opcode takes at least one byte, so without a deadline the opcode budget only
        # needs looking at when it is smaller than the stream.
        next_check = self.next_check(0)
        # One reading of the bytes: the end of the current FRAME (-1 outside one). An opcode
        # whose argument crosses a frame's end, or a FRAME inside a frame, is read
        # differently by a file-fed unpickler (which drops the frame's rest and reads on)
        # and by an in-memory one (which treats FRAME as a no-op): such streams are refused,
        # so every reader executes the opcodes this scan judged (CPython never writes them).
        frame_end = -1
        while True:
            if frame_end >= 0:
                if pos == frame_end:
                    frame_end = -1
                elif pos > frame_end:
                    raise self.refuse("an opcode crosses the end of its FRAME", frame_end)
            if pos >= n:
                raise self.refuse("the stream ends before STOP", pos)
            ops += 1
            if ops >= next_check:
                if ops > b.max_opcodes:
                    raise self.refuse(f"more than {b.max_opcodes} opcodes", pos, "max_opcodes")
                self.checks += 1
                check_deadline(self.deadline, f"scanning the result's pickle (at byte {pos})")
                next_check = self.next_check(ops)
            op = data[pos]
            at = pos
            pos += 1
            # Fast paths for the opcodes that dominate real streams (scalars have depth 0,
            # so they skip the depth check); each mirrors its general case below.
            if op == 0x8C:  # SHORT_BINUNICODE
                if pos >= n:
                    raise self.refuse("truncated length", at)
                end = pos + 1 + data[pos]
                if end > n:
                    raise self.refuse("a length past the end of the stream", at)
                try:
                    text = data[pos + 1 : end].decode("utf-8")
                except UnicodeDecodeError:
                    raise self.refuse(
                        "a string that is not text (invalid UTF-8 or a lone surrogate)", at
                    ) from None
                pos = end
                self.stack.append(_Val("str", text))
                continue
            if op == 0x94:  # MEMOIZE
                if len(memo) >= b.max_memo:
                    raise self.refuse(f"more than {b.max_memo} memo entries", at, "max_memo")
                if not self.stack:
                    raise self.refuse("stack underflow", at)
                memo.append(self.stack[-1])
                continue
            if op == 0x47:  # BINFLOAT
                if pos + 8 > n:
                    raise self.refuse("truncated float", at)
                self.stack.append(_Val("float", unpack(">d", data, pos)[0]))
                pos += 8
                continue
            if op == 0x2E:  # STOP
                if self.meta or len(self.stack) != 1:
                    raise self.refuse("STOP with an unbalanced stack", at)
                if pos != n:
                    raise self.refuse("bytes after STOP", pos)
                return
            if op == 0x95:  # FRAME
                if frame_end >= 0:
                    raise self.refuse("a FRAME inside a frame", at)
                if pos + 8 > n:
                    raise self.refuse("truncated FRAME", at)
                (size,) = unpack("<Q", data, pos)
                pos += 8
                if size > n - pos:
                    raise self.refuse("a FRAME longer than the stream", at)
                frame_end = pos + size
                continue
            if op == 0x58 or op == 0x8D:  # BINUNICODE, BINUNICODE8
                width = 4 if op == 0x58 else 8
                size, pos = _length(data, pos, width, at)
                raw = data[pos : pos + size]
                pos += size
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise self.refuse(
                        "a string that is not text (invalid UTF-8 or a lone surrogate)", at
                    ) from None
                stack_push(_Val("str", text), at)
                continue
            if op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                width = 1 if op == 0x68 else 4
                if pos + width > n:
                    raise self.refuse("truncated GET", at)
                idx = data[pos] if width == 1 else unpack("<I", data, pos)[0]
                pos += width
                if idx >= len(self.memo):
                    raise self.refuse(f"GET of memo entry {idx} that was never stored", at)
                stack_push(self.memo[idx], at)
                continue
            if op == 0x4B or op == 0x4D or op == 0x4A:  # BININT1, BININT2, BININT
                fmt, width = {0x4B: ("<B", 1), 0x4D: ("<H", 2), 0x4A: ("<i", 4)}[op]
                if pos + width > n:
                    raise self.refuse("truncated integer", at)
                (value,) = unpack(fmt, data, pos)
                pos += width
                stack_push(_Val("int", value), at)
                continue
            if op == 0x8A or op == 0x8B:  # LONG1, LONG4
                size, pos = _length(data, pos, 1 if op == 0x8A else 4, at, signed=op == 0x8B)
                if size > b.max_int_bytes:
                    raise self.refuse(
                        f"an integer of {size} bytes (cap {b.max_int_bytes})", at, "max_int_bytes"
                    )
                value = int.from_bytes(data[pos : pos + size], "little", signed=True)
                pos += size
                stack_push(_Val("int", value), at)
                continue
            if op in (0x43, 0x42, 0x8E, 0x96):  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                width = {0x43: 1, 0x42: 4, 0x8E: 8, 0x96: 8}[op]
                size, pos = _length(data, pos, width, at)
                kind = "bytearray" if op == 0x96 else "bytes"
                v = _Val(kind, bytes(data[pos : pos + size]) if size <= 64 else None)
                v.n = size
                stack_push(v, at)
                pos += size
                continue
            if op == 0x28:  # MARK
                if len(self.meta) >= b.max_depth:
                    raise self.refuse(f"MARKs nested deeper than {b.max_depth}", at, "max_depth")
                self.meta.append(self.stack)
                self.stack = []
                continue
            if op in (0x4E, 0x88, 0x89):  # NONE, NEWTRUE, NEWFALSE
                kind = "none" if op == 0x4E else "bool"
                stack_push(_Val(kind, None if op == 0x4E else op == 0x88), at)
                continue
            if op in (0x5D, 0x7D, 0x8F, 0x29):  # EMPTY_LIST, EMPTY_DICT, EMPTY_SET, EMPTY_TUPLE
                kind = {0x5D: "list", 0x7D: "dict", 0x8F: "set", 0x29: "tuple"}[op]
                stack_push(_Val(kind, [] if kind == "tuple" else None), at)
                continue
            if op == 0x61 or op == 0x65:  # APPEND, APPENDS
                items = [self.pop(at)] if op == 0x61 else self.pop_mark(at)
                target = self.top(at)
                if target.kind != "list" and not (
                    target.kind == "obj" and APPENDS in self.allow.lookup(target.name).uses
                ):
                    raise self.refuse(f"APPEND to a {target.kind}", at)
                target.n += len(items)
                self.grow(target, items, at)
                continue
            if op == 0x73 or op == 0x75:  # SETITEM, SETITEMS
                if op == 0x73:
                    value_v = self.pop(at)
                    items = [self.pop(at), value_v]
                else:
                    items = self.pop_mark(at)
                    if len(items) % 2:
                        raise self.refuse("SETITEMS with an odd number of items", at)
                target = self.top(at)
                if target.kind != "dict" and not (
                    target.kind == "obj" and SETITEMS in self.allow.lookup(target.name).uses
                ):
                    raise self.refuse(f"SETITEM on a {target.kind}", at)
                keys = items[0::2]
                self.count_hashes(target, keys, at)
                if target.kind == "dict":
                    if target.keys is None:
                        target.keys = []
                    target.keys.append(keys)
                target.n += len(keys)
                self.grow(target, items, at)
                continue
            if op == 0x90:  # ADDITEMS
                items = self.pop_mark(at)
                target = self.top(at)
                if target.kind != "set":
                    raise self.refuse(f"ADDITEMS to a {target.kind}", at)
                target.n += len(items)
                self.count_hashes(target, items, at)
                self.grow(target, items, at)
                continue
            if op == 0x91:  # FROZENSET
                items = self.pop_mark(at)
                v = _Val("frozenset")
                v.n = len(items)
                self.count_hashes(v, items, at)
                self.grow(v, items, at)
                stack_push(v, at)
                continue
            if op == 0x74 or op in (0x85, 0x86, 0x87):  # TUPLE, TUPLE1..3
                if op == 0x74:
                    items = self.pop_mark(at)
                else:
                    count = op - 0x84
                    if len(self.stack) < count:
                        raise self.refuse("stack underflow", at)
                    items = self.stack[-count:]
                    del self.stack[-count:]
                v = _Val("tuple", items)
                v.n = len(items)
                self.grow(v, items, at)
                stack_push(v, at)
                continue
            if op == 0x30:  # POP
                if self.stack:
                    self.stack.pop()
                else:
                    self.pop_mark(at)
                continue
            if op == 0x31:  # POP_MARK
                self.pop_mark(at)
                continue
            if op == 0x93:  # STACK_GLOBAL
                name_v = self.pop(at)
                module_v = self.pop(at)
                if name_v.kind != "str" or module_v.kind != "str":
                    raise self.refuse("STACK_GLOBAL with names that are not literal strings", at)
                full = f"{module_v.const}.{name_v.const}"
                self.allow.lookup(full)  # refuses unknown or denied names right here
                self.globals.add(full)
                if len(self.globals) > b.max_globals:
                    raise self.refuse(
                        f"more than {b.max_globals} distinct globals", at, "max_globals"
                    )
                stack_push(_Val("global", name=full), at)
                continue
            if op == 0x52:  # REDUCE
                args = self.pop(at)
                func = self.pop(at)
                if args.kind != "tuple":
                    raise self.refuse("REDUCE with arguments that are not a tuple", at)
                self.use(func, REDUCE, at, args.const)
                self.copy_cost(args.const, at)
                stack_push(_Val("obj", name=func.name, depth=args.depth + 1), at)
                continue
            if op == 0x81:  # NEWOBJ
                args = self.pop(at)
                cls = self.pop(at)
                if args.kind != "tuple":
                    raise self.refuse("NEWOBJ with arguments that are not a tuple", at)
                self.use(cls, NEWOBJ, at, args.const)
                self.copy_cost(args.const, at)
                stack_push(_Val("obj", name=cls.name, depth=args.depth + 1), at)
                continue
            if op == 0x92:  # NEWOBJ_EX
                kwargs = self.pop(at)
                args = self.pop(at)
                cls = self.pop(at)
                if args.kind != "tuple" or kwargs.kind != "dict":
                    raise self.refuse("NEWOBJ_EX with malformed arguments", at)
                self.use(cls, NEWOBJ_EX, at, None)
                self.copy_cost([*args.const, kwargs], at)
                stack_push(_Val("obj", name=cls.name, depth=max(args.depth, kwargs.depth) + 1), at)
                continue
            if op == 0x62:  # BUILD
                state = self.pop(at)
                target = self.top(at)
                if target.kind != "obj":
                    raise self.refuse(
                        f"BUILD on a {target.kind}: only an instance built in "
                        f"the stream may receive state",
                        at,
                    )
                entry = self.allow.lookup(target.name)
                self.copy_cost(
                    state.const if state.kind == "tuple" and state.const else [state], at
                )
                if BUILD not in entry.uses:
                    raise UnpickleRefused(
                        f"{target.name} may not receive state (BUILD)", target=target.name
                    )
                if not entry.trusted:  # globals a policy names exactly keep their own state
                    self.check_state(state, at, entry.own_setstate)
                self.grow(target, [state], at)
                continue
            name = _OPCODE_NAMES.get(op, f"0x{op:02x}")
            raise self.refuse(f"opcode {name} is outside the allowed families", at)


def _size(v: _Val) -> int:
    """What handing `v` to a constructor or BUILD copies: its characters, bytes or items."""
    if v.kind == "str":
        return len(v.const)  # type: ignore[no-any-return]
    return v.n


def _length(data: bytes, pos: int, width: int, at: int, *, signed: bool = False) -> tuple[int, int]:
    if pos + width > len(data):
        raise UnpickleRefused(f"truncated length (at byte {at})")
    size = int.from_bytes(data[pos : pos + width], "little", signed=signed)
    pos += width
    if size < 0 or size > len(data) - pos:
        raise UnpickleRefused(f"a length of {size} past the end of the stream (at byte {at})")
    return size, pos


_OPCODE_NAMES = {
    ord("c"): "GLOBAL",
    ord("i"): "INST",
    ord("o"): "OBJ",
    ord("P"): "PERSID",
    ord("Q"): "BINPERSID",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    ord("p"): "PUT",
    ord("q"): "BINPUT",
    ord("r"): "LONG_BINPUT",
    ord("g"): "GET",
    ord("S"): "STRING",
    ord("T"): "BINSTRING",
    ord("U"): "SHORT_BINSTRING",
    ord("V"): "UNICODE",
    ord("I"): "INT",
    ord("L"): "LONG",
    ord("F"): "FLOAT",
    ord("2"): "DUP",
    ord("d"): "DICT",
    ord("l"): "LIST",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
    0x80: "PROTO",
}


def prescan(
    data: bytes,
    allow: Allowlist | None = None,
    budgets: Budgets | None = None,
    deadline: float | None = None,
) -> set[str]:
    """Check a stream before anything is built; return the globals it names.

    Raises `UnpickleRefused` naming the opcode, the global or the budget at fault. A stream
    of plain data (no globals) is first offered to the C prescan (`_host/intake/_fastscan.c`),
    which accepts only what this Python scan accepts and answers "not sure" for everything
    else; then this scan runs and decides. Past `deadline` (a `time.monotonic` instant, the
    call's) the scan stops with `DeadlinePassed`: the C prescan is linear and fast (about
    50 ms at the 4 MB cap), the Python one is looked at every `DEADLINE_EVERY` opcodes.
    """
    data = bytes(data)
    budgets = budgets or Budgets()
    check_deadline(deadline, "about to scan the result's pickle")
    if _fastscan is not None and _fastscan.prescan_data(
        data,
        budgets.max_bytes,
        budgets.max_opcodes,
        budgets.max_depth,
        budgets.max_memo,
        budgets.max_int_bytes,
        budgets.max_same_hash,
    ):
        return set()
    return python_prescan(data, allow, budgets, deadline)


def python_prescan(
    data: bytes,
    allow: Allowlist | None = None,
    budgets: Budgets | None = None,
    deadline: float | None = None,
) -> set[str]:
    """`prescan` without the C fast path (the reference the C prescan is tested against)."""
    scan = _Scan(bytes(data), allow or Allowlist(), budgets or Budgets(), deadline)
    try:
        scan.run()
    except UnpickleRefused:
        raise
    except (RecursionError, MemoryError, OverflowError, ValueError, struct.error) as exc:
        raise UnpickleRefused(f"the prescan failed: {type(exc).__name__}") from None
    return scan.globals
