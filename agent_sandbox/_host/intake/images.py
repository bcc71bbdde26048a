"""What an image from a worker decodes to, read from its headers: format, size, frames.

A worker chooses every byte of an image it returns, and a model (or a viewer) that decodes
it pays for what the headers promise, not for the file's size: a 30 kB PNG can declare
60000 x 60000 pixels. The host reads the headers of PNG, JPEG, GIF and WebP here, without
decoding any pixel data, and the builder drops an image whose size or frame count is past
the policy's `limits.image_pixels` / `limits.image_frames` (with a notice in the host's
words). Every reader walks the data once, forward, and never allocates by what it reads.

What this does not do: check that the pixel data is well formed (the headers and the
frame structure are all that is read), or judge formats other than these four (they are
refused as unknown).
"""

from __future__ import annotations

import dataclasses
import struct

__all__ = ["ImageInfo", "ImageRejected", "image_info"]


class ImageRejected(ValueError):
    """The bytes are not an image this module can measure (the reason is the message)."""


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """An image's format (`png`, `jpeg`, `gif`, `webp`), size in pixels and frame count."""

    format: str
    width: int
    height: int
    frames: int

    @property
    def pixels(self) -> int:
        """Pixels of one frame."""
        return self.width * self.height


_PNG = b"\x89PNG\r\n\x1a\n"


def image_info(data: bytes) -> ImageInfo:
    """The format, size and frames `data` declares; `ImageRejected` when it cannot tell."""
    if data.startswith(_PNG):
        return _png(data)
    if data.startswith(b"\xff\xd8\xff"):
        return _jpeg(data)
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return _gif(data)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp(data)
    raise ImageRejected("not a PNG, JPEG, GIF or WebP image")


def _png(data: bytes) -> ImageInfo:
    # The first chunk is IHDR (13 bytes: width, height, ...); an animated PNG carries acTL
    # (its frame count) before the first IDAT. Chunks are walked up to IDAT.
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise ImageRejected("a PNG without its IHDR header")
    width, height = struct.unpack_from(">II", data, 16)
    frames, pos = 1, 8
    while pos + 8 <= len(data):
        (size,) = struct.unpack_from(">I", data, pos)
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT" or kind == b"IEND":
            break
        if kind == b"acTL" and size >= 8 and pos + 16 <= len(data):
            (frames,) = struct.unpack_from(">I", data, pos + 8)
        pos += 12 + size
    return _checked("png", width, height, max(frames, 1))


def _jpeg(data: bytes) -> ImageInfo:
    # Segments after SOI: a marker (0xFF, kind), a 2-byte length; a start-of-frame marker
    # (SOF0..SOF15 but DHT/JPG/DAC) carries precision, height, width.
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            raise ImageRejected("a JPEG segment without its marker")
        kind = data[pos + 1]
        if kind == 0xFF:  # fill byte
            pos += 1
            continue
        if 0xD0 <= kind <= 0xD9 or kind == 0x01:  # markers without a length
            pos += 2
            continue
        (size,) = struct.unpack_from(">H", data, pos + 2)
        if 0xC0 <= kind <= 0xCF and kind not in (0xC4, 0xC8, 0xCC):
            if pos + 9 > len(data):
                break
            height, width = struct.unpack_from(">HH", data, pos + 5)
            return _checked("jpeg", width, height, 1)
        if size < 2:
            raise ImageRejected("a JPEG segment of a bad length")
        pos += 2 + size
    raise ImageRejected("a JPEG without a frame header")


def _gif(data: bytes) -> ImageInfo:
    # Logical screen size, then blocks: image descriptors (0x2C, each a frame), extensions
    # (0x21) and the trailer (0x3B); colour tables and data sub-blocks are skipped.
    if len(data) < 13:
        raise ImageRejected("a GIF without its screen descriptor")
    width, height = struct.unpack_from("<HH", data, 6)
    pos = 13 + (3 << ((data[10] & 7) + 1) if data[10] & 0x80 else 0)
    frames = 0
    while pos < len(data):
        block = data[pos]
        if block == 0x3B:
            break
        if block == 0x2C:
            if pos + 10 > len(data):
                break
            flags = data[pos + 9]
            frames += 1
            pos += 10 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0) + 1  # + LZW size
        elif block == 0x21:
            pos += 2
        else:
            raise ImageRejected("a GIF with an unknown block")
        while pos < len(data) and data[pos] != 0:  # data sub-blocks
            pos += data[pos] + 1
        pos += 1
    return _checked("gif", width, height, max(frames, 1))


def _webp(data: bytes) -> ImageInfo:
    # RIFF chunks: VP8 (lossy: 14-bit sizes after a start code), VP8L (lossless: 14-bit
    # sizes packed after 0x2F), VP8X (extended: 24-bit canvas size; ANMF chunks are frames).
    pos, size, frames = 12, None, 0
    while pos + 8 <= len(data):
        kind = data[pos : pos + 4]
        (length,) = struct.unpack_from("<I", data, pos + 4)
        body = pos + 8
        if kind == b"VP8X" and body + 10 <= len(data):
            width = 1 + int.from_bytes(data[body + 4 : body + 7], "little")
            height = 1 + int.from_bytes(data[body + 7 : body + 10], "little")
            size = (width, height)
        elif kind == b"VP8 " and size is None and body + 10 <= len(data):
            if data[body + 3 : body + 6] != b"\x9d\x01\x2a":
                raise ImageRejected("a WebP VP8 frame without its start code")
            w, h = struct.unpack_from("<HH", data, body + 6)
            size = (w & 0x3FFF, h & 0x3FFF)
        elif kind == b"VP8L" and size is None and body + 5 <= len(data):
            if data[body] != 0x2F:
                raise ImageRejected("a WebP VP8L frame without its signature")
            bits = int.from_bytes(data[body + 1 : body + 5], "little")
            size = (1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF))
        elif kind == b"ANMF":
            frames += 1
        pos = body + length + (length & 1)
    if size is None:
        raise ImageRejected("a WebP without a frame size")
    return _checked("webp", size[0], size[1], max(frames, 1))


def _checked(fmt: str, width: int, height: int, frames: int) -> ImageInfo:
    if width <= 0 or height <= 0:
        raise ImageRejected(f"a {fmt.upper()} of {width} x {height} pixels")
    return ImageInfo(fmt, width, height, frames)
