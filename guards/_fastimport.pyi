"""Type stub of the C extension `_fastimport.c` (the import guard's fast path, module views,
and the arming state)."""

from collections.abc import Callable
from types import ModuleType
from typing import Any, final

__all__ = ["ArmState", "FastImport", "ModuleView", "VERSION", "state"]

VERSION: int

@final
class FastImport:
    """`__import__` for user code: an allowed, loaded module (or its view) from C, else
    `slow(...)`."""

    def __new__(
        cls,
        ok: set[str],
        modules: dict[str, Any],
        slow: Callable[..., Any],
        views: dict[str, Any] | None = ...,
        /,
    ) -> FastImport: ...
    def __call__(
        self,
        name: str,
        globals: Any = ...,
        locals: Any = ...,
        fromlist: Any = ...,
        level: int = ...,
    ) -> Any: ...

@final
class ModuleView(ModuleType):
    """A module as user code sees it; a module reached through it goes through `hook`."""

    def __new__(cls, real: ModuleType, hook: Callable[[Any, str, Any], Any], /) -> ModuleView: ...

@final
class ArmState:
    """The guards' arming state: `armed` is counted on every write; the rest is sealed."""

    armed: bool
    learn: bool
    policy_name: str
    trusted_roots: tuple[str, ...]
    user_threads: set[int]
    @property
    def sealed(self) -> bool: ...
    def seal(self) -> None: ...

state: ArmState

def block_info() -> dict[str, int]: ...
def block_read() -> tuple[int, int, int]: ...
