"""Type stub of the C extension `_fastscan.c` (the host's pickle prescan for plain data and
strict base64)."""

__all__ = ["VERSION", "b64decode", "prescan_data"]

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
