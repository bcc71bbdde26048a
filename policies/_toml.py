"""Writing a policy back to TOML (the standard library reads TOML but does not write it).

The writer knows the policy's shape only: scalars, lists of strings, tables, and the one
array of tables (`[[net.rules]]`). It writes the fields that differ from the defaults, in
the model's field order, one list item per line, so two policies diff line by line. Any
list item can carry a trailing comment (learning mode marks risky entries that way) and
the file can start with a comment block. The output always loads back with
`policy_from_toml` into an equal policy; `tests/policies/test_toml_writer.py` pins that.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from agent_sandbox.policies._model import Policy
from agent_sandbox.policies._paths import toml_quote, visible

__all__ = ["policy_to_toml", "toml_string"]

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
#: Keys written even when they hold the default, so a reader sees them.
_ALWAYS = ("name", "provider", "mode")


def toml_string(value: str) -> str:
    """A TOML string for `value` (see `policies._paths.toml_quote`): a literal string when
    it holds a backslash, so escaped path entries read as written; else a basic string."""
    return toml_quote(value)


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else toml_string(key)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} cannot be written to a policy")
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    raise TypeError(f"cannot write {type(value).__name__} as a TOML scalar")


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _emit_table(
    lines: list[str],
    path: tuple[str, ...],
    table: Mapping[str, Any],
    comments: Mapping[tuple[str, str], str],
) -> None:
    """Write `table` at dotted `path`: its plain keys, then sub-tables, then table arrays."""
    dotted = ".".join(path)
    plain = [(k, v) for k, v in table.items() if not isinstance(v, dict) and not _is_table_list(v)]
    subs = [(k, v) for k, v in table.items() if isinstance(v, dict)]
    arrays = [(k, v) for k, v in table.items() if _is_table_list(v)]
    if path and plain:
        lines.append("")
        lines.append(f"[{'.'.join(_key(p) for p in path)}]")
    for key, value in plain:
        if isinstance(value, list):
            field = f"{dotted}.{key}" if dotted else key
            if not value:
                lines.append(f"{_key(key)} = []")
                continue
            lines.append(f"{_key(key)} = [")
            for item in value:
                note = comments.get((field, str(item)))
                suffix = f"  # {_one_line(note)}" if note else ""
                lines.append(f"    {_scalar(item)},{suffix}")
            lines.append("]")
        else:
            lines.append(f"{_key(key)} = {_scalar(value)}")
    for key, value in subs:
        _emit_table(lines, (*path, key), value, comments)
    for key, value in arrays:
        field = f"{dotted}.{key}" if dotted else key
        for index, item in enumerate(value):
            lines.append("")
            note = comments.get((field, str(index)))
            if note:
                lines.append(f"# {_one_line(note)}")
            lines.append(f"[[{'.'.join(_key(p) for p in (*path, key))}]]")
            for sub_key, sub_value in item.items():
                lines.append(f"{_key(sub_key)} = {_scalar(sub_value)}")


def _one_line(text: str) -> str:
    return " ".join(_visible(text).split())


def _visible(text: str) -> str:
    """`text` for a comment, lines kept (see `policies._paths.visible`)."""
    return "\n".join(visible(line) for line in text.split("\n"))


def policy_to_toml(
    policy: Policy,
    *,
    header: str = "",
    comments: Mapping[tuple[str, str], str] | None = None,
) -> str:
    """The policy as TOML text that `policy_from_toml` reads back into an equal policy.

    `header` becomes a comment block at the top (one `# ` per line). `comments` maps
    `(dotted list field, item)` to a trailing comment on that item's line, for example
    `("imports.allow", "subprocess") -> "RISKY: ..."`; for `net.rules` the item is the
    rule's index as a string and the comment goes on the line above its table.
    """
    data = policy.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    full = policy.model_dump(mode="json", by_alias=True)
    if "net" in data:
        # Every field of a network rule is written: a rule reads as a whole.
        data["net"]["rules"] = full["net"]["rules"]
    ordered: dict[str, Any] = {}
    for key in full:
        if key in data:
            ordered[key] = data[key]
        elif key in _ALWAYS:
            ordered[key] = full[key]
    lines: list[str] = [f"# {line}".rstrip() for line in _visible(header).split("\n")]
    if lines:
        lines.append("")
    _emit_table(lines, (), ordered, comments or {})
    return "\n".join(lines).strip("\n") + "\n"
