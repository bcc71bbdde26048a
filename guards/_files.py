"""The file guard: every ordinary route to read, write, list, stat, create, delete, rename or
link a path is judged against the policy's `[files]` section while armed.

What it enforces:

1. The decision is taken on the resolved path (symlinks followed unless the call does not
   follow them, `..` applied after each link, `dir_fd` resolved through `/proc/self/fd`),
   while the call itself receives the unresolved path, so link semantics are kept. A
   `PathLike` is converted once (`os.fspath`) and the converted value is what the call gets,
   so an object cannot answer one path to the guard and another to the call.
2. Order of the rules: a hidden name (`files.hide`) looks absent (`HiddenPathDenied`, a
   FileNotFoundError with errno ENOENT, as does a refused stat-only probe); the worker's
   control directory (socket, log) is unreachable and the policy file never writable;
   `files.deny` beats every grant; writes need `files.write` (or the scratch
   directory, always read/write); reads need `files.read` or a write grant. A stat-only
   call is also allowed on the parents of a readable root, so `os.path.exists('/data')`
   works when `/data/in` is readable. A listing (`os.listdir`, `os.scandir`, and so
   `glob`, `pathlib`, `os.walk`) is allowed on a readable directory and at or below a
   pattern's fixed part, and shows only the entries a grant covers or that lead to one,
   never a hidden or denied name.
3. Always readable (never writable): the interpreter's import roots and folders (the
   standard library, site-packages, this package, the venv), because importing and
   tracebacks read them; the time-zone database; `/sys/fs/cgroup`, `/proc/cpuinfo`,
   `/proc/meminfo`; `/dev/null`, `/dev/zero`, `/dev/urandom` (and `/dev/null` writable).
4. The routes: `open`/`io.open`/`_io.open`/`io.open_code`, the `os` path functions and their
   `posix` twins (so `os.path`, `pathlib`, `shutil`, `glob`, `tempfile`, `fileinput`,
   `gzip`/`bz2`/`lzma`/`zipfile`/`tarfile` and `codecs.open`, which call them, are judged
   too), `tokenize`'s private `open` (used by `linecache`), and `sqlite3.connect`.

`io.FileIO`/`_io.FileIO` name a guarded subclass after install (instance checks still
answer for the C type), so `io.FileIO(path)` is judged too.

What it does NOT stop: a file descriptor obtained before arming or passed in; C code that
calls the C library directly (the original C type `FileIO` reached through the class
hierarchy, extension modules, ctypes); races where a path changes between the decision and the call
(the OS providers hold the boundary). Decisions on paths outside the writable roots are
cached; paths below a writable root are re-resolved on every call, because user code can
change the links there.

This module is longer than 600 lines because every patched route to a path and the
resolver that decides it are one guard: a route kept elsewhere is a route a reviewer of the
guard does not see.
"""

from __future__ import annotations

import errno
import os
import posix
import stat as _stat_mod
import sys
from _thread import get_ident
from collections.abc import Iterable

from agent_sandbox._denial import Denial
from agent_sandbox._errors import FileAccessDenied, HiddenPathDenied
from agent_sandbox._hints import METADATA_REFUSED, grant_hint
from agent_sandbox._worker import audit
from agent_sandbox.guards import _patch
from agent_sandbox.guards._state import refuse, state
from agent_sandbox.policies._paths import (
    entry_regex,
    expand_entry,
    glob_components,
    glob_leads_to,
    is_glob,
    literal,
    name_regex,
    static_prefix,
    unescape,
)

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["FileRules", "check", "configure", "install", "rules"]

# The originals the resolver uses: bound before any patch, so judging never re-enters a guard.
_lstat = posix.lstat
_readlink = posix.readlink
_getcwd = posix.getcwd
_S_ISLNK = _stat_mod.S_ISLNK

READ, WRITE, META, LIST = "read", "write", "meta", "list"

#: Read-only roots every policy grants implicitly.
IMPLICIT_READ: frozenset[str] = frozenset(
    {
        # NOTE: allowed because `zoneinfo`, `time` and `datetime` read the tz database.
        "/usr/share/zoneinfo",
        "/etc/localtime",
        # NOTE: allowed because numeric libraries read the CPU and memory limits there to
        # size their thread pools; it holds no user data.
        "/sys/fs/cgroup",
        "/proc/cpuinfo",
        "/proc/meminfo",
        # NOTE: allowed because they hold no data; `os.devnull` is used by many libraries.
        "/dev/null",
        "/dev/zero",
        "/dev/urandom",
        "/dev/random",
    }
)
#: Writable paths every policy grants implicitly (besides the scratch directory).
IMPLICIT_WRITE: frozenset[str] = frozenset({"/dev/null"})  # NOTE: a sink, holds nothing


