"""Claims of remote workers: a claim's name, the record of a claimed worker, the backend
protocol, and the two errors of a claim that fails.

A thread maps to one claim with a deterministic name, `claim_name(tenant, thread, policy
fingerprint)`: two agent processes serving the same thread create-or-adopt the same claim
(the name is the lock: the API server, or the file system for the local backend, lets one
create win). A claim that is not ready in time is a `ClaimCapacityError` naming the pool; a
claim the cluster refuses is a `ClaimError`. The backends: `local_claims.LocalClaimBackend`
and `k8s.K8sClaimBackend`.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Protocol

from agent_sandbox._errors import CapacityError, SandboxError

__all__ = [
    "Claim",
    "ClaimBackend",
    "ClaimCapacityError",
    "ClaimError",
    "claim_name",
]


class ClaimCapacityError(CapacityError):
    """No worker could be claimed in time from a pool (or the process's claim bound is full)."""

    def __init__(self, pool: str, waited: float, reason: str) -> None:
        self.pool = pool
        self.waited = waited
        self.reason = reason
        SandboxError.__init__(
            self,
            f"no remote worker from pool {pool!r} within {waited:g} s: {reason}; add ready "
            "workers to the pool (SandboxWarmPool replicas), raise claim_timeout, or close "
            "sessions that are done",
        )


class ClaimError(SandboxError):
    """A claim the cluster refused or gave up on (not capacity): `reason` names the case
    (Forbidden, Invalid, Terminating, ClaimFailed, WarmPoolNotFound, ...), `status` the API
    server's HTTP status when there was one; the SDK's or the API's error is the cause."""

    def __init__(self, message: str, *, reason: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


def claim_name(tenant: str, thread: str, fingerprint: str) -> str:
    """`ags-` + 20 base32 characters of SHA-256(tenant, thread, policy fingerprint): a valid
    DNS-1123 label, the same in every process, different for every (tenant, thread, policy)."""
    digest = hashlib.sha256("\0".join((tenant, thread, fingerprint)).encode()).digest()
    return "ags-" + base64.b32encode(digest).decode().lower().rstrip("=")[:20]


@dataclasses.dataclass(frozen=True)
class Claim:
    """A claimed worker: where to reach it, and whether this process created the claim."""

    name: str
    pool: str
    url: str
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    created: bool = True
    #: The claim's UID where the backend has one (k8s): its delete is made on it.
    uid: str | None = None


class ClaimBackend(Protocol):
    """Where remote workers come from. `claim` creates the named claim or adopts it when it
    exists, and waits until its worker is ready (else `ClaimCapacityError`); `release`
    deletes a claim this process created; `close` ends everything the backend started."""

    pool: str

    def claim(self, name: str, timeout: float) -> Claim: ...

    def release(self, claim: Claim) -> None: ...

    def close(self) -> None: ...
