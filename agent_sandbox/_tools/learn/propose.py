"""Learning mode, host side: from what a run needed to a proposed policy a person reviews.

Learning mode answers "what does this tool need?" by observation, and observation is the
weak point: the code being observed is not trusted, and whatever it does while learning
could become the next run's permissions. This module is written against that. It trusts
nothing the run did beyond the bare fact that it tried an operation, and it never changes a
policy by itself.

1. **The envelope** (`learning_envelope`). A learning run is the tool's policy switched to
   `mode = "learn"` (the Python guards record each operation they would refuse and let it
   proceed), run under a kernel provider when one is available (`auto`, reported) or the one
   named (an error when it is unavailable). Writes stay limited to the scratch directory and
   the declared write paths, the network to the declared rules, and secret-looking variables
   are not passed: the envelope never widens the policy it starts from.
2. **The proposal** (`propose`). Only records marked `learned` count. Each becomes a
   proposed entry, a RISKY proposed entry (marked on its line and listed first), or a
   FLAGGED observation that is not proposed, with the reason. Paths are judged on their real
   target after resolving symlinks; a path reached through a link the run could have
   planted (scratch, a writable or world-writable directory) is flagged, not proposed.
   Paths are proposed file by file; a directory only when `DIR_MIN_FILES` files directly in
   it were used and the directory is not a system, home, scratch or world-writable one.
   Never proposed: `/`, `/proc`, `/sys`, `/dev` (beyond a few harmless devices), `/run`,
   the policy file and its proposal, a parent of the home directory, the worker's control
   and scratch directories, sensitive files, `.pth`/`sitecustomize` files or writes into an
   import root, loader and interpreter variables, native-code and dynamic-code calls, and
   anything the current policy denies explicitly. Re-learning the same records gives the
   same proposal, byte for byte.
3. **Review** (`write_proposal`, `diff_policies`, `apply_proposal`). The proposal is written
   beside the policy as `<name>.proposed.toml` plus `<name>.proposed.diff`, never through a
   symlink. Applying it is a separate, explicit step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import ipaddress
import os
import re
import stat
import sys
import sysconfig
import tempfile
import threading
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from agent_sandbox._denial import Denial
from agent_sandbox._errors import LearningError, PolicyError
from agent_sandbox._host.intake.builder import RunResult
from agent_sandbox.policies import NetRule, Policy, policy_from_toml
from agent_sandbox.policies._paths import (
    entry_regex,
    expand_entry,
    is_glob,
    name_regex,
    risky_name,
    unescape,
    visible,
)
from agent_sandbox.policies._paths import literal as as_literal
from agent_sandbox.policies._toml import policy_to_toml

__all__ = [
    "DIR_MIN_FILES",
    "Finding",
    "Learner",
    "LearningRun",
    "Proposal",
    "ProposalFiles",
    "apply_proposal",
    "diff_files",
    "diff_policies",
    "envelope_report",
    "file_digest",
    "learn_run",
    "learning_envelope",
    "proposal_paths",
    "propose",
    "write_proposal",
]

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


@dataclasses.dataclass(frozen=True)
class ProposalFiles:
    """Where a proposal was written."""

    toml: Path
    diff: Path

    def __iter__(self) -> Iterator[Path]:
        return iter((self.toml, self.diff))


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A proposed policy with the findings that explain it; nothing here is applied."""

    current: Policy
    proposed: Policy
    findings: tuple[Finding, ...]
    records: int = 0

    @property
    def risky(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.status == "risky")

    @property
    def flagged(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.status == "flagged")

    @property
    def changed(self) -> bool:
        """Whether the proposed policy differs from the current one."""
        return self.proposed.fingerprint() != self.current.fingerprint()

    def _comments(self) -> dict[tuple[str, str], str]:
        notes: dict[tuple[str, str], str] = {}
        for f in self.findings:
            if f.status == "risky":
                notes[(f.field, f.value)] = f"RISKY: {f.reason}"
            elif f.status == "proposed" and f.reason:
                notes.setdefault((f.field, f.value), f"learned: {f.reason}")
        rules = list(self.proposed.net.rules)
        for f in self.findings:
            if f.field == "net.rules" and f.status != "flagged" and f.reason:
                for index, rule in enumerate(rules):
                    if _rule_text(rule) == f.value:
                        tag = "RISKY" if f.status == "risky" else "learned"
                        notes[("net.rules", str(index))] = f"{tag}: {f.reason}"
        return notes

    def header(self) -> str:
        source = self.current.source or "<in memory>"
        proposed = [f for f in self.findings if f.status != "flagged"]
        lines = [
            f"{_HEADER_START} for policy {self.current.name!r} (current: {source}).",
            "Nothing here is in force. Review every line, then apply it explicitly:",
            "  agent-sandbox policy apply <this file> --to <the current policy>",
            f"{self.records} distinct would-be denials observed: {len(proposed)} entries proposed "
            f"({len(self.risky)} RISKY, marked on their line), "
            f"{len(self.flagged)} FLAGGED and not proposed.",
        ]
        if self.risky:
            lines.append("RISKY (proposed, check each):")
            lines.extend(f"  {f.line()}" for f in self.risky)
        if self.flagged:
            lines.append("FLAGGED (not proposed; add by hand only if you are sure):")
            lines.extend(f"  {f.line()}" for f in self.flagged)
        return "\n".join(lines)

    def to_toml(self) -> str:
        """The proposed policy as TOML, with the header and the RISKY marks as comments."""
        return policy_to_toml(self.proposed, header=self.header(), comments=self._comments())

    def diff(self) -> str:
        """A readable diff from the current policy to the proposal, then the flagged list."""
        notes = {(field, value): text for (field, value), text in self._comments().items()}
        left = self.current.source or self.current.name
        text = diff_policies(self.current, self.proposed, notes=notes, labels=(left, "proposed"))
        if self.flagged:
            text += "\nflagged, not proposed:\n"
            text += "".join(f"  ! {f.line()}\n" for f in self.flagged)
        return text


# -- the learning envelope --------------------------------------------------------------


def learning_envelope(policy: Policy, *, provider: str | None = None) -> Policy:
    """The policy to run a learning session under: `policy` in mode `learn`, contained.

    The provider is `provider` when given (an error if it is unavailable), else the policy's
    own provider when it names one other than `subprocess`, else `auto`, which picks the
    deepest kernel stack that serves the policy and names it in the result (see
    `envelope_report`). Files, network, imports and calls stay as declared: the guards record
    what they would refuse, and the kernel provider still holds writes to the scratch
    directory and the declared write paths. Secret-looking and loader variables are dropped
    from `env.pass`, and the policy file and its proposal files are added to `files.deny`;
    nothing is widened.
    """
    from agent_sandbox.providers import get_provider, select_provider

    requested = provider
    if requested is None:
        requested = policy.provider if policy.provider != "subprocess" else "auto"
    if requested == "auto":
        get_provider("auto").require()
        name = "auto"
    else:
        name = select_provider(requested).name
    passthrough = tuple(p for p in policy.env.passthrough if not _env_pattern_unsafe(p))
    overrides: dict[str, Any] = {
        "mode": "learn",
        "provider": name,
        "env": {"pass": list(passthrough)},
    }
    path = _source_path(policy)
    if path:
        # The policy file and its proposal files are masked where the kernel provider can.
        own = [
            as_literal(p)
            for p in [os.path.abspath(path), *map(str, proposal_paths(os.path.abspath(path)))]
        ]
        overrides["files"] = {"deny": list(dict.fromkeys([*policy.files.deny, *own]))}
    return policy.merged(overrides)


