"""The policy model: one frozen, deny-by-default declaration per tool.

Every section is a pydantic model with `extra="forbid"` and `frozen=True`: an unknown key
is an error, and a loaded policy cannot be mutated. Anything not allowed is denied; a
DENY beats an ALLOW wherever a section has both.

The worker never imports pydantic: it receives `Policy.to_wire()`, a plain JSON dict.

This module is longer than 600 lines because the policy is one deny-by-default
declaration: every section, its defaults and the checks across sections are read in one
place (docs/policy.md follows it section by section).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import socket
import typing
import warnings
import weakref
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from agent_sandbox.policies._paths import check_entry
from agent_sandbox.policies._validation import map_validation_errors, merge_dicts

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
    "SECTIONS",
    "RemotePolicy",
    "ToolsPolicy",
    "SENSITIVE_CATEGORIES",
]

#: Provider names a policy may request. `auto` is the only one that chooses.
PROVIDERS = frozenset(
    {"auto", "subprocess", "landlock", "unshare", "bwrap", "firejail", "gvisor", "qemu", "remote"}
)

#: Sensitive-call categories (see `agent_sandbox.guards`); a function rule names a
#: dotted function instead, e.g. `subprocess.run`.
SENSITIVE_CATEGORIES = frozenset(
    {
        "deserialization",
        "dynamic-code",
        "introspection",
        "native-code",
        "process-control",
        "process-exec",
    }
)

#: Categories that print a warning when granted, because they open the layer wide.
DANGEROUS_CATEGORIES = frozenset({"deserialization", "dynamic-code", "native-code"})


_FUNCTION_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")
_MODULE_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*(\.\*)?$")
_ENV_RE = re.compile(r"^[A-Za-z_*?][A-Za-z0-9_*?]*$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class FilesPolicy(_Section):
    """Paths the code may read and write, and names that look absent.

    Entries are absolute paths or globs (`/data/**`, `*.csv` under a directory). `$SCRATCH`
    stands for the worker's private scratch directory, which is always readable and
    writable. A write grant implies read. `deny` beats both.
    """

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    hide: tuple[str, ...] = (".env", ".env.*", "*.pem", "*.key", "id_rsa*", "id_ed25519*", ".netrc")

    @field_validator("read", "write", "deny")
    @classmethod
    def _paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            if not entry:
                raise ValueError("an empty path")
            if not (entry.startswith(("/", "$SCRATCH", "~"))):
                raise ValueError(
                    f"{entry!r} is not absolute; use an absolute path, `~/...` or `$SCRATCH/...`"
                )
            if "\x00" in entry:
                raise ValueError(f"{entry!r} contains a NUL byte")
            check_entry(entry)
        return value

    @field_validator("hide")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            if not entry or "\x00" in entry:
                raise ValueError(f"{entry!r} is not a name or a pattern")
            check_entry(entry)
        return value


class NetRule(_Section):
    """One network rule. Hosts are names (resolved once at load) or IP/CIDR."""

    action: Literal["allow", "deny"] = "allow"
    protocol: Literal["tcp", "udp", "any"] = "tcp"
    host: str
    ports: str = "1-65535"
    direction: Literal["connect", "bind", "any"] = "connect"

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("an empty host; use a name, an IP address or a CIDR like 10.0.0.0/8")
        if "/" in value:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError as exc:
                raise ValueError(f"{value!r} is not a valid CIDR") from exc
        return value

    @field_validator("ports", mode="before")
    @classmethod
    def _ports(cls, value: Any) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        if not isinstance(value, str):
            raise ValueError(
                "ports must be a number, a list of numbers or a range like '8000-8080'"
            )
        for part in value.split(","):
            part = part.strip()
            lo, _, hi = part.partition("-")
            try:
                a = int(lo)
                b = int(hi) if hi else a
            except ValueError:
                raise ValueError(f"{part!r} is not a port or a port range") from None
            if not (0 <= a <= b <= 65535):
                raise ValueError(f"port range {part!r} is outside 0-65535")
        return value

    def port_ranges(self) -> list[tuple[int, int]]:
        """The ports as inclusive (low, high) ranges."""
        out = []
        for part in self.ports.split(","):
            lo, _, hi = part.strip().partition("-")
            out.append((int(lo), int(hi) if hi else int(lo)))
        return out


class NetPolicy(_Section):
    """Network rules; no rule means no network. A deny rule beats an allow rule.

    The bounds below are the host's egress proxy's, per worker (namespace and qemu
    providers): one worker reaching its own never delays or refuses another's.
    """

    rules: tuple[NetRule, ...] = ()
    #: Proxy connections (tunnels included) one worker may hold open at once.
    connections: int = Field(default=64, ge=1, le=4096)
    #: Bytes the proxy relays for one worker in one call (both directions, all connections).
    bytes_per_call: int = Field(default=1 << 30, ge=1024)
    #: The longest one proxy connection lives, from its accept (an absolute deadline).
    connection_seconds: float = Field(default=300.0, gt=0, le=86_400)
    #: Whether the proxy's connections outlive the call that opened them (a client's
    #: keep-alive pool, a thread between calls); by default they end with the call.
    keep_connections: bool = False

    def allows_any(self) -> bool:
        """Whether any allow rule exists (the description says "network off" otherwise)."""
        return any(rule.action == "allow" for rule in self.rules)


class ImportsPolicy(_Section):
    """Top-level modules the code may import (`pkg` allows `pkg.*`). `deny` beats `allow`.

    `allow = ["*"]` allows every module and makes the policy a `danger` one.
    """

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @field_validator("allow", "deny")
    @classmethod
    def _modules(cls, value: tuple[str, ...], info: Any) -> tuple[str, ...]:
        for entry in value:
            if info.field_name == "allow" and entry.endswith(".*") and _MODULE_RE.match(entry):
                # `pkg.*` allows the submodules only, so `import pkg` itself stays refused.
                raise ValueError(
                    f"{entry!r} allows only the submodules, never `import {entry[:-2]}` "
                    f"itself; write {entry[:-2]!r} (it covers the submodules too)"
                )
            if entry != "*" and not _MODULE_RE.match(entry):
                raise ValueError(f"{entry!r} is not a module name")
        return value


class EnvPolicy(_Section):
    """Host variables passed to the worker (names or `*` patterns) and values set for it."""

    passthrough: tuple[str, ...] = Field(default=(), alias="pass")
    set: dict[str, str] = Field(default_factory=dict)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("passthrough")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            if not _ENV_RE.match(entry):
                raise ValueError(f"{entry!r} is not a variable name or pattern")
        return value


class ApiPolicy(_Section):
    """Sensitive calls granted by category or by dotted function; a function rule beats its
    category, and DENY beats ALLOW."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @field_validator("allow", "deny")
    @classmethod
    def _entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            if entry in SENSITIVE_CATEGORIES or _FUNCTION_RE.match(entry):
                continue
            known = ", ".join(sorted(SENSITIVE_CATEGORIES))
            raise ValueError(
                f"{entry!r} is neither a sensitive-call category ({known}) "
                f"nor a dotted function name like 'subprocess.run'"
            )
        return value


