"""Run one fuzz harness under atheris (coverage-guided), or write the seed corpus.

    .venv/bin/python tests/fuzz/run.py unpickle tests/fuzz/corpus/unpickle -max_total_time=600
    .venv/bin/python tests/fuzz/run.py seed          # (re)writes tests/fuzz/corpus/*/seed-*
    .venv/bin/python tests/fuzz/run.py replay NAME FOLDER SECONDS ARTIFACTS
                                     # every input, then seeded mutations (no coverage)

Any libFuzzer option passes through (`-runs=`, `-max_total_time=`, `-timeout=`,
`-artifact_prefix=`, corpus folders). libFuzzer prints executions (`#N`) and the final
`stat::` lines with `-print_final_stats=1`; `scripts/fuzz-long.sh` runs every harness.
"""

from __future__ import annotations

import datetime
import decimal
import pickle
import random
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def seeds() -> dict[str, list[bytes]]:
    import hostile

    values = [
        {"a": [1, 2.5, "x", b"y", None, True]},
        (datetime.datetime(2020, 1, 2, tzinfo=datetime.UTC), decimal.Decimal("1.5")),
        {frozenset({1, 2}), (1, 2)},
        uuid.UUID(int=5),
        [ValueError("x"), range(3), slice(1, 2), complex(1, 2)],
        b"z" * 300,
        bytearray(b"w" * 40),
    ]
    pickles = [pickle.dumps(v, protocol=5) for v in values]
    attacks = [
        hostile.SMALLEST_FRAME_SPLIT,
        hostile.fraction_from_string(),
        hostile.build_on_class(),
        hostile.frame_in_frame(),
        hostile.shared_tuple_key(6),
        hostile.int_keys_one_slot(300),
        b"\x80\x05\x95\x01\x00\x00\x00\x00\x00\x00\x00C\x05hello\x94.",  # frame < blob header
    ]
    ok = b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    sse = b'event: stdout\ndata: "hi"\n\nevent: done\ndata: {}\n\n'
    body = b"%x\r\n%b\r\n0\r\n\r\n" % (len(sse), sse)
    bare = b"HTTP/1.1 200 \ntransfer-encoding: chunked\n\n5\r\nhello\r\n0\r\n\r\n"
    import base64

    import harnesses

    layout = harnesses._LAYOUT
    blocks = [
        layout.pack(0x5A5A5A5A, 1, 1, 0, 0xA5A5A5A5) + layout.pack(0x5A5A5A5A, 2, 0, 0, 0xA5A5A5A5),
        layout.pack(0x5A5A5A5A, 3, 1, 0, 0xA5A5A5A5),
    ]
    return {
        "fastscan": [b"\x00\x00" + p for p in pickles + attacks]
        + [b"\x01\x01" + base64.b64encode(p) for p in pickles[-2:]],
        "unpickle": pickles + attacks,
        "events": [b"\x10" + sse, b"\x05event: result\ndata: " + b'{"encoding": "pickle-b64"}\n\n'],
        "remote_transport": [b"\x20" + ok + body, b"\x03" + bare],
        "guard_block": [b"\x02" + blocks[0], b"\x01" + blocks[1]],
        "serve_relay": [b"\x01" + ok + body, b"\x07" + bare, b"\xff" + ok + body],
    }


def write_seeds() -> None:
    for name, items in seeds().items():
        folder = HERE / "corpus" / name
        folder.mkdir(parents=True, exist_ok=True)
        for k, data in enumerate(items):
            (folder / f"seed-{k:02d}").write_bytes(data)


def mutate(data: bytes, rng: random.Random, pool: list[bytes]) -> bytes:
    """One random edit: flip, insert, delete, copy a run, splice another input, or set a
    little-endian length field to a nearby value (what moves a frame's end)."""
    out = bytearray(data)
    pick = rng.randrange(6)
    at = rng.randrange(len(out) + 1)
    if pick == 0 and out:
        out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
    elif pick == 1:
        out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    elif pick == 2:
        del out[at : at + rng.randrange(1, 9)]
    elif pick == 3 and out:
        start = rng.randrange(len(out))
        out[at:at] = out[start : start + rng.randrange(1, 33)]
    elif pick == 4 and pool:
        other = rng.choice(pool)
        out = out[:at] + other[rng.randrange(len(other) + 1) :]
    elif out:
        width = rng.choice((1, 2, 4, 8))
        at = min(at, max(0, len(out) - width))
        value = int.from_bytes(out[at : at + width], "little") + rng.randrange(-9, 10)
        out[at : at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(out[:8192])


def replay(name: str, folder: Path, seconds: float, artifacts: Path) -> None:
    """Every input in `folder`, then seeded random mutations of them until `seconds` of
    CPU time have passed (for the sanitized builds, where libFuzzer's coverage feedback
    does not work); prints the executions; writes a failing input to `artifacts`."""
    import harnesses

    target = harnesses.HARNESSES[name]
    pool = [p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()]
    rng = random.Random(30)
    runs = 0
    start = time.process_time()
    queue = iter(pool)
    while True:
        data = next(queue, None)
        if data is None:
            if time.process_time() - start > seconds or not pool:
                break
            data = mutate(rng.choice(pool), rng, pool)
        try:
            target(data)
        except BaseException:
            artifacts.mkdir(parents=True, exist_ok=True)
            (artifacts / f"crash-{name}-{runs}").write_bytes(data)
            raise
        runs += 1
    print(f"stat::number_of_executed_units: {runs}")


def main(argv: list[str]) -> None:
    if argv[1:2] == ["seed"]:
        write_seeds()
        return
    if argv[1:2] == ["replay"]:
        replay(argv[2], Path(argv[3]), float(argv[4]), Path(argv[5]))
        return
    import atheris

    # The whole package is imported (not a bare one): `agent_sandbox.guards` (the C
    # extension) is only found through the package's own import set-up.

    with atheris.instrument_imports(include=["agent_sandbox"]):
        import harnesses
    target = harnesses.HARNESSES[argv[1]]
    atheris.Setup([argv[0], *argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
