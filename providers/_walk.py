"""One capped directory walker for the host side (scratch size checks, masks of hidden names).

`walk_capped(root, visit, max_entries, seen)` lists `root` and its subdirectories with
`os.scandir`, never following a symbolic link, and calls `visit(entry, is_dir)` for each
entry (a link is passed with `is_dir` False); a True answer descends into a directory.
Directories that cannot be listed are skipped. It raises `TooManyEntries` as soon as the
count of entries listed (starting from `seen`, so several roots share one cap) passes
`max_entries`, and returns the count otherwise. A caller that has seen enough raises its own
exception from `visit`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["TooManyEntries", "walk_capped"]


class TooManyEntries(Exception):
    """The walk listed more entries than its cap."""


def walk_capped(
    root: str,
    visit: Callable[[os.DirEntry[str], bool], bool],
    max_entries: int,
    seen: int = 0,
) -> int:
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        seen += len(entries)
        if seen > max_entries:
            raise TooManyEntries(folder)
        for entry in entries:
            try:
                is_dir = not entry.is_symlink() and entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if visit(entry, is_dir) and is_dir:
                stack.append(entry.path)
    return seen
