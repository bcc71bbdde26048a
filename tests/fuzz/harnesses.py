"""Fuzz harnesses for every host-side reader of worker bytes (issue 30).

Each harness is a plain function of one input (`bytes -> None`) that raises only on a
defect: an exception other than the reader's own refusal, a forbidden audit event while
decoding (an import, a process start, exec, compile, a socket connect), or a differential
oracle that fails. The same functions serve two runners:

* `run.py NAME [libFuzzer options]`: coverage-guided runs with atheris, for as long as you
  like (`scripts/fuzz-long.sh` runs every harness with ASan and UBSan builds of the C
  extensions; docs/objects.md has the commands and the last figures);
* `test_fuzz_replay.py`: the normal suite replays `corpus/NAME/*` (the issue's reproducers
  and the interesting inputs the runs found) through each harness in-process, seconds in
  total.

Why atheris for all of them: these readers take bytes, and their defects sit behind
byte-level conditions (a length one past a frame's end, a CR without its LF) that coverage
guidance reaches and a structured generator rarely does. The structured, value-level
differentials (random plain data re-framed; mutated responses against h11) are hypothesis
and seeded tests in the suite (`tests/host/intake/test_one_reading.py`,
`test_fastscan.py`, `tests/remote/test_relay_framing.py`); atheris then finds the inputs
no generator thought of, and the replay keeps them.

Harnesses: `fastscan` (the C entry points against their Python twins), `unpickle` (the
prescans and the restricted unpickler, with the one-reading oracle), `events` (SSE framing
into `ResultBuilder` and the rebuilt exception), `remote_transport` (a worker's HTTP
response through the host's sans-IO protocol), `guard_block` (the arming block read from
the worker's memory), `serve_relay` (`ResponseReader` against h11). The egress proxy's
parsers have their own (issue 31).
"""

from __future__ import annotations

import base64
import binascii
import os
import pickle
import pickletools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import h11  # noqa: E402

from agent_sandbox._errors import (  # noqa: E402
    ChildException,
    TransportError,
    UnpickleRefused,
)
from agent_sandbox._host.intake import unpickle  # noqa: E402
from agent_sandbox._host.intake.builder import ResultBuilder  # noqa: E402
from agent_sandbox._host.intake.framing import SSEParser  # noqa: E402
from agent_sandbox._host.intake.guard_block import _LAYOUT, GuardWatch  # noqa: E402
from agent_sandbox._host.intake.transport import _Protocol  # noqa: E402
from agent_sandbox._host.intake.unpickle import Decoder, load_restricted  # noqa: E402
from agent_sandbox._host.intake.unpickle_classes import Allowlist  # noqa: E402
from agent_sandbox._host.intake.unpickle_prescan import Budgets, python_prescan  # noqa: E402
from agent_sandbox._host.remote.serve_relay import ResponseReader, UpstreamError  # noqa: E402

try:
    from agent_sandbox._host.intake import _fastscan
except ImportError:  # the C extension is optional: `fastscan` then checks nothing
    _fastscan = None  # type: ignore[assignment]
    if os.environ.get("FUZZ_REQUIRE_FASTSCAN"):  # scripts/fuzz-long.sh: never silently
        raise

import tblib  # noqa: E402,F401 - imported now: the decoder imports it lazily

_ACTIVE = False
_FORBIDDEN = frozenset(
    {
        "import",
        "os.system",
        "subprocess.Popen",
        "exec",
        "compile",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "socket.connect",
    }
)


def _hook(event: str, args: Any) -> None:
    if _ACTIVE and event in _FORBIDDEN:
        if event in ("exec", "compile") and _in_tblib():
            return  # tblib compiles a fixed stub to make traceback objects
        raise SystemExit(f"forbidden audit event while decoding: {event} {args!r:.200}")


def _in_tblib() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "tblib" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


sys.addaudithook(_hook)


class _Decoding:
    def __enter__(self) -> None:
        global _ACTIVE
        _ACTIVE = True

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = False


BUDGETS = Budgets(max_bytes=200_000)


def _c_prescan(data: bytes, b: Budgets) -> bool:
    assert _fastscan is not None
    return bool(
        _fastscan.prescan_data(
            data, b.max_bytes, b.max_opcodes, b.max_depth, b.max_memo, b.max_int_bytes,
            b.max_same_hash,
        )
    )  # fmt: skip


