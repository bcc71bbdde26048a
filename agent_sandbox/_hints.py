"""Hints: the policy fragment that allows exactly one refused thing, and nothing else.

A hint is a `[[grant]]` element (see docs/policies.md, "Adding to what a policy extends"):
pasted anywhere in the user's own policy file, any number of times, it adds its items to the
lists the policy inherits from its `extends` chain, so `import math` keeps working after the
`requests` hint is pasted into a policy that extends `data-analysis`.

* The guards in the worker build their hints with `grant_hint()` (so the text of an exception
  the user's code sees is the same fragment).
* The host never shows a worker's hint as it came: `host_hint()` re-derives it from the rule,
  the target and the host's own policy, reading the worker's hint only for the parameters it
  cannot know (the port of a refused name lookup, the protocol of a refused connect) and only
  when they are well formed. A worker cannot make the model read an instruction of its own.

Where no added line can allow a refusal (a `deny` entry or a hidden name beats every grant),
the hint is a sentence from `DENY_BEATS_GRANT`, not a fragment.

Standard library only: the worker imports it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from agent_sandbox._render import toml_fragment

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "DENY_BEATS_GRANT",
    "HIDDEN",
    "METADATA_REFUSED",
    "NO_SYNTAX_RULE",
    "glob_escape",
    "grant_hint",
    "host_hint",
    "memory_hint",
    "parse_grant",
]

DENY_BEATS_GRANT = (
    "no line added to a policy can allow this: a deny entry covers it and deny beats every "
    "grant; remove that entry from the policy file that lists it"
)
HIDDEN = (
    "no line added to a policy can allow this: the name is listed in [files] hide; remove it "
    "from the hide list of the policy file that lists it"
)
NO_SYNTAX_RULE = (
    "no line added to a policy can allow this: the code checker has no rule for this syntax "
    "(a construct newer than the checker); write it with other syntax"
)
METADATA_REFUSED = (
    "no line added to a policy can allow this under the landlock provider: its seccomp "
    "filter refuses every change of a file's mode, owner, times or extended attributes (a "
    "system call's path is not visible to seccomp, and Landlock has no right for metadata); "
    "in scratch the host makes os.chmod (permission bits), os.utime and a same-owner "
    "os.chown of a path for the code, nothing else; change the file in scratch, copy "
    'contents only (shutil.copyfile), or set provider = "bwrap" or "unshare", whose '
    "write grants allow it"
)
_GLOB = re.compile(r"([*?\[])")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_HOST = re.compile(r"^[A-Za-z0-9_.:%-]{1,253}$")
_MAX_HINT = 4096
_LIMIT_KEYS = {
    "limits.cpu": "cpu_seconds",
    "limits.memory": "memory_mb",
    "limits.processes": "processes",
    "limits.output": "output_bytes",
    "limits.result": "result_bytes",
    "limits.file-size": "file_size_mb",
    "limits.open-files": "open_files",
    "limits.timeout": "wall_seconds",
}
_BUDGET_KEYS = {
    "code.iterations": ("max_iterations", None),
    "code.call-depth": ("max_call_depth", 10_000),
    "code.allocation": ("max_allocation", None),
}


def glob_escape(path: str) -> str:
    """`name` as an `env.pass` pattern (fnmatch) matching exactly it (glob characters
    bracketed). File paths use the policy path language's escapes (`policies/_paths.py`)."""
    return _GLOB.sub(r"[\1]", path)


def grant_hint(grant: Mapping[str, Any]) -> str:
    """The fragment for `grant` (dotted key -> value), as the guards put it in a denial."""
    return toml_fragment(grant)


def parse_grant(hint: str) -> dict[str, Any] | None:
    """The dotted keys of a one-element `[[grant]]` fragment, or None if it is not one."""
    if not hint or len(hint) > _MAX_HINT or not hint.lstrip().startswith("[[grant]]"):
        return None
    import tomllib

    try:
        data = tomllib.loads(hint)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        return None
    grants = data.get("grant")
    if set(data) != {"grant"} or not isinstance(grants, list) or len(grants) != 1:
        return None
    out: dict[str, Any] = {}

    def walk(prefix: str, table: Mapping[str, Any]) -> None:
        for key, value in table.items():
            dotted = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict) and prefix.count(".") < 2:
                walk(dotted, value)
            else:
                out[dotted] = value

    walk("", grants[0])
    return out