class _Roots:
    """A set of path grants: plain prefixes (a directory and all below it) and globs."""

    def __init__(self, entries: Iterable[str]) -> None:
        """`entries` are in the `[files]` language: resolved paths written with `literal`,
        or globs."""
        self.entries = tuple(dict.fromkeys(e for e in entries if e))
        self.prefixes = tuple(
            unescape(e).rstrip("/") or "/" for e in self.entries if not is_glob(e)
        )
        self.globs = tuple((e, entry_regex(e)) for e in self.entries if is_glob(e))

    def match(self, path: str) -> str | None:
        """The entry that covers `path`, or None."""
        for prefix in self.prefixes:
            if prefix == "/" or path == prefix or path.startswith(prefix + "/"):
                return prefix
        for entry, regex in self.globs:
            if regex.fullmatch(path):
                return entry
        return None

    def strictly_below(self, path: str) -> bool:
        for prefix in self.prefixes:
            if prefix == "/" or path.startswith(prefix + "/"):
                return True
        return any(regex.fullmatch(path) for _, regex in self.globs)

    def has_descendant(self, path: str) -> bool:
        """Whether some plain root lies below `path` (so `path` is one of its parents)."""
        base = path.rstrip("/") + "/"
        return any(p.startswith(base) for p in self.prefixes) or path == "/"

    def leads_to(self, path: str) -> bool:
        """Whether something a grant covers may lie below `path`: a plain root below it, or
        a glob whose components up to `path`'s depth match it (a `**` matches any depth)."""
        if self.has_descendant(path):
            return True
        parts = [p for p in path.split("/") if p]
        return any(glob_leads_to(components, parts) for components in self._glob_parts)

    def lists(self, path: str) -> bool:
        """Whether `path` is at or below a glob's fixed part and may lead to a match."""
        parts = [p for p in path.split("/") if p]
        for (entry, _), components in zip(self.globs, self._glob_parts, strict=True):
            fixed = unescape(static_prefix(entry)).rstrip("/")
            if (path == fixed or path.startswith(fixed + "/")) and glob_leads_to(components, parts):
                return True
        return False

    @property
    def _glob_parts(self) -> list[list[Any]]:
        cached = self.__dict__.get("_parts")
        if cached is None:
            cached = self.__dict__["_parts"] = [glob_components(e) for e, _ in self.globs]
        return cached


