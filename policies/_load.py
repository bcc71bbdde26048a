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
import tomllib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agent_sandbox._errors import PolicyError, PolicyNotFound
from agent_sandbox.policies._model import Policy

__all__ = [
    "list_presets",
    "load_policy",
    "map_validation_errors",
    "merge_dicts",
    "policy_from_dict",
    "policy_from_toml",
    "resolve_policy",
]

_PRESET_PACKAGE = "agent_sandbox.policies"


def list_presets() -> list[str]:
    """Names of the policies shipped with the package."""
    folder = resources.files(_PRESET_PACKAGE).joinpath("presets")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Load a policy from a TOML file; errors name the file, key, line and expectation."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyNotFound(
            "no such policy file", source=str(file), expected="an existing TOML file"
        ) from None
    except IsADirectoryError:
        raise PolicyError("is a directory", source=str(file), expected="a TOML file") from None
    except UnicodeDecodeError as exc:
        raise PolicyError(f"not UTF-8 text ({exc.reason})", source=str(file)) from None
    except OSError as exc:
        raise PolicyError(f"cannot read ({exc.strerror})", source=str(file)) from None
    return policy_from_toml(text, source=str(file))


def policy_from_toml(text: str, *, source: str = "<string>") -> Policy:
    """Parse TOML text into a policy."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = _toml_error_line(str(exc))
        raise PolicyError(
            f"not valid TOML: {exc}", source=source, line=line, expected="TOML syntax"
        ) from None
    return policy_from_dict(data, source=source, text=text)


def resolve_policy(spec: Policy | str | os.PathLike[str] | None) -> Policy:
    """A `Policy` from a policy, a preset name, or a TOML path (None means `pure-computation`)."""
    if spec is None:
        spec = "pure-computation"
    if isinstance(spec, Policy):
        return spec
    text = os.fspath(spec)
    if text in list_presets():
        res = resources.files(_PRESET_PACKAGE).joinpath("presets", f"{text}.toml")
        return policy_from_toml(res.read_text(encoding="utf-8"), source=f"preset:{text}")
    if text.endswith(".toml") or os.sep in text or os.path.exists(text):
        return load_policy(text)
    presets = ", ".join(list_presets())
    raise PolicyNotFound(
        f"{text!r} is neither a shipped policy nor a TOML file",
        source=text,
        expected=f"one of {presets}, or a path to a .toml file",
    )


def policy_from_dict(
    data: dict[str, Any], *, source: str | None = None, text: str | None = None
) -> Policy:
    """Validate a dict (as parsed from TOML) into a policy, mapping validation errors."""
    data = dict(data)
    extends = data.pop("extends", None)
    sources: tuple[str, ...] = ()
    if extends is not None:
        if not isinstance(extends, str):
            raise PolicyError("must be a preset name or a path", source=source, key="extends")
        base_path = extends
        if source and not os.path.isabs(extends) and extends.endswith(".toml"):
            base_path = os.path.join(os.path.dirname(source), extends)
        base = resolve_policy(base_path)
        data = merge_dicts(base.model_dump(mode="json", by_alias=True), data)
        sources = tuple(s for s in (base.source, *base.sources) if s)
    with map_validation_errors(source, text):
        policy = Policy.model_validate(data)
    if source is not None or sources:
        policy = policy.model_copy(update={"source": source, "sources": sources})
    return policy


def merge_dicts(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge `overrides` into a copy of `base`: tables merge key by key, the rest replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "set":
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


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
        for err in exc.errors():
            loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
            key = ".".join(loc) or "<root>"
            expected: str | None
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
                expected = "one of the documented keys (see `agent-sandbox policy explain`)"
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
        message = problems[0] if len(problems) == 1 else "\n  " + "\n  ".join(problems)
        raise PolicyError(
            f"invalid policy: {message}", source=source, key=first_key, line=first_line
        ) from None
    finally:
        _mapping.reset(token)


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
