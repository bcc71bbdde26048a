"""The Denial value and the catalogue of rule names.

A denial is data before it is an exception. Its `rule` is a stable dotted name that a
person can grep for in a policy and in this file; `RULES` below is the one place where
every rule is documented. Tests check that every rule the code emits is listed here.

Standard library only: the worker imports this before arming.
"""

from __future__ import annotations

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "BETWEEN_CALLS",
    "DURING_CALL",
    "Denial",
    "INTERNAL",
    "LEARNED",
    "USER",
    "RULES",
    "fold_detail",
    "is_sensitive",
    "refusal_first",
    "refusal_line",
    "rule_doc",
    "REFUSAL_END",
    "REFUSAL_START",
]

#: Every rule name a denial can carry, with what it means. Keep sorted.
RULES: dict[str, str] = {
    "api.deserialization": "pickle/marshal/shelve loading of bytes; grant `deserialization`",
    "api.dynamic-code": "eval, exec or compile of a string; grant `dynamic-code`",
    "api.introspection": "frame and garbage-collector introspection; grant `introspection`",
    "api.native-code": "ctypes, cffi and other foreign-function access; grant `native-code`",
    "api.process-control": "fork, kill, signals; grant `process-control`",
    "api.process-exec": "subprocess, os.system, exec*, spawn*; grant `process-exec`",
    "code.allocation": "an allocation larger than the code budget `max_allocation`",
    "code.attribute": "an attribute outside the policy's sub-language",
    "code.call-depth": "recursion deeper than the code budget `max_call_depth`",
    "code.dunder": "a dunder name or attribute, refused unless granted",
    "code.iterations": "more loop iterations than the code budget `max_iterations`",
    "code.name": "a name outside the policy's sub-language",
    "code.syntax": "syntax outside the policy's sub-language, or code that does not parse",
    "env": "a host environment variable the policy does not pass",
    "files.hidden": "a hidden name (`files.hide`); it looks absent",
    "files.metadata": "changing a file's mode, owner, times or extended attributes under "
    "the landlock provider, which refuses them (Landlock cannot judge them) but for the "
    "host's os.chmod, os.utime and same-owner os.chown of a path in scratch",
    "files.read": "reading, listing or stat-ing a path outside `files.read`",
    "files.transfer": "a session file put, get or remove refused: a name that is not one "
    "plain component of scratch (`..`, `/`, NUL), a link, not a regular file, an existing "
    "name without `overwrite`, or a file that changed while it was read",
    "files.write": "writing, creating, deleting or renaming outside `files.write`",
    "guard.tampered": "a guard was disarmed, replaced or displaced; the worker is discarded",
    "imports": "an import of a module outside `imports.allow`",
    "limits.cpu": "CPU time above `limits.cpu_seconds`",
    "limits.file-size": "a file larger than `limits.file_size_mb`",
    "limits.memory": "memory above `limits.memory_mb`",
    "limits.net": "a proxy connection past a `net` bound (`net.connections`, "
    "`net.bytes_per_call`, `net.connection_seconds`, the request head's size or time)",
    "limits.open-files": "more open files than `limits.open_files`",
    "limits.output": "more output than `limits.output_bytes`",
    "limits.processes": "more processes than `limits.processes`",
    "limits.result": "a result larger than `limits.result_bytes`",
    "limits.scratch": "the scratch directory filled past `limits.scratch_mb`",
    "limits.timeout": "wall time above `limits.wall_seconds`",
    "limits.transfer": "a session file larger than `limits.transfer_mb`",
    "net.bind": "binding or listening on an address outside `net.rules`",
    "net.connect": "connecting or sending to an address outside `net.rules`",
    "net.resolve": "resolving a host name that no `net.rules` entry names",
    "remote.busy": "a remote session's worker was already in a call (one at a time); "
    "nothing was run and the session is kept (docs/scale-out.md)",
    "result.refused": "a value or exception state the host's restricted unpickler refused "
    "(a type outside `result_types`, an opcode outside its families, or a budget)",
    "tools": "a call to a host tool that `tools.allow` does not list",
    "tools.timeout": "a host tool that did not return within `tools.timeout_seconds`",
    "worker.crashed": "the worker process died during the call; its state is lost",
    "worker.protocol": "the worker sent something malformed, out of order or contradictory; "
    "the host discarded it and its result",
}