def _boundary_names() -> list[str]:
    """The kernel providers `auto` can use here, strongest first."""
    from agent_sandbox.providers import get_provider

    details = get_provider("auto").probe().details
    names = [str(n) for n in details.get("candidates", ())]
    return [n for n in names if get_provider(n).is_boundary]


def envelope_report(policy: Policy, envelope: Policy, ran_under: str = "") -> list[str]:
    """What the learning run is allowed, in lines a person reads before trusting the result.

    `ran_under` is `RunResult.provider` after the run (what `auto` really chose).
    """
    from agent_sandbox.providers import get_provider

    lines = []
    unbounded = (
        "NO kernel boundary: operations the guards record also take effect; "
        "learn only on code you trust"
    )
    if ran_under:
        bounded = get_provider(ran_under).is_boundary
        lines.append(f"ran under: {ran_under}" + ("" if bounded else f" ({unbounded})"))
    elif envelope.provider == "auto":
        kernels = _boundary_names()
        if kernels:
            lines.append(
                f"provider: auto, the deepest kernel stack that serves this policy "
                f"(kernel boundary; candidates here: {', '.join(kernels)})"
            )
        else:
            lines.append(f"provider: auto, and no kernel provider works here ({unbounded})")
    elif get_provider(envelope.provider).is_boundary:
        lines.append(f"provider: {envelope.provider} (kernel boundary)")
    else:
        lines.append(f"provider: {envelope.provider} ({unbounded})")
    writes = [w for w in envelope.files.write if not w.startswith("$SCRATCH")]
    lines.append("writes: the scratch directory" + (f" and {', '.join(writes)}" if writes else ""))
    allowed = [_rule_text(r) for r in envelope.net.rules]
    lines.append("network: " + ("; ".join(allowed) if allowed else "none"))
    dropped = sorted(set(policy.env.passthrough) - set(envelope.env.passthrough))
    lines.append(
        "environment passed: "
        + (", ".join(envelope.env.passthrough) or "none")
        + (f" (withheld while learning: {', '.join(dropped)})" if dropped else "")
    )
    lines.append("mode: learn (operations the policy refuses are recorded and allowed)")
    return lines


def _env_pattern_unsafe(pattern: str) -> bool:
    """Whether passing `pattern` could hand a secret or a loader variable to the worker."""
    if _LOADER_ENV.match(pattern) or _SECRET_ENV.search(pattern):
        return True
    if any(ch in pattern for ch in "*?"):
        if pattern.strip("*?") == "":
            return True
        return any(
            (_SECRET_ENV.search(name) or _LOADER_ENV.match(name))
            and fnmatch.fnmatchcase(name, pattern)
            for name in os.environ
        )
    return False


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


def _default_control_patterns() -> tuple[str, ...]:
    tmp = os.path.realpath(tempfile.gettempdir())
    return (os.path.join(tmp, "agent-sandbox-*"),)


def _default_import_roots() -> tuple[str, ...]:
    roots: dict[str, None] = {}
    paths = sysconfig.get_paths()
    for entry in (*sys.path, paths["stdlib"], paths["purelib"], paths["platlib"]):
        if entry and os.path.isabs(entry):
            roots.setdefault(os.path.realpath(entry), None)
    # The import root of agent_sandbox itself (this file is agent_sandbox/_tools/learn/).
    package = os.path.dirname(os.path.realpath(__file__))
    roots.setdefault(str(Path(package).parents[2]), None)
    return tuple(roots)


def _records(items: Iterable[Denial | RunResult]) -> list[Denial]:
    out: list[Denial] = []
    for item in items:
        if isinstance(item, RunResult):
            out.extend(item.denials)
        elif isinstance(item, Denial):
            out.append(item)
        else:
            raise TypeError(f"expected Denial or RunResult records, got {type(item).__name__}")
    return out


