"""A switch for the test suite only: turn a kernel protection off, to show that the
containment tests fail without it (issue 29: a suite that cannot pass by accident).

`AGENT_SANDBOX_TEST_DISABLE=landlock,seccomp` makes the probe of each named protection say
it is unavailable, so no provider stacks it (and the handshake expects it nowhere). It is
honoured only in a process that runs pytest (the `_pytest` package is imported); in any
other process the variable's presence is an error (`ProviderUnavailable`, naming it), so it
can never weaken a real agent's sandbox.

What it does NOT do: switch off the namespaces of bwrap or unshare, firejail's own filters,
the VM, or the Python guards.
"""

from __future__ import annotations

import os
import sys

from agent_sandbox._errors import ProviderUnavailable

__all__ = ["KNOWN", "VARIABLE", "disabled"]

VARIABLE = "AGENT_SANDBOX_TEST_DISABLE"
#: What the switch can turn off.
KNOWN = frozenset({"landlock", "seccomp"})


def disabled(protection: str) -> str:
    """The reason `protection` is switched off for this test run ("" when it is not)."""
    raw = os.environ.get(VARIABLE, "")
    if not raw:
        return ""
    if "_pytest" not in sys.modules:
        raise ProviderUnavailable(
            "sandbox",
            f"{VARIABLE} is set ({raw!r}): it switches kernel protections off for the test "
            f"suite only and is refused anywhere else; unset it",
        )
    names = {n.strip() for n in raw.split(",")} - {""}
    unknown = names - KNOWN
    if unknown:
        raise ProviderUnavailable(
            "sandbox", f"{VARIABLE} names {sorted(unknown)}; it knows {sorted(KNOWN)}"
        )
    if protection in names:
        return f"switched off for this test run ({VARIABLE}={raw})"
    return ""