def rule_doc(rule: str) -> str:
    """The documentation line of `rule`, or of its family (`api.x` falls back to `api.*`)."""
    if rule in RULES:
        return RULES[rule]
    return RULES.get(rule.split(".", 1)[0], "")


#: How a refusal is classified (see docs/denials.md, "Whose refusal is it?").
USER = "user"
INTERNAL = "internal"
LEARNED = "learned"
#: Where it was recorded: during the call, or by a thread of the code between two calls
#: (attributed to the next call's result), or by the host itself.
DURING_CALL = "call"
BETWEEN_CALLS = "between-calls"


class FrozenValue:
    """A frozen value over its `__slots__`: equality, hash and repr over the fields, no
    assignment or deletion (what `dataclasses.dataclass(frozen=True)` makes, without
    `dataclasses` and the `inspect` it imports, which the worker's start avoids). Shared by
    `Denial` and the code layer's `Violation` and `Rules`; a subclass lists its fields as
    its `__slots__` and sets them with `object.__setattr__`."""

    __slots__ = ()

    def _fields(self) -> tuple[str, ...]:
        return self.__slots__  # type: ignore[return-value]  # (each subclass's own tuple)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._fields())

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(
            f"cannot assign to field {name!r} (a {self.__class__.__name__} is frozen)"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(
            f"cannot delete field {name!r} (a {self.__class__.__name__} is frozen)"
        )

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields())
        return f"{self.__class__.__qualname__}({fields})"


