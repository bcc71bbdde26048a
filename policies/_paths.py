"""The path language of `[files]`: globs, and backslash escapes that make a name literal.

One module decides what a `files.read`/`write`/`deny`/`hide` entry means, for every reader:
the Python file guard (in the worker, which imports this module without pydantic), the
kernel providers' builders (which bind or grant the fixed part before the first wildcard)
and learning mode (which writes names it observed as literals).

The language:

* `**` matches any run of characters, `/` included; `*` any run within one component; `?`
  one character other than `/`; `[abc]`, `[a-z]` and `[!abc]` one character of a class.
* `\\` makes the next character literal. It may precede only `*`, `?`, `[`, `]`, `{`, `}`
  and `\\` itself (so `\\*` is a star, `\\\\` a backslash); before anything else it is an
  error, so a path that merely contains a backslash cannot change meaning silently. `]`,
  `{` and `}` are not special today; they are escapable so that a literal written now stays
  literal if the language grows.
* An entry is a glob when it has an unescaped `*`, `?` or `[`; otherwise it names one path
  (after unescaping) and grants that path and everything below it.

`literal(path)` writes any path as an entry that matches exactly that path (and what is
below it); `risky_name(path)` says why a name deserves a reviewer's eye (glob or control
characters), whatever its escaping.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "ESCAPABLE",
    "check_entry",
    "entry_regex",
    "expand_entry",
    "glob_components",
    "glob_leads_to",
    "is_glob",
    "literal",
    "name_regex",
    "risky_name",
    "static_prefix",
    "toml_quote",
    "unescape",
    "visible",
]

#: Characters a backslash may escape.
ESCAPABLE = frozenset("*?[]{}\\")
_WILD = frozenset("*?[")


def check_entry(entry: str) -> None:
    """Raise ValueError when `entry` has a backslash that escapes nothing escapable."""
    i = 0
    while i < len(entry):
        if entry[i] == "\\":
            if i + 1 >= len(entry):
                raise ValueError(
                    f"{entry!r} ends with a lone backslash; write \\\\ for a backslash"
                )
            if entry[i + 1] not in ESCAPABLE:
                raise ValueError(
                    f"{entry!r}: a backslash may only escape * ? [ ] {{ }} or \\; "
                    "write \\\\ for a backslash"
                )
            i += 2
            continue
        i += 1
    tokens = _tokens(entry)
    for k, token in enumerate(tokens):
        if token == ("[", False) and _class_span(tokens, k)[2] == -1:
            raise ValueError(f"{entry!r} has a [ that is not closed; write \\[ for a bracket")
    try:
        entry_regex(entry)
    except re.error as exc:
        raise ValueError(f"{entry!r} is not a valid pattern ({exc})") from None


def _tokens(entry: str) -> list[tuple[str, bool]]:
    """(character, is_literal) pairs: an escaped character is literal, others may be wild."""
    out: list[tuple[str, bool]] = []
    i = 0
    while i < len(entry):
        c = entry[i]
        if c == "\\" and i + 1 < len(entry):
            out.append((entry[i + 1], True))
            i += 2
            continue
        out.append((c, c not in _WILD))
        i += 1
    return out


def is_glob(entry: str) -> bool:
    """Whether `entry` has an unescaped `*`, `?` or `[`."""
    if "\\" not in entry:  # the common case, without the per-character walk
        return any(c in _WILD for c in entry)
    return any(not lit for _, lit in _tokens(entry))


def unescape(entry: str) -> str:
    """The characters of `entry` with its escapes removed (the path a literal entry names)."""
    if "\\" not in entry:
        return entry
    return "".join(c for c, _ in _tokens(entry))


def literal(path: str) -> str:
    """An entry matching exactly `path` (and what is below it): every escapable escaped."""
    return "".join("\\" + c if c in ESCAPABLE else c for c in path)


def static_prefix(entry: str) -> str:
    """The unescaped leading path of `entry` before its first component holding a wildcard
    (the whole path, unescaped, when it has none): what a kernel provider binds or grants."""
    tokens = _tokens(entry)
    components: list[list[tuple[str, bool]]] = [[]]
    for c, lit in tokens:
        if c == "/" and lit:
            components.append([])
        else:
            components[-1].append((c, lit))
    kept: list[str] = []
    for part in components:
        if any(not lit for _, lit in part):
            return "/".join(kept) or "/"
        kept.append("".join(c for c, _ in part))
    return "/".join(kept) or "/"


def expand_entry(entry: str, *, scratch: str = "", home: str = "") -> str:
    """`entry` with a leading `$SCRATCH`, `~` or `~user` replaced by that directory, written
    as a literal, so glob characters in the directory's own name stay literal. `home`
    overrides the user's home directory for `~`."""
    if entry.startswith("$SCRATCH") and scratch:
        return literal(scratch) + entry[len("$SCRATCH") :]
    if entry.startswith("~"):
        head, sep, rest = entry.partition("/")
        expanded = home if head == "~" and home else os.path.expanduser(head)
        if expanded != head:
            return literal(expanded) + sep + rest
    return entry


