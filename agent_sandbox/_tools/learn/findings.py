"""What learning mode never proposes, and the findings a proposal is made of.

The tables below are the deny-by-default side of learning (see `agent_sandbox._tools.learn`):
trees, files, path components, variables, hosts, modules and call categories that are never
proposed or only with a RISKY mark, each with its reason. `Finding` is one judged
observation, `_Context` what one proposal is judged against (the current policy, home,
scratch and import roots), and `_rule_text` a network rule as findings and diffs write it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Literal

from agent_sandbox.policies import NetRule, Policy
from agent_sandbox.policies._paths import visible

__all__ = ["DIR_MIN_FILES", "Finding", "Status"]

#: A directory is proposed instead of its files only when this many files directly in it
#: were used; below that each file is proposed on its own.
DIR_MIN_FILES = 3

Status = Literal["proposed", "risky", "flagged"]
_HEADER_START = "Proposed by agent-sandbox learning mode"

# -- what is never proposed ------------------------------------------------------------

#: Trees never proposed for reading or writing.
_FORBIDDEN_TREES = ("/proc", "/sys", "/dev", "/run", "/var/run", "/boot")
#: Device files that are harmless to read and write.
# NOTE: allowed because they carry no host state (sinks and entropy sources).
_HARMLESS_DEVICES = frozenset(
    {"/dev/null", "/dev/zero", "/dev/random", "/dev/urandom", "/dev/full"}
)
#: System files whose content is a secret or a privilege.
_SENSITIVE_FILES = frozenset(
    {
        "/etc/shadow",
        "/etc/shadow-",
        "/etc/gshadow",
        "/etc/gshadow-",
        "/etc/sudoers",
        "/etc/security/opasswd",
        "/etc/master.passwd",
    }
)
_SENSITIVE_TREES = ("/etc/sudoers.d", "/etc/ssh", "/var/lib/docker", "/etc/ssl/private")
#: Path components that hold credentials wherever they appear.
_SENSITIVE_COMPONENTS = frozenset(
    {
        ".ssh",
        ".aws",
        ".gnupg",
        ".kube",
        ".docker",
        ".azure",
        ".netrc",
        ".git-credentials",
        ".pypirc",
        ".npmrc",
        ".bash_history",
        ".python_history",
        ".zsh_history",
        "gcloud",
    }
)
#: Files that run code when an interpreter starts, wherever they are written.
_STARTUP_FILES = ("*.pth", "sitecustomize.py", "usercustomize.py", "__init__.py")
#: Variables that change how the worker's interpreter or loader starts: never passed.
_LOADER_ENV = re.compile(r"^(LD_|PYTHON|DYLD_|GCONV_PATH$|MALLOC_|BASH_ENV$|ENV$)")
#: Variable names that look like credentials.
_SECRET_ENV = re.compile(
    r"(KEY|SECRET|TOKEN|PASSW|PWD|CREDENTIAL|AUTH|SESSION|COOKIE|PRIVATE|CERT|DSN)", re.I
)
#: Cloud metadata endpoints: reaching them hands out the host's credentials.
_METADATA_HOSTS = frozenset(
    {"169.254.169.254", "fd00:ec2::254", "metadata.google.internal", "metadata", "100.100.100.200"}
)
#: Modules proposed only with a RISKY mark, and why.
_RISKY_MODULES: dict[str, str] = {
    "ctypes": "native code: reaches any C function, past every Python guard",
    "_ctypes": "native code: reaches any C function, past every Python guard",
    "cffi": "native code: reaches any C function, past every Python guard",
    "subprocess": "runs other programs",
    "_posixsubprocess": "runs other programs",
    "multiprocessing": "starts processes",
    "pty": "starts processes with a terminal",
    "pickle": "deserialization runs code named by the data",
    "_pickle": "deserialization runs code named by the data",
    "marshal": "loads code objects",
    "shelve": "pickle underneath",
    "dill": "pickle underneath",
    "cloudpickle": "pickle underneath",
    "importlib": "imports by name at run time, around the import list",
    "runpy": "runs modules by name",
    "code": "an interactive interpreter",
    "codeop": "compiles code strings",
    "posix": "the raw OS layer under `os`",
    "signal": "signals other processes",
    "gc": "reaches every live object",
    "inspect": "frames and closures",
    "builtins": "rebinds the built-in functions",
}
#: Modules (and their submodules) that are risky only when the policy has no network.
_NET_MODULES = frozenset(
    {
        "socket",
        "_socket",
        "ssl",
        "_ssl",
        "http.client",
        "http.server",
        "urllib.request",
        "requests",
        "httpx",
        "aiohttp",
        "ftplib",
        "smtplib",
        "imaplib",
        "poplib",
        "xmlrpc",
    }
)
#: Sensitive-call categories whose grant opens the Python layer wide: never proposed.
_NEVER_PROPOSED_CATEGORIES = frozenset({"native-code", "dynamic-code"})
_CATEGORY_RISK = {
    "process-exec": "runs other programs (each is outside the Python guards)",
    "process-control": "forks and signals processes",
    "deserialization": "deserialization runs code named by the data",
    "introspection": "frames and the garbage collector reach guarded objects",
}
_FUNCTION_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NOT_LEARNABLE = ("code.", "limits.", "worker.")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One outcome of learning: an entry proposed (maybe risky), or an observation flagged.

    `field` is the dotted policy field (`files.read`, `net.rules`, `imports.allow`, ...);
    `value` is the proposed entry (for net rules a readable `connect tcp host:ports`) or,
    when flagged, what was observed; `targets` are the observed targets it stands for.
    """

    field: str
    value: str
    status: Status
    reason: str = ""
    rule: str = ""
    targets: tuple[str, ...] = ()

    def line(self) -> str:
        """One line for people: control and invisible characters shown as escapes."""
        text = f"[{self.field}] {self.value}"
        if self.reason:
            text += f": {self.reason}"
        return visible(text)


# -- proposing --------------------------------------------------------------------------


@dataclasses.dataclass
class _Context:
    current: Policy
    home: str
    policy_paths: tuple[str, ...]
    scratch_roots: tuple[str, ...]
    control_patterns: tuple[str, ...]
    import_roots: tuple[str, ...]
    run_written: tuple[str, ...] = ()


def _source_path(policy: Policy) -> str | None:
    source = policy.source
    if not source or source.startswith(("preset:", "<")):
        return None
    return source


def _ports_text(ports: Iterable[int]) -> str:
    values = sorted(set(ports))
    parts: list[str] = []
    start = prev = values[0]
    for value in values[1:]:
        if value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = value
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def _rule_text(rule: NetRule) -> str:
    host = f"[{rule.host}]" if ":" in rule.host and "/" not in rule.host else rule.host
    text = f"{rule.direction} {rule.protocol} {host}:{rule.ports}"
    return text if rule.action == "allow" else f"deny {text}"