class FileRules:
    """The policy's `[files]` section compiled for fast decisions on resolved paths."""

    def __init__(
        self,
        files: dict[str, Any],
        *,
        scratch: str,
        policy_name: str = "",
        policy_file: str = "",
        import_roots: Iterable[str] = (),
        metadata_refused: bool = False,
    ) -> None:
        self.policy_name = policy_name
        #: The provider's kernel layer refuses every metadata change (`landlock`: its
        #: seccomp filter, `_seccomp.metadata_rules`); the guard says so as `files.metadata`.
        self.metadata_refused = metadata_refused
        self.scratch = os.path.realpath(scratch) if scratch else ""
        self.control_dir = os.path.dirname(self.scratch) if self.scratch else ""
        self.policy_file = os.path.realpath(policy_file) if policy_file else ""
        expand = self._expander()
        write = [expand(p) for p in files.get("write", ())]
        read = [expand(p) for p in files.get("read", ())]
        deny = [expand(p) for p in files.get("deny", ())]
        own = [literal(self.scratch)] if self.scratch else []
        self.write = _Roots([*write, *own, *map(literal, IMPLICIT_WRITE)])
        # NOTE: the interpreter's own folders (its executable, `pyvenv.cfg`) are read by
        # `sysconfig` and `platform` when packages import; they hold no user data.
        bindir = os.path.dirname(sys.executable)
        interpreter = {sys.prefix, sys.base_prefix, bindir}
        venv = os.path.dirname(bindir)
        if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
            interpreter.add(venv)  # the virtual environment the worker's python belongs to
        roots = [literal(os.path.realpath(r)) for r in [*import_roots, *interpreter] if r]
        self.read = _Roots([*read, *write, *own, *map(literal, IMPLICIT_READ), *roots])
        self.import_roots = _Roots(roots)
        self.deny = _Roots(deny)
        self.hide: tuple[str, ...] = tuple(str(h) for h in files.get("hide", ()))
        self._hide_names = tuple((h, name_regex(h)) for h in self.hide if "/" not in h)
        self._hide_paths = tuple((h, entry_regex(h)) for h in self.hide if "/" in h)

    def _expander(self) -> Any:
        scratch = self.scratch
        home = os.path.expanduser("~")

        def expand(entry: str) -> str:
            # A literal entry becomes its resolved path; a glob stays a pattern whose
            # `$SCRATCH` or `~` is written as a literal (see policies/_paths.py).
            entry = expand_entry(entry, scratch=scratch, home=home)
            if not is_glob(entry):
                return literal(os.path.realpath(unescape(entry)))
            return entry

        return expand

    # -- decisions on resolved paths ---------------------------------------------------------

    def hidden_by(self, path: str) -> str | None:
        """The `files.hide` pattern that hides `path` (any component), or None."""
        if not self.hide or self.import_roots.match(path):
            # NOTE: package data under the import roots (certifi's cacert.pem) is not a secret.
            return None
        for part in path.split("/"):
            if part:
                for pattern, regex in self._hide_names:
                    if regex.fullmatch(part):
                        return pattern
        for pattern, regex in self._hide_paths:
            if regex.fullmatch(path):
                return pattern
        return None

    def _in_control_dir(self, path: str, op: str) -> bool:
        """Inside the worker's control directory but not in its scratch directory (a stat of
        the control directory itself passes: resolving a path in scratch does one)."""
        control, scratch = self.control_dir, self.scratch
        if not control or not (path == control or path.startswith(control + "/")):
            return False
        if path == control and op == META:
            return False
        return not (scratch and (path == scratch or path.startswith(scratch + "/")))

    def decide(self, op: str, path: str) -> tuple[Any, Denial] | None:
        """None when `op` on the resolved `path` is allowed, else the exception and denial."""
        pattern = self.hidden_by(path)
        if pattern is not None:
            return _Always(HiddenPathDenied), Denial(
                rule="files.hidden",
                action=op if op != META else "stat",
                target=path,
                policy=self.policy_name,
                detail=f"the name matches {pattern!r} in [files] hide, so it looks absent",
                hint=f"remove {pattern!r} from [files] hide",
            )
        rule = "files.write" if op == WRITE else "files.read"
        action = {READ: "read", WRITE: "write", META: "stat", LIST: "list"}[op]
        if self._in_control_dir(path, op):
            return _Always(FileAccessDenied), Denial(
                rule=rule,
                action=action,
                target=path,
                policy=self.policy_name,
                detail="the worker's control directory (its socket and log) is never "
                "reachable from user code",
            )
        if op == WRITE and self.policy_file and path == self.policy_file:
            return _Always(FileAccessDenied), Denial(
                rule=rule,
                action=action,
                target=path,
                policy=self.policy_name,
                detail="the policy file is never writable from inside the sandbox",
            )
        denied_by = self.deny.match(path)
        if denied_by is not None:
            return FileAccessDenied, Denial(
                rule=rule,
                action=action,
                target=path,
                policy=self.policy_name,
                detail=f"{denied_by!r} is listed in [files] deny, which beats every grant",
                hint=f"remove {denied_by!r} from [files] deny",
            )
        if op == WRITE:
            if self.write.match(path) is not None:
                return None
            return FileAccessDenied, Denial(
                rule=rule,
                action=action,
                target=path,
                policy=self.policy_name,
                detail="the path is outside [files] write (only the scratch directory is "
                "writable unless the policy says more)",
                hint=grant_hint({"files.write": [literal(path)]}),
            )
        if self.read.match(path) is not None:
            return None
        if op == META and self.read.leads_to(path):
            return None  # a parent of what is readable: a stat answers
        if op == LIST and self.read.lists(path):
            # At or below a glob's fixed part (what the kernel providers grant): a listing
            # shows only the entries that are readable or lead to something readable.
            return None
        # A stat-only probe looks like a missing path (ENOENT), so `Path.exists()` answers
        # False as it would for a missing file instead of raising.
        return HiddenPathDenied if op == META else FileAccessDenied, Denial(
            rule=rule,
            action=action,
            target=path,
            policy=self.policy_name,
            detail="the path is outside [files] read",
            hint=grant_hint({"files.read": [literal(path)]}),
        )


def _visible_filter(rules: FileRules, directory: str) -> Any:
    """What a listing of the resolved `directory` may show: a predicate on entry names, or
    None when every entry may be shown. An entry is shown when it is readable or leads to
    something readable, and is neither hidden nor denied."""
    if not (rules.hide or rules.deny.entries) and rules.read.match(directory) is not None:
        return None
    base = directory.rstrip("/") + "/"
    whole = rules.read.match(directory) is not None and rules.deny.match(directory) is None

    def visible(name: str) -> bool:
        path = base + name
        if rules.hidden_by(path) is not None or rules.deny.match(path) is not None:
            return False
        if whole:
            return True
        return rules.read.match(path) is not None or rules.read.lists(path)

    return visible


