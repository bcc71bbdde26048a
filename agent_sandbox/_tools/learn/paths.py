"""Learning mode's judgement of file paths: what the run read and wrote, resolved and narrowed.

A path is judged on its real target after resolving symlinks; one reached through a link the
run could have planted (scratch, a writable or world-writable directory) is flagged, not
proposed. Files are proposed one by one; a directory only when `DIR_MIN_FILES` files
directly in it were used and it is not a system, home, scratch or world-writable one.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from typing import TYPE_CHECKING

from agent_sandbox._tools.learn.findings import (
    _FORBIDDEN_TREES,
    _HARMLESS_DEVICES,
    _SENSITIVE_COMPONENTS,
    _SENSITIVE_FILES,
    _SENSITIVE_TREES,
    _STARTUP_FILES,
    DIR_MIN_FILES,
    Finding,
)
from agent_sandbox.policies._paths import (
    entry_regex,
    expand_entry,
    is_glob,
    name_regex,
    risky_name,
    unescape,
)
from agent_sandbox.policies._paths import literal as as_literal

if TYPE_CHECKING:
    from agent_sandbox._tools.learn.findings import Status, _Context

__all__: list[str] = []


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
