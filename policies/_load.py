"""Loading policies from TOML, from presets and from dicts, with errors that say where.

Every failure becomes a `PolicyError` naming the file, the dotted key, the line when it
can be found, and what was expected. No `tomllib.TOMLDecodeError` or pydantic
`ValidationError` leaves this module unmapped.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import os
import re
import stat
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from agent_sandbox._errors import PolicyError, PolicyNotFound
from agent_sandbox.policies._model import Policy

__all__ = [
    "MAX_EXTENDS_DEPTH",
    "MAX_NESTING",
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
MAX_PROBLEMS = 20

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
                line=_find_line(text, ["extends"]),
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
    with map_validation_errors(source, text):
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
        return load_policy(extends)
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
    return load_policy(target)


def _inside(path: str, folder: str) -> bool:
    folder = folder.rstrip("/") or "/"
    return path == folder or path.startswith(folder if folder == "/" else folder + "/")


def merge_dicts(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge `overrides` into a copy of `base`: tables merge key by key, the rest replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "set":
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_grants(data: dict[str, Any], grants: Any, *, source: str | None = None) -> dict[str, Any]:
    """Add each `[[grant]]` element to `data` (the policy after `extends` and its own tables).

    A list in a grant is appended to the list it names (items already there are not
    repeated), so a grant only ever adds to what the policy and its `extends` chain allow; a
    table is merged key by key; a number or a string replaces the value (a limit raised).
    """
    if not isinstance(grants, list) or not all(isinstance(g, dict) for g in grants):
        raise PolicyError(
            "must be [[grant]] tables", source=source, key="grant", expected="[[grant]] tables"
        )
    out = copy.deepcopy(data)
    for grant in grants:
        _add(out, grant)
    return out


def _add(into: dict[str, Any], grant: dict[str, Any]) -> None:
    for key, value in grant.items():
        current = into.get(key)
        if isinstance(value, dict) and key != "set":
            if not isinstance(current, dict):
                current = into[key] = {}
            _add(current, value)
        elif isinstance(value, dict):
            into[key] = {**(current if isinstance(current, dict) else {}), **value}
        elif isinstance(value, list):
            items = list(current) if isinstance(current, list) else []
            for item in value:
                if item not in items:
                    items.append(copy.deepcopy(item))
            into[key] = items
        else:
            into[key] = value


_mapping: contextvars.ContextVar[bool] = contextvars.ContextVar("policy_mapping", default=False)


@contextlib.contextmanager
def map_validation_errors(source: str | None, text: str | None) -> Iterator[None]:
    """Turn pydantic's ValidationError into PolicyError; nested uses map only once."""
    if _mapping.get():
        yield  # an outer block maps (and knows the file and its text)
        return
    token = _mapping.set(True)
    try:
        yield
    except ValidationError as exc:
        problems = []
        first_key = None
        first_line = None
        errors = exc.errors()
        for err in errors[:MAX_PROBLEMS]:
            loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
            key = ".".join(loc) or "<root>"
            expected: str | None
            if err["type"] == "extra_forbidden":
                msg, expected = _unknown_key(loc)
            else:
                msg = err["msg"].removeprefix("Value error, ")
                expected = _expected_for(err)
            line = _find_line(text, loc) if text else None
            first_key = first_key or key
            first_line = first_line or line
            where = f"line {line}: " if line else ""
            problems.append(
                f"{where}[{key}] {msg}" + (f" (expected {expected})" if expected else "")
            )
        if len(errors) > MAX_PROBLEMS:
            problems.append(f"... and {len(errors) - MAX_PROBLEMS} more")
        if len(problems) == 1:
            # The file, line and key go in front of the message once, by PolicyError.
            only = problems[0].removeprefix(f"line {first_line}: ").removeprefix(f"[{first_key}] ")
            root_key = None if first_key == "<root>" else first_key  # a rule across keys
            raise PolicyError(only, source=source, key=root_key, line=first_line) from None
        message = "\n  " + "\n  ".join(problems)
        raise PolicyError(
            f"invalid policy: {message}", source=source, key=first_key, line=first_line
        ) from None
    finally:
        _mapping.reset(token)


def _unknown_key(loc: list[str]) -> tuple[str, str]:
    """The message for an unknown key: the closest known key, and the keys that exist there."""
    from agent_sandbox.policies._model import Policy

    model: Any = Policy
    for part in loc[:-1]:
        if part.isdigit():
            continue
        field = getattr(model, "model_fields", {}).get(part)
        inner = _model_of(field.annotation) if field is not None else None
        if inner is None:
            return "unknown key", "a documented key (docs/policies.md lists them)"
        model = inner
    fields = getattr(model, "model_fields", {})
    known = sorted({f.alias or name for name, f in fields.items()} | _loader_keys(model))
    given = loc[-1] if loc else ""
    import difflib

    close = (
        difflib.get_close_matches(given, known, n=1, cutoff=0.6)
        or [k for k in known if given and k.startswith(given)][:1]
    )
    msg = f"unknown key; did you mean `{close[0]}`?" if close else "unknown key"
    where = f"[{'.'.join(p for p in loc[:-1] if not p.isdigit())}]" if len(loc) > 1 else "the top"
    return msg, f"one of the keys of {where}: {', '.join(known)}"


def _loader_keys(model: Any) -> set[str]:
    """Keys the loader reads itself (not fields of the model) where they are valid."""
    from agent_sandbox.policies._model import Policy

    return {"extends"} if model is Policy else set()


def _model_of(annotation: Any) -> Any:
    """The pydantic model inside a field's annotation (`LimitsPolicy`, `tuple[NetRule, ...]`)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _expected_for(err: Any) -> str | None:
    kind = err["type"]
    table = {
        "string_type": "a string",
        "int_type": "an integer",
        "int_parsing": "an integer",
        "float_type": "a number",
        "float_parsing": "a number",
        "bool_type": "true or false",
        "bool_parsing": "true or false",
        "tuple_type": "a list",
        "list_type": "a list",
        "dict_type": "a table",
        "model_type": "a table",
        "missing": "this key to be set",
        "literal_error": None,
    }
    if kind == "literal_error":
        return str(err.get("ctx", {}).get("expected", "")) or None
    if kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        ctx = err.get("ctx", {})
        return " and ".join(f"{k.replace('_', ' ')} {v}" for k, v in ctx.items())
    return table.get(kind)


def _find_line(text: str | None, loc: list[str]) -> int | None:
    """Best effort: the 1-based line where the dotted key `loc` is written in TOML `text`."""
    if not text or not loc:
        return None
    lines = text.splitlines()
    keys = [p for p in loc if not p.isdigit()]
    if not keys:
        return None
    # Find the deepest table header that is a prefix of the key path, then the key below it.
    section: list[str] = []
    best: int | None = None
    header_re = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    key_re = re.compile(r"^\s*([A-Za-z0-9_\-\"'.]+)\s*=")
    for number, line in enumerate(lines, 1):
        m = header_re.match(line)
        if m:
            section = [s.strip().strip("\"'") for s in m.group(1).split(".")]
            if section == keys[: len(section)] and len(section) == len(keys):
                best = number
            continue
        m = key_re.match(line)
        if m:
            dotted = section + [s.strip().strip("\"'") for s in m.group(1).split(".")]
            if dotted == keys:
                return number
            if best is None and dotted == keys[: len(dotted)]:
                best = number
    return best


def _toml_error_line(message: str) -> int | None:
    m = re.search(r"line (\d+)", message)
    return int(m.group(1)) if m else None