def propose(
    current: Policy,
    records: Iterable[Denial | RunResult],
    *,
    policy_path: str | os.PathLike[str] | None = None,
    scratch_roots: Iterable[str] = (),
    home: str | None = None,
) -> Proposal:
    """The proposal for `current` from learning-mode records (denials or whole results).

    `policy_path` is the policy file (defaults to `current.source`); it and its proposal
    files are never proposed. `scratch_roots` adds directories that were the worker's
    scratch (the usual `<tmp>/agent-sandbox-*` control directories are always known).
    `home` overrides the user's home directory. The result depends only on the set of
    records, not on their order, so re-learning the same run gives the same proposal.
    """
    path = os.fspath(policy_path) if policy_path is not None else _source_path(current)
    policy_paths: tuple[str, ...] = ()
    if path:
        real = os.path.realpath(path)
        stem = real[:-5] if real.endswith(".toml") else real
        policy_paths = tuple(
            dict.fromkeys(
                (os.path.abspath(path), real, f"{stem}.proposed.toml", f"{stem}.proposed.diff")
            )
        )
    ctx = _Context(
        current=current,
        home=os.path.realpath(home or os.path.expanduser("~")),
        policy_paths=policy_paths,
        scratch_roots=tuple(os.path.realpath(s) for s in scratch_roots),
        control_patterns=_default_control_patterns(),
        import_roots=_default_import_roots(),
    )
    denials = _records(records)
    unique = sorted({(d.rule, d.action, d.target, d.detail, d.learned) for d in denials})
    findings: list[Finding] = []
    by_rule: dict[str, list[tuple[str, str, str]]] = {}
    for rule, action, target, detail, learned in unique:
        if rule == "guard.tampered":
            findings.append(
                Finding(
                    "guards",
                    target or "guard",
                    "flagged",
                    "the run disarmed or replaced a guard: its records are "
                    "incomplete and the code is hostile or broken",
                    rule,
                )
            )
            continue
        if not learned:
            findings.append(
                Finding(
                    _field_for(rule),
                    target,
                    "flagged",
                    "refused, not observed in learning mode",
                    rule,
                )
            )
            continue
        if rule.startswith(_NOT_LEARNABLE):
            findings.append(
                Finding(
                    _field_for(rule),
                    target,
                    "flagged",
                    "limits and the code layer are not learned; change them by hand",
                    rule,
                )
            )
            continue
        by_rule.setdefault(rule, []).append((action, target, detail))

    writes = sorted({t for _, t, _ in by_rule.get("files.write", [])})
    ctx.run_written = tuple(_lexical(t) for t in writes if t.startswith("/"))
    updates: dict[str, Any] = {}
    read_new, f1 = _learn_paths(ctx, "files.read", _with_requested(by_rule.pop("files.read", [])))
    write_new, f2 = _learn_paths(
        ctx, "files.write", _with_requested(by_rule.pop("files.write", []))
    )
    findings += f1 + f2
    for _, target, _ in by_rule.pop("files.hidden", []):
        findings.append(
            Finding("files.hide", target, "flagged", "a hidden name stays hidden", "files.hidden")
        )
    net_rules, f3 = _learn_net(
        ctx,
        by_rule.pop("net.connect", []),
        by_rule.pop("net.bind", []),
        by_rule.pop("net.resolve", []),
    )
    findings += f3
    net_on = current.net.allows_any() or bool(net_rules)
    imports_new, f4 = _learn_imports(
        ctx, sorted({t for _, t, _ in by_rule.pop("imports", [])}), net_on
    )
    findings += f4
    env_new, f5 = _learn_env(ctx, sorted({t for _, t, _ in by_rule.pop("env", [])}))
    findings += f5
    api_new: list[str] = []
    for rule in sorted(r for r in by_rule if r.startswith("api.")):
        new, found = _learn_api(ctx, rule, sorted({t for _, t, _ in by_rule.pop(rule)}))
        api_new += new
        findings += found
    for rule, items in sorted(by_rule.items()):
        for _, target, _ in sorted(items):
            findings.append(
                Finding(_field_for(rule), target, "flagged", f"no learning rule for {rule!r}", rule)
            )

    if read_new:
        updates.setdefault("files", {})["read"] = [*current.files.read, *read_new]
    if write_new:
        updates.setdefault("files", {})["write"] = [*current.files.write, *write_new]
    if net_rules:
        updates["net"] = {
            "rules": [r.model_dump(mode="json") for r in current.net.rules]
            + [r.model_dump(mode="json") for r in net_rules]
        }
    if imports_new:
        updates["imports"] = {"allow": [*current.imports.allow, *imports_new]}
    if env_new:
        updates["env"] = {"pass": [*current.env.passthrough, *env_new]}
    if api_new:
        updates["api"] = {"allow": [*current.api.allow, *sorted(set(api_new))]}
    updates["mode"] = "enforce"
    try:
        proposed = current.merged(updates)
    except PolicyError as exc:
        raise LearningError(f"the proposed policy does not validate: {exc}") from exc
    order = {"risky": 0, "flagged": 1, "proposed": 2}
    findings = list(dict.fromkeys(findings))
    findings.sort(key=lambda f: (order[f.status], f.field, f.value))
    return Proposal(
        current=current,
        proposed=proposed.model_copy(update={"source": None}),
        findings=tuple(findings),
        records=len(unique),
    )


def _source_path(policy: Policy) -> str | None:
    source = policy.source
    if not source or source.startswith(("preset:", "<")):
        return None
    return source


def _field_for(rule: str) -> str:
    return {
        "files.read": "files.read",
        "files.write": "files.write",
        "net.connect": "net.rules",
        "net.bind": "net.rules",
        "net.resolve": "net.rules",
        "imports": "imports.allow",
        "env": "env.pass",
    }.get(rule, "api.allow" if rule.startswith("api.") else rule)


# -- paths ------------------------------------------------------------------------------


def _lexical(path: str) -> str:
    return os.path.normpath(path) if path.startswith("/") else path


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith("/" if root == "/" else root + "/")


def _resolve(path: str) -> tuple[str, list[str]]:
    """Resolve `path` one component at a time: (real path, the symlinks crossed).

    Components that do not exist are kept lexically. A link loop stops the walk.
    """
    pending = [p for p in path.split("/") if p]
    current = "/"
    links: list[str] = []
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current) or "/"
            continue
        candidate = os.path.join(current, name)
        try:
            info = os.lstat(candidate)
        except OSError:
            rest = os.path.join(candidate, *pending) if pending else candidate
            return os.path.normpath(rest), links
        if stat.S_ISLNK(info.st_mode):
            if len(links) >= 40:
                raise OSError(f"too many levels of symbolic links in {path}")
            links.append(candidate)
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = "/"
            pending = [p for p in target.split("/") if p] + pending
            continue
        current = candidate
    return current, links


def _world_writable(directory: str) -> bool:
    try:
        return bool(os.stat(directory).st_mode & stat.S_IWOTH)
    except OSError:
        return False


def _swappable(path: str) -> bool:
    """Whether some parent of `path` is world-writable without the sticky bit (anyone could
    rename `path` away and put a link in its place)."""
    parent = os.path.dirname(path)
    while parent and parent != "/":
        try:
            mode = os.stat(parent).st_mode
        except OSError:
            return False
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            return True
        parent = os.path.dirname(parent)
    return False


def _in_scratch(ctx: _Context, path: str) -> bool:
    if any(_under(path, s) for s in ctx.scratch_roots):
        return True
    return any(
        fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + "/*")
        for pattern in ctx.control_patterns
    )


def _covers(entry: str, path: str, home: str) -> bool:
    """Whether the policy entry `entry` (in the `[files]` language) covers the real `path`."""
    if entry.startswith("$SCRATCH"):
        return False
    entry = expand_entry(entry, home=home)
    if is_glob(entry):
        return bool(entry_regex(entry).fullmatch(path))
    return _under(path, _lexical(unescape(entry)))


def _untrusted_link(ctx: _Context, link: str) -> str | None:
    """Why a symlink at `link` may have been planted by the run (None if it looks trusted)."""
    parent = os.path.dirname(link)
    if _in_scratch(ctx, link):
        return "in the worker's scratch directory"
    for root in ctx.run_written:
        if _under(link, root) or _under(root, link):
            return "at a path the run wrote"
    for entry in ctx.current.files.write:
        if not entry.startswith("$SCRATCH") and _covers(entry, link, ctx.home):
            return "in a directory the policy lets the run write"
    if _world_writable(parent):
        return f"in a world-writable directory ({parent})"
    return None


