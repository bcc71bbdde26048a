"""Remote workers behind an in-test reverse proxy that behaves like agent-sandbox's
sandbox-router (`fake_k8s.FakeRouter`): TLS in front, routing by `X-Sandbox-ID` (a DNS-1123
label naming a known sandbox), its own token in `Authorization` checked and stripped before
the pod, plain HTTP to the pod, the response relayed unbuffered. No Kubernetes SDK here
(`test_k8s_backend.py` adds the claims on top)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_sandbox._errors import WorkerStartError
from agent_sandbox._host.intake.remote_transport import TOKEN_HEADER, RemoteTLS
from agent_sandbox._host.remote.serve import ServeConfig, WorkerServer
from agent_sandbox._host.remote.worker import RemoteWorker

from .conftest import BIND_SECRET, Certs, remote_policy
from .fake_k8s import FakeRouter
from .fakes import serving

ROUTER_TOKEN = "router-" + secrets.token_hex(8)


class Routed:
    def __init__(self, router: FakeRouter, pods: dict[str, WorkerServer], certs: Certs) -> None:
        self.router, self.pods, self.certs = router, pods, certs

    def headers(self, sandbox: str, token: str | None = ROUTER_TOKEN) -> dict[str, str]:
        out = {"X-Sandbox-ID": sandbox, "X-Sandbox-Namespace": "agents", "X-Sandbox-Port": "8888"}
        if token is not None:
            out["Authorization"] = "Bearer " + token
        return out

    def connect(self, sandbox: str, token: str, **kw: Any) -> RemoteWorker:
        return RemoteWorker.connect(
            remote_policy(),
            self.router.url,
            token=token,
            bind_secret=BIND_SECRET,
            tls=RemoteTLS(ca_file=self.certs.ca),
            headers=kw.pop("headers", None) or self.headers(sandbox),
            start_timeout=15,
        )


@pytest.fixture
def routed(certs: Certs) -> Iterator[Routed]:
    with contextlib.ExitStack() as stack:
        pods = {}
        for name in ("pod-a", "pod-b"):
            config = ServeConfig(
                host="127.0.0.1",
                port=0,
                plaintext="accepted",  # the router's pod hop, as the real one's usually is
                bind_secret=BIND_SECRET,
                provider="subprocess",
                keepalive=0.2,
            )
            pods[name] = stack.enter_context(serving(config))
        routes = {name: ("127.0.0.1", pod.port) for name, pod in pods.items()}
        router = stack.enter_context(FakeRouter(certs.server, routes, ROUTER_TOKEN))
        yield Routed(router, pods, certs)


def test_the_router_routes_by_sandbox_id(routed: Routed) -> None:
    a = routed.connect("pod-a", secrets.token_hex(16))
    b = routed.connect("pod-b", secrets.token_hex(16))
    try:
        assert a.run("x = 'a'\nx").value == "a"
        assert b.run("x = 'b'\nx").value == "b"
        assert a.run("x").value == "a"  # two pods, two interpreters
        assert routed.pods["pod-a"].worker.proc.pid != routed.pods["pod-b"].worker.proc.pid
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("sandbox", "token", "status"),
    [("Pod_A", ROUTER_TOKEN, 400), ("pod-z", ROUTER_TOKEN, 404), ("pod-a", None, 401)],
    ids=["not-a-dns-label", "unknown-sandbox", "no-router-token"],
)
def test_the_router_refuses_what_it_cannot_route(
    routed: Routed, sandbox: str, token: str | None, status: int
) -> None:
    with pytest.raises(WorkerStartError):
        routed.connect(sandbox, secrets.token_hex(16), headers=routed.headers(sandbox, token))
    assert routed.router.refused == [status]
    assert not routed.pods["pod-a"]._bound  # nothing reached the pod


def test_the_session_token_survives_the_router_and_authorization_never_counts(
    routed: Routed, certs: Certs
) -> None:
    """The router strips `Authorization` (it carries the router's token): the pod
    authenticates the session by its own header, and a session token sent in
    `Authorization` (as a local worker takes it) is refused by the pod."""
    token = secrets.token_hex(16)
    worker = routed.connect("pod-a", token)
    try:
        assert worker.run("6 * 7").value == 42
        assert routed.router.seen_authorization and all(routed.router.seen_authorization)
        pod = f"http://127.0.0.1:{routed.pods['pod-a'].port}"
        with httpx.Client() as http:
            as_bearer = http.get(pod + "/hello", headers={"Authorization": "Bearer " + token})
            own = http.get(pod + "/hello", headers={TOKEN_HEADER: token})
        assert as_bearer.status_code == 403
        assert own.status_code == 200
    finally:
        worker.close()


def test_live_events_stream_through_the_router(routed: Routed) -> None:
    """A cell prints, then waits for a file in its scratch directory that the host creates
    only when that print has reached it: a proxy that buffered the stream would hold the
    print until the cell ended, and the cell would end by its wall time instead (no timing
    is measured)."""
    worker = routed.connect("pod-a", secrets.token_hex(16))
    seen: list[str] = []

    def on_event(kind: str, data: Any) -> None:
        if kind == "stdout" and str(data).startswith("waiting in "):
            seen.append("stdout")
            Path(str(data)[len("waiting in ") :].strip(), "go").write_text("go")

    code = (
        "import os, time\n"
        "print('waiting in', os.getcwd(), flush=True)\n"
        "while not os.path.exists('go'):\n"
        "    time.sleep(0.02)\n"
        "'released'"
    )
    try:
        result = worker.run(code, timeout=8, on_event=on_event)
    finally:
        worker.close()
    assert seen == ["stdout"]
    assert result.error is None, result.error
    assert result.value == "released"


def test_keepalive_comments_cross_the_router_on_an_idle_stream(routed: Routed) -> None:
    token = secrets.token_hex(16)
    worker = routed.connect("pod-a", token)
    try:
        assert worker.run("import time\ntime.sleep(0.8)\n8").value == 8  # skipped by the judge
        with (
            httpx.Client(verify=RemoteTLS(ca_file=routed.certs.ca).ssl_context()) as http,
            http.stream(
                "POST",
                routed.router.url + "/run",
                json={"code": "import time\ntime.sleep(0.8)\n7"},
                headers={**routed.headers("pod-a"), TOKEN_HEADER: token},
            ) as r,
        ):
            raw = b"".join(r.iter_raw())
        assert raw.count(b": keep-alive\n\n") >= 2
        assert b"event: done" in raw
    finally:
        worker.close()


def test_nothing_is_left_running(routed: Routed) -> None:
    worker = routed.connect("pod-b", secrets.token_hex(16))
    pid = routed.pods["pod-b"].worker.proc.pid
    worker.close()  # POST /shutdown through the router: the pod ends its worker
    routed.pods["pod-b"].worker.wait_exit(10)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
