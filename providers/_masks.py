"""Names the kernel must keep from the worker inside what the policy grants.

A policy grants directories; inside them, three kinds of path must still be out of reach
of native code, not only of the Python guards:

* names matching `files.hide` (`.env`, `*.pem`, ... at any depth);
* paths matching a `files.deny` entry (a plain path or a glob);
* what the fixed part of a glob grant holds beyond the glob (`/data/*.csv` grants `/data`
  to the kernel; `/data/notes.txt` and `/data/sub/` are masked);
* the files the running policy was loaded from, and every file it `extends`: a tool that
  could rewrite its policy would widen its own next start.

`find_masks(policy, spec)` walks each directory the policy grants (host I/O, done once per
worker start, bounded by `MAX_ENTRIES`) and returns the concrete paths that exist now, with
the directory listings Landlock needs to grant around them. The builders stay pure: the
namespace view (`_view.mounts_for`) mounts an empty, unreadable file or directory over each
path; Landlock alone (`_landlock.landlock_setup`) never grants a directory that holds one:
it grants that directory's other entries one by one, and the directory itself for listing
only.

What it does NOT cover: a matching name created after the worker started, by the host or
by the worker itself, inside a directory granted as a whole (the view is built once; a
Landlock grant of a subdirectory covers what is created in it later). Names under the
interpreter's own folders (its prefix, the import roots) are not walked: package data such
as certifi's `cacert.pem` is not a secret. Symbolic links are not followed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from collections.abc import Iterable, Mapping
from typing import Any

from agent_sandbox._errors import PolicyError
from agent_sandbox.policies._paths import (
    entry_regex,
    expand_entry,
    glob_components,
    glob_leads_to,
    is_glob,
    name_regex,
    static_prefix,
    unescape,
)
from agent_sandbox.providers._walk import TooManyEntries, walk_capped

__all__ = ["MAX_ENTRIES", "Masks", "find_masks", "policy_file_warnings", "policy_files"]

#: Entries walked in the policy's granted directories before the start is refused: a grant
#: over a huge tree cannot be searched for hidden names at every start.
MAX_ENTRIES = 50_000
#: Trees never walked: mounted fresh in a namespace, refused under Landlock alone.
_SKIP = ("/proc", "/sys", "/dev")


@dataclasses.dataclass(frozen=True)
class Masks:
    """What to keep from the worker: `paths` maps each host path to "dir" or "file", and
    why (`reasons`: the rule that asks for it); `listings` holds, for each directory
    above a masked path, its entries (names, symbolic links left out) with their kind."""

    paths: Mapping[str, str] = dataclasses.field(default_factory=dict)
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)
    listings: Mapping[str, tuple[tuple[str, str], ...]] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.paths)


def policy_files(policy: Any) -> tuple[str, ...]:
    """The real paths of the files `policy` was loaded from (its own, then each `extends`)."""
    out: list[str] = []
    source = getattr(policy, "source", None)
    sources = tuple(getattr(policy, "sources", ()) or ())
    for entry in (source, *sources):
        if not entry or entry.startswith("preset:") or entry == "<string>":
            continue
        path = os.path.realpath(entry)
        if path not in out:
            out.append(path)
    return tuple(out)


def _expand(entry: str, scratch: str) -> str:
    """`entry` in the `[files]` language with `$SCRATCH` and `~` expanded (a glob stays one)."""
    return expand_entry(entry, scratch=scratch, home=os.path.expanduser("~"))


def _under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def _kind(path: str) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return ""
    if stat.S_ISLNK(st.st_mode):
        return "link"
    return "dir" if stat.S_ISDIR(st.st_mode) else "file"


def find_masks(policy: Any, spec: Any, *, limit: int = MAX_ENTRIES) -> Masks:
    """Walk the policy's granted directories; return what must be masked (see module doc).

    Raises PolicyError when the granted trees hold more than `limit` entries (naming the
    rule and what to do), rather than start with hidden names left reachable.
    """
    files = policy.files
    scratch = os.path.realpath(spec.scratch)
    hide = tuple(files.hide)
    hide_names = tuple((h, name_regex(h)) for h in hide if "/" not in h)
    hide_paths = tuple((h, entry_regex(_expand(h, scratch))) for h in hide if "/" in h)
    deny_plain: list[str] = []
    deny_globs: list[tuple[str, re.Pattern[str]]] = []
    for entry in files.deny:
        expanded = _expand(entry, scratch)
        if is_glob(expanded):
            deny_globs.append((entry, entry_regex(expanded)))
        else:
            deny_plain.append(os.path.realpath(unescape(expanded)))

    found: dict[str, str] = {}
    reasons: dict[str, str] = {}

    def add(path: str, kind: str, reason: str) -> None:
        if kind in ("dir", "file") and path not in found:
            found[path] = kind
            reasons[path] = reason

    # A glob grant (`/data/*.csv`) is granted by its fixed part (`/data`): what that part
    # holds beyond the glob (and beyond every other grant) is masked too, so a grant means
    # the same to native code as to the Python guard.
    plain_grants: list[str] = []
    glob_grants: list[tuple[str, re.Pattern[str], list[Any]]] = []
    for entry in (*files.read, *files.write):
        expanded = _expand(entry, scratch)
        if is_glob(expanded):
            fixed = os.path.realpath(os.path.normpath(static_prefix(expanded)))
            glob_grants.append((fixed, entry_regex(expanded), glob_components(expanded)))
        else:
            plain_grants.append(os.path.realpath(unescape(expanded)))
    plain_grants.append(scratch)

    def outside_globs(path: str) -> str:
        """Why `path` (below a glob grant's fixed part) is masked: "" when a grant covers
        it or it leads to something a grant covers."""
        owners = [g for g in glob_grants if _under(path, g[0]) and path != g[0]]
        if not owners or any(_under(path, p) or _under(p, path) for p in plain_grants):
            return ""
        parts = [p for p in path.split("/") if p]
        for _, regex, components in glob_grants:
            if regex.fullmatch(path) or glob_leads_to(components, parts):
                return ""
        return f"files.read {owners[0][0]!r} is granted only through a pattern"

    def verdict(path: str, name: str) -> str:
        why = outside_globs(path) if glob_grants else ""
        if why:
            return why
        for pattern, regex in hide_names:
            if regex.fullmatch(name):
                return f"files.hide {pattern!r}"
        for pattern, regex in hide_paths:
            if regex.fullmatch(path):
                return f"files.hide {pattern!r}"
        for entry, regex in deny_globs:
            if regex.fullmatch(path):
                return f"files.deny {entry!r}"
        return ""

    roots = _coalesce(
        os.path.realpath(os.path.normpath(static_prefix(_expand(p, scratch))))
        for p in (*files.read, *files.write)
    )
    roots = [r for r in roots if not any(_under(r, s) for s in _SKIP) and r != scratch]
    seen = 0
    for root in roots:
        root_kind = _kind(root)
        if root_kind not in ("dir", "file"):
            continue
        why = verdict(root, os.path.basename(root))
        if why:
            add(root, root_kind, why)
            continue
        if root_kind != "dir":
            continue

        def visit(entry: os.DirEntry[str], is_dir: bool) -> bool:
            if entry.is_symlink():
                return False  # never followed: the rules apply to what a link resolves to
            why = verdict(entry.path, entry.name)
            if why:
                add(entry.path, "dir" if is_dir else "file", why)
                return False
            return is_dir

        try:
            seen = walk_capped(root, visit, limit, seen)
        except TooManyEntries:
            raise PolicyError(
                f"the directories granted in [files] hold more than {limit} entries, too "
                f"many to search for the names in [files] hide and deny at each start "
                f"(while walking {root}); grant narrower paths",
                source=_source(policy),
                key="files.read",
                expected="granted directories small enough to search",
            ) from None
    for path in deny_plain:
        add(path, _kind(path), "files.deny")
    for path in policy_files(policy):
        add(path, _kind(path), "the policy file")
    listings: dict[str, tuple[tuple[str, str], ...]] = {}
    for path in found:
        parent = os.path.dirname(path)
        while True:
            if parent not in listings:
                listings[parent] = _listing(parent)
            if parent == "/":
                break
            parent = os.path.dirname(parent)
    return Masks(paths=dict(sorted(found.items())), reasons=reasons, listings=listings)


def _listing(folder: str) -> tuple[tuple[str, str], ...]:
    """(name, "dir"|"file") of each entry of `folder`, symbolic links left out."""
    out = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return ()
    for entry in entries:
        try:
            if entry.is_symlink():
                continue
            out.append((entry.name, "dir" if entry.is_dir(follow_symlinks=False) else "file"))
        except OSError:
            continue
    return tuple(sorted(out))


def _coalesce(paths: Iterable[str]) -> list[str]:
    out: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if not any(_under(path, kept) for kept in out):
            out.append(path)
    return out


def _source(policy: Any) -> str | None:
    source = getattr(policy, "source", None)
    return str(source) if source else None


def policy_file_warnings(policy: Any) -> list[str]:
    """A warning for each policy file that lies inside a directory the policy lets the tool
    write (for `agent-sandbox policy check`): the kernel providers mask it, but the
    `subprocess` provider cannot, and under Landlock alone no new file can be created at
    that directory's own level."""
    out = []
    writes = [
        os.path.realpath(os.path.normpath(static_prefix(_expand(p, ""))))
        for p in policy.files.write
        if not p.startswith("$SCRATCH")
    ]
    for path in policy_files(policy):
        for root in writes:
            if _under(path, root):
                out.append(
                    f"the policy file {path} lies inside {root}, which [files] write lets the "
                    "tool write; the kernel providers keep it from the tool, the subprocess "
                    "provider does not; move the policy file out of the writable directory"
                )
                break
    return out