class _FilteredScandir:
    """`os.scandir`'s iterator with the entries a listing may not show left out."""

    def __init__(self, inner: Any, visible: Any) -> None:
        self._inner = inner
        self._visible = visible

    def __iter__(self) -> _FilteredScandir:
        return self

    def __next__(self) -> Any:
        while True:
            entry = next(self._inner)
            name = entry.name if type(entry.name) is str else os.fsdecode(entry.name)
            if self._visible(name):
                return entry

    def __enter__(self) -> _FilteredScandir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()

    def close(self) -> None:
        self._inner.close()


def _listing_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """`os.listdir`/`os.scandir`: judged as a listing, and what they return filtered."""
    if not _active() or _rules is None or _resolver is None:
        return wrapped(*args, **kwargs)
    path = args[0] if args else kwargs.get("path", ".")
    if isinstance(path, int):  # a descriptor: judged when it was opened
        return wrapped(*args, **kwargs)
    checked = check(LIST, path)
    text = checked if type(checked) is str else os.fsdecode(os.fspath(checked))
    resolved, _ = _resolver.resolve(text, True, None)
    visible = _visible_filter(_rules, resolved)
    args = (checked, *args[1:]) if args else args
    if not args and "path" in kwargs:
        kwargs = dict(kwargs, path=checked)
    result = wrapped(*args, **kwargs)
    if visible is None:
        return result
    if isinstance(result, list):
        return [n for n in result if visible(n if type(n) is str else os.fsdecode(n))]
    return _FilteredScandir(result, visible)


# -- the resolver ------------------------------------------------------------------------------

_MAX_LINKS = 40


def _current_dir(last: str) -> str:
    """The working directory, or `last` when it was removed (`getcwd` fails): a relative
    path is then judged where it would be, and the kernel answers ENOENT for it anyway."""
    try:
        return _getcwd()
    except OSError:
        return last


class _Resolver:
    """Resolves paths like `realpath`, with the originals, and says whether the result may
    change under user code (a link or a component below a writable root)."""

    def __init__(self, rules: FileRules) -> None:
        self.rules = rules
        self.dirs: dict[str, str] = {}
        self.cwd = _current_dir("/")

    def volatile(self, resolved: str) -> bool:
        return self.rules.write.strictly_below(resolved)

    def realpath(self, path: str) -> tuple[str, bool]:
        """(resolved absolute path, volatile). `path` must be absolute."""
        volatile = False
        resolved = ""
        pending = path.split("/")
        pending.reverse()
        links = 0
        while pending:
            name = pending.pop()
            if not name or name == ".":
                continue
            if name == "..":
                resolved = resolved.rpartition("/")[0]
                continue
            candidate = resolved + "/" + name
            try:
                st = _lstat(candidate)
            except OSError:
                resolved = candidate
                continue
            if not _S_ISLNK(st.st_mode):
                resolved = candidate
                continue
            if self.volatile(candidate):
                volatile = True
            links += 1
            if links > _MAX_LINKS:
                # A loop: the call itself fails with ELOOP; judge the lexical path.
                return os.path.normpath(path), True
            target = _readlink(candidate)
            if target.startswith("/"):
                resolved = ""
            parts = target.split("/")
            parts.reverse()
            pending.extend(parts)
        resolved = resolved or "/"
        return resolved, volatile or self.volatile(resolved)

    def resolve(self, path: str, follow: bool, dir_fd: int | None) -> tuple[str, bool]:
        if not path.startswith("/"):
            if dir_fd is not None:
                try:
                    base = _readlink(f"/proc/self/fd/{dir_fd}")
                except OSError:
                    base = f"/proc/self/fd/{dir_fd}"
            else:
                base = self.cwd
            path = base + "/" + path
        head, _, tail = path.rstrip("/").rpartition("/") if path.rstrip("/") else ("", "", "")
        if tail in ("", ".", ".."):
            resolved, volatile = self.realpath(path)
            return resolved, volatile
        cached = self.dirs.get(head)
        if cached is None:
            rdir, vol = self.realpath(head or "/")
            if not vol:
                if len(self.dirs) > 4096:
                    self.dirs.clear()
                self.dirs[head] = rdir
        else:
            rdir, vol = cached, False
        candidate = (rdir.rstrip("/") or "") + "/" + tail
        if follow:
            try:
                st = _lstat(candidate)
            except OSError:
                st = None
            if st is not None and _S_ISLNK(st.st_mode):
                return self.realpath(candidate)
        return candidate, vol or self.volatile(candidate)


# -- the checking entry point ----------------------------------------------------------------

