"""`K8sClaimBackend`: remote workers as SandboxClaims of kubernetes-sigs/agent-sandbox.

Through the project's Python SDK (`k8s-agent-sandbox`, the `k8s` extra, imported on first use):
`SandboxClient.create_sandbox(warmpool, claim_name=name, adopt_existing=True)` creates the
claim or, on HTTP 409, adopts the existing one after checking its warm pool; the SDK watches
the claim until it is bound and Ready. The claim's name is `claim_name(tenant, thread, policy
fingerprint)`, so the API server's name uniqueness is the lock between agent processes.

The data path does not go through the SDK: the host speaks the worker protocol (httpx, TLS)
either to the sandbox-router (`router_url`, the request routed by `X-Sandbox-ID`,
`X-Sandbox-Namespace` and `X-Sandbox-Port`; `router_token` goes in `Authorization`, which
the router checks and strips) or straight to the pod's IP (`router_url=None`, from inside
the cluster; the pod's certificate must then name that IP).

A claim not Ready within the timeout is a `ClaimCapacityError` naming the warm pool (the
pool had no ready pod and a cold start took longer); a claim the controller gives up on
(a terminal Ready reason: the pod failed or finished, the claim expired) is a `SandboxError`
with the controller's reason. Neither ever falls back to a local worker.
"""

from __future__ import annotations

import math
from typing import Any

from agent_sandbox._errors import DIST_NAME, SandboxError, install_hint
from agent_sandbox.providers._remote import Claim, ClaimCapacityError

__all__ = ["K8sClaimBackend", "import_sdk"]

#: Labels on every claim this backend creates (selectable with kubectl).
CLAIM_LABELS = {"app.kubernetes.io/managed-by": "agent-sandbox-kit"}


def import_sdk() -> Any:
    """The `k8s_agent_sandbox` module, or an ImportError naming the extra that installs it."""
    try:
        import k8s_agent_sandbox
    except ImportError:
        raise ImportError(
            f"K8sClaimBackend needs the kubernetes-sigs/agent-sandbox Python SDK, which "
            f"{DIST_NAME} installs as an extra: {install_hint('k8s')}"
        ) from None
    return k8s_agent_sandbox


class K8sClaimBackend:
    """Claims from one SandboxWarmPool in one namespace.

    `client` is a ready `k8s_agent_sandbox.SandboxClient` (tests pass one built on a fake
    API server); otherwise one is made from `api_client` or the usual kubeconfig / in-cluster
    configuration. `shutdown_after_seconds` sets the claim's hard expiry (`shutdownTime`);
    the idle expiry is the pod's own (`worker serve --idle-exit`).
    """

    def __init__(
        self,
        warmpool: str,
        *,
        namespace: str = "default",
        router_url: str | None = None,
        router_token: str | None = None,
        port: int = 8888,
        shutdown_after_seconds: int | None = None,
        client: Any = None,
        api_client: Any = None,
    ) -> None:
        if not warmpool:
            raise ValueError("K8sClaimBackend needs the name of a SandboxWarmPool")
        self.pool = warmpool
        self.namespace = namespace
        self.router_url = router_url.rstrip("/") if router_url else None
        self.router_token = router_token
        self.port = port
        self.shutdown_after_seconds = shutdown_after_seconds
        self._client = client
        self._api_client = api_client

    def _sdk_client(self) -> Any:
        if self._client is None:
            sdk = import_sdk()
            from k8s_agent_sandbox.models import SandboxInClusterConnectionConfig

            # The SDK's own data path is never used; a connection config that starts
            # nothing (no port-forward) is given all the same.
            self._client = sdk.SandboxClient(
                connection_config=SandboxInClusterConnectionConfig(server_port=self.port),
                api_client=self._api_client,
            )
        return self._client

    def claim(self, name: str, timeout: float) -> Claim:
        sdk = import_sdk()
        client = self._sdk_client()
        try:
            sandbox = client.create_sandbox(
                self.pool,
                namespace=self.namespace,
                sandbox_ready_timeout=max(1, math.ceil(timeout)),
                labels=dict(CLAIM_LABELS),
                claim_name=name,
                adopt_existing=True,
                shutdown_after_seconds=self.shutdown_after_seconds,
            )
        except TimeoutError as exc:
            raise ClaimCapacityError(
                self.pool, timeout, f"claim {name!r} was not Ready in time ({exc})"
            ) from None
        except sdk.SandboxWarmPoolNotFoundError as exc:
            raise SandboxError(
                f"the SandboxWarmPool {self.pool!r} does not exist in namespace "
                f"{self.namespace!r}: {exc}"
            ) from None
        except sdk.SandboxError as exc:
            raise SandboxError(f"claim {name!r} from pool {self.pool!r} failed: {exc}") from None
        sandbox_id = str(sandbox.sandbox_id)
        if self.router_url is not None:
            headers = {
                "X-Sandbox-ID": sandbox_id,
                "X-Sandbox-Namespace": self.namespace,
                "X-Sandbox-Port": str(self.port),
            }
            if self.router_token:
                headers["Authorization"] = "Bearer " + self.router_token
            return Claim(name, self.pool, self.router_url, headers=headers)
        ip = sandbox.get_pod_ip()
        if not ip:
            raise SandboxError(f"the sandbox {sandbox_id!r} of claim {name!r} reports no pod IP")
        host = f"[{ip}]" if ":" in ip else ip
        return Claim(name, self.pool, f"https://{host}:{self.port}")

    def release(self, claim: Claim) -> None:
        """Delete the claim (its pod goes with it); a claim already gone is not an error."""
        self._sdk_client().delete_sandbox(claim.name, namespace=self.namespace)

    def close(self) -> None:
        """Nothing to end locally: claims this process made are released by their sessions,
        and anything left is reaped by the pod's idle exit and the claim's expiry."""
