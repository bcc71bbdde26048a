"""Time and memory of each blow-up class of issue 30 at a given size (default: the default
result cap, 4,000,000 bytes), for docs/objects.md and the issue's closing note:

    .venv/bin/python tests/fuzz/measure_blowups.py [--bytes N] [--repeat R] [--only TEXT]

Per class: the input's size, the host's answer, CPU seconds (median and range over R
runs, `time.process_time`) and the peak traced memory (one run under tracemalloc). The
pickle classes come first, then every other intake path (JSON events through the host's
SSE parser and judge, HTTP chunks, base64, images, denials, tracebacks) with its own cap
scaled from `--bytes` as the defaults scale it (output: 1.5x, one JSON event each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile

from agent_sandbox._errors import UnpickleRefused
from agent_sandbox._host.intake.unpickle import load_restricted
from agent_sandbox._host.intake.unpickle_prescan import Budgets, python_prescan

try:
    from agent_sandbox._host.intake import _fastscan
except ImportError:
    _fastscan = None  # type: ignore[assignment]


def _classes(cap: int) -> dict[str, tuple[bytes, Callable[[bytes], str]]]:
    b = Budgets(max_bytes=cap)

    def c_prescan(data: bytes) -> str:
        if _fastscan is None:
            return "no C extension"
        args = (b.max_bytes, b.max_opcodes, b.max_depth, b.max_memo, b.max_int_bytes)
        return (
            "C accepted" if _fastscan.prescan_data(data, *args, b.max_same_hash) else "C not sure"
        )

    def restricted(data: bytes) -> str:
        try:
            load_restricted(data, None, b)
            return "accepted"
        except UnpickleRefused as exc:
            return f"refused: {exc.reason[:60]}"

    def python(data: bytes) -> str:
        try:
            python_prescan(data, None, b)
            return "accepted"
        except UnpickleRefused as exc:
            return f"refused: {exc.reason[:60]}"

    # 7 levels of `width` BINGETs (2 bytes each), within the opcode budget
    width = max(1, min((cap - 40) // 14, (b.max_opcodes - 64) // 7 - 3))
    keys = max(1, (cap - 10) // 11)  # LONG1 8 bytes + NONE
    return {
        "shared tuple key (Python prescan)": (hostile.shared_tuple_key(width), python),
        "one-slot int keys (C prescan)": (hostile.int_keys_one_slot(keys), c_prescan),
        "one-slot int keys (whole decode)": (hostile.int_keys_one_slot(keys), restricted),
        "one state dict BUILT again (decode)": (
            hostile.repeated_build_state(max(1, cap // 20), max(1, cap // 6)),
            restricted,
        ),
        "deque(shared list) again (decode)": (
            hostile.repeated_copying_call(max(1, (cap - 100) // 4), max(1, (cap - 100) // 12)),
            restricted,
        ),
    }


def _intake_classes(cap: int) -> dict[str, tuple[bytes, Callable[[bytes], str]]]:
    """Every other intake path: (the bytes the worker sends, the host's reading of them)."""
    from agent_sandbox._host.intake.builder import ResultBuilder
    from agent_sandbox._host.intake.events import HostBounds
    from agent_sandbox._host.intake.framing import SSEParser
    from agent_sandbox._host.intake.transport import _Protocol
    from agent_sandbox._host.intake.unpickle import Decoder, _traceback
    from agent_sandbox._wire import value_budget

    bounds = HostBounds(output_chars=cap // 4, result_bytes=cap)
    caps = bounds.kind_caps()
    budget = value_budget(caps["result"][0])

    def judged(data: bytes, chunk: int = 65536) -> str:
        """Parsed 64 KiB at a time (one `recv`), every event judged by the builder."""
        parser = SSEParser(bounds.max_event_bytes(), caps, budget)
        builder = ResultBuilder(None, "p", bounds=bounds)
        builder.add("start", {"call": 1})
        events = 0
        try:
            for k in range(0, len(data), chunk):
                for kind, value in parser.feed(data[k : k + chunk]):
                    builder.add(kind, value)
                    events += 1
        except Exception as exc:  # the host's refusal: what ends the call
            return f"{events} ev, {type(exc).__name__}: {exc}"
        return f"{events} events accepted"

    def chunked(data: bytes) -> str:
        proto = _Protocol("t", bounds.max_event_bytes(), caps)
        proto.request("POST", "/run", {"code": ""})
        events = 0
        try:
            for k in range(0, len(data), 65536):
                events += len(proto.receive(data[k : k + 65536]))
        except Exception as exc:
            return f"{events} ev, {type(exc).__name__}: {exc}"
        return f"{events} events, done={proto.done}"

    def b64(data: bytes) -> str:
        try:
            return f"{len(Decoder(objects=True, max_bytes=cap)._bytes(data.decode()))} B"
        except UnpickleRefused as exc:
            return f"refused: {exc.reason}"

    def traceback(data: bytes) -> str:
        return "rebuilt" if _traceback(json.loads(data)) is not None else "dropped"

    def near_deadline(data: bytes) -> str:
        try:
            load_restricted(data, None, Budgets(max_bytes=cap), time.monotonic() + 0.05)
            return "accepted"
        except (TimeoutError, UnpickleRefused) as exc:
            return f"stopped: {exc}"

    ev = hostile.sse_event
    out = cap // 4 * 6  # the output event's cap: 6 bytes of JSON per character kept
    pairs = (cap - 2 * 140_000) // 2
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    one = ev("stdout", b'"x"')
    tb: dict[str, object] | None = None
    for _ in range(200):
        code = {"co_filename": "f" * 500, "co_name": "n" * 500}
        frame = {"f_code": code, "f_globals": {"__name__": "m" * 500}, "f_lineno": 10_000_000}
        tb = {"tb_frame": frame, "tb_lineno": 10_000_000, "tb_next": tb}
    detail = "the name matches 'a' in [files] hide, so it looks absent " * 280
    denial = {"rule": "files.read", "action": "read", "target": "/t", "detail": detail[:16000]}
    denials = b"".join(
        ev("denial", json.dumps({**denial, "target": f"/t{k}"}).encode())
        for k in range(cap // 8000)
    )
    return {
        "escaped quotes, unterminated (JSON count)": (
            ev("result", hostile.escaped_quote_run(pairs, 140_000)),
            judged,
        ),
        "[{},{},...] as output (JSON decode)": (
            ev("stdout", hostile.empty_objects((out - 64) // 3)),
            judged,
        ),
        "[{},{},...] as an image (JSON decode)": (
            ev("image", hostile.empty_objects((cap - 64) // 3)),
            judged,
        ),
        "[[[[...]]]] as a result (JSON depth)": (
            ev("result", b"[" * (cap // 2) + b"]" * (cap // 2)),
            judged,
        ),
        "many 1-char output events": (one * (cap // len(one)), judged),
        "one output event, 16-byte reads": (
            ev("stdout", json.dumps("x" * (cap // 4 - 64)).encode()),
            lambda d: judged(d, 16),
        ),
        "1-byte HTTP chunks (h11 + parser)": (
            head + b"".join(b"1\r\n" + bytes([c]) + b"\r\n" for c in one * (cap // 6 // 12)),
            chunked,
        ),
        "non-canonical base64 pickle text": (
            b"A" * ((cap // 3) * 4 - 4) + b"AB==",
            b64,
        ),
        "image of base64 at the cap": (
            ev(
                "image",
                json.dumps({"name": "a", "mime": "image/png", "data": "A" * (cap - 1024)}).encode(),
            ),
            judged,
        ),
        "denials with 16K-char details": (denials, judged),
        "200-frame traceback, line 10**7": (json.dumps(tb).encode(), traceback),
        "Fraction list, deadline in 50 ms": (
            hostile.long_pickle_with_globals(max(1, (cap - 100) // 11)),
            near_deadline,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=4_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default="", help="run only the classes whose name has this")
    args = parser.parse_args()
    classes = {**_classes(args.bytes), **_intake_classes(args.bytes)}
    for name, (data, run) in classes.items():
        if args.only not in name:
            continue
        times = []
        answer = ""
        for _ in range(args.repeat):
            start = time.process_time()
            answer = run(data)
            times.append(time.process_time() - start)
        tracemalloc.start()
        run(data)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(
            f"{name:42} {len(data):>9} B  {answer:44.44}  cpu median {statistics.median(times):.3f}s "
            f"(range {min(times):.3f}-{max(times):.3f}, n={len(times)})  peak {peak / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