def _judge_path(ctx: _Context, path: str, field: str) -> str | None:
    """Why `path` must not be proposed for `field` (None when it may be)."""
    if path == "/":
        return "the whole filesystem"
    if path in ctx.policy_paths:
        return "the policy file or its proposal: a run never gets its own policy"
    if _in_scratch(ctx, path):
        return "inside a worker's control or scratch directory"
    if path not in _HARMLESS_DEVICES:
        for tree in _FORBIDDEN_TREES:
            if _under(path, tree):
                return f"under {tree}, which exposes the host's processes, devices or sockets"
    if _under(ctx.home, path):
        return "the home directory or one of its parents"
    if path in _SENSITIVE_FILES or any(_under(path, t) for t in _SENSITIVE_TREES):
        return "a sensitive system file"
    parts = path.split("/")
    if any(part in _SENSITIVE_COMPONENTS for part in parts):
        return "a credentials location"
    base = parts[-1]
    hidden = [
        p
        for p in ctx.current.files.hide
        for part in parts
        if part and "/" not in p and name_regex(p).fullmatch(part)
    ]
    if hidden:
        return f"matches the hidden name {hidden[0]!r}"
    for entry in ctx.current.files.deny:
        if _covers(entry, path, ctx.home):
            return f"the policy denies it explicitly ({entry})"
    if field == "files.write":
        if any(fnmatch.fnmatchcase(base, p) for p in _STARTUP_FILES):
            return "a file the interpreter runs at start-up or on import"
        for root in ctx.import_roots:
            if _under(path, root) or _under(root, path):
                return f"inside an import root ({root}): it would pre-empt the next run's imports"
    return None


#: How a file denial names the path as the code asked for it, before links were resolved.
_REQUESTED_RE = re.compile(r"requested as '([^']*)'")


def _with_requested(items: list[tuple[str, str, str]]) -> list[tuple[str, tuple[str, ...]]]:
    """(resolved target, the paths the code asked for that led there), sorted."""
    out: dict[str, set[str]] = {}
    for _, target, detail in items:
        requested = out.setdefault(target, set())
        match = _REQUESTED_RE.search(detail)
        if match and match.group(1) != target:
            requested.add(match.group(1))
    return [(t, tuple(sorted(r))) for t, r in sorted(out.items())]


def _via_planted_link(ctx: _Context, requested: str) -> str | None:
    """Why the path the code asked for may run through a link the run planted (or None)."""
    if not requested.startswith("/"):
        return "a relative path, resolved from the worker's scratch directory"
    literal = _lexical(requested)
    if _in_scratch(ctx, literal):
        return "in a worker's scratch directory"
    parent = os.path.dirname(literal)
    if any(_under(parent, root) for root in ctx.run_written):
        return "in a path the run could write"
    for entry in ctx.current.files.write:
        if _covers(entry, parent, ctx.home):
            return "in a path the run could write"
    return None


def _learn_paths(
    ctx: _Context, field: str, targets: list[tuple[str, tuple[str, ...]]]
) -> tuple[list[str], list[Finding]]:
    rule = field
    findings: list[Finding] = []
    files: dict[str, set[str]] = {}
    dirs: set[str] = set()
    for target, requested in targets:
        if not target.startswith("/"):
            findings.append(Finding(field, target, "flagged", "not an absolute path", rule))
            continue
        via = [(r, why) for r in requested if (why := _via_planted_link(ctx, r))]
        if via:
            asked, why = via[0]
            findings.append(
                Finding(
                    field,
                    f"{asked} -> {target}",
                    "flagged",
                    f"reached through a link the run could plant ({why}); "
                    "a planted link is never followed into a proposal",
                    rule,
                )
            )
            continue
        literal = _lexical(target)
        if _in_scratch(ctx, literal):
            findings.append(
                Finding(
                    field,
                    target,
                    "flagged",
                    "inside a worker's control or scratch directory, which vanishes "
                    "with the worker",
                    rule,
                )
            )
            continue
        try:
            real, links = _resolve(target)
        except OSError as exc:
            findings.append(Finding(field, target, "flagged", str(exc), rule))
            continue
        planted = [(link, why) for link in links if (why := _untrusted_link(ctx, link))]
        if planted:
            link, why = planted[0]
            findings.append(
                Finding(
                    field,
                    target,
                    "flagged",
                    f"reached through the symlink {link} ({why}) to {real}; "
                    "a link the run could plant is never followed into a "
                    "proposal",
                    rule,
                )
            )
            continue
        reason = _judge_path(ctx, literal, field)
        shown = target
        if reason is None and real != literal:
            reason = _judge_path(ctx, real, field)
            shown = f"{target} -> {real}"
        if reason:
            findings.append(Finding(field, shown, "flagged", reason, rule))
            continue
        allowed = (
            ctx.current.files.write
            if field == "files.write"
            else (*ctx.current.files.read, *ctx.current.files.write)
        )
        if any(_covers(entry, real, ctx.home) for entry in allowed):
            continue
        if os.path.isdir(real):
            # A listed or opened directory: a grant on it covers everything below it.
            why_not = _collapse_refusal(ctx, real, field)
            if why_not:
                findings.append(
                    Finding(
                        field,
                        real,
                        "flagged",
                        f"a directory ({why_not}); a grant on it would cover every file below it",
                        rule,
                    )
                )
                continue
            dirs.add(real)
            continue
        files.setdefault(os.path.dirname(real), set()).add(real)

    proposed: list[str] = []
    for directory in sorted(dirs):
        if any(_under(directory, other) and directory != other for other in dirs):
            continue
        proposed.append(as_literal(directory))
        findings.append(
            Finding(
                field,
                as_literal(directory),
                "risky",
                _joined("a whole directory: covers every file below it", risky_name(directory)),
                rule,
                (directory,),
            )
        )
    files = {d: names for d, names in files.items() if not any(_under(d, k) for k in dirs)}
    for directory in sorted(files):
        group = sorted(files[directory])
        why_not = _collapse_refusal(ctx, directory, field)
        if len(group) >= DIR_MIN_FILES and why_not is None:
            names = ", ".join(os.path.basename(g) for g in group)
            proposed.append(as_literal(directory))
            findings.append(
                Finding(
                    field,
                    as_literal(directory),
                    _path_status(ctx, directory),
                    _path_risk(ctx, directory)
                    or f"a directory: {len(group)} files in it were used ({names})",
                    rule,
                    tuple(group),
                )
            )
            continue
        for file in group:
            proposed.append(as_literal(file))
            findings.append(
                Finding(
                    field,
                    as_literal(file),
                    _path_status(ctx, file),
                    _path_risk(ctx, file),
                    rule,
                    (file,),
                )
            )
    return proposed, findings


def _collapse_refusal(ctx: _Context, directory: str, field: str) -> str | None:
    if directory.count("/") < 2:
        return "a top-level directory"
    if _under(directory, "/etc"):
        return "system configuration stays file by file"
    if _world_writable(directory):
        return "a world-writable directory"
    if _swappable(directory):
        return "a world-writable parent without the sticky bit lets anyone swap it"
    if any(_under(p, directory) for p in ctx.policy_paths):
        return "it holds the policy file"
    return _judge_path(ctx, directory, field)


def _path_risk(ctx: _Context, path: str) -> str:
    where = ""
    if _under(path, ctx.home):
        where = "inside the home directory"
    elif _under(path, "/etc"):
        where = "system configuration"
    return _joined(where, _name_risk(path))


