"""The operation matrix: what each kind of grant lets code do to a path, below Python.

One table, `EXPECTED`, of (grant kind) x (operation) -> outcome, for a policy without the
`process-exec` category. `tests/providers/test_operation_matrix.py` runs every cell under
every kernel provider with the Python layer off (native calls through ctypes), so the
kernel is what is measured; `docs/policies.md` shows the table `render_markdown()` makes.
Where a provider does not hold a cell, `GAPS` names it with the reason, and the test is a
strict expected failure for that cell (so a fix, or a regression, shows). Where a provider
holds a cell only by refusing the policies that do not accept it open, `VISIBLE` names it:
the `landlock` provider cannot hide names, so it refuses at construction every policy
without `visible_names = "accepted"`, and under one with it those cells are allowed by the
policy's own choice (the test measures them allowed, and measures the refusal without it).

Grant kinds, for a target directory `T` holding a file `T/f`:

* `read`: `T` in `files.read`; `write`: `T` in `files.write`; `scratch`: `T` inside the
  worker's scratch directory; `hidden`: `T` matches `files.hide`, inside a writable grant;
  `deny`: `T` in `files.deny`, inside a writable grant; `none`: `T` in no grant.
"""

from __future__ import annotations

__all__ = [
    "EXPECTED",
    "GAPS",
    "KINDS",
    "NARROWED",
    "OPERATIONS",
    "VISIBLE",
    "GapOpen",
    "render_markdown",
]

KINDS: tuple[str, ...] = ("read", "write", "scratch", "hidden", "deny", "none")

#: operation -> what the probe does (native, one call), for the docs.
OPERATIONS: dict[str, str] = {
    "open-read": "open `T/f` read-only and read it",
    "open-write": "open `T/f` for writing",
    "create": "create `T/new`",
    "list": "open `T` as a directory and list it",
    "stat": "stat `T/f`",
    "unlink": "unlink `T/f`",
    "rename-in": "rename a scratch file to `T/in`",
    "rename-out": "rename `T/f` into scratch",
    "hard-link": "link `T/f` as `T/hl`",
    "symlink": "create a symbolic link `T/sl`",
    "chmod": "chmod `T/f`",
    "chown": "chown `T/f` (to its own owner)",
    "utime": "set `T/f`'s times",
    "setxattr": "set a `user.` extended attribute on `T/f`",
    "removexattr": "remove that attribute",
    "truncate": "truncate `T/f`",
    "mkfifo": "make a FIFO `T/fifo` (and `mknod` a regular file)",
    "bind-unix": "bind a Unix socket at `T/sock`",
    "exec": "execute `T/x` (a script, mode 0755)",
    "mmap-exec": "map `T/f` with `PROT_EXEC`",
}

_READ_ONLY = {"open-read", "list", "stat", "mmap-exec"}
_ALL = set(OPERATIONS)
#: Refused for every kind by the policy's other sections, not by `[files]`: `exec` (no
#: `process-exec`: seccomp refuses execve) and `bind-unix` (no Unix-socket `[net]` rule:
#: seccomp refuses the socket).
_NEVER = {"exec", "bind-unix"}


def _row(allowed: set[str]) -> dict[str, bool]:
    return {op: op in allowed for op in OPERATIONS}


#: (kind, operation) -> allowed, for a policy without `process-exec` and without Unix-socket
#: rules. `mmap-exec` goes with reading: mapping a readable file executable gives native
#: code nothing that mapping anonymous memory executable (which it can) does not.
EXPECTED: dict[str, dict[str, bool]] = {
    "read": _row(_READ_ONLY),
    "write": _row(_ALL - _NEVER),
    "scratch": _row(_ALL - _NEVER),
    "hidden": _row(set()),
    "deny": _row(set()),
    "none": _row(set()),
}

#: (provider, kind, operation) -> why that provider does not hold the cell today. Filled
#: from the measured matrix; each is a strict xfail in the test (`raises=GapOpen`). None
#: today. The chmod, chown, utime and xattr cells hold under `landlock` through its second
#: layer: its seccomp filter refuses every metadata change (`_seccomp.metadata_rules`),
#: inside the grants too, since Landlock has no right to judge them by.
GAPS: dict[tuple[str, str, str], str] = {}