class CodeBudgets(_Section):
    """Budgets the rewritten code counts against while it runs (0 means unlimited).

    Integers only (a string or a boolean is an error, not a conversion).

    Each one exceeded is a `code.<budget>` denial (`code.iterations`, `code.call-depth`,
    `code.allocation`); see `agent_sandbox.guards._code_budget` for what is counted.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)

    #: Loop iterations per call, over all `for`/`while` loops and comprehensions together.
    max_iterations: int = Field(default=10_000_000, ge=0)
    #: Python frames above the cell (user functions and the library code they call).
    #: Capped at 10000 so deep recursion cannot overflow the C stack.
    max_call_depth: int = Field(default=1000, ge=0, le=10_000)
    #: Bytes one checked allocation may produce (`'x' * n`, `2 ** n`, `1 << n`, format widths).
    max_allocation: int = Field(default=100_000_000, ge=0)


def _code_tables() -> Any:
    # Imported lazily: the tables live with the checker (standard library only, worker-side).
    from agent_sandbox.guards import _code_check

    return _code_check


_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class CodePolicy(_Section):
    """The sub-language the code string must stay within (checked before it runs).

    `enabled = false` skips the check and the budgets (the other layers still apply).
    `syntax` lists syntax groups; `names` is `"*"` (any name except `globals`, `locals`,
    `vars`, `breakpoint`, which must be listed) or an allowlist of names and name groups;
    `deny_names` beats `names`; `attributes` is `"*"` or attribute names and groups
    (`string-methods`, `list-methods`, ...); `dunders` grants dunder names and groups
    (`common`, `protocol`). Frame, code, generator and class-hierarchy internals
    (`f_globals`, `gi_frame`, `tb_frame`, `__code__`, `__globals__`, `__subclasses__`, ...)
    can never be granted: listing one is a load error.
    """

    enabled: bool = True
    syntax: tuple[str, ...] = Field(default_factory=lambda: _code_tables().DEFAULT_SYNTAX)
    names: tuple[str, ...] = ("*",)
    deny_names: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ("*",)
    dunders: tuple[str, ...] = Field(default_factory=lambda: _code_tables().DEFAULT_DUNDERS)
    budgets: CodeBudgets = Field(default_factory=CodeBudgets)

    @field_validator("syntax")
    @classmethod
    def _syntax(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        groups = _code_tables().SYNTAX_GROUPS
        for entry in value:
            if entry not in groups:
                raise ValueError(
                    f"{entry!r} is not a syntax group; known: {', '.join(sorted(groups))}"
                )
        return value

    @field_validator("names", "deny_names", "attributes", "dunders")
    @classmethod
    def _grants(cls, value: tuple[str, ...], info: Any) -> tuple[str, ...]:
        tables = _code_tables()
        field = info.field_name
        groups = {
            "names": tables.NAME_GROUPS,
            "attributes": tables.ATTRIBUTE_GROUPS,
            "dunders": tables.DUNDER_GROUPS,
        }.get(field, {})
        for entry in value:
            if entry in tables.NEVER_GRANTABLE or entry.startswith(tables.RESERVED_PREFIX):
                raise ValueError(
                    f"{entry!r} reaches interpreter internals (frames, code objects, "
                    f"generators, the class hierarchy) and can never be granted"
                )
            if entry in groups or (entry == "*" and field in ("names", "attributes")):
                continue
            if not _IDENT_RE.match(entry):
                raise ValueError(f"{entry!r} is not a name or a group of `{field}`")
            if field == "dunders" and not tables.is_dunder(entry):
                known = ", ".join(sorted(groups))
                raise ValueError(
                    f"{entry!r} is not a dunder name (`__x__`) or a dunder group ({known})"
                )
            if field == "attributes" and tables.is_dunder(entry):
                raise ValueError(f"{entry!r} is a dunder; grant it in `dunders` instead")
        return value


class LimitsPolicy(_Section):
    """Resource limits; each one hit is a `limits.<name>` denial and the worker is replaced.

    Numbers only: `wall_seconds = "60"` (a string) or `true` is an error, not a conversion.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)

    wall_seconds: float = Field(default=30.0, gt=0, le=86_400)
    cpu_seconds: int = Field(default=60, ge=1)
    memory_mb: int = Field(default=2048, ge=32)
    processes: int = Field(default=64, ge=1)
    #: The CPU share of the whole sandbox (the worker and all it starts), in cores: a
    #: per-worker cgroup quota (`cpu.cfs_quota_us` on cgroup v1, `cpu.max` on v2).
    cpu_cores: float = Field(default=1.0, ge=0.01, le=1024)
    output_bytes: int = Field(default=1_000_000, ge=1024)
    result_bytes: int = Field(default=4_000_000, ge=1024)
    file_size_mb: int = Field(default=256, ge=1)
    #: The scratch directory's size: a tmpfs of this size under the namespace providers
    #: (and under Landlock when the worker may mount), else a check after every call.
    scratch_mb: int = Field(default=512, ge=1)
    open_files: int = Field(default=256, ge=16)
    #: What one returned image may decode to (its headers are read on the host, never its
    #: pixels): pixels of one frame, and frames. Past either, the image is not returned.
    image_pixels: int = Field(default=16_777_216, ge=1, le=2**40)
    image_frames: int = Field(default=1, ge=1, le=10_000)
    #: The largest file the session files API puts into scratch or takes out of it.
    transfer_mb: int = Field(default=64, ge=1)