def _regex_body(entry: str, *, slash: bool) -> str:
    """The regex for `entry` (no anchors). `slash`: `**` crosses `/`, `*` and `?` do not."""
    tokens = _tokens(entry)
    out: list[str] = []
    i = 0
    while i < len(tokens):
        c, lit = tokens[i]
        if lit:
            out.append(re.escape(c))
        elif c == "*":
            if i + 1 < len(tokens) and tokens[i + 1] == ("*", False):
                out.append(".*" if slash else "[^/]*")
                i += 2
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        else:  # "[": a class up to its closing "]" (check_entry refuses an unclosed one)
            negate, first, end = _class_span(tokens, i)
            if end == -1:
                out.append(re.escape("["))
                i += 1
                continue
            members = tokens[first:end]
            body = []
            for k, (cc, _) in enumerate(members):
                # A "-" between two members is a range (a-z); anything else is literal.
                inner = 0 < k < len(members) - 1
                body.append("-" if cc == "-" and inner else _cls(cc))
            out.append(("[^" if negate else "[") + "".join(body) + "]")
            i = end + 1
            continue
        i += 1
    return "".join(out)


def _class_span(tokens: list[tuple[str, bool]], i: int) -> tuple[bool, int, int]:
    """For the `[` at `i`: (negated, index of the first member, index of the closing `]`),
    the last -1 when the class is not closed. A `]` right after `[` or `[!` is a member."""
    first = i + 1
    negate = first < len(tokens) and tokens[first] == ("!", True)
    if negate:
        first += 1
    for j in range(first + 1, len(tokens)):
        if tokens[j] == ("]", True):
            return negate, first, j
    return negate, first, -1


def _cls(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


def entry_regex(entry: str) -> re.Pattern[str]:
    """A regex a resolved path fully matches when `entry` covers it (the path named, or
    anything below a match)."""
    return re.compile(_regex_body(entry.rstrip("/") or "/", slash=True) + "(?:/.*)?", re.DOTALL)


def name_regex(pattern: str) -> re.Pattern[str]:
    """A regex one path component fully matches when the `files.hide` name `pattern` does."""
    return re.compile(_regex_body(pattern, slash=False), re.DOTALL)


def glob_components(entry: str) -> list[re.Pattern[str] | None]:
    """A glob entry as one matcher per path component: None for a component holding an
    unescaped `**` (it matches at any depth), else the component's regex."""
    out: list[re.Pattern[str] | None] = []
    for part in entry.split("/"):  # a backslash never escapes "/" in this language
        if part:
            wild = any(c == "*" and not lit for c, lit in _tokens(part))
            out.append(None if wild and "**" in _unescaped_stars(part) else name_regex(part))
    return out


def _unescaped_stars(part: str) -> str:
    return "".join(c if not lit else "_" for c, lit in _tokens(part))


def glob_leads_to(components: list[re.Pattern[str] | None], parts: list[str]) -> bool:
    """Whether the path of components `parts` is, or is a parent of, a path that the glob of
    `components` (`glob_components`) matches: what a listing may show for that glob."""
    for i, name in enumerate(parts):
        if i >= len(components):
            return False
        matcher = components[i]
        if matcher is None:
            return True
        if not matcher.fullmatch(name):
            return False
    return True


def risky_name(name: str) -> str:
    """Why a name a run used deserves review ("" when it is plain): glob characters, which
    a reader might take for a pattern, or control or invisible characters, which can hide
    what it is. Facts only: the caller says what it did about them."""
    reasons = []
    found = sorted({c for c in name if c in ESCAPABLE})
    if found:
        reasons.append(f"the name contains pattern characters ({' '.join(found)})")
    if any(_hidden_char(c) for c in name):
        reasons.append("the name contains control or invisible characters (shown as \\u escapes)")
    return "; ".join(reasons)


def toml_quote(value: str) -> str:
    """`value` as a TOML string: a literal string ('...') when it holds a backslash and
    can be one (no `'`, no control characters), so escapes read as written; otherwise a
    basic string with quotes, backslashes and control characters escaped."""
    if "\\" in value and "'" not in value and not any(_hidden_char(c) for c in value):
        return f"'{value}'"
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif _hidden_char(ch):
            out.append(f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _hidden_char(ch: str) -> bool:
    """Control, format (bidirectional overrides, zero-width) and separator characters:
    they hide or disguise what a name is when it is printed."""
    if ch < " " or "\x7f" <= ch <= "\x9f":
        return True
    if ch.isascii():
        return False
    import unicodedata

    return unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")


def visible(text: str) -> str:
    """`text` for a person or a comment line: control and invisible characters (newlines
    included) as `\\u` escapes, so a quoted name can neither break a line nor disguise
    itself."""
    return "".join(
        (f"\\u{ord(c):04X}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08X}") if _hidden_char(c) else c
        for c in text
    )
