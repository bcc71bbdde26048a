"""agent_sandbox: run an LLM agent's Python in a sandboxed worker under a per-tool policy.

Layout (see docs/architecture.md): this package is the public API and the modules both
sides share; `agent_sandbox._host` runs in the agent's process and never trusts a worker,
`agent_sandbox._worker` runs inside the sandbox, `agent_sandbox._tools` holds the CLI,
learning mode and the demo. `agent_sandbox.policies` is the policy model,
`agent_sandbox.providers` the OS sandboxes,
`agent_sandbox.guards` the Python-level guards that run inside the worker, and
`agent_sandbox.adapters` the LangChain and CrewAI tools.
"""

from agent_sandbox._denial import RULES as RULES
from agent_sandbox._denial import Denial as Denial
from agent_sandbox._errors import AttributeDenied as AttributeDenied
from agent_sandbox._errors import CallDenied as CallDenied
from agent_sandbox._errors import CapacityError as CapacityError
from agent_sandbox._errors import ChildException as ChildException
from agent_sandbox._errors import CodeRejected as CodeRejected
from agent_sandbox._errors import EnvDenied as EnvDenied
from agent_sandbox._errors import FileAccessDenied as FileAccessDenied
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
from agent_sandbox._host.oplog import log_refusals as log_refusals
from agent_sandbox._host.result import Image as Image
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
    "HiddenPathDenied",
    "Image",
    "ImportDenied",
    "Learner",
    "LearningError",
    "LimitExceeded",
    "MessageTooLarge",
    "NetworkDenied",
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
