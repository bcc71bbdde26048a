"""`K8sClaimBackend` over the real `k8s-agent-sandbox` SDK and kubernetes client, against a
fake Kubernetes API (`fake_k8s.FakeKube`) and a fake sandbox-router, with real `worker serve`
pods (in-process, plain HTTP behind the router's TLS).

Tested here: the exact SandboxClaim the SDK posts for us, create-then-adopt on 409 (two
"processes" on one thread reach one pod), the watch-based readiness, a claim never Ready
(`ClaimCapacityError` naming the pool), a terminal reason, deletion on release, and the data
path through a router that routes by `X-Sandbox-ID` and strips `Authorization`. Not tested
here: a real API server, controller, router, NetworkPolicy or runtime class (docs/scale-out.md).
"""

from __future__ import annotations

import contextlib
import secrets
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("k8s_agent_sandbox")

from agent_sandbox._errors import SandboxError
from agent_sandbox._host.remote.k8s import K8sClaimBackend, import_sdk
from agent_sandbox._host.remote.provider import (
    ClaimCapacityError,
    RemoteProvider,
    claim_name,
)
from agent_sandbox._host.remote.serve import ServeConfig

from .conftest import BIND_SECRET, SESSION_KEY, Certs, remote_policy
from .fake_k8s import FakeKube, FakeRouter
from .fakes import serving

POOL = "python-pool"
ROUTER_TOKEN = "router-" + secrets.token_hex(8)


class Cluster:
    def __init__(self, kube: FakeKube, router: FakeRouter, certs: Certs) -> None:
        self.kube = kube
        self.router = router
        self.certs = certs

    def backend(self, **kw: Any) -> K8sClaimBackend:
        return K8sClaimBackend(
            POOL,
            router_url=self.router.url,
            router_token=ROUTER_TOKEN,
            api_client=self.kube.api_client(),
            **kw,
        )

    def provider(self, backend: K8sClaimBackend | None = None, **kw: Any) -> RemoteProvider:
        return RemoteProvider(
            backend or self.backend(),
            session_key=SESSION_KEY,
            bind_secret=BIND_SECRET,
            tls=self.certs.tls(),
            **kw,
        )


@pytest.fixture
def cluster(certs: Certs) -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        pods = []
        routes = {}
        for i in range(2):
            config = ServeConfig(
                host="127.0.0.1",
                port=0,
                plaintext="accepted",
                bind_secret=BIND_SECRET,
                provider="subprocess",
            )
            server = stack.enter_context(serving(config))
            name = f"{POOL}-pod{i}"
            pods.append((name, "127.0.0.1", server.port))
            routes[name] = ("127.0.0.1", server.port)
        kube = stack.enter_context(FakeKube(pods))
        router = stack.enter_context(FakeRouter(certs.server, routes, ROUTER_TOKEN))
        yield Cluster(kube, router, certs)


def test_the_claim_posted_is_exactly_this(cluster: Cluster) -> None:
    policy = remote_policy()
    with cluster.provider(cluster.backend(shutdown_after_seconds=3600)).session(
        policy, thread="thread-1"
    ) as session:
        assert session.run("1").value == 1
    body = cluster.kube.created_bodies[0]
    name = claim_name("default", "thread-1", policy.fingerprint())
    annotations = body["metadata"].pop("annotations")
    assert set(annotations) == {"agents.x-k8s.io/client-first-requested-at"}
    lifecycle = body["spec"].pop("lifecycle")
    assert lifecycle["shutdownPolicy"] == "Delete" and lifecycle["shutdownTime"]
    assert body == {
        "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
        "kind": "SandboxClaim",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/managed-by": "agent-sandbox-kit",
                "agents.x-k8s.io/created-by": "python-client",
            },
        },
        "spec": {"warmPoolRef": {"name": POOL}},
    }
    # No `env` and no volumes: either would force a cold start instead of a warm pod.


def test_calls_go_through_the_router_which_strips_its_token(cluster: Cluster) -> None:
    with cluster.provider().session(remote_policy(), thread="t") as session:
        result = session.run("import time\nprint('a', flush=True)\ntime.sleep(0.2)\n6 * 7")
    assert result.value == 42 and result.stdout == "a\n"
    assert result.provider == "remote"
    # Every request carried the router's token, and the pod authenticated the session by its
    # own header: the router removed Authorization before the pod.
    assert cluster.router.seen_authorization and all(cluster.router.seen_authorization)
    assert cluster.router.refused == []


def test_two_processes_on_one_thread_adopt_one_claim_and_one_pod(cluster: Cluster) -> None:
    """Two agent processes (two SDK clients, the same tenant key) serving one thread: the
    second create gets 409 and adopts; both reach the same interpreter."""
    policy = remote_policy()
    a = cluster.provider().session(policy, thread="shared")
    b = cluster.provider().session(policy, thread="shared")
    try:
        a.run("note = 'from a'")
        assert b.run("note").value == "from a"
    finally:
        b.close()  # the adopter leaves the claim and its pod to the process that bound it
        assert len(cluster.kube.claims) == 1
        assert a.run("note").value == "from a"
        a.close()
    assert len(cluster.kube.created_bodies) == 2  # the second create met the conflict
    assert cluster.kube.deleted == [claim_name("default", "shared", policy.fingerprint())]


def test_a_claim_never_ready_is_a_capacity_error_naming_the_pool(cluster: Cluster) -> None:
    cluster.kube.mode = "never"
    provider = cluster.provider(claim_timeout=1.5)
    session = provider.session(remote_policy(), thread="t")
    with pytest.raises(ClaimCapacityError, match=POOL) as info:
        session.run("1")
    assert info.value.pool == POOL
    session.close()
    assert cluster.kube.bound == {}  # and nothing ran anywhere else


def test_a_terminal_claim_reason_is_reported_at_once(cluster: Cluster) -> None:

    cluster.kube.mode = "PodFailed"
    # A claim timeout far past the test's own: the error can only come from the reason.
    session = cluster.provider(claim_timeout=3600).session(remote_policy(), thread="t")
    with pytest.raises(SandboxError, match="PodFailed"):
        session.run("1")
    session.close()


def test_closing_the_session_deletes_its_claim(cluster: Cluster) -> None:
    policy = remote_policy()
    with cluster.provider().session(policy, thread="bye") as session:
        session.run("1")
        assert len(cluster.kube.claims) == 1
    assert cluster.kube.claims == {}
    assert cluster.kube.deleted == [claim_name("default", "bye", policy.fingerprint())]


def test_without_the_sdk_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "k8s_agent_sandbox", None)
    with pytest.raises(ImportError, match=r"agent-sandbox-kit\[k8s\]"):
        import_sdk()
