"""Validation errors mapped to `PolicyError`, and the dict merges policies are built from.

Shared by the loader (`_load.py`) and the model (`_model.py`, whose constructor maps its
own errors); it imports neither, so neither imports the other at run time. No pydantic
`ValidationError` leaves `map_validation_errors` unmapped: each becomes a `PolicyError`
naming the source, the dotted key, the line when the text is known, and what was expected.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ValidationError

from agent_sandbox._errors import PolicyError

__all__ = ["MAX_PROBLEMS", "apply_grants", "find_line", "map_validation_errors", "merge_dicts"]

#: The most validation problems one error lists; the rest are counted.
MAX_PROBLEMS = 20


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
def map_validation_errors(
    source: str | None, text: str | None, *, root: type[BaseModel]
) -> Iterator[None]:
    """Turn pydantic's ValidationError into PolicyError; nested uses map only once.

    `root` is the model being validated (`Policy`), whose fields name the keys an unknown
    key is compared with.
    """
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
                msg, expected = _unknown_key(root, loc)
            else:
                msg = err["msg"].removeprefix("Value error, ")
                expected = _expected_for(err)
            line = find_line(text, loc) if text else None
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


def _unknown_key(root: type[BaseModel], loc: list[str]) -> tuple[str, str]:
    """The message for an unknown key: the closest known key, and the keys that exist there."""
    model: Any = root
    for part in loc[:-1]:
        if part.isdigit():
            continue
        field = getattr(model, "model_fields", {}).get(part)
        inner = _model_of(field.annotation) if field is not None else None
        if inner is None:
            return "unknown key", "a documented key (docs/policies.md lists them)"
        model = inner
    fields = getattr(model, "model_fields", {})
    known = sorted({f.alias or name for name, f in fields.items()} | _loader_keys(root, model))
    given = loc[-1] if loc else ""
    if given in _loader_keys(root, model):
        # `extends` reached the model itself: `Policy(extends=...)`, not a file or a dict.
        return (
            f"`{given}` is read by the policy loader, not by `Policy(...)`",
            f"`policy_from_dict({{'{given}': ..., ...}})` or a TOML file with `{given} = ...`",
        )
    import difflib

    close = (
        difflib.get_close_matches(given, known, n=1, cutoff=0.6)
        or [k for k in known if given and k.startswith(given)][:1]
    )
    msg = f"unknown key; did you mean `{close[0]}`?" if close else "unknown key"
    where = f"[{'.'.join(p for p in loc[:-1] if not p.isdigit())}]" if len(loc) > 1 else "the top"
    return msg, f"one of the keys of {where}: {', '.join(known)}"


def _loader_keys(root: type[BaseModel], model: Any) -> set[str]:
    """Keys the loader reads itself (not fields of the model) where they are valid."""
    return {"extends"} if model is root else set()


def _model_of(annotation: Any) -> Any:
    """The pydantic model inside a field's annotation (`LimitsPolicy`, `tuple[NetRule, ...]`)."""
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


def find_line(text: str | None, loc: list[str]) -> int | None:
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
