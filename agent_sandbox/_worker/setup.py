"""Preparing the worker before it serves: limits, kernel restrictions, guards, code layer.

The order is fixed, and each step runs while the worker still has a single thread:

1. Stamp the policy name on denials.
2. Apply the policy's rlimits (both soft and hard, so user code cannot raise them).
3. Hand the egress proxy's listener to the host (namespace providers with network rules),
   then apply the provider's in-worker restrictions (`worker_setup` of the launch plan).
4. Build the runner (the session namespace).
5. Install the code-layer check and the Python guards; from here on, user code runs armed.

`prepare()` returns the runner, the checks reported in the handshake, and the hooks the
server calls (`tamper_check` after every call).
"""

from __future__ import annotations

import resource

from agent_sandbox._worker import audit
from agent_sandbox._worker.run import Runner

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["apply_rlimits", "import_ahead", "prepare", "rlimits_for"]

_MB = 1024 * 1024


def rlimits_for(limits: dict[str, Any]) -> dict[int, int]:
    """The rlimits (resource id -> value) a policy's `limits` section asks for."""
    cpu = int(limits.get("cpu_seconds", 60))
    return {
        resource.RLIMIT_CPU: cpu,
        resource.RLIMIT_AS: int(limits.get("memory_mb", 2048)) * _MB,
        resource.RLIMIT_FSIZE: int(limits.get("file_size_mb", 256)) * _MB,
        resource.RLIMIT_NOFILE: int(limits.get("open_files", 256)),
        resource.RLIMIT_CORE: 0,
    }


def apply_rlimits(limits: dict[str, Any]) -> dict[str, int]:
    """Lower each rlimit to the policy's value (never raise one); return what was applied."""
    applied = {}
    for res, value in rlimits_for(limits).items():
        _soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        if res == resource.RLIMIT_CPU:
            # SIGXCPU at the soft limit, SIGKILL one second later at the hard limit.
            resource.setrlimit(res, (value, value + 1 if hard == resource.RLIM_INFINITY else hard))
        else:
            resource.setrlimit(res, (value, value))
        applied[_RLIMIT_NAMES.get(res, str(res))] = value
    return applied


_RLIMIT_NAMES = {
    resource.RLIMIT_CPU: "cpu",
    resource.RLIMIT_AS: "as",
    resource.RLIMIT_FSIZE: "fsize",
    resource.RLIMIT_NOFILE: "nofile",
    resource.RLIMIT_CORE: "core",
}


def import_ahead(boot: dict[str, Any]) -> None:
    """Import the modules `prepare(boot)` will use, without applying anything."""
    setup = boot.get("worker_setup") or {}
    if setup:
        import agent_sandbox._worker._inworker
    if setup.get("landlock"):
        import agent_sandbox._landlock_sys
    if (boot["policy"].get("code") or {}).get("enabled", True):
        import agent_sandbox.guards._code_budget
    import agent_sandbox.guards._install
    import agent_sandbox.guards._state  # noqa: F401


def prepare(boot: dict[str, Any]) -> tuple[Runner, dict[str, Any], dict[str, Any]]:
    """Run the set-up steps above; see the module docstring for the order."""
    policy: dict[str, Any] = boot["policy"]
    audit.set_policy_name(str(policy.get("name", "")))
    checks: dict[str, Any] = {"rlimits": apply_rlimits(policy.get("limits", {}))}
    setup = boot.get("worker_setup") or {}
    if setup.get("egress") and int(setup["egress"].get("fd", -1)) >= 0:
        # 3a. The egress proxy's listener goes to the host before any restriction applies
        #     (a VM's worker has none: its guest agent forwards the proxy address).
        from agent_sandbox._worker._inworker import open_egress_listener

        checks["egress"] = open_egress_listener(setup["egress"])
    if setup.get("egress_relay"):
        # 3b. gVisor: the proxy address on the sandbox's loopback, relayed by a child forked
        #     now (single-threaded, before any restriction) to the host's end of the route.
        from agent_sandbox._worker._inworker import start_egress_relay

        checks["egress"] = start_egress_relay(setup["egress_relay"])
    if setup:
        from agent_sandbox._worker._inworker import apply_worker_setup

        checks.update(apply_worker_setup(setup))
    runner = Runner(policy, boot["scratch"])
    hooks: dict[str, Any] = {}
    # 5a. The code layer: `runner.code_check(code, tree)` raises CodeRejected before a call runs
    #     (a cell accepted before is reused only when the check depends on its text alone).
    code_policy = policy.get("code") or {}
    if code_policy.get("enabled", True):
        from agent_sandbox.guards._code_budget import make_code_check

        check = make_code_check(code_policy, runner.namespace, runner.policy_name)
        runner.code_check = check
        runner.code_start = check.start
        runner.reuse_compiled = check.pure
    # 5b. The guards: `runner.run_armed(...)` arms them around each call; `hooks["tamper_check"]()`
    #     returns the reasons the guards are no longer intact (each becomes `guard.tampered`).
    from agent_sandbox.guards._install import install_guards, seal, summary

    guards = install_guards(boot, runner.namespace)
    seal()
    runner.run_armed = guards.run_armed
    hooks["tamper_check"] = guards.tamper_check
    # 5c. The tamper check's one-time work (grouping the patches by owner) is done now, while
    #     the worker waits to be handed out, not in its first call.
    guards.prime()
    from agent_sandbox.guards._state import USER_FILES

    runner.register_file = USER_FILES.add
    checks["guards"] = summary()
    return runner, checks, hooks
