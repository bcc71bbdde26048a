"""Coverage-guided fuzz targets (atheris) for what the host reads from a worker.

Run one target by hand, for as long as you like:

    .venv/bin/python tests/host/intake/fuzz_targets.py unpickle -max_total_time=600
    .venv/bin/python tests/host/intake/fuzz_targets.py sse -runs=100000
    .venv/bin/python tests/host/intake/fuzz_targets.py events
    .venv/bin/python tests/host/intake/fuzz_targets.py decode -max_total_time=600

Targets:

* `unpickle`: `load_restricted` on arbitrary bytes (seeded with valid protocol-5 pickles).
* `sse`: the SSE parser fed the input in two chunks at a point the input chooses.
* `decode`: the C base64 decoders (`b64decode`, and `decode_blob` for a pickle that is one
  bytes value) against strict `binascii` and `load_restricted`, on the input's base64 (a
  pickle, by default) or, after a leading 0x01, on the input itself as text; the vector
  loop is on or off as the input's last byte says.
* `events`: one SSE stream through the parser into `ResultBuilder` with an objects-mode
  decoder, then `raise_error()`.

The oracle in every target: only `UnpickleRefused` / `TransportError` may escape, an audit
hook fails the run on any import, `os.system`, `subprocess.Popen`, `exec` or `compile`
during decoding, and libFuzzer itself reports hangs and crashes.
`test_fuzz_smoke.py` runs each target briefly.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import decimal
import pickle
import sys
import uuid
from typing import Any

import atheris


def _bare_package() -> None:
    """Map `agent_sandbox` as a bare package (as the worker does), so its `__init__` (and
    pydantic) is not imported and only the modules under test get instrumented."""
    import importlib.util
    import types

    if "agent_sandbox" in sys.modules:
        return
    spec = importlib.util.find_spec("agent_sandbox")
    assert spec is not None and spec.submodule_search_locations
    package = types.ModuleType("agent_sandbox")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["agent_sandbox"] = package


# Not `_bare_package()`: a bare package does not find `agent_sandbox.guards` (the C
# extension lives where the package's own import set-up points), so the `decode` target
# silently checked nothing (issue 30). Kept for reference.
with atheris.instrument_imports(include=["agent_sandbox"]):
    from agent_sandbox._errors import ChildException, TransportError, UnpickleRefused
    from agent_sandbox._host.intake.builder import ResultBuilder
    from agent_sandbox._host.intake.framing import SSEParser
    from agent_sandbox._host.intake.unpickle import Decoder, load_restricted
    from agent_sandbox._host.intake.unpickle_classes import Allowlist
    from agent_sandbox._host.intake.unpickle_prescan import Budgets

import tblib  # noqa: E402,F401 - imported now: the decoder imports it lazily

try:
    from agent_sandbox._host.intake import _fastscan
except ImportError:  # not built: the `decode` target has nothing to check
    _fastscan = None

_ACTIVE = False
_FORBIDDEN = (
    "import",
    "os.system",
    "subprocess.Popen",
    "exec",
    "compile",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "socket.connect",
)


def _hook(event: str, args: Any) -> None:
    if _ACTIVE and event in _FORBIDDEN:
        # tblib compiles and execs a fixed stub to make traceback objects; that is allowed.
        if event in ("exec", "compile") and _in_tblib():
            return
        raise SystemExit(f"forbidden audit event during decoding: {event} {args!r:.200}")


def _in_tblib() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "tblib" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


sys.addaudithook(_hook)

SEEDS = [
    pickle.dumps(v, protocol=5)
    for v in (
        {"a": [1, 2.5, "x", b"y", None, True]},
        (datetime.datetime(2020, 1, 2, tzinfo=datetime.UTC), decimal.Decimal("1.5")),
        {frozenset({1, 2}), (1, 2)},
        uuid.UUID(int=5),
        [ValueError("x"), range(3), slice(1, 2), complex(1, 2)],
    )
]
_DECODER = Decoder(objects=True, max_bytes=1_000_000)


def target_unpickle(data: bytes) -> None:
    global _ACTIVE
    _ACTIVE = True
    try:
        load_restricted(data, Allowlist(), Budgets(max_bytes=100_000))
    except UnpickleRefused:
        pass
    finally:
        _ACTIVE = False


def target_sse(data: bytes) -> None:
    cut = data[0] if data else 0
    body = data[1:]
    parser = SSEParser(4096)
    try:
        parser.feed(body[:cut])
        parser.feed(body[cut:])
    except TransportError:
        pass


def target_events(data: bytes) -> None:
    global _ACTIVE
    builder = ResultBuilder(_DECODER)
    _ACTIVE = True
    try:
        builder.add("start", {"call": 1})
        for kind, payload in SSEParser(1_000_000).feed(data):
            builder.add(kind, payload)
        result = builder.build()
        try:
            result.raise_error()
        except (Exception, ChildException):  # any host-side Exception type is fine
            pass
    except TransportError:
        pass
    finally:
        _ACTIVE = False


def target_decode(data: bytes) -> None:
    if _fastscan is None:
        return
    _fastscan.vector(bool(data[-1:]) and data[-1] & 1 == 1)
    as_text = data[:1] == b"\x01"
    text = data[1:].decode("latin-1") if as_text else base64.b64encode(data).decode()
    try:
        strict: bytes | None = binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        strict = None
    fast = _fastscan.b64decode(text)
    if fast is not None and fast != strict:
        raise AssertionError(f"b64decode differs from binascii on {text!r:.200}")
    if strict is not None and base64.b64encode(strict).decode() == text and fast != strict:
        raise AssertionError(f"b64decode refused canonical text {text!r:.200}")
    budgets = Budgets(max_bytes=100_000)
    blob = _fastscan.decode_blob(text, budgets.max_bytes, budgets.max_opcodes, budgets.max_memo)
    if blob is None:
        return
    if strict is None:
        raise AssertionError(f"decode_blob accepted bad base64 {text!r:.200}")
    global _ACTIVE
    _ACTIVE = True
    try:
        value = load_restricted(strict, Allowlist(), budgets)
    except UnpickleRefused:
        raise AssertionError(
            f"decode_blob accepted what the prescan refuses {strict!r:.200}"
        ) from None
    finally:
        _ACTIVE = False
    if type(value) is not type(blob) or value != blob:
        raise AssertionError(f"decode_blob differs from load_restricted on {strict!r:.200}")


TARGETS = {
    "unpickle": target_unpickle,
    "sse": target_sse,
    "events": target_events,
    "decode": target_decode,
}


def main(argv: list[str]) -> None:
    name = argv[1]
    target = TARGETS[name]
    atheris.Setup([argv[0], *argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
