"""Reviewing a proposal: `Proposal` (its TOML, header and diff), the files beside the policy,
and applying it (step 3 of learning mode).

`write_proposal` writes `<name>.proposed.toml` and `<name>.proposed.diff` beside the policy,
never through a symlink; `apply_proposal` is the separate, explicit step that appends what
the reviewed proposal adds to the user's file as one `[[grant]]` element, leaving the rest
of the file byte for byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import tempfile
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_sandbox._errors import LearningError, PolicyError
from agent_sandbox._tools.learn.findings import _HEADER_START, _rule_text, _source_path
from agent_sandbox.policies import NetRule, Policy, policy_from_toml
from agent_sandbox.policies._paths import visible
from agent_sandbox.policies._toml import grant_to_toml, policy_to_toml

if TYPE_CHECKING:
    from agent_sandbox._tools.learn.findings import Finding

__all__ = [
    "Proposal",
    "ProposalFiles",
    "apply_proposal",
    "diff_files",
    "diff_policies",
    "file_digest",
    "proposal_paths",
    "write_proposal",
]


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
    """`current_text` unchanged, then a comment and the `[[grant]]` element (written by
    `policies._toml.grant_to_toml`, so every name is quoted and escaped as TOML data)."""
    head = current_text if current_text.endswith("\n") or not current_text else current_text + "\n"
    note = f"\n# Added by `agent-sandbox policy apply` from {source_name} (a reviewed proposal).\n"
    return head + note + grant_to_toml(grant)


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