#: (provider, kind, operation) -> why a refused cell is open under that provider by the
#: policy's choice: the provider refuses, at construction, every policy that does not say
#: `visible_names = "accepted"` (`policies._model.check_visible_names`, and the provider's
#: `[files]` answer, `_netcheck.landlock_files`, for `auto`), and the test measures the cell
#: allowed under a policy that does (and the refusal under one that does not).
_LANDLOCK_NAMES = (
    "Landlock does not restrict stat, and a directory above a masked name is granted for "
    "listing, which Landlock applies to everything below it; no second layer sees paths. "
    "So the landlock provider refuses every policy that does not say "
    '`visible_names = "accepted"`; under one that does, names and metadata are visible by '
    "that choice, contents are not (the open, write and change cells stay refused)"
)
VISIBLE: dict[tuple[str, str, str], str] = {
    **{
        ("landlock", kind, op): _LANDLOCK_NAMES
        for kind in ("hidden", "deny")
        for op in ("list", "stat")
    },
    ("landlock", "none", "stat"): _LANDLOCK_NAMES,
}

#: (provider, kind, operation) -> why an allowed cell is refused by that provider on
#: purpose (a second layer that cannot tell the grants apart): the test expects the refusal.
NARROWED: dict[tuple[str, str, str], str] = {
    **{
        ("landlock", kind, op): (
            "The landlock provider's seccomp filter refuses every metadata change, in the "
            "write grants and scratch too: Landlock has no right for metadata, and seccomp "
            "sees a call's arguments, not the file a path or descriptor names, so the "
            "worker's kernel layer cannot tell scratch from a read grant (letting descriptor "
            "calls through would let the code chmod a read-granted file its user owns). What "
            "this cell measures, native code's own call, stays refused; Python's os.chmod "
            "(permission bits), os.utime and a same-owner os.chown of a path in scratch are "
            "made by the host, beneath its own descriptor of scratch with openat2 "
            "(RESOLVE_BENEATH, no links), so shutil.copy, copy2 and tarfile work there. "
            "Elsewhere the Python guard names `files.metadata` and the hint says to copy "
            "contents only or use `bwrap` or `unshare`"
        )
        for kind in ("write", "scratch")
        for op in ("chmod", "chown", "utime", "setxattr", "removexattr")
    },
    **{
        ("gvisor", "write", op): (
            "gVisor's file system for a host directory keeps no `user.` extended attributes "
            "(ENOTSUP), in `files.write` too; its own scratch does"
        )
        for op in ("setxattr", "removexattr")
    },
}


class GapOpen(AssertionError):
    """A cell of the matrix that a provider does not hold (raised by the matrix test)."""


def render_markdown() -> str:
    """The matrix as a Markdown table (what docs/policies.md shows); a cell a provider does
    not hold, narrows or leaves visible by the policy's choice is marked with that
    provider's name, and the reasons follow the table."""
    head = "| operation | " + " | ".join(KINDS) + " |"
    rule = "|---|" + "---|" * len(KINDS)
    lines = [head, rule]
    reasons: dict[str, int] = {}
    for op, what in OPERATIONS.items():
        cells = []
        for kind in KINDS:
            cell = "allowed" if EXPECTED[kind][op] else "refused"
            for (provider, k, o), why in GAPS.items():
                if (k, o) == (kind, op):
                    n = reasons.setdefault(why, len(reasons) + 1)
                    cell += f" (not under {provider} alone [{n}])"
            for (provider, k, o), why in VISIBLE.items():
                if (k, o) == (kind, op):
                    n = reasons.setdefault(why, len(reasons) + 1)
                    cell += f" (visible by choice under {provider} [{n}])"
            for (provider, k, o), why in NARROWED.items():
                if (k, o) == (kind, op):
                    n = reasons.setdefault(why, len(reasons) + 1)
                    cell += f" (refused under {provider} [{n}])"
            cells.append(cell)
        lines.append(f"| `{op}`: {what} | " + " | ".join(cells) + " |")
    lines.append("")
    for why, n in reasons.items():
        lines.append(f"[{n}] {why}.")
    return "\n".join(lines)
