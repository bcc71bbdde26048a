"""Provider lookup by name, and the `auto` choice.

`get_provider(name)` returns the provider object; `select_provider(name)` also probes it and
raises `ProviderUnavailable` when an explicitly named provider cannot run. `auto` picks the
strongest available stack and says which in the plan's `stack`.
"""

from __future__ import annotations

from agent_sandbox._errors import ProviderUnavailable
from agent_sandbox.providers._auto import AutoProvider
from agent_sandbox.providers._base import ProbeResult, Provider
from agent_sandbox.providers._bwrap import BwrapProvider
from agent_sandbox.providers._firejail import FirejailProvider
from agent_sandbox.providers._landlock import LandlockProvider
from agent_sandbox.providers._subprocess import SubprocessProvider
from agent_sandbox.providers._unshare import UnshareProvider
from agent_sandbox.providers.gvisor.provider import GvisorProvider

__all__ = ["all_providers", "get_provider", "probe_all", "select_provider"]

_REGISTRY: dict[str, type[Provider]] = {
    SubprocessProvider.name: SubprocessProvider,
    LandlockProvider.name: LandlockProvider,
    BwrapProvider.name: BwrapProvider,
    UnshareProvider.name: UnshareProvider,
    FirejailProvider.name: FirejailProvider,
    GvisorProvider.name: GvisorProvider,
}
#: Providers whose module is imported when first asked for (the qemu one brings its image
#: builder): name -> (module, class).
_DEFERRED: dict[str, tuple[str, str]] = {
    "qemu": ("agent_sandbox.providers.qemu.provider", "QemuProvider"),
}


def _load_deferred() -> None:
    import importlib

    for name, (module, attr) in list(_DEFERRED.items()):
        _REGISTRY.setdefault(name, getattr(importlib.import_module(module), attr))
        _DEFERRED.pop(name, None)


def register(cls: type[Provider]) -> type[Provider]:
    """Add a provider class to the registry (used by the provider modules)."""
    _REGISTRY[cls.name] = cls
    return cls


def all_providers() -> list[Provider]:
    """One instance of every known provider, strongest first."""
    _load_deferred()
    return sorted((cls() for cls in _REGISTRY.values()), key=lambda p: -p.strength)


def get_provider(name: str) -> Provider:
    """The provider called `name` (not probed)."""
    if name == "auto":
        return _auto()
    if name in _DEFERRED:
        _load_deferred()
    try:
        return _REGISTRY[name]()
    except KeyError:
        known = ", ".join(sorted([*_REGISTRY, *_DEFERRED, "auto"]))
        raise ProviderUnavailable(name, f"no such provider (known: {known})") from None


def select_provider(name: str) -> Provider:
    """The provider called `name`, probed; an unavailable one is an error, never a downgrade."""
    provider = get_provider(name)
    provider.require()
    return provider


def probe_all() -> list[ProbeResult]:
    """Probe every provider (for `agent-sandbox doctor`)."""
    return [p.probe() for p in all_providers()]


def _auto() -> Provider:
    # Chooses per policy, at build time: the deepest stack that works (see `_auto.py`).
    return AutoProvider()
