"""`K8sClaimBackend`'s failure semantics, through the real `k8s-agent-sandbox` SDK and kubernetes
client against `FakeKube`: every SDK and API error is one of ours with the original as its
cause (`ClaimCapacityError` only for capacity), passing failures are retried with backoff
within the claim's timeout, deletes carry the claim's UID, and a failed delete is logged and
retried by the next sweep. No pod is reached here (the claim's headers are the result)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("k8s_agent_sandbox")

from agent_sandbox._host.intake import remote_transport
from agent_sandbox._host.remote import k8s as _remote_k8s
from agent_sandbox._host.remote.k8s import K8sClaimBackend
from agent_sandbox._host.remote.provider import ClaimCapacityError, ClaimError

from .fake_k8s import FakeKube

ApiException = pytest.importorskip("kubernetes.client.exceptions").ApiException

POOL = "ags-pool"


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    monkeypatch.setattr(_remote_k8s, "RETRY_DELAYS", (0.05, 0.1, 0.2))
    pods = [(f"sb-{i}", f"198.51.100.{i + 5}", 8888) for i in range(3)]
    with FakeKube(pods) as fake:
        yield fake


def _backend(kube: FakeKube) -> K8sClaimBackend:
    return K8sClaimBackend(POOL, router_url="https://router.example", api_client=kube.api_client())


def test_a_claim_carries_the_routing_headers_and_its_uid(kube: FakeKube) -> None:
    claim = _backend(kube).claim("ags-one", 10)
    assert claim.headers["X-Sandbox-ID"] == "sb-0"
    assert claim.headers["X-Sandbox-Pod-IP"] == "198.51.100.5"
    assert claim.uid == kube.claims["ags-one"]["metadata"]["uid"]


@pytest.mark.parametrize("status", [500, 503])
def test_a_passing_api_failure_is_retried(kube: FakeKube, status: int) -> None:
    kube.create_errors = [(status, "etcd leader changed"), (status, "etcd leader changed")]
    backend = _backend(kube)
    claim = backend.claim("ags-retry", 10)
    assert claim.headers["X-Sandbox-ID"] == "sb-0" and backend.retries == 2


def test_an_api_failure_that_lasts_is_a_claim_error_with_its_cause(kube: FakeKube) -> None:
    kube.create_errors = [(503, "unavailable")] * 20
    with pytest.raises(ClaimError, match="kept failing") as info:
        _backend(kube).claim("ags-down", 1.0)
    assert info.value.reason == "APIError" and info.value.status == 503
    assert isinstance(info.value.__cause__, ApiException)


@pytest.mark.parametrize(
    ("status", "message", "reason", "words"),
    [
        (403, "sandboxclaims is forbidden: User cannot create", "Forbidden", "create, get, watch"),
        (422, "spec.warmPoolRef.name: Required value", "Invalid", "rejected the claim"),
        (404, "the server could not find the requested resource", "NoAPI", "v0.5.0"),
    ],
)
def test_api_refusals_are_named(
    kube: FakeKube, status: int, message: str, reason: str, words: str
) -> None:
    kube.create_errors = [(status, message)]
    with pytest.raises(ClaimError, match=words) as info:
        _backend(kube).claim("ags-refused", 5)
    assert not isinstance(info.value, ClaimCapacityError)
    assert info.value.reason == reason and info.value.status == status
    assert message in str(info.value)
    assert isinstance(info.value.__cause__, ApiException)


def test_a_resource_quota_is_capacity(kube: FakeKube) -> None:
    kube.create_errors = [(403, 'sandboxclaims "x" is forbidden: exceeded quota: claims')]
    with pytest.raises(ClaimCapacityError, match="exceeded quota") as info:
        _backend(kube).claim("ags-quota", 5)
    assert info.value.pool == POOL


def test_only_a_claim_never_ready_is_capacity(kube: FakeKube) -> None:
    kube.mode = "never"
    with pytest.raises(ClaimCapacityError, match=POOL):
        _backend(kube).claim("ags-never", 1.5)


def _terminating(kube: FakeKube, name: str) -> None:
    with kube.lock:
        kube.claims[name] = {
            "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
            "kind": "SandboxClaim",
            "metadata": {
                "name": name,
                "uid": "old-uid",
                "resourceVersion": "1",
                "deletionTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {"warmPoolRef": {"name": POOL}},
        }


def test_a_same_name_claim_terminating_is_waited_out(kube: FakeKube) -> None:
    """The SDK's bare ValueError ("is terminating") is a passing failure: retried until the
    old claim is gone, then the claim is made."""
    _terminating(kube, "ags-again")

    def gone() -> None:
        with kube.lock:
            kube.claims.pop("ags-again", None)

    timer = threading.Timer(0.3, gone)
    timer.start()
    try:
        backend = _backend(kube)
        claim = backend.claim("ags-again", 10)
    finally:
        timer.cancel()
    assert claim.uid != "old-uid" and backend.retries >= 1


def test_a_same_name_claim_that_stays_terminating_is_named(kube: FakeKube) -> None:
    _terminating(kube, "ags-stuck")
    with pytest.raises(ClaimError, match="still being deleted") as info:
        _backend(kube).claim("ags-stuck", 1.0)
    assert info.value.reason == "Terminating"
    assert isinstance(info.value.__cause__, ValueError)  # the SDK's, kept as the cause


def test_a_claim_from_another_pool_is_named(kube: FakeKube) -> None:
    _terminating(kube, "ags-other")
    with kube.lock:
        del kube.claims["ags-other"]["metadata"]["deletionTimestamp"]
        kube.claims["ags-other"]["spec"]["warmPoolRef"]["name"] = "another-pool"
    with pytest.raises(ClaimError, match="another warm pool") as info:
        _backend(kube).claim("ags-other", 5)
    assert info.value.reason == "OtherPool"


def test_a_delete_carries_the_uid_and_spares_a_newer_claim(kube: FakeKube) -> None:
    backend = _backend(kube)
    claim = backend.claim("ags-uid", 10)
    with kube.lock:  # the claim was deleted and made again by another process meanwhile
        kube.claims["ags-uid"]["metadata"]["uid"] = "newer-uid"
    backend.release(claim)
    assert kube.delete_preconditions == [claim.uid]
    assert "ags-uid" in kube.claims  # the newer claim stays
    assert backend._unreleased == {}  # and nothing is left to retry


def test_a_failed_delete_is_logged_and_swept(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _backend(kube)
    claim = backend.claim("ags-sweep", 10)
    kube.delete_errors = [(500, "etcd timeout")]
    with caplog.at_level(logging.WARNING, logger="agent_sandbox.remote"):
        backend.release(claim)
    assert "ags-sweep" in kube.claims
    assert any("the next sweep retries it" in r.getMessage() for r in caplog.records)
    assert backend._unreleased == {"ags-sweep": claim.uid}
    backend.claim("ags-next", 10)  # each claim sweeps first
    assert "ags-sweep" not in kube.claims and backend._unreleased == {}
    assert kube.delete_preconditions == [claim.uid, claim.uid]


def test_the_bind_retry_delays_are_the_sdks() -> None:
    assert remote_transport.RETRY_DELAYS == (0.5, 1.0, 2.0, 4.0)
    assert {500, 502, 503, 504} == remote_transport.RETRY_STATUSES


def test_no_kubernetes_configuration_is_named(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kubernetes.config import kube_config

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", f"{tmp_path}/none")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClaimError, match="no Kubernetes configuration") as info:
        K8sClaimBackend(POOL).claim("ags-nowhere", 5)
    assert info.value.reason == "NoConfig" and info.value.__cause__ is not None
