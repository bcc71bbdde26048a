"""Output that cannot hurt: every string from a worker is text, every image is measured.

The rule for text (`framing.valid_text`): a lone surrogate, the only thing a strict UTF-8
JSON event can still carry that is not text, becomes U+FFFD. Images are measured from their
headers (`intake/images.py`) against `limits.image_pixels` and `limits.image_frames`.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib

import pytest

from agent_sandbox._host.intake.builder import ResultBuilder
from agent_sandbox._host.intake.events import HostBounds
from agent_sandbox._host.intake.framing import SSEParser, valid_text
from agent_sandbox._host.intake.images import ImageRejected, image_info
from agent_sandbox._wire import encode_event


def _feed(kind: str, data: object) -> object:
    (event,) = SSEParser(1_000_000).feed(encode_event(kind, data))
    return event[1]


def test_a_lone_surrogate_from_the_worker_becomes_a_replacement_character() -> None:
    """It denies the host a string it cannot encode: `print('\\ud800')` arrives as U+FFFD."""
    assert _feed("stdout", "a\ud800b") == "a\ufffdb"
    got = _feed("result", {"k\udfff": ["\udc80", {"x": "\ud83d"}], "ok": "\U0001f600"})
    assert got == {"k\ufffd": ["\ufffd", {"x": "\ufffd"}], "ok": "\U0001f600"}
    # Everything the host keeps can now be written as UTF-8 JSON.
    json.dumps(got, ensure_ascii=False).encode("utf-8")


def test_a_surrogate_pair_escaped_in_json_stays_one_character() -> None:
    """It keeps a valid astral character sent as an escaped pair (json joins the pair)."""
    raw = b'event: stdout\ndata: "\\ud83d\\ude00"\n\n'
    assert SSEParser(1000).feed(raw) == [("stdout", "\U0001f600")]


def test_a_deep_value_is_made_valid_without_recursion() -> None:
    """It walks a deeply nested value iteratively (no RecursionError)."""
    value: object = "\ud800"
    for _ in range(5000):
        value = [value]
    out = valid_text(value)
    for _ in range(5000):
        assert isinstance(out, list)
        out = out[0]
    assert out == "\ufffd"


def test_the_builder_keeps_output_that_encodes() -> None:
    b = ResultBuilder(policy="t", call=1)
    b.add("start", {"call": 1})
    b.add(*SSEParser(10_000).feed(encode_event("stdout", "\ud800\n"))[0])
    b.add("result", {"value": None})
    b.add("done", {"duration": 0.0, "discard": False, "denials": 0})
    result = b.build()
    assert result.stdout == "\ufffd\n"
    result.to_json().encode("utf-8")


# -- images --------------------------------------------------------------------------------


def _png(width: int, height: int, frames: int | None = None) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    actl = chunk(b"acTL", struct.pack(">II", frames, 0)) if frames else b""
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + actl
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )


def _jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + b"\x01\x01\0\0\x01\0\x01\0\0"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


def _gif(width: int, height: int, frames: int) -> bytes:
    head = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\0" * 6
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00"
    return head + b"\x21\xf9\x04\x00\x00\x00\x00\x00" + frame * frames + b"\x3b"


def _webp_vp8x(width: int, height: int, frames: int) -> bytes:
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x02\0\0\0"
    vp8x += (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    anmf = (b"ANMF" + struct.pack("<I", 16) + b"\0" * 16) * frames
    body = b"WEBP" + vp8x + anmf
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _webp_vp8l(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    chunk = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + bits.to_bytes(4, "little") + b"\0"
    body = b"WEBP" + chunk
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (_png(640, 480), ("png", 640, 480, 1)),
        (_png(10, 10, frames=300), ("png", 10, 10, 300)),
        (_jpeg(1920, 1080), ("jpeg", 1920, 1080, 1)),
        (_gif(32, 16, 5), ("gif", 32, 16, 5)),
        (_webp_vp8x(4000, 3000, 7), ("webp", 4000, 3000, 7)),
        (_webp_vp8l(100, 50), ("webp", 100, 50, 1)),
    ],
)
def test_image_headers_say_what_an_image_decodes_to(
    data: bytes, expected: tuple[str, int, int, int]
) -> None:
    info = image_info(data)
    assert (info.format, info.width, info.height, info.frames) == expected


@pytest.mark.parametrize(
    "data", [b"", b"GIF89a", b"\x89PNG\r\n\x1a\nxxxx", b"<svg/>", b"\xff\xd8\xff"]
)
def test_bytes_that_are_not_a_measurable_image_are_rejected(data: bytes) -> None:
    with pytest.raises(ImageRejected):
        image_info(data)


def _image_builder(**bounds: int) -> ResultBuilder:
    b = ResultBuilder(bounds=HostBounds(**bounds), policy="t", call=1)
    b.add("start", {"call": 1})
    return b


def _image(data: bytes, name: str = "p.png") -> dict[str, str]:
    return {"name": name, "mime": "image/png", "data": base64.b64encode(data).decode()}


def test_a_decompression_bomb_png_is_not_returned() -> None:
    """It denies a 60000 x 60000 PNG of a few bytes a place in the result, and says why."""
    b = _image_builder()
    kind, text = b.add("image", _image(_png(60_000, 60_000))) or ("", "")
    assert kind == "notice" and "60000 x 60000" in text and "limits.image_pixels" in text
    assert b.images == [] and b.notices == [text]
    assert b.add("image", _image(_png(800, 600)))[0] == "image"  # type: ignore[index]
    assert [i.name for i in b.images] == ["p.png"]


def test_an_animated_png_past_the_frame_bound_is_not_returned() -> None:
    """It denies an APNG of 300 frames (the default allows one)."""
    b = _image_builder()
    assert b.add("image", _image(_png(10, 10, frames=300)))[0] == "notice"  # type: ignore[index]
    assert "limits.image_frames" in b.notices[0] and b.images == []
    b = _image_builder(image_frames=500)
    assert b.add("image", _image(_png(10, 10, frames=300)))[0] == "image"  # type: ignore[index]


def test_an_image_named_png_that_is_not_one_is_not_returned() -> None:
    """It denies JPEG, GIF and unknown bytes sent as `image/png` (the model is told PNG)."""
    for data in (_jpeg(10, 10), _gif(1, 1, 1), b"<svg onload=x>"):
        b = _image_builder()
        assert b.add("image", _image(data, "x\n.png"))[0] == "notice"  # type: ignore[index]
        assert b.images == [] and "\n" not in b.notices[0]


def test_the_policy_bound_reaches_the_host() -> None:
    from agent_sandbox import Policy

    policy = Policy.model_validate(
        {"name": "p", "limits": {"image_pixels": 100, "image_frames": 2}}
    )
    bounds = HostBounds.from_policy(policy)
    assert (bounds.image_pixels, bounds.image_frames) == (100, 2)


def test_objects_mode_applies_the_same_rule_to_text() -> None:
    """It returns a lone surrogate in an objects-mode value as U+FFFD (the worker applies the
    rule to plain containers; bytes that look like one stay bytes), never a refusal."""
    from agent_sandbox import Sandbox
    from agent_sandbox.policies._load import policy_from_dict

    policy = policy_from_dict({"name": "o", "result_mode": "objects"})
    with Sandbox(policy, warm=0) as sandbox:
        result = sandbox.run("['a\\ud800', {'k\\udfff': ('x',)}, b'\\xed\\xa0\\x80']")
    assert result.error is None, result.error
    assert result.value == ["a\ufffd", {"k\ufffd": ("x",)}, b"\xed\xa0\x80"]
