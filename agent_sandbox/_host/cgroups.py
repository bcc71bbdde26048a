"""The cgroup hierarchies this process can make worker groups in, read from `/proc/self`.

What `limits` makes its per-worker groups under, and what the agent's guardian and
`agent-sandbox leftovers` sweep (`hierarchy_bases`); it imports nothing of the host, so
`lifecycle` can ask for the folders without importing `limits`, which names its groups
after the owner token `lifecycle` draws.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["Hierarchy", "hierarchies", "hierarchy_bases", "read_or_empty", "unified_controllers"]


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    kind: str  # "memory-v1", "pids-v1", "unified"
    mount: str  # where the hierarchy is mounted
    path: str  # this process's cgroup inside it ("/..." )

    @property
    def base(self) -> str:
        return os.path.join(self.mount, self.path.lstrip("/"))


def _mounts(text: str) -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup mount in a mountinfo text."""
    out = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        rfields = right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        if rfields[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], rfields[0], set(rfields[2].split(","))))
    return out


def _own_cgroups(text: str) -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from a /proc/self/cgroup text."""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def hierarchies(mountinfo: str | None = None, cgroup: str | None = None) -> dict[str, Hierarchy]:
    """The hierarchies this process could make worker groups in (writable ones only).

    A hybrid host (v1 controllers, plus a v2 tree without them) gives `memory-v1`, `pids-v1`
    and `unified`; a pure v2 host gives `unified` only, whose delegated controllers then
    carry the memory and process limits.
    """
    own = _own_cgroups(read_or_empty("/proc/self/cgroup") if cgroup is None else cgroup)
    mounts = _mounts(read_or_empty("/proc/self/mountinfo") if mountinfo is None else mountinfo)
    found: dict[str, Hierarchy] = {}
    for mount, fstype, opts in mounts:
        if fstype == "cgroup" and "memory" in opts and "memory" in own:
            found.setdefault("memory-v1", Hierarchy("memory-v1", mount, own["memory"]))
        elif fstype == "cgroup" and "pids" in opts and "pids" in own:
            found.setdefault("pids-v1", Hierarchy("pids-v1", mount, own["pids"]))
        elif fstype == "cgroup" and "cpu" in opts and "cpu" in own:
            found.setdefault("cpu-v1", Hierarchy("cpu-v1", mount, own["cpu"]))
        elif fstype == "cgroup2" and "" in own:
            found.setdefault("unified", Hierarchy("unified", mount, own[""]))
    return {k: h for k, h in found.items() if os.access(h.base, os.W_OK)}


def unified_controllers(h: Hierarchy) -> set[str]:
    try:
        with open(os.path.join(h.base, "cgroup.subtree_control")) as fh:
            return set(fh.read().split())
    except OSError:
        return set()


def hierarchy_bases() -> list[str]:
    """The folders this process makes worker groups in (one per writable hierarchy)."""
    return sorted({h.base for h in hierarchies().values()})


def read_or_empty(path: str) -> str:
    """The text of a control file, or "" where it cannot be read (gone, or never there)."""
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""
