"""Which kernel boundary a policy runs behind, decided when a `Sandbox` or a tool is built.

`resolve_boundary(policy, provider)` does everything that can fail about a provider before the
first call: the name is known, the provider works here (its probe), it can serve this policy
(a dry `build()` on placeholder paths, which is pure), and a provider without a kernel boundary
is only taken with the policy's explicit opt-out (`no_kernel_boundary = "accepted"`), and
`landlock`, which cannot hide names, only with `visible_names = "accepted"`. For
`auto` it returns the concrete provider `auto` chose for this policy, so the pool starts workers
with it directly (and keeps a template where that provider allows one).

`boundary_name(stack)` is the text every result, tool description and trace shows:
`"bwrap+landlock+seccomp"`, or `"none"` when no kernel boundary held the worker.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from agent_sandbox._errors import PolicyError
from agent_sandbox._host.launch import (
    BOOT_SCRIPT,
    import_roots,
    package_dirs,
    worker_env,
    worker_python,
)
from agent_sandbox._host.result import NO_BOUNDARY, boundary_name
from agent_sandbox.policies import Policy
from agent_sandbox.policies._model import (
    check_boundary_opt_out,
    check_min_boundary,
    check_visible_names,
)
from agent_sandbox.providers import AutoProvider, Provider, WorkerSpec, get_provider
from agent_sandbox.providers._netcheck import refuse_unenforceable

__all__ = ["NO_BOUNDARY", "Boundary", "boundary_name", "resolve_boundary"]

# Placeholder paths for the dry build: never created, never used to start anything.
_DRY_DIR = "/nonexistent/agent-sandbox-dry-build"


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The provider a policy's workers start with and the stack it builds for that policy."""

    provider: Provider
    stack: tuple[str, ...]

    @property
    def name(self) -> str:
        return boundary_name(self.stack, self.provider.is_boundary)

    @property
    def is_kernel(self) -> bool:
        return self.provider.is_boundary


def _dry_spec(policy: Policy) -> WorkerSpec:

    return WorkerSpec(
        python=worker_python(),
        boot_script=BOOT_SCRIPT,
        scratch=os.path.join(_DRY_DIR, "scratch"),
        control_dir=_DRY_DIR,
        listen_fd=3,
        boot_fd=4,
        sys_path=import_roots(),
        package_dirs=package_dirs(),
        env=worker_env(policy, os.environ),
        prefix=sys.prefix,
        base_prefix=sys.base_prefix,
    )


def resolve_boundary(policy: Policy, provider: str | None = None) -> Boundary:
    """The provider and stack `policy`'s workers get here; raises what is wrong, with the fix.

    `provider` overrides the policy's own. Raises `PolicyError` for a provider without a
    kernel boundary, or one that cannot hide names (`landlock`), that the policy does not
    accept in words, `ProviderUnavailable` for an
    unknown provider, one that does not work here, or one that cannot serve this policy.
    """
    name = provider or policy.provider
    try:
        check_boundary_opt_out(name, policy.no_kernel_boundary)
        check_visible_names(name, policy.visible_names)
        check_min_boundary(name, policy.min_boundary)
    except ValueError as exc:
        raise PolicyError(str(exc), source=policy.source, key="provider") from None
    if name == "remote":
        return _remote_boundary(policy)
    chosen = get_provider(name)
    chosen.require()
    plan = chosen.build(policy, _dry_spec(policy))
    if isinstance(chosen, AutoProvider):
        chosen = chosen.provider_named(plan.provider)
    # Every provider, whatever its build checks: what it does not answer refuses the policy.
    refuse_unenforceable(chosen, policy)
    return Boundary(chosen, tuple(plan.stack))


def _remote_boundary(policy: Policy) -> Boundary:
    """Workers claimed elsewhere (`_host/remote/provider.py`): the policy must say where, and the
    transport must be installed; which layer holds them is the pod's, said per result."""
    from agent_sandbox._host.remote.provider import RemoteBoundary

    if policy.remote is None:
        raise PolicyError(
            'provider = "remote" needs a [remote] table: the claim backend (backend, pool), '
            "the tenant and how to reach the workers (see docs/scale-out.md)",
            source=policy.source,
            key="remote",
        )
    chosen = RemoteBoundary()
    chosen.require()
    return Boundary(chosen, ("remote",))