class ToolsPolicy(_Section):
    """Host tools the code may call (an agent framework's tools, run by the host process).

    A call is a request from the worker to the host over the worker's channel; the host runs
    the tool only when its name is in `allow` (else a `tools` refusal), and stops waiting for
    it after `timeout_seconds` (a `tools.timeout` refusal; the call's `limits.wall_seconds`
    still bounds the whole call). None by default.
    """

    allow: tuple[str, ...] = ()
    timeout_seconds: float = Field(default=30.0, gt=0, le=3600)

    @field_validator("allow")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            if not _IDENT_RE.match(entry):
                raise ValueError(f"{entry!r} is not a tool name (a Python identifier)")
        return value


_REMOTE_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

#: The `[remote]` keys that only one claim backend reads.
_K8S_ONLY = (
    "namespace",
    "router_url",
    "router_token_file",
    "shutdown_after_seconds",
    "server_name",
)
_LOCAL_ONLY = ("server_cert", "server_key", "client_ca", "warm", "max_workers", "state_dir")


class RemotePolicy(_Section):
    """Where a `provider = "remote"` policy's workers run: the claim backend and how to reach
    it (see docs/scale-out.md). Secrets are never values here: they are files, or environment
    variables when no file is named (`AGENT_SANDBOX_SESSION_KEY`, `AGENT_SANDBOX_BIND_SECRET`,
    `AGENT_SANDBOX_ROUTER_TOKEN`). Not part of the policy's fingerprint and never sent to a
    worker: it says where the policy runs, not what it allows.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)

    #: `k8s`: SandboxClaims of kubernetes-sigs/agent-sandbox; `local`: `worker serve`
    #: processes on this machine's loopback (tests, a single host).
    backend: Literal["k8s", "local"] = "k8s"
    #: The SandboxWarmPool claims come from (k8s; required), or the local pool's label.
    pool: str = ""
    namespace: str = "default"
    #: Part of every claim's name: two tenants' threads never share a worker.
    tenant: str = "default"
    #: The sandbox-router's URL (k8s); empty: straight to the pod's IP (inside the cluster).
    router_url: str = ""
    router_token_file: str = ""
    #: The tenant's session key (at least 16 bytes), shared by its agent processes only.
    session_key_file: str = ""
    #: The template-wide bootstrap secret the workers check on bind.
    bind_secret_file: str = ""
    #: The CA bundle that signs the workers' (or the router's) certificates; empty: the
    #: system's trust store.
    ca_file: str = ""
    #: This host's client certificate (mTLS) and its key (empty: in the certificate's file).
    client_cert: str = ""
    client_key: str = ""
    proxy: str = ""
    plaintext: Literal["", "accepted"] = ""
    max_claims: int = Field(default=16, ge=1, le=100_000)
    claim_timeout: float = Field(default=30.0, gt=0, le=3600)
    start_timeout: float = Field(default=15.0, gt=0, le=3600)
    #: The claim's hard expiry in seconds (k8s `shutdownTime`, then deleted): by default a
    #: day, so a claim whose agent crashed is reaped even if its pod never idles out; 0 (in
    #: so many words): none, the pod's idle exit alone.
    shutdown_after_seconds: int = Field(default=86_400, ge=0)
    #: Direct pod-IP mode (no `router_url`): the name the pods' shared certificate carries
    #: (e.g. `ags-worker.<namespace>.svc`), checked instead of the pod's IP.
    server_name: str = ""
    #: The local backend's `worker serve` certificate and key (key empty: in the cert's file),
    #: and the CA its clients' certificates must chain to (empty: no mTLS).
    server_cert: str = ""
    server_key: str = ""
    client_ca: str = ""
    warm: int = Field(default=1, ge=0, le=64)
    max_workers: int = Field(default=8, ge=1, le=1024)
    #: The provider the worker runs under inside the pod (local backend: inside `worker
    #: serve`); the k8s template fixes it for its pods (`agent-sandbox k8s manifests`).
    worker_provider: str = "auto"
    #: Where local claims are recorded; processes sharing it share one worker per thread.
    state_dir: str = ""

    @field_validator("pool", "namespace")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if value and not _REMOTE_NAME_RE.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes name (a DNS-1123 label)")
        return value

    @field_validator("worker_provider")
    @classmethod
    def _worker_provider(cls, value: str) -> str:
        if value not in PROVIDERS or value == "remote":
            known = ", ".join(sorted(PROVIDERS - {"remote"}))
            raise ValueError(f"unknown worker provider {value!r}; known: {known}")
        return value

    @field_validator("router_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if value and not value.startswith(("https://", "http://")):
            raise ValueError(f"{value!r} is not an https:// URL")
        return value

    @model_validator(mode="after")
    def _backend_keys(self) -> RemotePolicy:
        defaults = type(self).model_fields
        if self.backend == "k8s":
            if not self.pool:
                raise ValueError(
                    "backend k8s needs `pool`, the name of the SandboxWarmPool to claim from"
                )
            stray = [k for k in _LOCAL_ONLY if getattr(self, k) != defaults[k].default]
        else:
            if not self.server_cert:
                raise ValueError(
                    "backend local needs `server_cert`, the certificate its `worker serve` "
                    "processes present (and `ca_file`, the CA the host checks it against)"
                )
            stray = [k for k in _K8S_ONLY if getattr(self, k) != defaults[k].default]
        if stray:
            raise ValueError(
                f"{', '.join(stray)}: not read by backend {self.backend!r}; remove "
                f"{'it' if len(stray) == 1 else 'them'}"
            )
        return self


#: Providers that are no kernel boundary: a policy names one only with the explicit opt-out.
#: Fingerprints computed so far, by the id of their (frozen) policy. Kept beside the model, not
#: in a private attribute: pydantic compares private attributes in `==` and copies them in
#: `model_copy` (also when an update changes fields).
_FINGERPRINTS: dict[int, tuple[weakref.ref[Policy], str]] = {}

NO_BOUNDARY_PROVIDERS = frozenset({"subprocess"})

#: The classes of boundary a policy's `min_boundary` names, weakest first, and the class of
#: each provider (`remote`: the pod's runtime decides, so it meets only the default).
BOUNDARY_CLASSES = ("none", "host-kernel", "user-space-kernel", "virtual-machine")
PROVIDER_CLASS = {
    "subprocess": "none",
    "landlock": "host-kernel",
    "unshare": "host-kernel",
    "bwrap": "host-kernel",
    "firejail": "host-kernel",
    "remote": "host-kernel",
    "gvisor": "user-space-kernel",
    "qemu": "virtual-machine",
}


def meets_boundary(provider: str, minimum: str) -> bool:
    """Whether `provider`'s class of boundary is `minimum` or stronger (`auto`: decided per
    candidate, so always True here; the default `host-kernel`: True, since a provider
    without a boundary is the opt-out's to allow; an unknown name: False)."""
    if provider == "auto" or minimum == "host-kernel":
        return True  # the default: `no_kernel_boundary` alone governs the opt-out
    have = PROVIDER_CLASS.get(provider)
    if have is None:
        return False
    return BOUNDARY_CLASSES.index(have) >= BOUNDARY_CLASSES.index(minimum)