def _python_accepts(data: bytes, b: Budgets = BUDGETS) -> bool:
    try:
        python_prescan(data, Allowlist(), b)
    except UnpickleRefused:
        return False
    return True


# -- fastscan: every C entry point against its Python twin ----------------------------------------


def fastscan(data: bytes) -> None:
    """prescan_data, b64decode and decode_blob: C may only answer where Python agrees.

    The first byte picks the input's use: even, the rest is a pickle (prescanned by both,
    then its base64 given to decode_blob); odd, the rest is base64 text; the low bits of
    the second choose the AVX2 loop and tight budgets."""
    if _fastscan is None or len(data) < 2:
        return
    mode, knobs, body = data[0], data[1], data[2:]
    _fastscan.vector(bool(knobs & 1))
    budgets = BUDGETS if not knobs & 2 else Budgets(200_000, 40, 4, 8, 8, 2)
    if mode & 1 == 0:
        if _c_prescan(body, budgets) and not _python_accepts(body, budgets):
            raise AssertionError(f"prescan_data accepted what Python refuses: {body!r:.300}")
        text = base64.b64encode(body).decode()
    else:
        text = body.decode("latin-1")
    try:
        strict: bytes | None = binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        strict = None
    fast = _fastscan.b64decode(text)
    if fast is not None and fast != strict:
        raise AssertionError(f"b64decode differs from binascii on {text!r:.200}")
    blob = _fastscan.decode_blob(text, budgets.max_bytes, budgets.max_opcodes, budgets.max_memo)
    if blob is None:
        return
    if strict is None:
        raise AssertionError(f"decode_blob accepted bad base64 {text!r:.200}")
    with _Decoding():
        try:
            value = load_restricted(strict, Allowlist(), budgets)
        except UnpickleRefused:
            raise AssertionError(
                f"decode_blob accepted what Python refuses {strict!r:.200}"
            ) from None
    if type(value) is not type(blob) or value != blob:
        raise AssertionError(f"decode_blob differs from load_restricted on {strict!r:.200}")


# -- unpickle: the prescans and the restricted unpickler, one reading -----------------------------


