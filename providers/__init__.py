"""OS providers: how the worker process is started and which kernel boundary holds it.

Each provider is a pure builder (policy, worker spec) -> launch plan plus a thin launcher,
and a probe that says whether it works on this machine. See `_base.py`.
"""

from agent_sandbox.providers._auto import AutoProvider as AutoProvider
from agent_sandbox.providers._base import LaunchPlan as LaunchPlan
from agent_sandbox.providers._base import ProbeResult as ProbeResult
from agent_sandbox.providers._base import Provider as Provider
from agent_sandbox.providers._base import WorkerSpec as WorkerSpec
from agent_sandbox.providers._bwrap import BwrapProvider as BwrapProvider
from agent_sandbox.providers._firejail import FirejailProvider as FirejailProvider
from agent_sandbox.providers._landlock import LandlockProvider as LandlockProvider
from agent_sandbox.providers._registry import all_providers as all_providers
from agent_sandbox.providers._registry import get_provider as get_provider
from agent_sandbox.providers._registry import probe_all as probe_all
from agent_sandbox.providers._registry import select_provider as select_provider
from agent_sandbox.providers._subprocess import SubprocessProvider as SubprocessProvider
from agent_sandbox.providers._unshare import UnshareProvider as UnshareProvider

__all__ = [
    "AutoProvider",
    "BwrapProvider",
    "FirejailProvider",
    "LandlockProvider",
    "LaunchPlan",
    "ProbeResult",
    "Provider",
    "SubprocessProvider",
    "UnshareProvider",
    "WorkerSpec",
    "all_providers",
    "get_provider",
    "probe_all",
    "select_provider",
]