_rules: FileRules | None = None
_resolver: _Resolver | None = None
#: (op, follow) -> raw absolute str path -> decision, for paths that cannot change under us.
_fast: dict[tuple[str, bool], dict[str, Any]] = {
    (op, follow): {} for op in (READ, WRITE, META, LIST) for follow in (True, False)
}
_decisions: dict[tuple[str, str], Any] = {}


def configure(rules: FileRules) -> None:
    """Use `rules` for every later decision (clears the caches)."""
    global _rules, _resolver
    _rules = rules
    _resolver = _Resolver(rules)
    for table in _fast.values():
        table.clear()
    _decisions.clear()


def rules() -> FileRules | None:
    return _rules


class _Always:
    """Marks a refusal that learning mode must not turn into a would-be denial."""

    __slots__ = ("exc_class",)

    def __init__(self, exc_class: type[BaseException]) -> None:
        self.exc_class = exc_class


def _apply(decision: Any) -> None:
    if decision is not None:
        kind = decision[0]
        if isinstance(kind, _Always):
            refuse(kind.exc_class, decision[1], always=True)
        else:
            refuse(kind, decision[1])


def check(op: str, path: Any, dir_fd: int | None = None, follow: bool = True) -> Any:
    """Judge `op` on `path`; returns the path to hand to the call (fspath applied once).

    Integers (file descriptors) pass: they were judged when opened.
    """
    if isinstance(path, int) or path is None or _rules is None or _resolver is None:
        return path
    path = os.fspath(path)
    text = path if type(path) is str else os.fsdecode(path)
    if "\x00" in text:
        return path  # the call raises ValueError itself
    fast = _fast[(op, follow)]
    if dir_fd is None and text in fast:
        _apply(fast[text])
        return path
    resolved, volatile = _resolver.resolve(text, follow, dir_fd)
    key = (op, resolved)
    decision = _decisions.get(key, _decisions)
    if decision is _decisions:
        decision = _rules.decide(op, resolved)
        if len(_decisions) > 8192:
            _decisions.clear()
        _decisions[key] = decision
    if decision is not None and text != resolved:
        # Name the path as the code asked for it too: a learning proposal must be able to
        # tell a file reached through a link the run planted from one asked for directly.
        exc_class, denial = decision
        requested = text if dir_fd is None else f"<dir_fd {dir_fd}>/{text}"
        detail = f"{denial.detail} (requested as '{requested}')"
        decision = (exc_class, denial.replace(detail=detail))
    if not volatile and dir_fd is None and text.startswith("/"):
        if len(fast) > 8192:
            fast.clear()
        fast[text] = decision
    _apply(decision)
    return path


# -- wrappers ----------------------------------------------------------------------------------

_st = state
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _active() -> bool:
    return _st.armed or (bool(_st.user_threads) and get_ident() in _st.user_threads)


def _one_path(op: str, follow_default: bool = True, default: Any = None) -> Any:
    """A wrapper for `f(path, ..., dir_fd=None, follow_symlinks=True)`."""
    table = _fast[(op, follow_default)]

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _st.armed or (_st.user_threads and get_ident() in _st.user_threads):
            if not kwargs and args and type(args[0]) is str and args[0] in table:
                _apply(table[args[0]])
                return wrapped(*args)
            follow = kwargs.get("follow_symlinks", follow_default)
            dir_fd = kwargs.get("dir_fd")
            if args:
                args = (check(op, args[0], dir_fd, follow), *args[1:])
            elif "path" in kwargs:
                kwargs = dict(kwargs, path=check(op, kwargs["path"], dir_fd, follow))
            elif default is not None:
                check(op, default, dir_fd, follow)
        return wrapped(*args, **kwargs)

    return wrapper


#: During a call, the worker's way to ask the host for a chmod or utime in scratch
#: (`agent_sandbox._host.scratchmeta`); None between calls. Set by the worker's server.
_scratch_metadata: list[Any] = [None]


def set_scratch_metadata(ask: Any) -> None:
    """Install (or, with None, remove) the call's scratch metadata request to the host."""
    _scratch_metadata[0] = ask


def _scratch_relative(rules: FileRules, target: Any, dir_fd: Any, follow: bool) -> str:
    """`target` relative to scratch when it is a path there (no descriptor, no `dir_fd`,
    links followed); "" otherwise."""
    if not rules.scratch or dir_fd is not None or not follow or isinstance(target, int):
        return ""
    if not isinstance(target, str | bytes):
        return ""
    real = os.path.realpath(os.fsdecode(target))
    if real == rules.scratch or not real.startswith(rules.scratch + os.sep):
        return ""
    return real[len(rules.scratch) + 1 :]