def check_min_boundary(provider: str, minimum: str) -> None:
    """Refuse a provider named explicitly whose class of boundary is below `min_boundary`."""
    if not meets_boundary(provider, minimum):
        have = PROVIDER_CLASS.get(provider, "unknown")
        stronger = sorted(
            p
            for p, c in PROVIDER_CLASS.items()
            if p != "remote" and BOUNDARY_CLASSES.index(c) >= BOUNDARY_CLASSES.index(minimum)
        )
        raise ValueError(
            f"provider {provider!r} is a {have} boundary, below min_boundary = "
            f'"{minimum}"; use provider = "auto" (the fastest that meets it) or one of '
            f"{', '.join(stronger)}"
        )


def check_boundary_opt_out(provider: str, acknowledgement: str) -> None:
    """Refuse a provider without a kernel boundary unless the policy accepts that in words."""
    if provider in NO_BOUNDARY_PROVIDERS and acknowledgement != "accepted":
        raise ValueError(
            f"provider {provider!r} runs the code with no kernel boundary (only the Python "
            'guards and rlimits, which hostile code gets past); use provider = "auto" '
            "(the strongest kernel sandbox that works here, see `agent-sandbox doctor`), or "
            'opt out in so many words with no_kernel_boundary = "accepted"'
        )