def _name_risk(path: str) -> str:
    """A path's risky name, and that the proposal writes it so it matches only itself."""
    why = risky_name(path)
    return f"{why}; written escaped, so it matches only this name" if why else ""


def _joined(*reasons: str) -> str:
    return "; ".join(r for r in reasons if r)


def _path_status(ctx: _Context, path: str) -> Status:
    return "risky" if _path_risk(ctx, path) else "proposed"


# -- network ----------------------------------------------------------------------------


def _split_host_port(target: str) -> tuple[str, int | None]:
    text = target.strip()
    if "://" in text:
        text = text.split("://", 1)[1]
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        # `::1:8080`, as the guard writes an IPv6 address and a port.
        left, _, right = text.rpartition(":")
        host, port = text, ""
        if right.isdigit():
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(left.split("%")[0])
                host, port = left, right
    try:
        number = int(port) if port else None
    except ValueError:
        number = None
    if number is not None and not 0 <= number <= 65535:
        number = None
    return host.strip().lower().rstrip("."), number


#: A host name as a rule may name it literally: DNS labels (underscores allowed).
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME_RE = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")


def _host_unwritable(host: str) -> str:
    """Why `host` cannot be proposed as the one host it is ("" when it can): a rule's host
    is a name, one address or a CIDR, so anything else (a network such as `0.0.0.0/0`, a
    wildcard, control characters) would mean more than what the run used."""
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    if _HOSTNAME_RE.match(host) and host not in ("any",):
        return ""
    what = risky_name(host) or "it is not a plain host name or one address"
    return (
        f"{what}; a rule naming it would not mean this one host, and a proposal names "
        "exactly what the run used (write the rule by hand if you mean it)"
    )


def _protocol(action: str, target: str, detail: str) -> Literal["tcp", "udp"]:
    text = f"{action} {target} {detail}".lower()
    return "udp" if "udp" in text or "sendto" in text or "datagram" in text else "tcp"


def _host_risk(host: str, direction: str) -> tuple[Status, str] | None:
    if host in _METADATA_HOSTS:
        return ("flagged", "a cloud metadata endpoint: it hands out the host's credentials")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host in ("localhost", "localhost.localdomain"):
            return ("risky", "the local machine: reaches services on this host")
        return None
    if address.is_unspecified and direction == "bind":
        return ("risky", "listens on every interface")
    if address.is_link_local:
        return ("flagged", "a link-local address (metadata and neighbour services)")
    if address.is_loopback:
        return ("risky", "the local machine: reaches services on this host")
    if address.is_private:
        return ("risky", "a private network address")
    return None


def _net_allowed(ctx: _Context, host: str, port: int, direction: str, protocol: str) -> str:
    """'deny' when a deny rule matches, 'allow' when an allow rule does, else ''."""
    verdict = ""
    for rule in ctx.current.net.rules:
        if rule.direction not in ("any", direction) or rule.protocol not in ("any", protocol):
            continue
        if not any(lo <= port <= hi for lo, hi in rule.port_ranges()):
            continue
        if not _host_matches(rule.host, host):
            continue
        if rule.action == "deny":
            return "deny"
        verdict = "allow"
    return verdict


def _host_matches(rule_host: str, host: str) -> bool:
    if rule_host.lower() == host:
        return True
    if "/" in rule_host:
        try:
            return ipaddress.ip_address(host) in ipaddress.ip_network(rule_host, strict=False)
        except ValueError:
            return False
    return False


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


def _learn_net(
    ctx: _Context,
    connects: list[tuple[str, str, str]],
    binds: list[tuple[str, str, str]],
    resolves: list[tuple[str, str, str]],
) -> tuple[list[NetRule], list[Finding]]:
    findings: list[Finding] = []
    wanted: dict[tuple[str, str, str], set[int]] = {}
    protocol: str
    named: set[str] = set()
    observed = [("connect", c) for c in connects] + [("bind", b) for b in binds]
    for direction, (action, target, detail) in observed:
        rule = f"net.{direction}"
        host, port = _split_host_port(target)
        if not host or port is None:
            findings.append(
                Finding(
                    "net.rules",
                    target,
                    "flagged",
                    "no host and port could be read from the record",
                    rule,
                )
            )
            continue
        unwritable = _host_unwritable(host)
        if unwritable:
            findings.append(Finding("net.rules", target, "flagged", unwritable, rule))
            continue
        protocol = _protocol(action, target, detail)
        key = (direction, protocol, host)
        wanted.setdefault(key, set()).add(port)
        named.add(host)
    pending_resolves: list[tuple[str, str]] = []
    for action, target, detail in resolves:
        host, port = _split_host_port(target)
        if not host:
            continue
        unwritable = _host_unwritable(host)
        if unwritable:
            findings.append(Finding("net.rules", target, "flagged", unwritable, "net.resolve"))
            continue
        if port is None:
            # The host's egress proxy says which port the name was wanted for.
            asked = re.search(r"\(port (\d{1,5})\)", detail)
            if asked and 0 < int(asked.group(1)) < 65536:
                port = int(asked.group(1))
        if port is None:
            pending_resolves.append((host, target))
            continue
        protocol = _protocol(action, target, detail)
        wanted.setdefault(("connect", protocol, host), set()).add(port)
        named.add(host)
    remote_ports = {
        port
        for (direction, protocol, host), ports in wanted.items()
        if direction == "connect" and protocol == "tcp" and not _host_risk(host, direction)
        for port in ports
    }
    inferred: set[str] = set()
    for host, target in pending_resolves:
        covered = host in named or any(_host_matches(r.host, host) for r in ctx.current.net.rules)
        if not covered and remote_ports and not _host_risk(host, "connect"):
            # The guard records the lookup by name and the connection by address; the name
            # gets the ports the run connected to, marked for review.
            wanted.setdefault(("connect", "tcp", host), set()).update(remote_ports)
            inferred.add(host)
            continue
        if not covered:
            findings.append(
                Finding(
                    "net.rules",
                    target,
                    "flagged",
                    "a name looked up without a port and never connected to; "
                    "add a rule with the ports it needs by hand",
                    "net.resolve",
                )
            )
    rules: list[NetRule] = []
    for (direction, protocol, host), ports in sorted(wanted.items()):
        rule_name = f"net.{direction}"
        new_ports: set[int] = set()
        for port in ports:
            verdict = _net_allowed(ctx, host, port, direction, protocol)
            if verdict == "deny":
                findings.append(
                    Finding(
                        "net.rules",
                        f"{direction} {protocol} {host}:{port}",
                        "flagged",
                        "the policy denies it explicitly",
                        rule_name,
                    )
                )
            elif verdict == "":
                new_ports.add(port)
        if not new_ports:
            continue
        risk = _host_risk(host, direction)
        if risk and risk[0] == "flagged":
            findings.append(
                Finding(
                    "net.rules",
                    f"{direction} {protocol} {host}:{_ports_text(new_ports)}",
                    "flagged",
                    risk[1],
                    rule_name,
                )
            )
            continue
        try:
            new_rule = NetRule.model_validate(
                {
                    "host": host,
                    "ports": _ports_text(new_ports),
                    "direction": direction,
                    "protocol": protocol,
                }
            )
        except ValueError as exc:
            findings.append(Finding("net.rules", f"{host}", "flagged", str(exc), rule_name))
            continue
        rules.append(new_rule)
        status: Status = risk[0] if risk else "proposed"
        if host in inferred and not risk:
            status = "risky"
            risk = ("risky", "a name the run looked up; its ports are those the run connected to")
        findings.append(
            Finding(
                "net.rules",
                _rule_text(new_rule),
                status,
                risk[1] if risk else "",
                rule_name,
                tuple(f"{host}:{p}" for p in sorted(new_ports)),
            )
        )
    return rules, findings