def _by_host(name: str, relative: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The request for `name` (chmod, chown or utime) of `relative` in scratch, or None when the
    call's arguments are not ones the host serves (then it is refused as before)."""
    if name == "chmod":
        mode = args[1] if len(args) > 1 else kwargs.get("mode")
        return {"op": "chmod", "path": relative, "mode": mode} if type(mode) is int else None
    if name == "chown":
        uid = args[1] if len(args) > 1 else kwargs.get("uid")
        gid = args[2] if len(args) > 2 else kwargs.get("gid")
        if type(uid) is not int or type(gid) is not int:
            return None
        return {"op": "chown", "path": relative, "uid": uid, "gid": gid}
    if name != "utime":
        return None
    times = args[1] if len(args) > 1 else kwargs.get("times")
    ns = kwargs.get("ns")
    if times is not None and ns is not None:
        return None
    if times is not None:
        try:
            ns = [
                int(t * 1_000_000_000) if isinstance(t, float) else int(t) * 1_000_000_000
                for t in times
            ]
        except (TypeError, ValueError):
            return None
    elif ns is not None:
        if not (isinstance(ns, tuple | list) and all(type(v) is int for v in ns)):
            return None
        ns = list(ns)
    if ns is not None and len(ns) != 2:
        return None
    return {"op": "utime", "path": relative, "ns": ns}


def _metadata_wrapper(name: str, follow_default: bool, then: Any) -> Any:
    """Wraps a metadata call (`then`: its path wrapper, or None): when the kernel layer
    refuses every metadata change, the call is refused here with that rule, after the path
    was judged as a write (a path outside the grants keeps its own rule). A chmod or utime
    of a path in scratch during a call is asked of the host instead, which makes it beneath
    its own descriptor of scratch (`agent_sandbox._host.scratchmeta`)."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rules = _rules
        if rules is not None and rules.metadata_refused and _active():
            target = args[0] if args else kwargs.get("path", kwargs.get("fd"))
            follow = kwargs.get("follow_symlinks", follow_default)
            target = check(WRITE, target, kwargs.get("dir_fd"), follow)
            ask = _scratch_metadata[0]
            relative = (
                _scratch_relative(rules, target, kwargs.get("dir_fd"), follow)
                if ask is not None
                else ""
            )
            request = _by_host(name, relative, args, kwargs) if relative else None
            host_said = ""
            if request is not None:
                reply = ask(request)
                if reply.get("ok") is True:
                    return None
                code = reply.get("errno")
                host_said = str(reply.get("reason", ""))[:300]
                if type(code) is int and code not in _REFUSED_BY_HOST:
                    raise OSError(code, os.strerror(code), os.fsdecode(target))
            shown = (
                f"<fd {target}>"
                if isinstance(target, int)
                else os.fsdecode(target)
                if target is not None
                else "?"
            )
            refuse(
                FileAccessDenied,
                Denial(
                    rule="files.metadata",
                    action=name,
                    target=shown,
                    policy=rules.policy_name,
                    detail=(
                        f"the host refused it in scratch: {host_said}"
                        if host_said
                        else "the landlock provider refuses every change of a file's mode, "
                        "owner, times or extended attributes (Landlock cannot judge them), "
                        "inside the grants too; in scratch the host makes os.chmod, "
                        "os.utime and a same-owner os.chown of a path"
                    ),
                    hint=METADATA_REFUSED,
                ),
                always=True,
            )
        if then is not None:
            return then(wrapped, instance, args, kwargs)
        return wrapped(*args, **kwargs)

    return wrapper


def _two_paths(op1: str, op2: str) -> Any:
    """A wrapper for `f(src, dst, *, src_dir_fd=None, dst_dir_fd=None, ...)`."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _active():
            args = list(args)  # type: ignore[assignment]
            names = ("src", "dst")
            for i, (name, op) in enumerate(zip(names, (op1, op2), strict=True)):
                dir_fd = kwargs.get(f"{name}_dir_fd")
                if len(args) > i:
                    args[i] = check(op, args[i], dir_fd, False)  # type: ignore[index]
                elif name in kwargs:
                    kwargs = dict(kwargs, **{name: check(op, kwargs[name], dir_fd, False)})
            args = tuple(args)
        return wrapped(*args, **kwargs)

    return wrapper


def _symlink_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    # os.symlink(src, dst): only the new link is written; what it points to is judged at use.
    if _active():
        dir_fd = kwargs.get("dir_fd")
        if len(args) > 1:
            args = (args[0], check(WRITE, args[1], dir_fd, False), *args[2:])
        elif "dst" in kwargs:
            kwargs = dict(kwargs, dst=check(WRITE, kwargs["dst"], dir_fd, False))
    return wrapped(*args, **kwargs)


def _os_open_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _active():
        flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
        op = WRITE if flags & _WRITE_FLAGS else READ
        dir_fd = kwargs.get("dir_fd")
        if args:
            args = (check(op, args[0], dir_fd, True), *args[1:])
        elif "path" in kwargs:
            kwargs = dict(kwargs, path=check(op, kwargs["path"], dir_fd, True))
    return wrapped(*args, **kwargs)


def _open_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _st.armed or (_st.user_threads and get_ident() in _st.user_threads):
        mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
        op = (
            WRITE
            if isinstance(mode, str) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
            else READ
        )
        if args:
            target = args[0]
            if type(target) is str and not kwargs.get("opener"):
                table = _fast[(op, True)]
                if target in table:
                    _apply(table[target])
                    return wrapped(*args, **kwargs)
            args = (check(op, target), *args[1:])
        elif "file" in kwargs:
            kwargs = dict(kwargs, file=check(op, kwargs["file"]))
    return wrapped(*args, **kwargs)


def _open_code_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _active() and args:
        args = (check(READ, args[0]), *args[1:])
    return wrapped(*args, **kwargs)


def _chdir_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _active() and args:
        args = (check(READ, args[0]), *args[1:])
    result = wrapped(*args, **kwargs)
    if _resolver is not None:
        _resolver.cwd = _current_dir(_resolver.cwd)
    return result


def _sqlite_target(database: Any, uri: bool) -> tuple[str, str]:
    """(operation, path) SQLite opens for `database`; path "" for an in-memory database."""
    text = os.fsdecode(os.fspath(database))
    op = WRITE
    if uri and text.startswith("file:"):
        text, _, query = text[5:].partition("?")
        if "mode=memory" in query or not text:
            text = ""
        elif "mode=ro" in query:
            op = READ
        if text.startswith("//"):
            text = "/" + text[2:].partition("/")[2]
    return op, "" if text == ":memory:" else text


def _sqlite_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if not _active():
        return wrapped(*args, **kwargs)
    database = args[0] if args else kwargs.get("database")
    if database is not None and not isinstance(database, int):
        uri = kwargs.get("uri", False) or (len(args) > 7 and args[7])
        op, text = _sqlite_target(database, bool(uri))
        if text:
            check(op, text)
    # Every connection made while armed judges the files SQLite opens later by itself
    # (ATTACH DATABASE, VACUUM INTO), through an authorizer that stays first.
    if len(args) > 5:
        args = (*args[:5], _guarded_factory(args[5]), *args[6:])
    else:
        kwargs = {**kwargs, "factory": _guarded_factory(kwargs.get("factory"))}
    return wrapped(*args, **kwargs)


_factories: dict[Any, Any] = {}


def _guarded_factory(factory: Any) -> Any:
    """A subclass of the connection class `factory` whose authorizer judges attached files."""
    import sqlite3

    base = sqlite3.Connection if factory is None else factory
    made = _factories.get(base)
    if made is not None:
        return made
    if not (isinstance(base, type) and issubclass(base, sqlite3.Connection)):
        return factory  # not a connection class: sqlite3 refuses it itself
    set_authorizer = sqlite3.Connection.set_authorizer

    class _AttachGuard(base):  # type: ignore[valid-type, misc]
        """Installs the attach authorizer at once and keeps it ahead of the user's own."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            set_authorizer(self, _attach_authorizer(None))

        def set_authorizer(self, authorizer_callback: Any) -> None:
            set_authorizer(self, _attach_authorizer(authorizer_callback))

    _AttachGuard.__name__ = _AttachGuard.__qualname__ = base.__name__
    _AttachGuard.__module__ = base.__module__
    _factories[base] = _AttachGuard
    return _AttachGuard


def _attach_authorizer(then: Any) -> Any:
    """SQLite's authorizer: ATTACH (and VACUUM INTO, which attaches its target) is judged
    like opening the file; everything else goes to the user's authorizer `then`, if any."""
    import sqlite3

    attach, ok, deny = sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_OK, sqlite3.SQLITE_DENY

    def authorizer(action: int, arg1: Any, arg2: Any, database: Any, trigger: Any) -> int:
        if action == attach and arg1 and _active():
            op, text = _sqlite_target(arg1, True)
            if text:
                try:
                    check(op, text)
                except (FileAccessDenied, HiddenPathDenied) as exc:
                    # Recorded already; SQLite fails the user's statement ("not
                    # authorized"), so the refusal did reach user code.
                    audit.forget_raised(exc)
                    return deny
        if then is None:
            return ok
        result: int = then(action, arg1, arg2, database, trigger)
        return result

    return authorizer


#: os/posix functions taking one path: name -> (operation, follows symlinks by default).
ONE_PATH: dict[str, tuple[str, bool]] = {
    "stat": (META, True),
    "lstat": (META, False),
    "access": (META, True),
    "statvfs": (META, True),
    "pathconf": (META, True),
    "readlink": (META, False),
    "getxattr": (READ, True),
    "listxattr": (READ, True),
    "mkdir": (WRITE, False),
    "rmdir": (WRITE, False),
    "remove": (WRITE, False),
    "unlink": (WRITE, False),
    "chmod": (WRITE, True),
    "chown": (WRITE, True),
    "lchown": (WRITE, False),
    "chflags": (WRITE, True),
    "lchflags": (WRITE, False),
    "lchmod": (WRITE, False),
    "utime": (WRITE, True),
    "truncate": (WRITE, True),
    "mkfifo": (WRITE, False),
    "mknod": (WRITE, False),
    "setxattr": (WRITE, True),
    "removexattr": (WRITE, True),
    "chroot": (WRITE, True),
}
#: The host's answers to a scratch metadata request that are refusals, not the file's errors.
_REFUSED_BY_HOST = frozenset({errno.EPERM, errno.EACCES, errno.EXDEV, errno.ELOOP, errno.ENOSYS})
#: Functions that change a file's metadata (path or descriptor): refused as `files.metadata`
#: when the kernel layer refuses them all (`FileRules.metadata_refused`).
METADATA: dict[str, bool] = {
    "chmod": True,
    "chown": True,
    "lchown": False,
    "lchmod": False,
    "utime": True,
    "setxattr": True,
    "removexattr": True,
    "fchmod": True,
    "fchown": True,
}
#: Functions whose path defaults to "." when omitted.
_DEFAULT_DOT = frozenset({"listdir", "scandir"})
TWO_PATHS: dict[str, tuple[str, str]] = {
    "rename": (WRITE, WRITE),
    "replace": (WRITE, WRITE),
    "link": (WRITE, WRITE),
}


_ORIGINAL_FILEIO: Any = __import__("_io").FileIO


class _SameFileIO(type):
    """Makes `isinstance(f, io.FileIO)` keep answering for files `open()` made (C FileIO)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _ORIGINAL_FILEIO)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _ORIGINAL_FILEIO)


class GuardedFileIO(_ORIGINAL_FILEIO, metaclass=_SameFileIO):  # type: ignore[misc]
    """What `io.FileIO` names after install: the C raw file, with its path judged."""

    def __init__(
        self, file: Any, mode: str = "r", closefd: bool = True, opener: Any = None
    ) -> None:
        if _st.armed or (_st.user_threads and get_ident() in _st.user_threads):
            write = isinstance(mode, str) and any(c in mode for c in "wax+")
            file = check(WRITE if write else READ, file)
        super().__init__(file, mode, closefd, opener)


def install() -> None:
    """Patch every route above (call once, before arming)."""
    import _io
    import builtins
    import io

    for module in (os, posix):
        for name, (op, follow) in ONE_PATH.items():
            if hasattr(module, name):
                default = "." if name in _DEFAULT_DOT else None
                inner = _one_path(op, follow, default)
                if name in METADATA:
                    inner = _metadata_wrapper(name, follow, inner)
                _patch.wrap(module, name, inner)
        for name in ("fchmod", "fchown"):
            if hasattr(module, name):
                _patch.wrap(module, name, _metadata_wrapper(name, True, None))
        for name, (op1, op2) in TWO_PATHS.items():
            if hasattr(module, name):
                _patch.wrap(module, name, _two_paths(op1, op2))
        for name in _DEFAULT_DOT:
            if hasattr(module, name):
                _patch.wrap(module, name, _listing_wrapper)
        _patch.wrap(module, "symlink", _symlink_wrapper)
        _patch.wrap(module, "open", _os_open_wrapper)
        _patch.wrap(module, "chdir", _chdir_wrapper)
        _patch.wrap(module, "fchdir", _chdir_wrapper)  # keeps the cached cwd current
    for module in (builtins, io, _io):
        _patch.wrap(module, "open", _open_wrapper)
    for module in (io, _io):
        _patch.wrap(module, "open_code", _open_code_wrapper)
    for module in (io, _io):
        _patch.set_attr(module, "FileIO", GuardedFileIO, label=f"{module.__name__}.FileIO")
    _patch.wrap_later("tokenize", "_builtin_open", _open_wrapper)
    _patch.wrap_later("sqlite3", "connect", _sqlite_wrapper)
    _patch.wrap_later("_sqlite3", "connect", _sqlite_wrapper)
