"""The Denial value and the catalogue of rule names.

A denial is data before it is an exception. Its `rule` is a stable dotted name that a
person can grep for in a policy and in this file; `RULES` below is the one place where
every rule is documented. Tests check that every rule the code emits is listed here.

Standard library only: the worker imports this before arming.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "Denial",
    "RULES",
    "rule_doc",
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
    "files.read": "reading, listing or stat-ing a path outside `files.read`",
    "files.write": "writing, creating, deleting or renaming outside `files.write`",
    "guard.tampered": "a guard was disarmed, replaced or displaced; the worker is discarded",
    "imports": "an import of a module outside `imports.allow`",
    "limits.cpu": "CPU time above `limits.cpu_seconds`",
    "limits.file-size": "a file larger than `limits.file_size_mb`",
    "limits.memory": "memory above `limits.memory_mb`",
    "limits.open-files": "more open files than `limits.open_files`",
    "limits.output": "more output than `limits.output_bytes`",
    "limits.processes": "more processes than `limits.processes`",
    "limits.result": "a result larger than `limits.result_bytes`",
    "limits.scratch": "the scratch directory filled past `limits.scratch_mb`",
    "limits.timeout": "wall time above `limits.wall_seconds`",
    "net.bind": "binding or listening on an address outside `net.rules`",
    "net.connect": "connecting or sending to an address outside `net.rules`",
    "net.resolve": "resolving a host name that no `net.rules` entry names",
    "result.refused": "a value or exception state the host's restricted unpickler refused "
    "(a type outside `result_types`, an opcode outside its families, or a budget)",
    "worker.crashed": "the worker process died during the call; its state is lost",
    "worker.protocol": "the worker sent something malformed, out of order or contradictory; "
    "the host discarded it and its result",
}


def rule_doc(rule: str) -> str:
    """The documentation line of `rule`, or of its family (`api.x` falls back to `api.*`)."""
    if rule in RULES:
        return RULES[rule]
    return RULES.get(rule.split(".", 1)[0], "")


@dataclasses.dataclass(frozen=True)
class Denial:
    """One refusal: which rule, what was attempted on what, under which policy, how to allow it.

    `action` is a verb (`read`, `connect`, `import`, `call`, ...); `target` is what it was
    attempted on (a path, `host:port`, a module, a variable, a function). `hint` is the exact
    policy line that would allow it, when there is one. `learned` marks a would-be denial
    recorded in learning mode (the operation was allowed to proceed). `internal` marks a
    refusal raised inside library code and handled there (matplotlib probing font folders):
    the user's code never saw it, so it is kept for the operator but does not fail the call.
    """

    rule: str
    action: str
    target: str
    policy: str = ""
    hint: str = ""
    detail: str = ""
    learned: bool = False
    internal: bool = False

    def message(self) -> str:
        """The text a model reads: the rule, the target, the policy and what would allow it."""
        text = f"[{self.rule}] {self.action} {self.target!r} refused"
        if self.policy:
            text += f" by policy {self.policy!r}"
        if self.detail:
            text += f": {self.detail}"
        if self.hint:
            text += f". To allow it, add to the policy: {self.hint}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict, the form denials take in traces and on the wire."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Denial:
        """Rebuild from `to_dict()` output; unknown keys are ignored, missing ones defaulted."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs.setdefault("rule", "unknown")
        kwargs.setdefault("action", "")
        kwargs.setdefault("target", "")
        for key in ("rule", "action", "target", "policy", "hint", "detail"):
            if key in kwargs:
                kwargs[key] = str(kwargs[key])
        for flag in ("learned", "internal"):
            if flag in kwargs:
                kwargs[flag] = bool(kwargs[flag])
        return cls(**kwargs)
