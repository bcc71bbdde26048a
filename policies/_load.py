"""Loading policies from TOML, from presets and from dicts, with errors that say where.

Every failure becomes a `PolicyError` naming the file, the dotted key, the line when it
can be found, and what was expected. No `tomllib.TOMLDecodeError` or pydantic
`ValidationError` leaves this module unmapped.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import stat
from collections.abc import Iterator
from typing import Any

from agent_sandbox._errors import PolicyError, PolicyNotFound
from agent_sandbox.policies._model import Policy
from agent_sandbox.policies._validation import (
    MAX_PROBLEMS,
    apply_grants,
    find_line,
    map_validation_errors,
    merge_dicts,
)

__all__ = [
    "MAX_EXTENDS_DEPTH",
    "MAX_NESTING",
    "MAX_PROBLEMS",
    "MAX_POLICY_BYTES",
    "apply_grants",
    "list_presets",
    "load_policy",
    "map_validation_errors",
    "merge_dicts",
    "policy_from_dict",
    "policy_from_toml",
    "read_policy_text",
    "resolve_policy",
]

_PRESET_PACKAGE = "agent_sandbox.policies"


def list_presets() -> list[str]:
    """Names of the policies shipped with the package."""
    from importlib import resources

    folder = resources.files(_PRESET_PACKAGE).joinpath("presets")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


#: The largest policy file read (bytes); a policy is a few kilobytes.
MAX_POLICY_BYTES = 1024 * 1024
#: How many files an `extends` chain may hold, the first one included.
MAX_EXTENDS_DEPTH = 8
#: How deeply arrays, inline tables and tables may nest in a policy file.
MAX_NESTING = 32
#: How many validation problems one error lists (the rest are counted).

# The files (real paths) and presets being loaded, outermost first: `extends` cycles and
# chain depth are checked against it.
_chain: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "policy_extends_chain", default=()
)


def read_policy_text(path: str | os.PathLike[str]) -> str:
    """The text of a policy file, read defensively: a regular file of at most
    `MAX_POLICY_BYTES`, UTF-8. Opening never blocks (a FIFO is refused, not waited on) and
    never reads more than the limit (a device such as `/dev/zero` is refused before any
    read). Every failure is a `PolicyError` naming the file and what was expected.
    """
    file = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise PolicyNotFound(
            "no such policy file", source=file, expected="an existing TOML file"
        ) from None
    except OSError as exc:
        raise PolicyError(
            f"cannot open it ({exc.strerror or exc})", source=file, expected="a readable TOML file"
        ) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise PolicyError("is a directory", source=file, expected="a TOML file")
        if not stat.S_ISREG(info.st_mode):
            raise PolicyError(
                f"not a regular file (a {_file_kind(info.st_mode)}); a policy is read only "
                "from a regular file",
                source=file,
                expected="a regular TOML file",
            )
        if info.st_size > MAX_POLICY_BYTES:
            raise PolicyError(
                f"too large ({info.st_size} bytes; the limit is {MAX_POLICY_BYTES})",
                source=file,
                expected="a policy file of at most 1 MiB",
            )
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_POLICY_BYTES:
            chunk = os.read(fd, MAX_POLICY_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise PolicyError(f"cannot read it ({exc.strerror or exc})", source=file) from None
    finally:
        os.close(fd)
    if size > MAX_POLICY_BYTES:
        raise PolicyError(
            f"grew past {MAX_POLICY_BYTES} bytes while it was read",
            source=file,
            expected="a policy file of at most 1 MiB that nothing is writing",
        )
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"not UTF-8 text ({exc.reason})", source=file) from None


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Load a policy from a TOML file; errors name the file, key, line and expectation."""
    file = os.fspath(path)
    real = os.path.realpath(file)
    with _extending(real, file):
        text = read_policy_text(file)
        return policy_from_toml(text, source=file)


@contextlib.contextmanager
def _extending(link: str, shown: str) -> Iterator[None]:
    """Push one file or preset onto the `extends` chain; refuse a cycle or a deep chain."""
    chain = _chain.get()
    if link in chain:
        names = [_short(c) for c in chain[chain.index(link) :]] + [_short(link)]
        raise PolicyError(
            f"cycle: {' -> '.join(names)}",
            source=shown,
            key="extends",
            expected="a chain without repeats; remove the `extends` that closes it",
        )
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise PolicyError(
            f"the extends chain is deeper than {MAX_EXTENDS_DEPTH} files "
            f"({' -> '.join(_short(c) for c in (*chain, link))})",
            source=shown,
            key="extends",
            expected=f"at most {MAX_EXTENDS_DEPTH} policies in a chain; merge some of them",
        )
    token = _chain.set((*chain, link))
    try:
        yield
    finally:
        _chain.reset(token)