# -- imports, environment, calls --------------------------------------------------------


def _module_covered(entries: Iterable[str], module: str) -> bool:
    for entry in entries:
        entry = entry.removesuffix(".*")
        if entry == "*" or module == entry or module.startswith(entry + "."):
            return True
    return False


def _learn_imports(
    ctx: _Context, modules: list[str], net_on: bool
) -> tuple[list[str], list[Finding]]:
    findings: list[Finding] = []
    candidates: list[str] = []
    for module in modules:
        if not _MODULE_RE.match(module):
            findings.append(
                Finding("imports.allow", module, "flagged", "not a module name", "imports")
            )
            continue
        if _module_covered(ctx.current.imports.deny, module):
            findings.append(
                Finding(
                    "imports.allow", module, "flagged", "the policy denies it explicitly", "imports"
                )
            )
            continue
        if _module_covered(ctx.current.imports.allow, module):
            continue
        candidates.append(module)
    chosen = [m for m in candidates if not _module_covered([c for c in candidates if c != m], m)]
    for module in chosen:
        covered = tuple(c for c in candidates if _module_covered([module], c))
        reason = ""
        for name in (module, *covered):
            top = name.split(".", 1)[0]
            reason = _RISKY_MODULES.get(name) or _RISKY_MODULES.get(top, "")
            if not reason and not net_on and _module_covered(_NET_MODULES, name):
                reason = "network access, and the policy has no network"
            if reason:
                break
        findings.append(
            Finding(
                "imports.allow",
                module,
                "risky" if reason else "proposed",
                reason,
                "imports",
                covered,
            )
        )
    return chosen, findings


def _learn_env(ctx: _Context, names: list[str]) -> tuple[list[str], list[Finding]]:
    findings: list[Finding] = []
    chosen: list[str] = []
    for name in names:
        if not _ENV_NAME_RE.match(name):
            findings.append(Finding("env.pass", name, "flagged", "not a variable name", "env"))
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in ctx.current.env.passthrough):
            continue
        if _LOADER_ENV.match(name):
            findings.append(
                Finding(
                    "env.pass",
                    name,
                    "flagged",
                    "changes how the worker's interpreter or loader starts",
                    "env",
                )
            )
            continue
        chosen.append(name)
        if _SECRET_ENV.search(name):
            findings.append(
                Finding(
                    "env.pass",
                    name,
                    "risky",
                    "looks like a secret: the tool's code would read its value",
                    "env",
                    (name,),
                )
            )
        else:
            findings.append(Finding("env.pass", name, "proposed", "", "env", (name,)))
    return chosen, findings


def _learn_api(ctx: _Context, rule: str, targets: list[str]) -> tuple[list[str], list[Finding]]:
    category = rule.split(".", 1)[1]
    findings: list[Finding] = []
    chosen: list[str] = []
    for function in targets:
        if not _FUNCTION_RE.match(function):
            findings.append(
                Finding("api.allow", function, "flagged", "not a dotted function name", rule)
            )
            continue
        if function in ctx.current.api.deny or category in ctx.current.api.deny:
            findings.append(
                Finding("api.allow", function, "flagged", "the policy denies it explicitly", rule)
            )
            continue
        if function in ctx.current.api.allow or category in ctx.current.api.allow:
            continue
        if category in _NEVER_PROPOSED_CATEGORIES:
            findings.append(
                Finding(
                    "api.allow",
                    function,
                    "flagged",
                    f"{category}: granting it opens the Python layer wide",
                    rule,
                )
            )
            continue
        chosen.append(function)
        findings.append(
            Finding(
                "api.allow",
                function,
                "risky",
                _CATEGORY_RISK.get(category, f"a sensitive call ({category})"),
                rule,
                (function,),
            )
        )
    return chosen, findings


# -- the diff ---------------------------------------------------------------------------


def _flatten(policy: Policy) -> dict[str, Any]:
    data = policy.model_dump(mode="json", by_alias=True)
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and prefix != "env.set":
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else key, sub)
        elif prefix == "net.rules":
            out[prefix] = [_rule_text(NetRule(**r)) for r in value]
        else:
            out[prefix] = value

    walk("", data)
    return out


def diff_policies(
    current: Policy,
    proposed: Policy,
    *,
    notes: Mapping[tuple[str, str], str] | None = None,
    labels: tuple[str, str] | None = None,
) -> str:
    """A readable diff: per field, the entries removed (`-`) and added (`+`), with notes.

    List fields are compared as sets of entries (order aside), other fields by value.
    `notes` maps `(field, entry)` to a note printed after the entry (RISKY marks).
    """
    notes = notes or {}
    a, b = _flatten(current), _flatten(proposed)
    left, right = labels or (current.source or current.name, proposed.source or proposed.name)
    lines = [
        f"--- {left} (fingerprint {current.fingerprint()})",
        f"+++ {right} (fingerprint {proposed.fingerprint()})",
    ]
    changes = 0
    for field in sorted(set(a) | set(b)):
        old, new = a.get(field), b.get(field)
        if old == new:
            continue
        lines.append(f"[{field}]")
        if isinstance(old, list) and isinstance(new, list):
            for item in old:
                if item not in new:
                    lines.append(f"  - {visible(str(item))}")
                    changes += 1
            for index, item in enumerate(new):
                if item not in old:
                    key = str(index) if field == "net.rules" else str(item)
                    note = notes.get((field, key))
                    lines.append(
                        f"  + {visible(str(item))}" + (f"    # {visible(note)}" if note else "")
                    )
                    changes += 1
        else:
            lines.append(f"  - {visible(repr(old))}")
            lines.append(f"  + {visible(repr(new))}")
            changes += 1
    if not changes:
        lines.append("(no change)")
    return "\n".join(lines) + "\n"


