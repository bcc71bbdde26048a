"""agent_sandbox: run an LLM agent's Python in a sandboxed worker under a per-tool policy.

Layout (see docs/architecture.md): this package is the public API and the modules both
sides share; `agent_sandbox._host` runs in the agent's process and never trusts a worker,
`agent_sandbox._worker` runs inside the sandbox, `agent_sandbox._tools` holds the CLI,
learning mode and the demo. `agent_sandbox.policies` is the policy model,
`agent_sandbox.providers` the OS sandboxes,
`agent_sandbox.guards` the Python-level guards that run inside the worker, and
`agent_sandbox.adapters` the LangChain and CrewAI tools.
"""

import importlib as _importlib
import os as _os
import sys as _sys
import typing as _typing

from agent_sandbox._denial import RULES as RULES
from agent_sandbox._denial import Denial as Denial
from agent_sandbox._errors import AttributeDenied as AttributeDenied
from agent_sandbox._errors import CallDenied as CallDenied
from agent_sandbox._errors import CapacityError as CapacityError
from agent_sandbox._errors import ChildException as ChildException
from agent_sandbox._errors import CodeRejected as CodeRejected
from agent_sandbox._errors import EnvDenied as EnvDenied
from agent_sandbox._errors import FileAccessDenied as FileAccessDenied
from agent_sandbox._errors import FileTransferRefused as FileTransferRefused
from agent_sandbox._errors import HiddenPathDenied as HiddenPathDenied
from agent_sandbox._errors import ImportDenied as ImportDenied
from agent_sandbox._errors import LearningError as LearningError
from agent_sandbox._errors import LimitExceeded as LimitExceeded
from agent_sandbox._errors import MessageTooLarge as MessageTooLarge
from agent_sandbox._errors import NetworkDenied as NetworkDenied
from agent_sandbox._errors import PolicyError as PolicyError
from agent_sandbox._errors import PolicyNotFound as PolicyNotFound
from agent_sandbox._errors import ProviderUnavailable as ProviderUnavailable
from agent_sandbox._errors import SandboxClosed as SandboxClosed
from agent_sandbox._errors import SandboxDenied as SandboxDenied
from agent_sandbox._errors import SandboxError as SandboxError
from agent_sandbox._errors import TransportError as TransportError
from agent_sandbox._errors import UnpickleRefused as UnpickleRefused
from agent_sandbox._errors import WorkerCrashed as WorkerCrashed
from agent_sandbox._errors import WorkerError as WorkerError
from agent_sandbox._errors import WorkerStartError as WorkerStartError


def _reach_the_installed_layout() -> None:
    """Under a strict editable install (setup.py), run from the checkout's root with the
    current directory on `sys.path` (`python -c`, `python -m pytest`), this file is found in
    the checkout's `agent_sandbox/` folder, which lacks the sub-packages that live beside it
    (`guards/`, `policies/`, ...). The install's link tree further down `sys.path` has them,
    and its `__init__.py` is a link to this very file: look there for sub-packages."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.isdir(_os.path.join(here, "policies")):
        return
    me = _os.path.realpath(__file__)
    for entry in _sys.path:
        other = _os.path.join(entry or ".", "agent_sandbox")
        init = _os.path.join(other, "__init__.py")
        if (
            _os.path.abspath(other) != here
            and _os.path.islink(init)
            and _os.path.realpath(init) == me
            and _os.path.isdir(_os.path.join(other, "policies"))
        ):
            __path__[:] = [_os.path.abspath(other)]
            return


_reach_the_installed_layout()

# The rest loads on first use (PEP 562): `import agent_sandbox` alone imports neither the
# learning code nor pydantic and the policy models; type checkers see the names below.
if _typing.TYPE_CHECKING:
    from agent_sandbox._host.files import FileInfo as FileInfo
    from agent_sandbox._host.oplog import log_refusals as log_refusals
    from agent_sandbox._host.result import Image as Image
    from agent_sandbox._host.result import OutputFile as OutputFile
    from agent_sandbox._host.result import RunError as RunError
    from agent_sandbox._host.result import RunResult as RunResult
    from agent_sandbox._host.sandbox import Sandbox as Sandbox
    from agent_sandbox._host.sandbox import Session as Session
    from agent_sandbox._tools.learn.observe import Learner as Learner
    from agent_sandbox._tools.learn.observe import learn_run as learn_run
    from agent_sandbox._tools.learn.observe import learning_envelope as learning_envelope
    from agent_sandbox._tools.learn.review import apply_proposal as apply_proposal
    from agent_sandbox._tools.learn.review import write_proposal as write_proposal
    from agent_sandbox.policies import Policy as Policy
    from agent_sandbox.policies import load_policy as load_policy
    from agent_sandbox.policies import resolve_policy as resolve_policy

_LAZY = {
    "log_refusals": "agent_sandbox._host.oplog",
    "FileInfo": "agent_sandbox._host.files",
    "Image": "agent_sandbox._host.result",
    "OutputFile": "agent_sandbox._host.result",
    "RunError": "agent_sandbox._host.result",
    "RunResult": "agent_sandbox._host.result",
    "Sandbox": "agent_sandbox._host.sandbox",
    "Session": "agent_sandbox._host.sandbox",
    "Learner": "agent_sandbox._tools.learn.observe",
    "learn_run": "agent_sandbox._tools.learn.observe",
    "learning_envelope": "agent_sandbox._tools.learn.observe",
    "apply_proposal": "agent_sandbox._tools.learn.review",
    "write_proposal": "agent_sandbox._tools.learn.review",
    "Policy": "agent_sandbox.policies",
    "load_policy": "agent_sandbox.policies",
    "resolve_policy": "agent_sandbox.policies",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_sandbox' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "AttributeDenied",
    "CallDenied",
    "CapacityError",
    "ChildException",
    "CodeRejected",
    "Denial",
    "EnvDenied",
    "FileAccessDenied",
    "FileInfo",
    "FileTransferRefused",
    "HiddenPathDenied",
    "Image",
    "ImportDenied",
    "Learner",
    "LearningError",
    "LimitExceeded",
    "MessageTooLarge",
    "NetworkDenied",
    "OutputFile",
    "Policy",
    "PolicyError",
    "PolicyNotFound",
    "ProviderUnavailable",
    "RULES",
    "RunError",
    "RunResult",
    "Sandbox",
    "SandboxClosed",
    "SandboxDenied",
    "SandboxError",
    "Session",
    "TransportError",
    "UnpickleRefused",
    "WorkerCrashed",
    "WorkerError",
    "WorkerStartError",
    "apply_proposal",
    "learn_run",
    "learning_envelope",
    "load_policy",
    "log_refusals",
    "resolve_policy",
    "write_proposal",
]