def _short(link: str) -> str:
    return link if link.startswith("preset:") else os.path.basename(link) or link


def policy_from_toml(text: str, *, source: str = "<string>") -> Policy:
    """Parse TOML text into a policy (nesting deeper than `MAX_NESTING` is refused)."""
    import tomllib  # loaded with the first policy text: a policy built in Python needs none

    _check_nesting(text, source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = _toml_error_line(str(exc))
        raise PolicyError(
            f"not valid TOML: {exc}", source=source, line=line, expected="TOML syntax"
        ) from None
    except RecursionError:  # NOTE: a backstop; _check_nesting refuses deep nesting first
        raise PolicyError(
            f"nested deeper than {MAX_NESTING} levels",
            source=source,
            expected="a flat policy (tables and lists a few levels deep)",
        ) from None
    if _data_depth(data) > MAX_NESTING:
        raise PolicyError(
            f"tables nested deeper than {MAX_NESTING} levels (dotted keys or headers)",
            source=source,
            expected="a flat policy (tables and lists a few levels deep)",
        )
    return policy_from_dict(data, source=source, text=text)


def _check_nesting(text: str, source: str) -> None:
    """Refuse arrays and inline tables nested deeper than `MAX_NESTING` before parsing.

    A linear scan that skips strings and comments; it only counts brackets, the parser
    judges the rest. It exists because the parser recurses once per level.
    """
    depth = 0
    dots = 0  # dots in the current dotted key (or header) since the last `=`, `,`, `{`
    line = 1
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\n" or c in "=,{":
            dots = 0
        if c == "\n":
            line += 1
        elif c == ".":
            dots += 1
            if dots > MAX_NESTING:
                raise PolicyError(
                    f"a dotted key nested deeper than {MAX_NESTING} levels",
                    source=source,
                    line=line,
                    expected="a flat policy (tables and lists a few levels deep)",
                )
        elif c == "#":
            end = text.find("\n", i)
            i = n if end == -1 else end
            continue
        elif c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            while i < n and not text.startswith(quote, i):
                if text[i] == "\\" and c == '"':
                    i += 1
                elif text[i] == "\n":
                    line += 1
                    if len(quote) == 1:
                        break  # an unterminated string: the parser reports it
                i += 1
            i += len(quote)
            continue
        elif c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise PolicyError(
                    f"nested deeper than {MAX_NESTING} levels",
                    source=source,
                    line=line,
                    expected="a flat policy (tables and lists a few levels deep)",
                )
        elif c in "]}":
            depth = max(0, depth - 1)
        i += 1


def _data_depth(data: Any) -> int:
    """How deeply dicts and lists nest in parsed TOML (iterative: no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_NESTING:
            return depth
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return deepest


def resolve_policy(spec: Policy | str | os.PathLike[str] | None) -> Policy:
    """A `Policy` from a policy, a preset name, or a TOML path (None means `pure-computation`)."""
    if spec is None:
        spec = "pure-computation"
    if isinstance(spec, Policy):
        return spec
    text = os.fspath(spec)
    if text in list_presets():
        return _load_preset(text)
    if text.endswith(".toml") or os.sep in text or os.path.exists(text):
        return load_policy(text)
    presets = ", ".join(list_presets())
    raise PolicyNotFound(
        f"{text!r} is neither a shipped policy nor a TOML file",
        source=text,
        expected=f"one of {presets}, or a path to a .toml file",
    )


def _load_preset(name: str) -> Policy:
    from importlib import resources

    with _extending(f"preset:{name}", f"preset:{name}"):
        res = resources.files(_PRESET_PACKAGE).joinpath("presets", f"{name}.toml")
        return policy_from_toml(res.read_text(encoding="utf-8"), source=f"preset:{name}")


def policy_from_dict(
    data: dict[str, Any], *, source: str | None = None, text: str | None = None
) -> Policy:
    """Validate a dict (as parsed from TOML) into a policy, mapping validation errors."""
    data = dict(data)
    grants = data.pop("grant", None)
    extends = data.pop("extends", None)
    sources: tuple[str, ...] = ()
    if extends is not None:
        try:
            base = _resolve_extends(extends, source)
        except PolicyError as exc:
            if exc.line is not None or exc.source != source or not text:
                raise
            # The error is about this file's own `extends` line: say which line it is.
            raise type(exc)(
                exc.reason,
                source=source,
                key="extends",
                line=find_line(text, ["extends"]),
                expected=exc.expected,
            ) from None
        inherited = base.model_dump(mode="json", by_alias=True)
        # The parent's description describes the parent: a child that changes its rules
        # would otherwise claim, say, "no network" while it adds a net rule.
        inherited.pop("description", None)
        data = merge_dicts(inherited, data)
        sources = tuple(s for s in (base.source, *base.sources) if s)
    if grants is not None:
        if extends is None:
            # Grants add to what the policy has, defaults included.
            data = merge_dicts(Policy().model_dump(mode="json", by_alias=True), data)
        data = apply_grants(data, grants, source=source)
    with map_validation_errors(source, text, root=Policy):
        policy = Policy.model_validate(data)
    if source is not None or sources:
        policy = policy.model_copy(update={"source": source, "sources": sources})
    return policy


def _resolve_extends(extends: Any, source: str | None) -> Policy:
    """The policy `extends` names, from the file `source` (see docs/policies.md, `extends`).

    A preset name; or a `.toml` path relative to the directory of `source` (the current
    directory for a policy without a file) that stays inside that directory once `..` and
    links are resolved; or an absolute `.toml` path, which is how a policy says it reaches
    outside its directory.
    """
    expected = (
        "a shipped policy name, a .toml path inside this file's directory, "
        "or an absolute .toml path"
    )
    if not isinstance(extends, str) or not extends:
        raise PolicyError(
            "must be a preset name or a path", source=source, key="extends", expected=expected
        )
    if "\x00" in extends:
        raise PolicyError(
            "contains a NUL character", source=source, key="extends", expected=expected
        )
    if source and source.startswith("preset:"):
        if extends not in list_presets():
            raise PolicyError(
                f"a shipped policy extends {extends!r}, which is not shipped",
                source=source,
                key="extends",
                expected="a shipped policy name",
            )
        return _load_preset(extends)
    if "/" not in extends and not extends.endswith(".toml"):
        if extends in list_presets():
            return _load_preset(extends)
        raise PolicyNotFound(
            f"{extends!r} is not a shipped policy",
            source=source,
            key="extends",
            expected=f"one of {', '.join(list_presets())}, or a path to a .toml file",
        )
    if not extends.endswith(".toml"):
        raise PolicyError(
            f"{extends!r} does not name a .toml file",
            source=source,
            key="extends",
            expected=expected,
        )
    if os.path.isabs(extends):
        return _load_extended(extends, extends, source)
    has_file = bool(source) and not str(source).startswith("<")
    folder = os.path.dirname(os.path.abspath(str(source))) if has_file else os.getcwd()
    target = os.path.join(folder, extends)
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(target)
    if not _inside(os.path.normpath(target), folder) or not _inside(real, real_folder):
        where = "this file's directory" if has_file else "the current directory"
        raise PolicyError(
            f"{extends!r} leads out of {where} ({folder}) to {real}",
            source=source,
            key="extends",
            expected="a path inside that directory, a shipped policy name, or an absolute "
            ".toml path to say the policy reaches outside on purpose",
        )
    return _load_extended(target, extends, source)


def _load_extended(path: str, extends: str, source: str | None) -> Policy:
    """`load_policy(path)`; a missing file is named with the file and line that extend it."""
    try:
        return load_policy(path)
    except PolicyNotFound as exc:
        if exc.source is None or os.path.abspath(str(exc.source)) != os.path.abspath(path):
            raise
        raise PolicyNotFound(
            f"extends {extends!r}, which names {path}: no such policy file",
            source=source,
            key="extends",
            expected="an existing TOML file (a path is relative to this file's directory)",
        ) from None


def _inside(path: str, folder: str) -> bool:
    folder = folder.rstrip("/") or "/"
    return path == folder or path.startswith(folder if folder == "/" else folder + "/")


def _toml_error_line(message: str) -> int | None:
    m = re.search(r"line (\d+)", message)
    return int(m.group(1)) if m else None