def _notes_from_text(text: str) -> dict[tuple[str, str], str]:
    """The `# RISKY:` / `# learned:` marks a proposal file carries, keyed like `diff_policies`."""
    notes: dict[tuple[str, str], str] = {}
    section = ""
    key = ""
    rule_index = -1
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("[[") and line.endswith("]]"):
            rule_index += 1
            if pending:
                notes[(line[2:-2].strip(), str(rule_index))] = pending
            pending = ""
            continue
        if line.startswith("[") and line.endswith("]"):
            section, pending = line[1:-1].strip(), ""
            continue
        if line.startswith("# RISKY:") or line.startswith("# learned:"):
            pending = line[2:]
            continue
        match = re.match(r"^([A-Za-z0-9_-]+)\s*=", line)
        if match:
            key = match.group(1)
        item = re.match(r"""^("(?:[^"\\]|\\.)*"|'[^']*'),\s*#\s*(.*)$""", line)
        if item and key:
            try:
                value = tomllib.loads(f"v = {item.group(1)}")["v"]
            except tomllib.TOMLDecodeError:
                continue
            notes[(f"{section}.{key}" if section else key, value)] = item.group(2)
    return notes


def diff_files(current: str | os.PathLike[str], proposed: str | os.PathLike[str]) -> str:
    """`diff_policies` of two policy files, with the RISKY marks read from the proposal."""
    from agent_sandbox.policies import resolve_policy

    a = resolve_policy(os.fspath(current))
    text = _read_text(Path(proposed))
    b = policy_from_toml(text, source=os.fspath(proposed))
    return diff_policies(a, b, notes=_notes_from_text(text))


# -- writing and applying ---------------------------------------------------------------


def proposal_paths(
    policy_path: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None
) -> ProposalFiles:
    """`<name>.proposed.toml` and `<name>.proposed.diff` beside the policy (or in `out_dir`)."""
    path = Path(policy_path)
    stem = path.name[:-5] if path.name.endswith(".toml") else path.name
    folder = Path(out_dir) if out_dir is not None else path.parent
    return ProposalFiles(folder / f"{stem}.proposed.toml", folder / f"{stem}.proposed.diff")


def file_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes (`""` when it cannot be read); used to spot edits."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def write_proposal(
    proposal: Proposal,
    policy_path: str | os.PathLike[str] | None = None,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    expect_digest: str | None = None,
    name: str | None = None,
) -> ProposalFiles:
    """Write the proposal and its diff beside the policy file; never through a symlink.

    With `out_dir`, they go there instead, named after `name` (default: the policy file's
    name, or the policy's name).
    `expect_digest` is the policy file's `file_digest` from before the learning run: when
    the file changed since, nothing is written (the run may have edited its own policy).
    """
    path = os.fspath(policy_path) if policy_path is not None else _source_path(proposal.current)
    if path and expect_digest is not None and file_digest(path) != expect_digest:
        raise LearningError(
            "the policy file changed while the learning run ran; no proposal was written. "
            "Check the file: the run may have edited it",
            path=path,
        )
    if out_dir is not None:
        stem = name or (Path(path).name if path else f"{proposal.current.name}.toml")
        files = proposal_paths(os.path.join(os.fspath(out_dir), stem))
    elif path:
        files = proposal_paths(path)
    else:
        raise LearningError(
            f"policy {proposal.current.name!r} was not loaded from a file; "
            "give the directory to write the proposal to (out_dir / --out)"
        )
    _write_text(files.toml, proposal.to_toml())
    _write_text(files.diff, proposal.diff())
    return files


def apply_proposal(
    proposed_path: str | os.PathLike[str], to: str | os.PathLike[str] | None = None
) -> Path:
    """Add what a reviewed proposal grants to the current policy file; returns the path.

    `to` defaults to the proposal's name without `.proposed` (`tool.proposed.toml` ->
    `tool.toml`). The proposal must validate; the target must not be a symlink. An existing
    target keeps every byte it had (its `extends`, comments and layout): what the proposal
    adds beyond the target's own policy is appended as one `[[grant]]` element (a grant only
    adds to lists, see docs/policies.md). A target that does not exist yet is written from
    the proposal.
    """
    source = Path(proposed_path)
    text = _read_text(source)
    proposed = policy_from_toml(text, source=os.fspath(source))
    if to is None:
        if not source.name.endswith(".proposed.toml"):
            raise LearningError(
                "cannot tell which policy this proposal is for; give --to", path=os.fspath(source)
            )
        to = source.with_name(source.name[: -len(".proposed.toml")] + ".toml")
    target = Path(to)
    if os.path.realpath(target) == os.path.realpath(source):
        raise LearningError("the proposal and the target are the same file", path=str(target))
    if target.is_symlink() or not target.exists():
        _write_text(target, _applied_text(text, source.name))  # refuses the symlink
        return target
    current_text = _read_text(target)
    current = policy_from_toml(current_text, source=os.fspath(target))
    grant = grant_between(current, proposed)
    if not grant:
        return target
    _write_text(target, appended_grant(current_text, grant, source.name))
    return target


#: The list keys a proposal can add to, as (table, key) in the policy's TOML.
_GRANT_LISTS: tuple[tuple[str, str], ...] = (
    ("files", "read"),
    ("files", "write"),
    ("imports", "allow"),
    ("env", "pass"),
    ("api", "allow"),
)


def grant_between(current: Policy, proposed: Policy) -> dict[str, Any]:
    """What `proposed` allows beyond `current`, as one `[[grant]]` element (lists only)."""
    now = current.model_dump(mode="json", by_alias=True)
    then = proposed.model_dump(mode="json", by_alias=True)
    grant: dict[str, Any] = {}
    for table, key in _GRANT_LISTS:
        have = now.get(table, {}).get(key) or []
        added = [item for item in then.get(table, {}).get(key) or [] if item not in have]
        if added:
            grant.setdefault(table, {})[key] = added
    rules_now = now.get("net", {}).get("rules") or []
    added_rules = [r for r in then.get("net", {}).get("rules") or [] if r not in rules_now]
    if added_rules:
        grant["net"] = {"rules": added_rules}
    return grant


def appended_grant(current_text: str, grant: dict[str, Any], source_name: str) -> str:
    """`current_text` unchanged, then a comment and the `[[grant]]` element (tomlkit writes
    it, so every name is quoted and escaped as TOML data)."""
    import tomlkit

    element = tomlkit.table()
    for table, entries in grant.items():
        sub = tomlkit.table()
        for key, value in entries.items():
            array = tomlkit.array()
            for item in value:
                if isinstance(item, dict):
                    inline = tomlkit.inline_table()
                    inline.update(item)
                    array.append(inline)
                else:
                    array.append(item)
            sub.add(key, array)
        element.add(table, sub)
    doc = tomlkit.document()
    aot = tomlkit.aot()
    aot.append(element)
    doc.add("grant", aot)
    head = current_text if current_text.endswith("\n") or not current_text else current_text + "\n"
    note = f"\n# Added by `agent-sandbox policy apply` from {source_name} (a reviewed proposal).\n"
    return head + note + tomlkit.dumps(doc)


