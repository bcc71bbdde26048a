"""Writing policies as TOML: the one place that does, through tomlkit.

The standard library reads TOML but does not write it; tomlkit (a dependency of the core)
writes it and keeps comments, so everything that writes policy text goes through here:
`policy_to_toml` (a whole policy: `Policy.to_toml`, learning's proposals) and
`grant_to_toml` (the `[[grant]]` element `agent-sandbox policy apply` appends to a file).

The writer knows the policy's shape only: scalars, lists of strings, tables, and the one
array of tables (`[[net.rules]]`). It writes the fields that differ from the defaults, in
the model's field order, one list item per line, so two policies diff line by line. Any
list item can carry a trailing comment (learning mode marks risky entries that way) and
the file can start with a comment block. Strings are quoted by `policies._paths.toml_quote`
(a literal string for a path with a backslash, invisible characters as escapes, so a
reviewer sees them); comments go through `visible` for the same reason. The output always
loads back with `policy_from_toml` into an equal policy; `tests/policies/test_toml_writer.py`
pins that. (The refusal hints' one-line fragments in `agent_sandbox/_render.py` are not
policy files: they run in the worker, which imports the standard library only.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import tomlkit
from tomlkit.items import AoT, Array, Item, Table

from agent_sandbox.policies._paths import toml_quote, visible

if TYPE_CHECKING:
    from agent_sandbox.policies._model import Policy

__all__ = ["grant_to_toml", "policy_to_toml", "toml_string"]

#: Keys written even when they hold the default, so a reader sees them.
_ALWAYS = ("name", "provider", "mode")


def toml_string(value: str) -> str:
    """A TOML string for `value` (see `policies._paths.toml_quote`): a literal string when
    it holds a backslash, so escaped path entries read as written; else a basic string."""
    return toml_quote(value)


def _string(value: str) -> Item:
    quoted = toml_quote(value)
    # `toml_quote` already escaped what a basic string needs, and more (invisible
    # characters); tomlkit writes its text verbatim between the quotes.
    return tomlkit.string(quoted[1:-1], literal=quoted.startswith("'"), escape=False)


def _scalar(value: Any) -> Item:
    if isinstance(value, bool | int):
        return tomlkit.item(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} cannot be written to a policy")
        return tomlkit.item(value)
    if isinstance(value, str):
        return _string(value)
    raise TypeError(f"cannot write {type(value).__name__} as a TOML scalar")


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _one_line(text: str) -> str:
    return " ".join(_visible(text).split())


def _visible(text: str) -> str:
    """`text` for a comment, lines kept (see `policies._paths.visible`)."""
    return "\n".join(visible(line) for line in text.split("\n"))


def _array(field: str, value: list[Any], comments: Mapping[tuple[str, str], str]) -> Array:
    array = tomlkit.array()
    if not value:
        return array
    for item in value:
        note = comments.get((field, str(item)))
        array.add_line(_scalar(item), comment=_one_line(note) if note else None)
    array.add_line(indent="")
    return array


def _fill(
    table: Any,
    path: tuple[str, ...],
    data: Mapping[str, Any],
    comments: Mapping[tuple[str, str], str],
) -> None:
    """Add `data` (at dotted `path`) to `table`: plain keys, then sub-tables, then arrays
    of tables, as TOML requires."""
    dotted = ".".join(path)
    plain = [(k, v) for k, v in data.items() if not isinstance(v, dict) and not _is_table_list(v)]
    subs = [(k, v) for k, v in data.items() if isinstance(v, dict)]
    arrays = [(k, v) for k, v in data.items() if _is_table_list(v)]
    for key, value in plain:
        field = f"{dotted}.{key}" if dotted else key
        item = _array(field, value, comments) if isinstance(value, list) else _scalar(value)
        table.add(key, item)
    for key, value in subs:
        # A table of tables only (`[code]` holding `[code.budgets]`) writes no header.
        only_tables = all(isinstance(v, dict) or _is_table_list(v) for v in value.values())
        sub = tomlkit.table(is_super_table=only_tables)
        _fill(sub, (*path, key), value, comments)
        table.add(key, sub)
    for key, value in arrays:
        field = f"{dotted}.{key}" if dotted else key
        aot: AoT = tomlkit.aot()
        for index, item in enumerate(value):
            element: Table = tomlkit.table()
            note = comments.get((field, str(index)))
            if note:
                element.add(tomlkit.comment(_one_line(note)))
            for sub_key, sub_value in item.items():
                element.add(sub_key, _scalar(sub_value))
            aot.append(element)
        table.add(key, aot)


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
    rule's index as a string and the comment is the first line of its table.
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
    doc = tomlkit.document()
    if header:
        for line in _visible(header).split("\n"):
            doc.add(tomlkit.comment(line) if line.strip() else tomlkit.nl())
        doc.add(tomlkit.nl())
    _fill(doc, (), ordered, comments or {})
    return tomlkit.dumps(doc).strip("\n") + "\n"


def grant_to_toml(grant: Mapping[str, Mapping[str, list[Any]]]) -> str:
    """One `[[grant]]` element setting each list of `grant` (`{table: {key: [items]}}`; a
    network rule is a dict and becomes an inline table), every name quoted as TOML data."""
    element = tomlkit.table()
    for table, entries in grant.items():
        sub = tomlkit.table()
        for key, value in entries.items():
            array = tomlkit.array()
            for item in value:
                if isinstance(item, dict):
                    inline = tomlkit.inline_table()
                    for k, v in item.items():
                        inline.append(k, _scalar(v))
                    array.append(inline)
                else:
                    array.append(_scalar(item))
            sub.add(key, array)
        element.add(table, sub)
    doc = tomlkit.document()
    aot = tomlkit.aot()
    aot.append(element)
    doc.add("grant", aot)
    return tomlkit.dumps(doc)
