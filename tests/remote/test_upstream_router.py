"""The host through agent-sandbox's router as it is upstream (`upstream_router.UpstreamRouter`,
the Python router's behaviour at commit 2fd412d55ecae90861a101a5424a75473de97c36), to pods
started from the generated template (`template_pods`: its command, args and env, plain HTTP
on the router hop), with the claims made by the `k8s-agent-sandbox` SDK against `FakeKube`.

What the manifests produce is what runs here: the router dials `http://<Pod IP>:<port>`, found
by the `X-Sandbox-Pod-IP` header the host sends (warm-pool pods have no per-sandbox Service),
with `X-Sandbox-Timeout` from the policy's wall time."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("k8s_agent_sandbox")

from agent_sandbox._host.intake import remote_transport
from agent_sandbox._host.intake.remote_transport import TOKEN_HEADER, RemoteTLS
from agent_sandbox._host.remote.provider import claim_name, router_timeout

from .conftest import Certs, remote_policy
from .routed_cluster import ROUTER_TOKEN, RoutedCluster, routed_cluster
from .upstream_router import UPSTREAM_COMMIT


@pytest.fixture
def cluster(certs: Certs) -> Iterator[RoutedCluster]:
    with routed_cluster(certs) as c:
        yield c


def _router(cluster: RoutedCluster, certs: Certs) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.router.url, verify=RemoteTLS(ca_file=certs.ca).ssl_context()
    )


def test_the_stand_in_names_the_upstream_commit() -> None:
    assert UPSTREAM_COMMIT.startswith("2fd412d")


def test_the_router_refuses_as_upstream_does(cluster: RoutedCluster, certs: Certs) -> None:
    pod = next(iter(cluster.pods.values()))
    auth = {"Authorization": "Bearer " + ROUTER_TOKEN}
    route = {"X-Sandbox-ID": pod.name, "X-Sandbox-Port": "8888"}
    with _router(cluster, certs) as http:
        cases = [
            ({}, 401, "Missing or invalid Authorization header."),
            ({"Authorization": "Bearer wrong"}, 401, "Invalid token."),
            (auth, 400, "X-Sandbox-ID header is required."),
            ({**auth, "X-Sandbox-ID": "Not_A_Label"}, 400, "Invalid sandbox ID format."),
            ({**auth, **route, "X-Sandbox-Port": "0"}, 400, "Invalid port format."),
            ({**auth, **route, "X-Sandbox-Pod-IP": "127.0.0.1"}, 400, "Invalid target IP address."),
            (
                {**auth, **route, "X-Sandbox-Pod-IP": "pod"},
                400,
                "Invalid target IP address format.",
            ),
            # No Pod IP: the per-sandbox Service name, which a warm-pool pod does not have.
            ({**auth, **route}, 502, f"Could not connect to the backend sandbox: {pod.name}"),
        ]
        for headers, status, detail in cases:
            reply = http.get("/healthz", headers=headers)
            assert (reply.status_code, reply.json()) == (status, {"detail": detail}), headers
        # With the Pod IP: plain HTTP to the pod, which answers its health route.
        reply = http.get("/healthz", headers={**auth, **route, "X-Sandbox-Pod-IP": pod.ip})
        assert reply.status_code == 200 and reply.json() == {"ready": True}
    _method, url, sent = cluster.router.forwarded[-1]
    assert url == f"http://{pod.ip}:8888/healthz"
    assert not {k.lower() for k in sent} & {"authorization", "x-sandbox-id", "x-sandbox-pod-ip"}


def test_a_session_runs_through_the_router_on_a_template_pod(cluster: RoutedCluster) -> None:
    """The template's own command line on the router hop (plain HTTP in the pod, TLS from the
    agent to the router); the host sends the SDK's routing headers, the pod never sees the
    router's token, and the session's token reaches it."""
    policy = remote_policy()
    with cluster.provider().session(policy, thread="t-" + secrets.token_hex(4)) as session:
        result = session.run("import time\nprint('a', flush=True)\ntime.sleep(0.2)\n6 * 7")
        assert result.ok and result.value == 42 and result.stdout == "a\n"
        assert result.provider == "remote" and "landlock" in result.stack
    (pod,) = cluster.pods.values()
    assert "--plaintext" in pod.argv and "--tls-cert" not in pod.argv
    received = [h for h in cluster.router.received if "x-sandbox-id" in h]
    assert received and all(h["x-sandbox-pod-ip"] == pod.ip for h in received)
    assert all(h["x-sandbox-timeout"] == f"{router_timeout(policy):g}" for h in received)
    assert router_timeout(policy) == policy.limits.wall_seconds + 30
    urls = [url for _, url, _ in cluster.router.forwarded]
    assert f"http://{pod.ip}:8888/v1/bind" in urls
    assert f"http://{pod.ip}:8888/run" in urls
    for _, _, sent in cluster.router.forwarded:
        lower = {k.lower() for k in sent}
        assert "authorization" not in lower and TOKEN_HEADER in lower


def test_a_router_502_three_times_costs_retries_not_a_claim(cluster: RoutedCluster) -> None:
    """The bind meets three 502s (a router whose pod connection is not up yet) and then
    the pod: three retry delays (0.5, 1, 2 s), one claim, none deleted."""
    cluster.router.inject = [502, 502, 502]
    policy = remote_policy()
    session = cluster.provider().session(policy, thread="t-retry")
    try:
        assert session.run("1 + 1").value == 2
        assert session.worker is not None and session.worker.remote_client is not None
        assert cluster.router.refused.count(502) == 3 and cluster.router.inject == []
        assert len(cluster.kube.created_bodies) == 1 and cluster.kube.deleted == []
    finally:
        session.close()
    assert cluster.kube.deleted == [claim_name("default", "t-retry", policy.fingerprint())]


def test_a_router_502_past_the_retries_fails_the_bind(
    cluster: RoutedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_sandbox._errors import WorkerStartError

    monkeypatch.setattr(remote_transport, "RETRY_DELAYS", (0.01, 0.01))
    cluster.router.inject = [502] * 3
    session = cluster.provider().session(remote_policy(), thread="t-502")
    with pytest.raises(WorkerStartError, match="HTTP 502"):
        session.run("1")
    session.close()
    assert cluster.router.refused.count(502) == 3


def test_an_idle_pods_exit_ends_its_claim(certs: Certs) -> None:
    """`--idle-exit` from the template: the pod's server exits 0 once idle, the pod is not
    restarted (`restartPolicy: Never`), the controller marks the Sandbox finished; the
    session's next call deletes the dead claim and binds a fresh pod under the same name."""
    with routed_cluster(certs, idle_exit=1.0) as cluster:
        policy = remote_policy()
        name = claim_name("default", "t-idle", policy.fingerprint())
        with cluster.provider().session(policy, thread="t-idle") as session:
            session.run("x = 1")
            first = cluster.kube.bound[name][0]
            pod = cluster.pods[first]
            assert pod.proc.wait(30) == 0  # idle: the server ended its session and exited
            cluster.kube.finish(first)
            result = session.run("1")  # the lost pod is found on this call...
            if not result.ok:
                result = session.run("1")  # ...or on the next, as after any worker's death
            assert result.value == 1 and result.state_lost
            assert cluster.kube.deleted == [name]
            assert cluster.kube.bound[name][0] != first
