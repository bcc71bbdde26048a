"""The policy model and the ready-made policies shipped with the package."""

from agent_sandbox.policies._load import list_presets as list_presets
from agent_sandbox.policies._load import load_policy as load_policy
from agent_sandbox.policies._load import merge_dicts as merge_dicts
from agent_sandbox.policies._load import policy_from_dict as policy_from_dict
from agent_sandbox.policies._load import policy_from_toml as policy_from_toml
from agent_sandbox.policies._load import resolve_policy as resolve_policy
from agent_sandbox.policies._model import PROVIDERS as PROVIDERS
from agent_sandbox.policies._model import SENSITIVE_CATEGORIES as SENSITIVE_CATEGORIES
from agent_sandbox.policies._model import ApiPolicy as ApiPolicy
from agent_sandbox.policies._model import CodeBudgets as CodeBudgets
from agent_sandbox.policies._model import CodePolicy as CodePolicy
from agent_sandbox.policies._model import EnvPolicy as EnvPolicy
from agent_sandbox.policies._model import FilesPolicy as FilesPolicy
from agent_sandbox.policies._model import ImportsPolicy as ImportsPolicy
from agent_sandbox.policies._model import LimitsPolicy as LimitsPolicy
from agent_sandbox.policies._model import NetPolicy as NetPolicy
from agent_sandbox.policies._model import NetRule as NetRule
from agent_sandbox.policies._model import Policy as Policy
from agent_sandbox.policies._model import RemotePolicy as RemotePolicy

__all__ = [
    "ApiPolicy",
    "CodeBudgets",
    "CodePolicy",
    "EnvPolicy",
    "FilesPolicy",
    "ImportsPolicy",
    "LimitsPolicy",
    "NetPolicy",
    "NetRule",
    "PROVIDERS",
    "Policy",
    "RemotePolicy",
    "SENSITIVE_CATEGORIES",
    "list_presets",
    "load_policy",
    "merge_dicts",
    "policy_from_dict",
    "policy_from_toml",
    "resolve_policy",
]
