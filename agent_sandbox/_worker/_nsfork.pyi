"""Type stub of the C extension `_nsfork.c` (a namespace template's fork of a worker)."""

__all__ = ["VERSION", "fork_worker"]

VERSION: int

def fork_worker(log_fd: int, cred_fd: int, init: str, /) -> tuple[str, int]: ...