def _applied_text(text: str, source_name: str) -> str:
    """The proposal as a live policy: its "nothing here is in force" header replaced."""
    lines = text.splitlines(keepends=True)
    if lines and lines[0].startswith("# " + _HEADER_START):
        while lines and lines[0].strip():
            lines.pop(0)
        while lines and not lines[0].strip():
            lines.pop(0)
    note = (
        f"# Applied from {source_name}, a reviewed learning-mode proposal "
        "(its .proposed.diff lists what was flagged and left out).\n\n"
    )
    return note + "".join(lines)


def _read_text(path: Path) -> str:
    """A policy or proposal file's text, read as defensively as a policy is loaded."""
    from agent_sandbox._errors import PolicyNotFound
    from agent_sandbox.policies._load import read_policy_text

    try:
        return read_policy_text(path)
    except PolicyNotFound:
        raise LearningError("no such file", path=str(path)) from None
    except PolicyError as exc:
        raise LearningError(f"cannot read it ({exc})", path=str(path)) from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _write_text(path: Path, text: str) -> None:
    """Atomically replace `path` with `text`: a temporary file in the same directory, then
    rename. A symlink at `path` is refused, not followed (and a rename never follows one)."""
    if path.is_symlink():
        raise LearningError(
            "is a symlink; refusing to write through it (remove it or choose another path)",
            path=str(path),
        )
    if path.exists() and not path.is_file():
        raise LearningError("exists and is not a regular file", path=str(path))
    folder = path.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise LearningError(
            f"cannot write in {folder} ({_reason(exc)}); make the directory "
            "writable or write the proposal elsewhere",
            path=str(path),
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise LearningError(f"cannot write it ({_reason(exc)})", path=str(path)) from None


# -- one learning run -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LearningRun:
    """One learning run: its result, the proposal, the envelope it ran in and its report."""

    result: RunResult
    proposal: Proposal
    envelope: Policy
    report: tuple[str, ...]
    #: The policy file's digest before the run (`""` for a policy without a file).
    digest: str = ""


def learn_run(
    code: str,
    policy: Policy | str | os.PathLike[str],
    *,
    provider: str | None = None,
    timeout: float | None = None,
    on_event: Any = None,
) -> LearningRun:
    """Run `code` once in the learning envelope of `policy` and propose from what it needed.

    Nothing is written: pass the result's proposal and digest to `write_proposal`. Raises
    `LearningError` when the policy file changed during the run.
    """
    from agent_sandbox._host.sandbox import Sandbox
    from agent_sandbox.policies import resolve_policy

    current = resolve_policy(policy)
    path = _source_path(current)
    digest = file_digest(path) if path else ""
    envelope = learning_envelope(current, provider=provider)
    report = tuple(envelope_report(current, envelope))
    with Sandbox(envelope, warm=0) as sandbox:
        result = sandbox.run(code, timeout=timeout, on_event=on_event)
    if path and file_digest(path) != digest:
        raise LearningError(
            "the policy file changed while the learning run ran; no proposal was made. "
            "Check the file: the run may have edited it",
            path=path,
        )
    if result.provider:
        report = (*report, envelope_report(current, envelope, ran_under=result.provider)[0])
    proposal = propose(current, [result])
    return LearningRun(result, proposal, envelope, report, digest)


# -- the adapter hook -------------------------------------------------------------------


class Learner:
    """Collects learning-mode results per tool across a conversation; one proposal per tool.

    Framework-free: an adapter in learning mode runs each call under `envelope(policy)` and
    hands the result to `record(tool, policy, result)`; at the end `write()` writes one
    proposal per tool beside its policy file (or in `out_dir` for policies without a file).
    Thread-safe. It remembers each policy file's digest at the first call, so a policy edited
    during the conversation is refused at `write()`.
    """

    def __init__(
        self, *, out_dir: str | os.PathLike[str] | None = None, provider: str | None = None
    ) -> None:
        self.out_dir = out_dir
        self.provider = provider
        self._lock = threading.Lock()
        self._policies: dict[str, Policy] = {}
        self._records: dict[str, list[Denial]] = {}
        self._digests: dict[str, str] = {}

    def envelope(self, policy: Policy, *, provider: str | None = None) -> Policy:
        """The learning envelope for `policy` (see `learning_envelope`); `provider` (the
        tool's own choice) beats the learner's."""
        return learning_envelope(policy, provider=provider or self.provider)

    def watch(self, tool: str, policy: Policy) -> None:
        """Register `tool` and its (enforced) policy before its first call."""
        with self._lock:
            known = self._policies.get(tool)
            if known is not None and known.fingerprint() != policy.fingerprint():
                raise LearningError(f"tool {tool!r} was registered with another policy")
            self._policies[tool] = policy
            self._records.setdefault(tool, [])
            path = _source_path(policy)
            if path and tool not in self._digests:
                self._digests[tool] = file_digest(path)

    def record(self, tool: str, policy: Policy, result: RunResult) -> None:
        """Add one call's result for `tool` (its would-be denials become learning records)."""
        self.watch(tool, policy)
        with self._lock:
            self._records[tool].extend(result.denials)

    def tools(self) -> list[str]:
        with self._lock:
            return sorted(self._policies)

    def proposals(self) -> dict[str, Proposal]:
        """One proposal per tool, from everything recorded so far."""
        with self._lock:
            items = [(t, self._policies[t], list(self._records[t])) for t in sorted(self._policies)]
        return {tool: propose(policy, records) for tool, policy, records in items}

    def write(self) -> dict[str, ProposalFiles]:
        """Write every tool's proposal; returns where each went.

        Beside a policy file the proposal is named after the file; tools that share one
        policy file share one proposal, learned from all their calls. With `out_dir`, each
        tool gets `<tool>.proposed.toml` there.
        """
        with self._lock:
            items = [(t, self._policies[t], list(self._records[t])) for t in sorted(self._policies)]
        groups: dict[str, list[tuple[str, Policy, list[Denial]]]] = {}
        for tool, policy, records in items:
            path = _source_path(policy) if self.out_dir is None else None
            groups.setdefault(os.path.abspath(path) if path else f"tool:{tool}", []).append(
                (tool, policy, records)
            )
        out: dict[str, ProposalFiles] = {}
        for members in groups.values():
            tool, policy, _ = members[0]
            records = [r for _, _, recs in members for r in recs]
            files = write_proposal(
                propose(policy, records),
                out_dir=self.out_dir,
                expect_digest=self._digests.get(tool),
                name=f"{_safe_name(tool)}.toml",
            )
            for member, _, _ in members:
                out[member] = files
        return out


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".") or "tool"