class _Trace(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """The pure-Python unpickler on the host's exact reader, recording each opcode run."""

    def __init__(self, data: bytes) -> None:
        super().__init__(unpickle._Reader(data))
        self.trace: list[int] = []
        self.dispatch = {c: self._rec(c, f) for c, f in pickle._Unpickler.dispatch.items()}

    def _rec(self, code: int, fn: Any) -> Any:
        def run(u: Any) -> Any:
            self.trace.append(code)
            return fn(u)

        return run

    def find_class(self, module: str, name: str) -> Any:
        return Allowlist().lookup(f"{module}.{name}").obj


def unpickle_target(data: bytes) -> None:
    """load_restricted on any bytes; when the prescan accepts, the C prescan never accepted
    alone, and the opcodes genops reads are the ones an unpickler on the same reader runs."""
    with _Decoding():
        try:
            load_restricted(data, Allowlist(), BUDGETS)
            accepted = True
        except UnpickleRefused:
            accepted = False
        if (
            _fastscan is not None
            and _c_prescan(data, BUDGETS)
            and not accepted
            and not _python_accepts(data)
        ):
            raise AssertionError(f"the C prescan accepted what Python refuses: {data!r:.300}")
        if not accepted:
            return
        linear = [data[pos] for _op, _arg, pos in pickletools.genops(data)]
        tracer = _Trace(data)
        try:
            tracer.load()
        except (pickle.UnpicklingError, UnpickleRefused, ValueError, TypeError) as exc:
            if isinstance(exc, pickle.UnpicklingError):
                raise AssertionError(f"a second reader disagrees: {exc} on {data!r:.300}") from None
            return  # a constructor refusing its (checked) arguments: both readers agree
        if tracer.trace != linear:
            raise AssertionError(f"the opcodes run differ from genops on {data!r:.300}")


# -- events: SSE framing into the result builder ------------------------------------------------

_DECODER = Decoder(objects=True, max_bytes=200_000)


def events(data: bytes) -> None:
    """An SSE stream fed in two pieces (the first byte says where to cut) into
    ResultBuilder with an objects-mode decoder, then the result's error raised."""
    cut, body = (data[0], data[1:]) if data else (0, b"")
    builder = ResultBuilder(_DECODER)
    with _Decoding():
        try:
            builder.add("start", {"call": 1})
            parser = SSEParser(1_000_000)
            for piece in (body[:cut], body[cut:]):
                for kind, payload in parser.feed(piece):
                    builder.add(kind, payload)
            result = builder.build()
            try:
                result.raise_error()
            except (Exception, ChildException):
                pass
        except TransportError:
            pass


# -- remote_transport: a worker's HTTP response through the host's protocol ----------------------


def remote_transport(data: bytes) -> None:
    """A response to `POST /run` fed in two pieces through `_Protocol` and the client's
    `_feed` (status check, events passed on): only TransportError may come out."""
    from agent_sandbox._host.intake.remote_transport import RemoteWorkerClient

    cut, body = (data[0], data[1:]) if data else (0, b"")
    proto = _Protocol("tok", 100_000, None, headers=[("host", "w"), ("x-token", "tok")])
    proto.request("POST", "/run", {"code": "1"})
    seen: list[Any] = []
    checked = False
    with _Decoding():
        try:
            for piece in (body[:cut], body[cut:], b""):
                checked, _done = RemoteWorkerClient._feed(proto, piece, seen.append, checked)
        except TransportError:
            pass


# -- guard_block: the arming block read from the worker's memory ---------------------------------


def guard_block(data: bytes) -> None:
    """A sequence of blocks as the host reads them (from a memfd standing for the worker's
    memory, at the address the hello gave) judged for a call's events: it never raises,
    and whenever it says PASS for `done` the block read two writes and the flag off."""
    size = _LAYOUT.size
    if len(data) < 2:
        return
    kinds, rest = data[0], data[1:]
    fd = os.memfd_create("guard-block-fuzz")
    try:
        head, tail = 0x5A5A5A5A, 0xA5A5A5A5
        first = _LAYOUT.pack(head, 0, 0, 0, tail)
        os.pwrite(fd, first, 64)
        watch = GuardWatch(os.dup(fd), os.getpid(), 64, head, tail)
        try:
            watch.begin_call()
            for k in range(0, len(rest), size):
                raw = rest[k : k + size]
                os.pwrite(fd, raw.ljust(size, b"\0"), 64)
                kind = "done" if (kinds >> (k // size % 8)) & 1 else "stdout"
                verdict = watch.judge(kind)
                if verdict not in ("pass", "hold", "tampered"):
                    raise AssertionError(f"judge said {verdict!r}")
                if verdict == "tampered":
                    break
                if kind == "done" and verdict == "pass":
                    watch.begin_call()
        finally:
            watch.close()
    finally:
        os.close(fd)


# -- serve_relay: ResponseReader against h11 -----------------------------------------------------


def _h11_reads(data: bytes) -> tuple[int, bytes] | None:
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/run", headers=[("host", "w")]))
    client.send(h11.EndOfMessage())
    try:
        client.receive_data(data)
        client.receive_data(b"")
        response = client.next_event()
        if not isinstance(response, h11.Response):
            return None
        body = bytearray()
        while True:
            event = client.next_event()
            if isinstance(event, h11.EndOfMessage):
                return response.status_code, bytes(body)
            if not isinstance(event, h11.Data):
                return None
            body += event.data
    except h11.RemoteProtocolError:
        return None


def serve_relay(data: bytes) -> None:
    """A worker's response fed to ResponseReader in pieces of the size the first byte
    says: only UpstreamError comes out, and a response it completes reads the same in
    h11 (the relay is only ever stricter)."""
    step, body = (max(1, data[0]), data[1:]) if data else (1, b"")
    reader = ResponseReader()
    out = bytearray()
    try:
        for k in range(0, len(body), step):
            out += b"".join(reader.feed(body[k : k + step]))
    except UpstreamError:
        return
    if reader.done and _h11_reads(body) != (reader.status, bytes(out)):
        raise AssertionError(f"ResponseReader frames a response unlike h11: {body!r:.300}")


HARNESSES: dict[str, Callable[[bytes], None]] = {
    "fastscan": fastscan,
    "unpickle": unpickle_target,
    "events": events,
    "remote_transport": remote_transport,
    "guard_block": guard_block,
    "serve_relay": serve_relay,
}
