"""From learned records to a proposal: `propose()`, step 2 of learning mode.

Only records marked `learned` count (see `agent_sandbox._tools.learn` for the whole flow).
Paths are judged in `paths`, hosts and ports in `net`; imports, environment variables and
sensitive-call categories are judged here. Everything a record says is the run's word: a
record becomes a proposed entry, a RISKY one, or a FLAGGED observation with the reason, by
the tables of `findings`, never by what the run claims about itself.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent_sandbox._denial import Denial
from agent_sandbox._errors import LearningError, PolicyError
from agent_sandbox._host.result import RunResult
from agent_sandbox._tools.learn.findings import (
    _CATEGORY_RISK,
    _ENV_NAME_RE,
    _FUNCTION_RE,
    _LOADER_ENV,
    _MODULE_RE,
    _NET_MODULES,
    _NEVER_PROPOSED_CATEGORIES,
    _NOT_LEARNABLE,
    _RISKY_MODULES,
    _SECRET_ENV,
    Finding,
    _Context,
    _source_path,
)
from agent_sandbox._tools.learn.net import _learn_net
from agent_sandbox._tools.learn.paths import _learn_paths, _lexical, _with_requested
from agent_sandbox._tools.learn.review import Proposal
from agent_sandbox.policies import Policy

__all__ = ["propose"]


def _default_control_patterns() -> tuple[str, ...]:
    tmp = os.path.realpath(tempfile.gettempdir())
    return (os.path.join(tmp, "agent-sandbox-*"),)


def _default_import_roots() -> tuple[str, ...]:
    roots: dict[str, None] = {}
    paths = sysconfig.get_paths()
    for entry in (*sys.path, paths["stdlib"], paths["purelib"], paths["platlib"]):
        if entry and os.path.isabs(entry):
            roots.setdefault(os.path.realpath(entry), None)
    # The import root of agent_sandbox itself (this file is agent_sandbox/_tools/learn/).
    package = os.path.dirname(os.path.realpath(__file__))
    roots.setdefault(str(Path(package).parents[2]), None)
    return tuple(roots)


def _records(items: Iterable[Denial | RunResult]) -> list[Denial]:
    out: list[Denial] = []
    for item in items:
        if isinstance(item, RunResult):
            out.extend(item.denials)
        elif isinstance(item, Denial):
            out.append(item)
        else:
            raise TypeError(f"expected Denial or RunResult records, got {type(item).__name__}")
    return out


def propose(
    current: Policy,
    records: Iterable[Denial | RunResult],
    *,
    policy_path: str | os.PathLike[str] | None = None,
    scratch_roots: Iterable[str] = (),
    home: str | None = None,
) -> Proposal:
    """The proposal for `current` from learning-mode records (denials or whole results).

    `policy_path` is the policy file (defaults to `current.source`); it and its proposal
    files are never proposed. `scratch_roots` adds directories that were the worker's
    scratch (the usual `<tmp>/agent-sandbox-*` control directories are always known).
    `home` overrides the user's home directory. The result depends only on the set of
    records, not on their order, so re-learning the same run gives the same proposal.
    """
    path = os.fspath(policy_path) if policy_path is not None else _source_path(current)
    policy_paths: tuple[str, ...] = ()
    if path:
        real = os.path.realpath(path)
        stem = real[:-5] if real.endswith(".toml") else real
        policy_paths = tuple(
            dict.fromkeys(
                (os.path.abspath(path), real, f"{stem}.proposed.toml", f"{stem}.proposed.diff")
            )
        )
    ctx = _Context(
        current=current,
        home=os.path.realpath(home or os.path.expanduser("~")),
        policy_paths=policy_paths,
        scratch_roots=tuple(os.path.realpath(s) for s in scratch_roots),
        control_patterns=_default_control_patterns(),
        import_roots=_default_import_roots(),
    )
    denials = _records(records)
    unique = sorted({(d.rule, d.action, d.target, d.detail, d.learned) for d in denials})
    findings: list[Finding] = []
    by_rule: dict[str, list[tuple[str, str, str]]] = {}
    for rule, action, target, detail, learned in unique:
        if rule == "guard.tampered":
            findings.append(
                Finding(
                    "guards",
                    target or "guard",
                    "flagged",
                    "the run disarmed or replaced a guard: its records are "
                    "incomplete and the code is hostile or broken",
                    rule,
                )
            )
            continue
        if not learned:
            findings.append(
                Finding(
                    _field_for(rule),
                    target,
                    "flagged",
                    "refused, not observed in learning mode",
                    rule,
                )
            )
            continue
        if rule.startswith(_NOT_LEARNABLE):
            findings.append(
                Finding(
                    _field_for(rule),
                    target,
                    "flagged",
                    "limits and the code layer are not learned; change them by hand",
                    rule,
                )
            )
            continue
        by_rule.setdefault(rule, []).append((action, target, detail))

    writes = sorted({t for _, t, _ in by_rule.get("files.write", [])})
    ctx.run_written = tuple(_lexical(t) for t in writes if t.startswith("/"))
    updates: dict[str, Any] = {}
    read_new, f1 = _learn_paths(ctx, "files.read", _with_requested(by_rule.pop("files.read", [])))
    write_new, f2 = _learn_paths(
        ctx, "files.write", _with_requested(by_rule.pop("files.write", []))
    )
    findings += f1 + f2
    for _, target, _ in by_rule.pop("files.hidden", []):
        findings.append(
            Finding("files.hide", target, "flagged", "a hidden name stays hidden", "files.hidden")
        )
    net_rules, f3 = _learn_net(
        ctx,
        by_rule.pop("net.connect", []),
        by_rule.pop("net.bind", []),
        by_rule.pop("net.resolve", []),
    )
    findings += f3
    net_on = current.net.allows_any() or bool(net_rules)
    imports_new, f4 = _learn_imports(
        ctx, sorted({t for _, t, _ in by_rule.pop("imports", [])}), net_on
    )
    findings += f4
    env_new, f5 = _learn_env(ctx, sorted({t for _, t, _ in by_rule.pop("env", [])}))
    findings += f5
    api_new: list[str] = []
    for rule in sorted(r for r in by_rule if r.startswith("api.")):
        new, found = _learn_api(ctx, rule, sorted({t for _, t, _ in by_rule.pop(rule)}))
        api_new += new
        findings += found
    for rule, items in sorted(by_rule.items()):
        for _, target, _ in sorted(items):
            findings.append(
                Finding(_field_for(rule), target, "flagged", f"no learning rule for {rule!r}", rule)
            )

    if read_new:
        updates.setdefault("files", {})["read"] = [*current.files.read, *read_new]
    if write_new:
        updates.setdefault("files", {})["write"] = [*current.files.write, *write_new]
    if net_rules:
        updates["net"] = {
            "rules": [r.model_dump(mode="json") for r in current.net.rules]
            + [r.model_dump(mode="json") for r in net_rules]
        }
    if imports_new:
        updates["imports"] = {"allow": [*current.imports.allow, *imports_new]}
    if env_new:
        updates["env"] = {"pass": [*current.env.passthrough, *env_new]}
    if api_new:
        updates["api"] = {"allow": [*current.api.allow, *sorted(set(api_new))]}
    updates["mode"] = "enforce"
    try:
        proposed = current.merged(updates)
    except PolicyError as exc:
        raise LearningError(f"the proposed policy does not validate: {exc}") from exc
    order = {"risky": 0, "flagged": 1, "proposed": 2}
    findings = list(dict.fromkeys(findings))
    findings.sort(key=lambda f: (order[f.status], f.field, f.value))
    return Proposal(
        current=current,
        proposed=proposed.model_copy(update={"source": None}),
        findings=tuple(findings),
        records=len(unique),
    )


def _field_for(rule: str) -> str:
    return {
        "files.read": "files.read",
        "files.write": "files.write",
        "net.connect": "net.rules",
        "net.bind": "net.rules",
        "net.resolve": "net.rules",
        "imports": "imports.allow",
        "env": "env.pass",
    }.get(rule, "api.allow" if rule.startswith("api.") else rule)


# -- imports, environment, calls --------------------------------------------------------


def _module_covered(entries: Iterable[str], module: str) -> bool:
    for entry in entries:
        entry = entry.removesuffix(".*")
        if entry == "*" or module == entry or module.startswith(entry + "."):
            return True
    return False


def _learn_imports(
    ctx: _Context, modules: list[str], net_on: bool
) -> tuple[list[str], list[Finding]]:
    findings: list[Finding] = []
    candidates: list[str] = []
    for module in modules:
        if not _MODULE_RE.match(module):
            findings.append(
                Finding("imports.allow", module, "flagged", "not a module name", "imports")
            )
            continue
        if _module_covered(ctx.current.imports.deny, module):
            findings.append(
                Finding(
                    "imports.allow", module, "flagged", "the policy denies it explicitly", "imports"
                )
            )
            continue
        if _module_covered(ctx.current.imports.allow, module):
            continue
        candidates.append(module)
    chosen = [m for m in candidates if not _module_covered([c for c in candidates if c != m], m)]
    for module in chosen:
        covered = tuple(c for c in candidates if _module_covered([module], c))
        reason = ""
        for name in (module, *covered):
            top = name.split(".", 1)[0]
            reason = _RISKY_MODULES.get(name) or _RISKY_MODULES.get(top, "")
            if not reason and not net_on and _module_covered(_NET_MODULES, name):
                reason = "network access, and the policy has no network"
            if reason:
                break
        findings.append(
            Finding(
                "imports.allow",
                module,
                "risky" if reason else "proposed",
                reason,
                "imports",
                covered,
            )
        )
    return chosen, findings


def _learn_env(ctx: _Context, names: list[str]) -> tuple[list[str], list[Finding]]:
    findings: list[Finding] = []
    chosen: list[str] = []
    for name in names:
        if not _ENV_NAME_RE.match(name):
            findings.append(Finding("env.pass", name, "flagged", "not a variable name", "env"))
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in ctx.current.env.passthrough):
            continue
        if _LOADER_ENV.match(name):
            findings.append(
                Finding(
                    "env.pass",
                    name,
                    "flagged",
                    "changes how the worker's interpreter or loader starts",
                    "env",
                )
            )
            continue
        chosen.append(name)
        if _SECRET_ENV.search(name):
            findings.append(
                Finding(
                    "env.pass",
                    name,
                    "risky",
                    "looks like a secret: the tool's code would read its value",
                    "env",
                    (name,),
                )
            )
        else:
            findings.append(Finding("env.pass", name, "proposed", "", "env", (name,)))
    return chosen, findings


def _learn_api(ctx: _Context, rule: str, targets: list[str]) -> tuple[list[str], list[Finding]]:
    category = rule.split(".", 1)[1]
    findings: list[Finding] = []
    chosen: list[str] = []
    for function in targets:
        if not _FUNCTION_RE.match(function):
            findings.append(
                Finding("api.allow", function, "flagged", "not a dotted function name", rule)
            )
            continue
        if function in ctx.current.api.deny or category in ctx.current.api.deny:
            findings.append(
                Finding("api.allow", function, "flagged", "the policy denies it explicitly", rule)
            )
            continue
        if function in ctx.current.api.allow or category in ctx.current.api.allow:
            continue
        if category in _NEVER_PROPOSED_CATEGORIES:
            findings.append(
                Finding(
                    "api.allow",
                    function,
                    "flagged",
                    f"{category}: granting it opens the Python layer wide",
                    rule,
                )
            )
            continue
        chosen.append(function)
        findings.append(
            Finding(
                "api.allow",
                function,
                "risky",
                _CATEGORY_RISK.get(category, f"a sensitive call ({category})"),
                rule,
                (function,),
            )
        )
    return chosen, findings
