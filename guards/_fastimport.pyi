"""Type stub of the C extension `_fastimport.c` (the import guard's fast path)."""

from collections.abc import Callable
from typing import Any, final

__all__ = ["FastImport"]

@final
class FastImport:
    """`__import__` for user code: an allowed, loaded module from C, else `slow(...)`."""

    def __new__(
        cls, ok: set[str], modules: dict[str, Any], slow: Callable[..., Any], /
    ) -> FastImport: ...
    def __call__(
        self,
        name: str,
        globals: Any = ...,
        locals: Any = ...,
        fromlist: Any = ...,
        level: int = ...,
    ) -> Any: ...
