"""A readable, section-by-section summary of what a policy allows."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent_sandbox.policies._paths import visible

if TYPE_CHECKING:
    from agent_sandbox.policies._model import Policy

__all__ = ["explain_policy"]


def _items(values: tuple[str, ...] | list[str], empty: str) -> str:
    # Control and invisible characters in a name are shown as escapes (see `_paths.visible`).
    return ", ".join(visible(v) for v in values) if values else empty


def explain_policy(policy: Policy) -> str:
    """Summarise `policy` for a person reviewing it (also used by `policy explain`)."""
    lines = [f"policy {policy.name!r} (fingerprint {policy.fingerprint()})"]
    if policy.source:
        lines.append(f"  loaded from: {policy.source}")
    if policy.description:
        lines.append(f"  {policy.description.strip()}")
    lines.append(
        f"  provider: {policy.provider}; result mode: {policy.result_mode}; mode: {policy.mode}"
    )
    f = policy.files
    lines.append("files:")
    read = tuple(e for e in f.read if e != "$SCRATCH")
    write = tuple(e for e in f.write if e != "$SCRATCH")
    lines.append(f"  read:  $SCRATCH, {_items(read, '(nothing else)')}")
    lines.append(f"  write: $SCRATCH, {_items(write, '(nothing else)')}")
    if f.deny:
        lines.append(f"  deny:  {_items(f.deny, '')}")
    lines.append(f"  hidden (look absent): {_items(f.hide, '(none)')}")
    lines.append("network:")
    if not policy.net.rules:
        lines.append("  off (no rule allows any address)")
    for rule in policy.net.rules:
        lines.append(
            f"  {rule.action:5} {rule.protocol} {rule.direction} {rule.host} ports {rule.ports}"
        )
    lines.append("imports:")
    lines.append(f"  allow: {_items(policy.imports.allow, '(standard library basics only)')}")
    if policy.imports.deny:
        lines.append(f"  deny:  {_items(policy.imports.deny, '')}")
    env = policy.env
    lines.append("environment:")
    lines.append(f"  passed from host: {_items(env.passthrough, '(none)')}")
    if env.set:
        lines.append("  set: " + ", ".join(f"{k}={v}" for k, v in sorted(env.set.items())))
    lines.append("sensitive calls:")
    lines.append(f"  granted: {_items(policy.api.allow, '(none)')}")
    if policy.api.deny:
        lines.append(f"  denied:  {_items(policy.api.deny, '')}")
    code = policy.code
    lines.append("code sub-language:")
    if not code.enabled:
        lines.append("  not checked")
    else:
        lines.append(f"  syntax: {_items(code.syntax, '(none)')}")
        lines.append(f"  dunders granted: {_items(code.dunders, '(none)')}")
        b = code.budgets
        lines.append(
            f"  budgets: {b.max_iterations} loop iterations, call depth {b.max_call_depth}, "
            f"allocations up to {b.max_allocation} bytes"
        )
    lim = policy.limits
    lines.append("limits:")
    lines.append(
        f"  wall {lim.wall_seconds:g} s, CPU {lim.cpu_seconds} s, memory {lim.memory_mb} MB, "
        f"{lim.processes} processes, output {lim.output_bytes} bytes, "
        f"result {lim.result_bytes} bytes, files up to {lim.file_size_mb} MB, "
        f"{lim.open_files} open files"
    )
    return "\n".join(lines)