#: The providers that cannot hide that a file exists: `stat` and listing a directory above a
#: grant succeed outside the grants (Landlock has no right for either, and no second layer
#: sees paths), so they take only a policy that accepts that in so many words.
VISIBLE_NAMES_PROVIDERS = frozenset({"landlock"})

VISIBLE_NAMES_WHY = (
    "Landlock cannot hide that a file exists: outside the policy's grants (hidden and denied "
    "names, everything not granted) the code can still list directories and stat files, "
    "learning names, sizes, owners and times, though never contents"
)
VISIBLE_NAMES_FIX = (
    'provider = "auto", "bwrap" or "unshare" (they build a view holding only what is '
    "granted; auto takes one where it works here), or accept it in so many words with "
    'visible_names = "accepted" (for a shipped preset: in a policy file that says '
    'extends = "<preset>" and that line)'
)


def check_visible_names(provider: str, acknowledgement: str) -> None:
    """Refuse a provider that cannot hide names unless the policy accepts that in words."""
    if provider in VISIBLE_NAMES_PROVIDERS and acknowledgement != "accepted":
        raise ValueError(
            f"provider {provider!r} is refused for this policy: {VISIBLE_NAMES_WHY}; use "
            f"{VISIBLE_NAMES_FIX}"
        )


def _is_ip_or_cidr(host: str) -> bool:
    if host.strip().lower() in ("*", "any"):
        return True  # every address: nothing to resolve
    try:
        ipaddress.ip_network(host, strict=False)
    except ValueError:
        return False
    return True


