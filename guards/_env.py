"""The environment guard: a host variable the policy does not pass is refused, not just unset.

The worker starts with only the variables `[env] pass` lets through plus `[env] set`; that
is what keeps secrets out (the parent builds the environment). This guard adds the
readable refusal: while armed, when user code reads a variable that is absent here but
exists on the host (the boot configuration lists the host's variable names, not values),
`os.environ[...]`, `os.environ.get`, `os.getenv` and the bytes twin `os.environb` raise
`EnvDenied` (a KeyError) naming the rule `env`, so "not allowed" differs from "not set".

Library code reading such a variable (a package probing `HOME`) sees it unset, as before,
and no denial is recorded: nothing was refused to the user's code.

How: the class of `os.environ`/`os.environb` is swapped (through `_patch.set_attr`, undone by
`uninstall()`) for a subclass whose `__getitem__` and `get` do the same work as the original
on a hit and call the guard only on a miss, so an allowed read costs what it did.

What it does NOT stop: nothing here hides a value, because the values are not in the worker
at all; `/proc/<pid>/environ` of other processes is a file (the file guard and the OS layer).
"""

from __future__ import annotations

import os
import sys
from _thread import get_ident

from agent_sandbox._denial import Denial
from agent_sandbox._errors import EnvDenied
from agent_sandbox._hints import glob_escape, grant_hint
from agent_sandbox.guards import _patch
from agent_sandbox.guards._state import is_user_frame, refuse, state

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["configure", "install"]

_st = state
_host_names: frozenset[str] = frozenset()
_policy_name = ""
_getframe = sys._getframe
#: Frames skipped when looking for the reader: `os.getenv` and the Mapping mixins.
_PASS_THROUGH = frozenset(
    {
        os.__file__,
        "<frozen os>",
        "<frozen _collections_abc>",
        getattr(sys.modules.get("_collections_abc"), "__file__", "") or "",
    }
)


def configure(host_env_names: Any, policy_name: str = "") -> None:
    global _host_names, _policy_name
    _host_names = frozenset(str(n) for n in host_env_names or ())
    _policy_name = policy_name


def _user_caller() -> bool:
    # 0 this function, 1 _refused, 2 __getitem__/get, 3 the reader (os.getenv is skipped)
    frame: Any = _getframe(3)
    while frame is not None:
        filename: str = frame.f_code.co_filename
        if filename not in _PASS_THROUGH:
            return is_user_frame(filename)
        frame = frame.f_back
    return False


def _refused(key: Any) -> bool:
    """On a miss: True (after recording) when user code read a host-only variable."""
    if not (_st.armed or (_st.user_threads and get_ident() in _st.user_threads)):
        return False
    name = os.fsdecode(key) if isinstance(key, bytes) else key
    if not isinstance(name, str) or name not in _host_names or not _user_caller():
        return False
    refuse(
        EnvDenied,
        Denial(
            rule="env",
            action="read",
            target=name,
            policy=_policy_name,
            detail="the variable exists on the host but the policy does not pass it",
            hint=grant_hint({"env.pass": [glob_escape(name)]}),
        ),
    )
    return False  # learning mode: behave as unset


class GuardedEnviron(os._Environ):  # type: ignore[misc,name-defined,type-arg]
    """`os._Environ` whose misses on host-only names are refused for user code."""

    def __getitem__(self, key: Any) -> Any:
        try:
            value = self._data[self.encodekey(key)]  # type: ignore[attr-defined]
        except KeyError:
            _refused(key)
            raise KeyError(key) from None
        return self.decodevalue(value)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            value = self._data[self.encodekey(key)]  # type: ignore[attr-defined]
        except KeyError:
            _refused(key)
            return default
        return self.decodevalue(value)


def install() -> None:
    for name in ("environ", "environb"):
        env = getattr(os, name, None)
        if env is not None and type(env) is os._Environ:  # type: ignore[attr-defined]
            _patch.set_attr(env, "__class__", GuardedEnviron, label=f"os.{name}.__class__")
