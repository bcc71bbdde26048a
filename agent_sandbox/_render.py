"""Rendering data from the worker as data: quoted, escaped, one line, bounded.

Everything a worker sends (paths, host names, module names, details, CSV cells that ended up
in a file name) is untrusted text. Before it reaches what a model or a person reads (the
model's text, the CLI, the trace) it goes through `quote()` or `clean()`: no control
characters, no newlines, no terminal escapes, no bidirectional overrides, and a length cap.
TOML fragments (the hints) are built by `toml_fragment()`, a serializer, never by string
formatting.

Standard library only: the worker imports it too (the exception text it raises).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["clean", "clean_block", "quote", "toml_fragment", "toml_key", "toml_string"]

#: C0, DEL, C1, and the Unicode characters that move or hide text on a terminal or page:
#: line/paragraph separators, bidirectional embeddings/overrides/isolates, zero-width ones.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
#: A backslash that does not start an escape `clean()` writes (`\x0a`, `\u202e`): the host
#: keeps a worker's text with its control characters already escaped that way
#: (`_host.intake.events.clean_text`), and quoting it again must not double them (`\\x0a`).
_LONE_BACKSLASH = re.compile(r"\\(?!x[0-9a-f]{2}|u[0-9a-f]{4})")
_DEFAULT_LIMIT = 300


def _escape(match: re.Match[str]) -> str:
    ch = match.group(0)
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    if ch in named:
        return named[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(text: Any, limit: int = _DEFAULT_LIMIT) -> str:
    """`text` on one line with every unsafe character escaped, cut at `limit` characters."""
    value = text if isinstance(text, str) else str(text)
    if len(value) > limit:
        value = value[:limit] + f"...[{len(value) - limit} more characters]"
    return _UNSAFE.sub(_escape, value)


def clean_block(text: Any, limit: int = 20_000) -> str:
    """Several lines of untrusted text (a traceback): each line `clean`ed, newlines kept."""
    value = text if isinstance(text, str) else str(text)
    if len(value) > limit:
        value = value[:limit] + f"\n...[{len(value) - limit} more characters]"
    return "\n".join(clean(line, limit) for line in value.split("\n"))


def quote(text: Any, limit: int = _DEFAULT_LIMIT) -> str:
    """`text` as a quoted, escaped, one-line literal: what data looks like in our prose.

    A control character shows as one escape (`"/tmp/x\\x0ay"`) whether it arrives raw or
    already escaped by the host's intake; any other backslash is doubled.
    """
    value = text if isinstance(text, str) else str(text)
    value = _LONE_BACKSLASH.sub(r"\\\\", value).replace('"', '\\"')
    return '"' + clean(value, limit) + '"'


def toml_string(value: str) -> str:
    """A TOML basic string; every character that is not plainly printable is escaped."""
    out = ['"']
    for ch in value:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif _UNSAFE.match(ch):
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else toml_string(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def toml_fragment(grant: Mapping[str, Any], *, indent: str = "") -> str:
    """A `[[grant]]` element setting each dotted key of `grant` (see docs/policies.md).

    The element is valid wherever it is pasted in a policy file, any number of times:
    an array-of-tables header always starts a new element.
    """
    lines = [f"{indent}[[grant]]"]
    for dotted, value in grant.items():
        key = ".".join(toml_key(part) for part in dotted.split("."))
        lines.append(f"{indent}{key} = {_toml_value(value)}")
    return "\n".join(lines)