class Denial(FrozenValue):
    """One refusal: which rule, what was attempted on what, under which policy, how to allow it.

    `action` is a verb (`read`, `connect`, `import`, `call`, ...); `target` is what it was
    attempted on (a path, `host:port`, a module, a variable, a function). `hint` is the policy
    fragment that would allow it (a `[[grant]]` element), or a sentence when nothing added to a
    policy can. `learned` marks a would-be denial recorded in learning mode (the operation was
    allowed to proceed). `internal` marks a refusal a library raised and handled itself while
    the user's code went on as if nothing happened (matplotlib probing font folders): it is kept
    for the operator but is not the user's. `count` is how many times this same refusal
    (rule, action, target, classification, origin) happened in the call; `last` is its last
    occurrence in full when there was more than one. `origin` is `call`, or `between-calls`
    for a refusal a thread of the code met between two calls.

    A frozen value (equality, hash, repr and pattern matching over its fields), written
    out rather than made with `dataclasses`: the worker imports it before its handshake,
    and `dataclasses` brings `inspect` (about 4 ms of a worker's start). `replace()` is
    `dataclasses.replace`'s equivalent (and `copy.replace`'s, from Python 3.13).
    """

    __slots__ = _FIELDS = (
        "rule",
        "action",
        "target",
        "policy",
        "hint",
        "detail",
        "learned",
        "internal",
        "count",
        "origin",
        "last",
    )
    __match_args__ = (
        "rule",
        "action",
        "target",
        "policy",
        "hint",
        "detail",
        "learned",
        "internal",
        "count",
        "origin",
        "last",
    )

    rule: str
    action: str
    target: str
    policy: str
    hint: str
    detail: str
    learned: bool
    internal: bool
    count: int
    origin: str
    last: Denial | None

    def __init__(
        self,
        rule: str,
        action: str,
        target: str,
        policy: str = "",
        hint: str = "",
        detail: str = "",
        learned: bool = False,
        internal: bool = False,
        count: int = 1,
        origin: str = DURING_CALL,
        last: Denial | None = None,
    ) -> None:
        init = object.__setattr__
        init(self, "rule", rule)
        init(self, "action", action)
        init(self, "target", target)
        init(self, "policy", policy)
        init(self, "hint", hint)
        init(self, "detail", detail)
        init(self, "learned", learned)
        init(self, "internal", internal)
        init(self, "count", count)
        init(self, "origin", origin)
        init(self, "last", last)

    def __reduce__(self) -> tuple[type[Denial], tuple[Any, ...]]:
        return (self.__class__, self._values())

    def replace(self, **changes: Any) -> Denial:
        """A copy with `changes` (field name -> value); an unknown name is a TypeError."""
        unknown = set(changes) - set(self._FIELDS)
        if unknown:
            raise TypeError(f"Denial has no field {sorted(unknown)[0]!r}")
        values = {name: getattr(self, name) for name in self._FIELDS}
        values.update(changes)
        return self.__class__(**values)

    __replace__ = replace

    @property
    def classification(self) -> str:
        """`user`, `internal` or `learned`."""
        return LEARNED if self.learned else INTERNAL if self.internal else USER

    def key(self) -> tuple[str, str, str, str, str]:
        """What makes two refusals "the same" for counting."""
        return (self.rule, self.action, self.target, self.classification, self.origin)

    def message(self) -> str:
        """The text a model reads: the rule, the target (quoted), the policy, what allows it.

        Every piece of data is quoted and escaped (`_render.quote`); the hint is a fragment
        to add to the policy file, on its own indented lines.
        """
        from agent_sandbox._render import clean, quote

        text = f"[{clean(self.rule, 60)}] {clean(self.action, 40)} {quote(self.target)} refused"
        if self.policy:
            text += f" by policy {quote(self.policy, 120)}"
        if self.detail:
            # A detail may span lines (the code layer lists every violation): each line is
            # escaped, and continuation lines are indented so none reads as our own line.
            lines = self.detail.split("\n")[:50]
            first = clean(lines[0], 1000)
            rest = "".join("\n    " + clean(line.strip(), 1000) for line in lines[1:] if line)
            text += f": {first}{rest}" if rest else f" ({first})"
            multiline = bool(rest)
        else:
            multiline = False
        if self.count > 1:
            text += f" [{self.count} times]"
        lead = "\nTo allow it" if multiline else ". To allow it"
        if self.hint.startswith("[[grant]]"):
            fragment = "\n".join("    " + line for line in self.hint.splitlines())
            text += f"{lead}, add to the policy file:\n" + fragment
        elif self.hint:
            text += f"{lead}: {clean(self.hint)}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict, the form denials take in traces and on the wire."""
        out = {name: getattr(self, name) for name in self._FIELDS if name != "last"}
        out["classification"] = self.classification
        out["last"] = self.last.to_dict() if self.last is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, nested: bool = True) -> Denial:
        """Rebuild from `to_dict()` output; unknown keys are ignored, missing ones defaulted."""
        names = cls._FIELDS
        kwargs = {k: v for k, v in data.items() if k in names and k != "last"}
        kwargs.setdefault("rule", "unknown")
        kwargs.setdefault("action", "")
        kwargs.setdefault("target", "")
        for key in ("rule", "action", "target", "policy", "hint", "detail", "origin"):
            if key in kwargs:
                kwargs[key] = str(kwargs[key])
        for flag in ("learned", "internal"):
            if flag in kwargs:
                kwargs[flag] = bool(kwargs[flag])
        count = kwargs.get("count", 1)
        kwargs["count"] = count if isinstance(count, int) and count >= 1 else 1
        if kwargs.get("origin") not in (DURING_CALL, BETWEEN_CALLS):
            kwargs["origin"] = DURING_CALL
        last = data.get("last")
        if nested and isinstance(last, dict):
            kwargs["last"] = cls.from_dict(last, nested=False)
        return cls(**kwargs)


#: Words in a refused target that make its refusal one the trail always keeps: credentials,
#: keys, secrets, and the places they live (lower-cased substring match).
_SENSITIVE_WORDS = (
    "shadow",
    "passw",
    "secret",
    "token",
    "credential",
    "private",
    "id_rsa",
    "id_ecdsa",
    "id_ed25519",
    ".ssh",
    ".aws",
    ".kube",
    ".gnupg",
    ".netrc",
    ".docker",
    "kubeconfig",
    "api_key",
    "apikey",
    "access_key",
    "/environ",
    "sudoers",
    "authorized_keys",
    "169.254.169.254",
    "fd00:ec2::254",
    "metadata.google",
    "/var/run/secrets",
)
#: Rules whose every refusal is important: the code tried to run a process, leave the
#: sandbox's network, or was stopped by a limit or the guards' own checks.
_SENSITIVE_RULES = ("api.", "net.", "limits.", "guard.", "worker.")


