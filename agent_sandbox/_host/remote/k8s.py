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

import json
import logging
import math
import threading
import time
from typing import Any

from agent_sandbox._errors import DIST_NAME, SandboxError, install_hint
from agent_sandbox._host.intake.remote_transport import RETRY_DELAYS
from agent_sandbox._host.remote.provider import Claim, ClaimCapacityError, ClaimError

__all__ = ["K8sClaimBackend", "import_sdk"]

_log = logging.getLogger("agent_sandbox.remote")

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
        self._lock = threading.Lock()
        #: Claims whose delete failed: name -> UID, retried by `sweep()`.
        self._unreleased: dict[str, str | None] = {}
        self.retries = 0

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
        """Create or adopt claim `name` and wait until it is Ready; the SDK's and the API
        server's errors mapped to ours (`_map_error`), passing ones retried with backoff
        within `timeout` (a 5xx, a reset connection, a same-name claim still terminating)."""
        self.sweep()
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                sandbox = self._create(name, remaining)
                break
            except Exception as exc:
                error = _map_error(exc, self.pool, self.namespace, name, timeout)
                if error is None:
                    raise
                delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]
                if not isinstance(error, _Passing) or time.monotonic() + delay >= deadline:
                    if isinstance(error, _Passing):
                        raise error.final() from exc
                    raise error from exc
                attempt += 1
                self.retries += 1
                _log.info("claim %s: %s; retrying in %g s", name, error, delay)
                time.sleep(delay)
        sandbox_id = str(sandbox.sandbox_id)
        uid = self._claim_uid(name)
        ip = _pod_ip(sandbox)
        if self.router_url is not None:
            headers = {
                "X-Sandbox-ID": sandbox_id,
                "X-Sandbox-Namespace": self.namespace,
                "X-Sandbox-Port": str(self.port),
            }
            if ip:
                # Warm-pool pods have no per-sandbox Service: the routers find them by
                # the Pod IP the Sandbox's status gives (as the SDK sends it).
                headers["X-Sandbox-Pod-IP"] = ip
            if self.router_token:
                headers["Authorization"] = "Bearer " + self.router_token
            return Claim(name, self.pool, self.router_url, headers=headers, uid=uid)
        if not ip:
            raise SandboxError(f"the sandbox {sandbox_id!r} of claim {name!r} reports no pod IP")
        host = f"[{ip}]" if ":" in ip else ip
        return Claim(name, self.pool, f"https://{host}:{self.port}", uid=uid)

    def _create(self, name: str, remaining: float) -> Any:
        return self._sdk_client().create_sandbox(
            self.pool,
            namespace=self.namespace,
            sandbox_ready_timeout=max(1, math.ceil(remaining)),
            labels=dict(CLAIM_LABELS),
            claim_name=name,
            adopt_existing=True,
            shutdown_after_seconds=self.shutdown_after_seconds,
        )

    def _claim_uid(self, name: str) -> str | None:
        """The claim's UID (deletes are made on it alone), or None when it cannot be read."""
        try:
            claim = self._sdk_client().k8s_helper.get_sandbox_claim(name, self.namespace)
        except Exception as exc:  # the delete then goes without a precondition
            _log.warning("claim %s: its UID could not be read (%s)", name, exc)
            return None
        uid = ((claim or {}).get("metadata") or {}).get("uid")
        return str(uid) if uid else None

    def release(self, claim: Claim) -> None:
        """Delete the claim, on its UID (a claim of the same name made since is never
        deleted by this); a claim already gone is not an error. A failure is logged and the
        delete retried by the next `sweep()` (each `claim()` and `close()` runs one)."""
        if not self._delete(claim.name, claim.uid):
            with self._lock:
                self._unreleased[claim.name] = claim.uid

    def _delete(self, name: str, uid: str | None) -> bool:
        try:
            self._sdk_client().k8s_helper.delete_sandbox_claim(
                name, self.namespace, expected_uid=uid
            )
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status == 409 and uid is not None:
                return (
                    True  # the UID precondition failed: that claim is gone, another holds the name
                )
            _log.warning("claim %s: the delete failed (%s); the next sweep retries it", name, exc)
            return False
        return True

    def sweep(self) -> None:
        """Retry the deletes that failed."""
        with self._lock:
            pending = dict(self._unreleased)
        for name, uid in pending.items():
            if self._delete(name, uid):
                with self._lock:
                    if self._unreleased.get(name, "-") == uid:
                        del self._unreleased[name]

    def close(self) -> None:
        """A last sweep of failed deletes; claims this process made are released by their
        sessions, and anything left is reaped by the pod's idle exit (its pod ends, the
        Sandbox finishes) and the claim's expiry."""
        self.sweep()


class _Passing(SandboxError):
    """A failure worth another attempt; `final()` is what the caller gets when none is left."""

    def __init__(self, message: str, final: SandboxError) -> None:
        super().__init__(message)
        self._final = final

    def final(self) -> SandboxError:
        return self._final