def _resolve_host(host: str) -> tuple[str, ...]:
    """The addresses `host` resolves to now (the pin), or () when it does not resolve.

    No warning: the worker's guard turns a lookup of such a name into a `net.resolve`
    denial naming the host (the model reads it in the result; the host prints nothing).
    """
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return ()
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos))


class Policy(_Section):
    """A tool's whole policy. Build it in Python or load it with `load_policy()`.

    Building one from keywords with a bad value raises `PolicyError` (a ValueError) naming
    the dotted key, as loading a file does; pydantic's own error never leaks out.
    """

    def __init__(self, /, **data: Any) -> None:
        with map_validation_errors(None, None, root=Policy):
            super().__init__(**data)

    name: str = "unnamed"
    description: str = ""
    provider: str = "auto"
    #: The explicit opt-out from a kernel boundary: `provider = "subprocess"` is refused
    #: unless this says `"accepted"` (the Python guards and rlimits are then all that holds).
    no_kernel_boundary: Literal["", "accepted"] = ""
    #: The explicit acceptance that the code may learn which files exist outside its grants
    #: and read their metadata (not their contents): `provider = "landlock"` is refused
    #: unless this says `"accepted"` (Landlock cannot hide names), and `auto` never takes
    #: Landlock alone without it.
    visible_names: Literal["", "accepted"] = ""
    #: The weakest class of boundary the workers may run behind (`BOUNDARY_CLASSES`, weakest
    #: first): `host-kernel` (namespaces, Landlock, seccomp on the host's kernel; any kernel
    #: provider), `user-space-kernel` (gVisor's Sentry, or stronger), `virtual-machine` (a
    #: guest kernel under QEMU). `auto` then picks the fastest provider that meets it; a
    #: provider named explicitly below it is refused.
    min_boundary: Literal["host-kernel", "user-space-kernel", "virtual-machine"] = "host-kernel"
    result_mode: Literal["data-only", "objects"] = "data-only"
    #: Extra globals the host's restricted unpickler may rebuild in `objects` mode:
    #: `"pkg.models.*"` admits the pydantic models, dataclasses, enums, named tuples and
    #: exception classes defined in `pkg.models`; `"pkg.mod.Name"` admits that one global,
    #: trusted as given (its arguments are not checked). The modules must be loaded in the
    #: host; nothing is imported to decode. See docs/objects.md.
    result_types: tuple[str, ...] = ()
    mode: Literal["enforce", "learn"] = "enforce"
    files: FilesPolicy = Field(default_factory=FilesPolicy)
    net: NetPolicy = Field(default_factory=NetPolicy)
    imports: ImportsPolicy = Field(default_factory=ImportsPolicy)
    env: EnvPolicy = Field(default_factory=EnvPolicy)
    api: ApiPolicy = Field(default_factory=ApiPolicy)
    code: CodePolicy = Field(default_factory=CodePolicy)
    limits: LimitsPolicy = Field(default_factory=LimitsPolicy)
    tools: ToolsPolicy = Field(default_factory=ToolsPolicy)
    #: Where the workers run when `provider = "remote"` (not part of the fingerprint).
    remote: RemotePolicy | None = None
    #: Where the policy was loaded from (not part of the fingerprint).
    source: Annotated[str | None, Field(exclude=True)] = None
    #: The files it `extends`, nearest first (not part of the fingerprint); with `source`,
    #: the files the kernel providers keep from the worker (`providers/_masks.py`).
    sources: Annotated[tuple[str, ...], Field(exclude=True)] = ()
    _pins: dict[str, tuple[str, ...]] | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$", value):
            raise ValueError(f"{value!r} is not a policy name (letters, digits, -, _, ., :)")
        return value

    @field_validator("result_types")
    @classmethod
    def _result_types(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            return value  # the default: the unpickler's tables load with the first worker
        from agent_sandbox._host.intake.unpickle_classes import denied_name

        for entry in value:
            name = entry.removesuffix(".*")
            wildcard = entry.endswith(".*") and _MODULE_RE.match(entry)
            if not _FUNCTION_RE.match(name) and not wildcard:
                raise ValueError(f"{entry!r} is neither `module.Name` nor `module.*`")
            if name == "__main__" or name.startswith("__main__."):
                raise ValueError(
                    f"{entry!r}: `__main__` is the host's own script, never a source of types"
                )
            if denied_name(name):
                raise ValueError(f"{entry!r} names a known unpickling gadget; never allowed")
        return value

    @field_validator("provider")
    @classmethod
    def _provider(cls, value: str) -> str:
        if value not in PROVIDERS:
            raise ValueError(f"unknown provider {value!r}; known: {', '.join(sorted(PROVIDERS))}")
        return value

    @model_validator(mode="after")
    def _boundary_opt_out(self) -> Policy:
        check_boundary_opt_out(self.provider, self.no_kernel_boundary)
        check_visible_names(self.provider, self.visible_names)
        check_min_boundary(self.provider, self.min_boundary)
        return self

    @model_validator(mode="after")
    def _danger_named(self) -> Policy:
        if self.is_permissive() and "danger" not in self.name.lower():
            raise ValueError(
                "this policy allows every import or grants dynamic or native code; "
                "a permissive policy must carry 'danger' in its name"
            )
        granted = sorted(DANGEROUS_CATEGORIES & set(self.api.allow))
        if granted:
            warnings.warn(
                f"policy {self.name!r} grants {', '.join(granted)}: code can then run "
                "arbitrary Python (eval/exec, unpickled streams, native calls) that the "
                "Python guards cannot follow; rely on an OS provider",
                UserWarning,
                stacklevel=2,
            )
        return self

    def is_permissive(self) -> bool:
        """Whether the policy opens the Python layer wide (all imports, eval/exec, ctypes)."""
        return "*" in self.imports.allow or bool(
            {"dynamic-code", "native-code"} & set(self.api.allow)
        )

    def _not_hashed(self) -> set[str]:
        """`remote`, and the keys added later while they hold their defaults (the default
        boundary class, names not accepted as visible), so adding them changed no
        fingerprint."""
        exclude = {"remote"}
        if self.min_boundary == "host-kernel":
            exclude.add("min_boundary")
        if not self.visible_names:
            exclude.add("visible_names")
        return exclude

    def to_wire(self, *, pin: bool = True) -> dict[str, Any]:
        """The JSON dict the worker receives (no pydantic needed to read it).

        Besides the fields it carries, for the guards: `net.rules[i].addresses`, the
        addresses a rule's host name resolved to (once per policy object, in the parent:
        the worker answers name lookups from this pin and never asks DNS), and
        `source_file`, the policy file the worker must never write. With `pin=False` (a
        worker behind the host's egress proxy, which resolves names itself) no name is
        resolved here and no rule carries addresses.
        """
        exclude = self._not_hashed()
        data = self.model_dump(mode="json", by_alias=True, exclude=exclude)
        pins = self.pinned_addresses() if pin else {}
        for rule in data.get("net", {}).get("rules", []):
            rule["addresses"] = list(pins.get(rule["host"], ()))
        if self.source and not self.source.startswith("preset:") and self.source != "<string>":
            data["source_file"] = os.path.realpath(self.source)
        return data

    def pinned_addresses(self) -> dict[str, tuple[str, ...]]:
        """Host name -> the addresses it resolved to; resolved once, then kept.

        A name that does not resolve pins no address: its rules then match nothing, and
        the worker refuses a lookup of it as a `net.resolve` denial saying so.
        """
        pins = self.__pydantic_private__.get("_pins") if self.__pydantic_private__ else None
        if pins is None:
            pins = {}
            for rule in self.net.rules:
                if rule.host in pins or _is_ip_or_cidr(rule.host):
                    continue
                pins[rule.host] = _resolve_host(rule.host)
            self._pins = pins
        return pins

    def fingerprint(self) -> str:
        """A stable hash: the same policy always gives the same fingerprint.

        It covers the declared fields only (not the pinned addresses, the file path, or the
        `[remote]` table, which says where the workers run, not what they may do).
        Computed once per policy object (the model is frozen), not once per call.
        """
        cached = _FINGERPRINTS.get(id(self))
        if cached is not None and cached[0]() is self:
            return cached[1]
        exclude = self._not_hashed()
        data = self.model_dump(mode="json", by_alias=True, exclude=exclude)
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        value = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        key = id(self)

        def forget(ref: weakref.ref[Policy], key: int = key) -> None:
            if _FINGERPRINTS.get(key, (None, ""))[0] is ref:
                del _FINGERPRINTS[key]

        _FINGERPRINTS[key] = (weakref.ref(self, forget), value)
        return value

    def merged(self, overrides: dict[str, Any]) -> Policy:
        """A new policy: this one with `overrides` (nested dicts) applied section by section.

        Lists replace lists; a nested table merges key by key. The result is validated again.
        """
        base = self.model_dump(mode="json", by_alias=True)
        with map_validation_errors(self.source, None, root=Policy):
            merged = Policy.model_validate(merge_dicts(base, overrides))
        return merged.model_copy(update={"source": self.source, "sources": self.sources})

    def to_toml(self) -> str:
        """The policy as TOML text that loads back into an equal policy (see `_toml.py`)."""
        from agent_sandbox.policies._toml import policy_to_toml

        return policy_to_toml(self)

    def explain(self) -> str:
        """A readable summary of what the policy allows, section by section."""
        from agent_sandbox.policies._explain import explain_policy

        return explain_policy(self)


#: The sections of a policy (its fields that are tables of their own), in declaration order:
#: what every provider answers (`Provider.answers`; tests/providers/test_enforceable.py is
#: generated from this tuple).
SECTIONS: tuple[str, ...] = tuple(
    name
    for name, field in Policy.model_fields.items()
    if any(
        isinstance(kind, type) and issubclass(kind, _Section)
        for kind in (field.annotation, *typing.get_args(field.annotation))
    )
)