def _split_address(target: str) -> tuple[str, str] | None:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not _HOST.match(host) or int(port) > 65535:
        return None
    return host, port


def _int_from(worker: Mapping[str, Any] | None, key: str) -> int | None:
    value = (worker or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def host_hint(
    rule: str,
    target: str,
    worker_hint: str,
    policy: Mapping[str, Any],
    *,
    timeout: float | None = None,
) -> str:
    """The hint the host shows for a denial reported by a worker (see the module docstring).

    `policy` is the policy's wire form (`Policy.to_wire()`), `timeout` the effective wall
    time of the call when the refusal is `limits.timeout`. Returns "" when nothing allows it.
    """
    if worker_hint.startswith("remove"):
        return HIDDEN if rule == "files.hidden" else DENY_BEATS_GRANT
    if rule == "files.hidden":
        return HIDDEN
    if rule == "files.metadata":
        return METADATA_REFUSED
    worker = parse_grant(worker_hint)
    if rule == "imports":
        top = target.split(".", 1)[0]
        return grant_hint({"imports.allow": [top]}) if _MODULE.match(top) else ""
    if rule == "env":
        return grant_hint({"env.pass": [glob_escape(target)]}) if target else ""
    if rule.startswith("api."):
        return grant_hint({"api.allow": [target]}) if _DOTTED.match(target) else ""
    if rule in ("files.read", "files.write"):
        if not target.startswith("/") or not worker_hint:
            return ""
        from agent_sandbox.policies._paths import literal

        return grant_hint({rule: [literal(target)]})
    if rule in ("net.connect", "net.bind"):
        address = _split_address(target)
        if address is None:
            return ""
        entry: dict[str, Any] = {"host": address[0], "ports": address[1]}
        proto = _worker_rule_field(worker, "protocol")
        if proto in ("udp", "any"):
            entry["protocol"] = proto
        if rule == "net.bind":
            entry["direction"] = "bind"
        return grant_hint({"net.rules": [entry]})
    if rule == "net.resolve":
        if not _HOST.match(target):
            return ""
        port = _worker_rule_field(worker, "ports")
        ports = port if isinstance(port, str) and port.isdigit() and int(port) < 65536 else "443"
        return grant_hint({"net.rules": [{"host": target, "ports": ports}]})
    if rule in ("code.dunder", "code.attribute", "code.name"):
        if not worker_hint or not _MODULE.match(target):
            return ""
        key = {"code.dunder": "dunders", "code.attribute": "attributes", "code.name": "names"}
        return grant_hint({f"code.{key[rule]}": [target]})
    if rule == "code.syntax":
        return _syntax_hint(worker, policy)
    if rule in _BUDGET_KEYS:
        name, cap = _BUDGET_KEYS[rule]
        current = int(((policy.get("code") or {}).get("budgets") or {}).get(name, 0) or 0)
        asked = _int_from(worker, f"code.budgets.{name}")
        value = asked if asked is not None and asked > current else max(current * 10, 1)
        if cap is not None:
            value = min(value, cap)
        return grant_hint({f"code.budgets.{name}": value}) if value > current else ""
    if rule == "tools":
        return grant_hint({"tools.allow": [target]}) if target.isidentifier() else ""
    if rule == "tools.timeout":
        seconds = float(((policy.get("tools") or {}).get("timeout_seconds")) or 30) * 2
        shown = int(seconds) if seconds == int(seconds) else seconds
        return grant_hint({"tools.timeout_seconds": shown})
    if rule in _LIMIT_KEYS:
        return limit_hint(rule, policy, timeout=timeout)
    return ""


def limit_hint(rule: str, policy: Mapping[str, Any], *, timeout: float | None = None) -> str:
    """A fragment raising the limit behind `rule` (twice the value that applied)."""
    key = _LIMIT_KEYS.get(rule)
    if key is None:
        return ""
    limits = policy.get("limits") or {}
    if key == "wall_seconds":
        current = timeout if timeout is not None else float(limits.get(key, 30))
        value: float = max(current * 2, 1)
        return grant_hint({"limits.wall_seconds": int(value) if value == int(value) else value})
    factor = 4 if key == "output_bytes" else 2
    return grant_hint({f"limits.{key}": int(limits.get(key, 1)) * factor})


_MIB = 1 << 20
#: The step a measured memory hint is rounded up to, and the headroom it adds (a quarter).
MEMORY_STEP_MB = 64


def memory_hint(
    limit_mb: int,
    *,
    measured_peak: int | None = None,
    worker_peak: int | None = None,
    asked: int | None = None,
) -> tuple[str, str]:
    """(hint, why) for a call stopped at `limits.memory_mb = limit_mb`.

    `measured_peak` is the worker's peak the host read itself (its memory cgroup's
    `memory.peak` or `memory.max_usage_in_bytes`), `worker_peak` the peak resident size the
    worker reported (`ru_maxrss`, its word) and `asked` the size of the allocation that
    failed when the worker could name it (numpy says it); all in bytes, None when unknown.

    With `asked` known the need is measured: what the worker held plus what it asked for,
    a quarter more for headroom, rounded up to 64 MiB. Without it the need cannot be known
    (a call is stopped at its first allocation past the limit, so its peak is at most the
    limit, whatever it would have used): the hint doubles the limit and `why` says it is a
    guess, with the peak that was measured and by whom.
    """
    said = []
    if measured_peak is not None:
        said.append(
            f"its memory cgroup peaked at {-(-measured_peak // _MIB)} MiB (measured by the "
            "host; pages shared with the worker's template are not counted there)"
        )
    if worker_peak is not None:
        said.append(
            f"its resident peak was {-(-worker_peak // _MIB)} MiB (the worker's ru_maxrss, "
            "unverified)"
        )
    held = "; ".join(said)
    peak = max((p for p in (measured_peak, worker_peak) if p is not None), default=None)
    if asked is not None and asked > 0:
        need = (peak or 0) + asked
        step = MEMORY_STEP_MB * _MIB
        value = max(-(-(need + need // 4) // step) * MEMORY_STEP_MB, limit_mb + MEMORY_STEP_MB)
        why = (
            f"the allocation that failed asked for {-(-asked // _MIB)} MiB (numpy's report, "
            f"the worker's word)" + (f"; {held}" if held else "") + f"; the hint proposes "
            f"{'it and the larger peak' if held else 'that'} with a quarter more for "
            f"headroom, rounded up to {MEMORY_STEP_MB} MiB"
        )
        return grant_hint({"limits.memory_mb": value}), why
    why = (
        (held + "; " if held else "the worker's peak could not be measured; ")
        + "how much the call needed cannot be known (it was stopped at its first "
        f"allocation past the limit), so the hint doubles `memory_mb = {limit_mb}`: a guess"
    )
    return grant_hint({"limits.memory_mb": max(limit_mb * 2, 1)}), why


def _worker_rule_field(worker: Mapping[str, Any] | None, field: str) -> Any:
    rules = (worker or {}).get("net.rules")
    if isinstance(rules, list) and len(rules) == 1 and isinstance(rules[0], dict):
        return rules[0].get(field)
    return None


def _syntax_hint(worker: Mapping[str, Any] | None, policy: Mapping[str, Any]) -> str:
    """The grant of the one syntax group the worker named, if it is a real group the policy
    lacks; the checker's sentence when the worker named none (a node it has no rule for)."""
    if not worker:
        return NO_SYNTAX_RULE
    groups = worker.get("code.syntax")
    if not (isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], str)):
        return ""
    from agent_sandbox.guards._code_check import SYNTAX_GROUPS

    group = groups[0]
    listed = (policy.get("code") or {}).get("syntax")
    if group not in SYNTAX_GROUPS or (isinstance(listed, list | tuple) and group in listed):
        return ""
    return grant_hint({"code.syntax": [group]})