def _pod_ip(sandbox: Any) -> str | None:
    try:
        ip = sandbox.get_pod_ip()
    except Exception as exc:
        _log.warning("the sandbox's pod IP could not be read (%s)", exc)
        return None
    return str(ip) if ip else None


def _map_error(
    exc: BaseException, pool: str, namespace: str, name: str, timeout: float
) -> SandboxError | None:
    """The SDK's or the API server's error as ours (None: not one of theirs). The cause is
    kept by the caller (`raise ... from exc`)."""
    sdk = import_sdk()
    where = f"claim {name!r} from pool {pool!r} in namespace {namespace!r}"
    if isinstance(exc, TimeoutError):
        return ClaimCapacityError(pool, timeout, f"claim {name!r} was not Ready in time ({exc})")
    if isinstance(exc, sdk.SandboxWarmPoolNotFoundError):
        return ClaimError(
            f"the SandboxWarmPool {pool!r} does not exist in namespace {namespace!r}: apply "
            "the manifests (`agent-sandbox k8s manifests`) and use the pool name they print",
            reason="WarmPoolNotFound",
        )
    if isinstance(exc, sdk.SandboxClaimFailedError):
        return ClaimError(f"{where} failed: {exc}", reason="ClaimFailed")
    if isinstance(exc, sdk.SandboxNotFoundError):
        final = ClaimError(f"{where}: {exc}", reason="NotFound")
        return _Passing(f"{where}: {exc}", final)  # e.g. gone between the 409 and the read
    if isinstance(exc, ValueError) and "is terminating" in str(exc):
        final = ClaimError(
            f"{where}: a claim of the same name is still being deleted (its pod ends first); "
            "retry once it is gone, or raise claim_timeout",
            reason="Terminating",
        )
        return _Passing(f"{where}: a same-name claim is terminating", final)
    if isinstance(exc, ValueError) and "references warm pool" in str(exc):
        return ClaimError(
            f"{where}: a claim of this name exists for another warm pool ({exc}); the same "
            "thread under another pool needs another tenant or policy",
            reason="OtherPool",
        )
    status = getattr(exc, "status", None)
    if isinstance(status, int) and _is_api_exception(exc):
        text = _api_message(exc)
        if status == 403 and "exceeded quota" in text:
            return ClaimCapacityError(pool, timeout, f"the namespace's ResourceQuota: {text}")
        if status in (401, 403):
            return ClaimError(
                f"{where}: the API server refused (HTTP {status}: {text}); this identity needs "
                "create, get, watch and delete on sandboxclaims.extensions.agents.x-k8s.io and "
                "get on sandboxes.agents.x-k8s.io in that namespace",
                reason="Forbidden",
                status=status,
            )
        if status == 422:
            return ClaimError(
                f"{where}: the API server rejected the claim (HTTP 422: {text})",
                reason="Invalid",
                status=status,
            )
        if status == 404:
            return ClaimError(
                f"{where}: the SandboxClaim API is not served (HTTP 404: {text}); install "
                "agent-sandbox v0.5.0 or later with its extensions (v1beta1)",
                reason="NoAPI",
                status=status,
            )
        if status == 429 or status >= 500:
            final = ClaimError(
                f"{where}: the API server kept failing (HTTP {status}: {text})",
                reason="APIError",
                status=status,
            )
            return _Passing(f"{where}: HTTP {status}", final)
        return ClaimError(f"{where}: HTTP {status}: {text}", reason="APIError", status=status)
    if type(exc).__name__ == "ConfigException":  # kubernetes.config: no way to the cluster
        return ClaimError(
            f"{where}: no Kubernetes configuration ({exc}); in a pod, mount a service "
            "account token; elsewhere, a kubeconfig (KUBECONFIG or ~/.kube/config)",
            reason="NoConfig",
        )
    if _is_connection_error(exc):
        final = ClaimError(
            f"{where}: the API server could not be reached ({exc})", reason="Unreachable"
        )
        return _Passing(f"{where}: {exc}", final)
    if isinstance(exc, sdk.SandboxError):
        return ClaimError(f"{where} failed: {exc}", reason=type(exc).__name__)
    return None


def _is_a(exc: BaseException, module: str, names: tuple[str, ...]) -> bool:
    """`exc` is (a subclass of) one of `module`'s `names`, found by its classes' names: the
    kubernetes client's and urllib3's errors, which the SDK raises, without importing those
    packages here (they are the SDK's dependencies, not ours)."""
    return any(c.__module__ == module and c.__name__ in names for c in type(exc).__mro__)


def _is_api_exception(exc: BaseException) -> bool:
    return _is_a(exc, "kubernetes.client.exceptions", ("ApiException",))


def _api_message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError, TypeError):
        message = None
    text = str(message or getattr(exc, "reason", "") or exc)
    return " ".join(text.split())[:500]


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, OSError)):
        return True
    return _is_a(
        exc, "urllib3.exceptions", ("ProtocolError", "NewConnectionError", "MaxRetryError")
    )
