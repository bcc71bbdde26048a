"""Type stub of the C extension `_fastscan.c` (the host's pickle prescan for plain data,
strict base64, and the decoder of a pickle that is one bytes value)."""

__all__ = ["VERSION", "b64decode", "decode_blob", "prescan_data", "probes", "vector"]

VERSION: int

def prescan_data(
    data: bytes,
    max_bytes: int,
    max_opcodes: int,
    max_depth: int,
    max_memo: int,
    max_int_bytes: int,
    max_same_hash: int,
    /,
) -> bool: ...
def b64decode(text: str, /) -> bytes | None: ...
def decode_blob(
    text: str, max_bytes: int, max_opcodes: int, max_memo: int, /
) -> bytes | bytearray | None: ...
def probes() -> int: ...
def vector(enabled: bool | None = None, /) -> bool: ...