def is_sensitive(rule: str, target: str) -> bool:
    """Whether a refusal is one the refusal trail keeps whatever else was refused.

    The recorder (`_worker/audit.py`) and the host's builder both keep a reserve of entries
    for these beyond the bound on ordinary ones, so a flood of harmless refusals never
    folds them away.
    """
    if rule.startswith(_SENSITIVE_RULES):
        return True
    low = target.lower()
    return any(word in low for word in _SENSITIVE_WORDS)


def fold_detail(rule: str, budget: int, sensitive: bool) -> str:
    """The detail of the entry that counts refusals of `rule` past `budget` distinct ones."""
    kind = "sensitive targets" if sensitive else "targets"
    return (
        f"past the first {budget} distinct {kind} of this rule in one call, further "
        "refusals are counted here (count: how many; last: the latest, in full)"
    )


# -- the egress proxy's refusal, as a client library carries it to the code ---------------

#: The egress proxy sends its refusal (a status line, a `CONNECT` reason phrase) between
#: these, and nothing between them holds a `|`, so the worker finds it exactly in whatever
#: error text a client library builds around it (`refusal_first`).
REFUSAL_START = "|agent-sandbox refusal| "
REFUSAL_END = " |end of refusal|"
#: Characters sent as they are; every other one (and `|`, `%`, the backslash) is percent-encoded.
_PLAIN = frozenset(chr(c) for c in range(0x20, 0x7F)) - set("|%\\")


def refusal_line(message: str, limit: int = 2048) -> str:
    """A refusal's message as the proxy sends it to a client: one line of printable ASCII
    between `REFUSAL_START` and `REFUSAL_END`, at most `limit` characters in all.

    Inside, whitespace runs are one space and `|`, `%`, the backslash and everything
    outside printable ASCII are percent-encoded (UTF-8). A client that quotes the line with
    `repr` (requests, httpx, aiohttp do, even twice) can only add backslashes (before a
    quote, before a backslash), so removing every backslash between the markers gives the
    line back exactly.
    """
    out: list[str] = []
    room = max(0, limit - len(REFUSAL_START) - len(REFUSAL_END))
    for char in " ".join(message.split()):
        piece = char if char in _PLAIN else "".join(f"%{b:02X}" for b in char.encode())
        room -= len(piece)
        if room < 0:
            break
        out.append(piece)
    return REFUSAL_START + "".join(out) + REFUSAL_END


def _unquote(text: str) -> str:
    data = bytearray()
    i = 0
    while i < len(text):
        if text[i] == "%" and i + 3 <= len(text):
            try:
                data.append(int(text[i + 1 : i + 3], 16))
                i += 3
                continue
            except ValueError:
                pass
        data += text[i].encode("ascii", "replace")
        i += 1
    return data.decode("utf-8", "replace")


def refusal_first(text: str, *, keep_marked: bool = False) -> str | None:
    """`text` (a client library's error message) with the proxy's refusal it carries put
    first: the refusal (rule, target, reason, hint), then the library's own words with
    `<the refusal above>` where the refusal was (each exact copy of it too); None when it
    carries none (its markers, `refusal_line`). What is left carries no marker, so a second
    pass changes nothing.

    `keep_marked` leaves the marked refusal in the library's words: for an exception whose
    text is rewritten in place (http.client's bare `OSError`), which another library may
    quote in its own error (urllib's `URLError`), where it is found and put first again.
    """
    start = text.find(REFUSAL_START)
    if start < 0:
        return None
    end = text.find(REFUSAL_END, start + len(REFUSAL_START))
    if end < 0:
        return None
    refusal = _unquote(text[start + len(REFUSAL_START) : end].replace("\\", ""))
    if keep_marked:
        return f"{refusal}\n(the client's error: {text})"
    words = text[:start] + "<the refusal above>" + text[end + len(REFUSAL_END) :]
    words = words.replace(refusal, "<the refusal above>")
    return f"{refusal}\n(the client's error: {words})"
