"""A cluster as the host meets it through the upstream router: `FakeKube` (the API server and
the controller, for the `k8s-agent-sandbox` SDK the host uses), `UpstreamRouter` (the Python
router's behaviour at the pinned commit) and pods started from the generated template
(`template_pods.start_pod`), reached at Pod IPs of their own (a documentation range) that the test's pod network carries to them."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

from agent_sandbox._host.remote.k8s_manifests import sandbox_template
from agent_sandbox._host.remote.provider import RemoteProvider

from .conftest import BIND_SECRET, SESSION_KEY, Certs, remote_policy
from .fake_k8s import FakeKube
from .template_pods import Pod, start_pod
from .upstream_router import UpstreamRouter

POOL = "ags-test-remote"
ROUTER_TOKEN = "router-token-for-tests"
PORT = 8888  # the template's


#: By hand, the real upstream router instead of the stand-in (never in CI: it is not
#: vendored): `AGENT_SANDBOX_UPSTREAM_ROUTER=https://127.0.0.1:PORT` (its uvicorn, TLS),
#: `..._CA` (the CA of its certificate), `..._POD_IP` (an address of this machine the pods
#: are reached at; the router refuses loopback), its `ROUTER_AUTH_TOKEN` = ROUTER_TOKEN.
EXTERNAL = os.environ.get("AGENT_SANDBOX_UPSTREAM_ROUTER", "")


class _External:
    """The real router, run by hand (see `EXTERNAL`)."""

    def __init__(self) -> None:
        self.url = EXTERNAL
        self.network: dict[str, tuple[str, int]] = {}

    def __enter__(self) -> _External:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class RoutedCluster:
    def __init__(self, certs: Certs, template: dict[str, Any], warm: int) -> None:
        self.certs = certs
        self.template = template
        self.pods: dict[str, Pod] = {}
        self._names = itertools.count()
        self._lock = threading.Lock()
        self.router: Any = (
            _External() if EXTERNAL else UpstreamRouter(certs.server, token=ROUTER_TOKEN)
        )
        self.kube = FakeKube([self._new_pod() for _ in range(warm)], factory=self._new_pod)

    def _new_pod(self) -> tuple[str, str, int]:
        with self._lock:
            n = next(self._names)
        name, ip = f"{POOL}-{n}", f"198.51.100.{10 + n}"
        if EXTERNAL:
            ip = os.environ["AGENT_SANDBOX_UPSTREAM_POD_IP"]
        pod = start_pod(self.template, name, bind_secret=BIND_SECRET, ip=ip)
        self.pods[name] = pod
        # The pod network: the Pod IP and the template's port reach the pod's process.
        self.router.network[f"{ip}:{PORT}"] = ("127.0.0.1", pod.port)
        return name, ip, PORT

    def backend(self, **kw: Any) -> Any:
        from agent_sandbox._host.remote.k8s import K8sClaimBackend
        from agent_sandbox._host.remote.provider import Claim

        cluster = self

        class OwnPort(K8sClaimBackend):
            """With the real router, the pods share this machine's address: each is reached
            at the port it got (on a cluster: the template's port at its own Pod IP)."""

            def claim(self, name: str, timeout: float) -> Claim:
                got = super().claim(name, timeout)
                port = cluster.pods[got.headers["X-Sandbox-ID"]].port
                headers = {**got.headers, "X-Sandbox-Port": str(port)}
                return Claim(got.name, got.pool, got.url, headers, got.created, got.uid)

        return (OwnPort if EXTERNAL else K8sClaimBackend)(
            POOL,
            router_url=self.router.url,
            router_token=ROUTER_TOKEN,
            api_client=self.kube.api_client(),
            **kw,
        )

    def provider(self, backend: Any = None, **kw: Any) -> RemoteProvider:
        ca = os.environ.get("AGENT_SANDBOX_UPSTREAM_ROUTER_CA") if EXTERNAL else None
        return RemoteProvider(
            backend or self.backend(),
            session_key=SESSION_KEY,
            bind_secret=BIND_SECRET,
            tls=self.certs.tls(client_cert=None, **({"ca_file": ca} if ca else {})),
            **kw,
        )

    def close(self) -> None:
        for pod in list(self.pods.values()):
            pod.stop()


@contextlib.contextmanager
def routed_cluster(certs: Certs, warm: int = 1, **template: Any) -> Iterator[RoutedCluster]:
    built = sandbox_template(remote_policy(), image="reg/ags:1", runtime="runc", **template)
    cluster = RoutedCluster(certs, built, warm)
    try:
        with cluster.kube, cluster.router:
            yield cluster
    finally:
        cluster.close()
