"""Policy grants resolved without following links, and pinned to what they name.

A kernel provider turns each `files.read` / `files.write` entry into a bind mount or a Landlock
rule, and both follow symbolic links: a bind of `project/data` mounts whatever the link there
points to, and Landlock's rule lands on the inode the path resolves to. A tool allowed to write
`project/` could therefore widen another tool's read grant on `project/data` by planting
`project/data -> ../secret`. The rule here: **a grant is what the policy names, not what a
link points to.**

1. In the parent, before each worker starts, every granted path (the part of an entry before
   its first wildcard) is walked one component at a time with `O_PATH | O_NOFOLLOW`, each
   step relative to the directory already reached, so no swap during the walk can redirect it.
   A component that is a symbolic link refuses the policy with a `PolicyError` naming the
   entry, the link and where it points. The object reached is pinned by device and inode
   (or pinned as absent).
2. In the worker, before it serves, each pin is checked against what the provider really
   granted: Landlock compares the descriptor it grants (`restrict_self`), a namespace view
   compares the path inside the view (`apply_worker_setup`). A link planted between the
   check and the mount or rule, or a path that appeared meanwhile, stops the start.
3. Once a worker runs, its grants stay on the objects pinned at its start (a bind mount and a
   Landlock rule hold the directory, not its name), so a link planted later leads nowhere the
   worker may go; the next worker's start is refused by step 1.

The worker's scratch directory is private to it and created by the parent, so entries under
`$SCRATCH` are neither walked nor pinned. The parent runs this module; the worker only
compares numbers (`_inworker.check_pins`, `_landlock_sys.restrict_self`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any

from agent_sandbox._errors import PolicyError
from agent_sandbox.policies._paths import expand_entry, static_prefix

__all__ = ["Pin", "grant_pins"]

#: (st_dev, st_ino) of a granted object, or None when the path did not exist.
Pin = list[int] | None


def _grants(policy: Any, spec: Any) -> Iterator[tuple[str, str, str]]:
    """(key, entry, absolute path granted) for every read and write entry outside scratch."""
    home = os.path.expanduser("~")
    files = policy.files
    scratch = os.path.normpath(spec.scratch) if spec.scratch else ""
    for key in ("read", "write"):
        for entry in getattr(files, key):
            expanded = expand_entry(entry, scratch=spec.scratch, home=home)
            path = os.path.normpath(static_prefix(expanded))
            if scratch and (path == scratch or path.startswith(scratch + "/")):
                continue
            yield f"files.{key}", entry, path


def grant_pins(policy: Any, spec: Any) -> dict[str, Pin]:
    """Walk every granted path without following links; refuse a link; pin what is there.

    Returns host path -> pin. Raises PolicyError naming the entry when any component of a
    granted path is a symbolic link.
    """
    pins: dict[str, Pin] = {}
    for key, entry, path in _grants(policy, spec):
        if path in pins:
            continue
        pins[path] = _walk(path, key, entry, policy)
    return pins


def _walk(path: str, key: str, entry: str, policy: Any) -> Pin:
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", flags)
    try:
        done = "/"
        for part in parts:
            try:
                child = os.open(part, flags, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                return None
            os.close(fd)
            fd = child
            done = os.path.join(done, part)
            info = os.fstat(fd)
            if stat.S_ISLNK(info.st_mode):
                _refuse_link(done, path, key, entry, policy)
        info = os.fstat(fd)
        return [info.st_dev, info.st_ino]
    finally:
        os.close(fd)


def _refuse_link(link: str, path: str, key: str, entry: str, policy: Any) -> None:
    try:
        target = os.readlink(link)
    except OSError:
        target = "?"
    real = os.path.realpath(path)
    source = getattr(policy, "source", None)
    raise PolicyError(
        f"{entry!r}: {link} is a symbolic link (to {target!r}); a kernel provider grants what "
        f"the policy names, never what a link points to, so the grant would reach {real}",
        source=str(source) if source else None,
        key=key,
        expected=f"a path without links: name the real path ({real}) if that is what the "
        f"tool needs, or remove the link",
    )
