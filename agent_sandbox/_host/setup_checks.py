"""The parent's side of a worker's handshake: what its kernel `checks` lack against its plan.

A worker applies its plan's `worker_setup` to itself (`_worker/_inworker.py`) and reports
what it read back from the kernel; the host refuses a worker whose report does not match.
The host imports nothing of the worker side, so the key names the worker acts on are
repeated here (tests/providers/test_landlock.py keeps the two tuples equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["verify_checks"]

_SECCOMP_MODE_FILTER = 2
#: The `worker_setup` keys that ask for a kernel step (the worker's `_inworker._KERNEL_KEYS`).
_KERNEL_KEYS = (
    "no_new_privs",
    "drop_caps",
    "landlock",
    "seccomp",
    "seccomp_exec",
    "scratch_tmpfs",
)


def verify_checks(setup: Mapping[str, Any], checks: Mapping[str, Any]) -> list[str]:
    """What the worker's handshake `checks` lack compared with its plan's `setup` (parent side).

    An empty list means the worker reported every restriction its plan asked for.
    """
    problems = []
    wants_kernel = any(k in setup for k in _KERNEL_KEYS)
    if wants_kernel and checks.get("no_new_privs") != 1:
        problems.append("NO_NEW_PRIVS is not set")
    if wants_kernel and checks.get("threads") != 1:
        problems.append("it was not single-threaded when it restricted itself")
    if setup.get("drop_caps") and checks.get("cap_eff") != "0" * 16:
        problems.append(f"it kept capabilities (CapEff {checks.get('cap_eff')})")
    if setup.get("landlock"):
        landlock = checks.get("landlock")
        if not isinstance(landlock, Mapping) or landlock.get("enforced") is not True:
            problems.append("Landlock is not enforced")
    if setup.get("seccomp") and checks.get("seccomp") != _SECCOMP_MODE_FILTER:
        problems.append(f"seccomp mode is {checks.get('seccomp')!r}, not a filter")
    if setup.get("scratch_tmpfs") and checks.get("scratch_tmpfs") != setup["scratch_tmpfs"].get(
        "bytes"
    ):
        problems.append("its scratch directory is not the bounded tmpfs")
    if setup.get("seccomp_exec") and checks.get("exec_denied") is not True:
        problems.append("the exec filter (no process grant) is not loaded")
    if setup.get("pins") and checks.get("pins") != len(setup["pins"]):
        problems.append("it did not check the grants the parent pinned")
    return problems
