"""Attacks on the remote channel, each named for what it tries: the wrong certificate, no
certificate, a replayed or forged bind, a stolen or missing token, a token fished from the
logs, plain text, and a hostile pod answering with oversized, malformed or endless streams.

The host must refuse each one with a clear error, never hang, and never run code on a worker
bound to someone else."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from agent_sandbox._errors import WorkerStartError
from agent_sandbox._host.intake.remote_transport import BIND_HEADER, TOKEN_HEADER, RemoteTLS
from agent_sandbox._host.remote.serve import ServeConfig, WorkerServer
from agent_sandbox._host.remote.worker import RemoteWorker
from agent_sandbox._wire import encode_event

from .conftest import BIND_SECRET, Certs, remote_policy, serve_config
from .fakes import HostilePod, serving, stream


def _config(certs: Certs, **changes: object) -> ServeConfig:
    return serve_config(certs, "subprocess", **changes)


@pytest.fixture
def server(certs: Certs) -> Iterator[WorkerServer]:
    with serving(_config(certs)) as srv:
        yield srv


def _url(server: WorkerServer) -> str:
    return f"https://127.0.0.1:{server.port}"


def _connect(server: WorkerServer, certs: Certs, token: str, **tls: object) -> RemoteWorker:
    return RemoteWorker.connect(
        remote_policy(),
        _url(server),
        token=token,
        bind_secret=BIND_SECRET,
        tls=certs.tls(**tls),
        start_timeout=15,
    )


def _raw(certs: Certs) -> httpx.Client:
    return httpx.Client(verify=RemoteTLS(ca_file=certs.ca, client_cert=certs.client).ssl_context())


# -- certificates ---------------------------------------------------------------------------


def test_wrong_server_certificate_is_refused(server: WorkerServer, certs: Certs) -> None:
    """A host that trusts only its CA refuses a worker whose certificate another CA signed
    (here: the host is given the rogue CA, so the real server's certificate does not verify)."""
    with pytest.raises(WorkerStartError, match="CERTIFICATE_VERIFY_FAILED"):
        _connect(server, certs, secrets.token_hex(16), ca_file=certs.rogue_ca)
    # Nothing was bound by the refused attempt.
    worker = _connect(server, certs, secrets.token_hex(16))
    assert worker.run("1").value == 1
    worker.close()


def test_impostor_worker_with_a_rogue_certificate_is_refused(certs: Certs) -> None:
    """A pod impersonating the worker with a certificate from another CA gets no bind (and so
    neither the policy nor the token hash)."""
    seen: list[bytes] = []
    pod = HostilePod(certs.rogue_server, {}, lambda s, c: seen.append(b"run"))
    with pod, pytest.raises(WorkerStartError, match="CERTIFICATE_VERIFY_FAILED"):
        RemoteWorker.connect(
            remote_policy(),
            pod.url,
            token="t" * 32,
            bind_secret=BIND_SECRET,
            tls=certs.tls(),
            start_timeout=5,
        )
    assert seen == []


@pytest.mark.parametrize("client", ["none", "rogue"])
def test_client_without_a_trusted_certificate_is_refused_by_mtls(
    server: WorkerServer, certs: Certs, client: str
) -> None:
    cert = None if client == "none" else certs.rogue_client
    with pytest.raises(WorkerStartError, match="cannot reach"):
        _connect(server, certs, secrets.token_hex(16), client_cert=cert)
    assert server.worker is None  # not bound


# -- bind -----------------------------------------------------------------------------------


def _bind_body(token: str) -> dict[str, object]:
    policy = remote_policy()
    return {
        "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
        "policy": policy.model_dump(mode="json", by_alias=True),
        "fingerprint": policy.fingerprint(),
    }


def test_bind_without_the_bootstrap_secret_is_refused(server: WorkerServer, certs: Certs) -> None:
    with _raw(certs) as http:
        for secret in (None, "wrong-" + BIND_SECRET):
            headers = {BIND_HEADER: secret} if secret else {}
            r = http.post(_url(server) + "/v1/bind", json=_bind_body("x" * 32), headers=headers)
            assert r.status_code == 403
    assert server.worker is None
    worker = _connect(server, certs, secrets.token_hex(16))  # still warm and bindable
    assert worker.run("2").value == 2
    worker.close()


def test_replayed_bind_is_refused_and_changes_nothing(server: WorkerServer, certs: Certs) -> None:
    """The same bind sent again (a replay), or a bind with another token, gets 409; the
    attacker's token opens nothing and the session's token still works."""
    token = secrets.token_hex(16)
    worker = _connect(server, certs, token)
    worker.run("secret = 'kept'")
    attacker = secrets.token_hex(16)
    with _raw(certs) as http:
        for body in (_bind_body(token), _bind_body(attacker)):
            r = http.post(_url(server) + "/v1/bind", json=body, headers={BIND_HEADER: BIND_SECRET})
            assert r.status_code == 409
        r = http.get(_url(server) + "/hello", headers={TOKEN_HEADER: attacker})
        assert r.status_code == 403
    with pytest.raises(WorkerStartError, match="bound to another session"):
        _connect(server, certs, attacker)
    assert worker.run("secret").value == "kept"
    worker.close()


def test_requests_without_or_with_a_wrong_token_are_refused(
    server: WorkerServer, certs: Certs
) -> None:
    token = secrets.token_hex(16)
    with _raw(certs) as http:
        # Before the bind no token works (there is none).
        assert http.get(_url(server) + "/hello", headers={TOKEN_HEADER: token}).status_code == 403
        worker = _connect(server, certs, token)
        for headers in ({}, {TOKEN_HEADER: token[:-1]}, {"authorization": "Bearer " + token}):
            r = http.post(_url(server) + "/run", json={"code": "1"}, headers=headers)
            assert r.status_code == 403
        assert http.get(_url(server) + "/healthz").json() == {"ready": True}
    assert worker.run("3").value == 3
    worker.close()


def test_the_token_and_bind_secret_never_reach_logs_or_replies(
    server: WorkerServer, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    token = secrets.token_hex(16)
    caplog.set_level(logging.DEBUG)
    worker = _connect(server, certs, token)
    result = worker.run("print('hi')\n1")
    assert result.value == 1
    texts = [
        caplog.text,
        json.dumps(worker.hello.to_dict()),
        repr(result),
        json.dumps(result.to_dict()),
    ]
    worker.close()
    for text in texts:
        assert token not in text
        assert BIND_SECRET not in text
        assert hashlib.sha256(token.encode()).hexdigest() not in text
    assert "bound a session" in caplog.text  # the server did log, without the secrets


def test_plaintext_is_refused_unless_accepted(certs: Certs) -> None:
    with pytest.raises(ValueError, match="plain HTTP"):
        RemoteTLS().check_url("http://127.0.0.1:8888")
    with pytest.raises(ValueError, match="--plaintext accepted"):
        ServeConfig(host="127.0.0.1", port=0, bind_secret=BIND_SECRET).check()
    with pytest.raises(ValueError, match="bind secret"):
        _config(certs, bind_secret=None).check()
    # The explicit opt-out works end to end.
    config = ServeConfig(
        host="127.0.0.1",
        port=0,
        bind_secret=BIND_SECRET,
        plaintext="accepted",
        provider="subprocess",
    )
    with serving(config) as srv:
        worker = RemoteWorker.connect(
            remote_policy(),
            f"http://127.0.0.1:{srv.port}",
            token=secrets.token_hex(16),
            bind_secret=BIND_SECRET,
            tls=RemoteTLS(plaintext="accepted"),
        )
        assert worker.run("4").value == 4
        worker.close()


# -- the stream -----------------------------------------------------------------------------


def test_keepalive_comments_flow_on_an_idle_stream(certs: Certs) -> None:
    with serving(_config(certs, keepalive=0.2)) as srv:
        token = secrets.token_hex(16)
        worker = _connect(srv, certs, token)
        # The host's judge reads the comments and skips them.
        assert worker.run("import time\ntime.sleep(1)\n8").value == 8
        with (
            _raw(certs) as http,
            http.stream(
                "POST",
                _url(srv) + "/run",
                json={"code": "import time\ntime.sleep(1)\n7"},
                headers={TOKEN_HEADER: token},
            ) as r,
        ):
            raw = b"".join(r.iter_raw())
        assert raw.count(b": keep-alive\n\n") >= 2
        worker.close()


def test_the_pod_enforces_the_wall_time_itself(certs: Certs) -> None:
    """A host that never gives up (no client deadline) still sees the call end: the pod kills
    its worker past `wall` plus a grace, and the session ends."""
    with serving(_config(certs, keepalive=0.2)) as srv:
        token = secrets.token_hex(16)
        _connect(srv, certs, token)
        with (
            _raw(certs) as http,
            http.stream(
                "POST",
                _url(srv) + "/run",
                json={"code": "import time\ntime.sleep(60)", "wall": 0.5},
                headers={TOKEN_HEADER: token},
                timeout=30,
            ) as r,
        ):
            # The event: the server ends the stream itself (its 60 s sleep never finishes).
            with pytest.raises(httpx.RemoteProtocolError):
                b"".join(r.iter_raw())
        for _ in range(50):
            if srv._stop.is_set():
                break
            time.sleep(0.1)
        assert srv.exit_reason == "its worker ended"


def test_idle_exit_after_bind(certs: Certs) -> None:
    config = _config(certs, idle_exit=0.5)
    server = WorkerServer(config)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        worker = _connect(server, certs, secrets.token_hex(16))
        inner = worker.hello["pid"]
        thread.join(10)
        assert not thread.is_alive() and server.exit_reason.startswith("idle")
        assert server.worker is not None and not server.worker.alive()
        assert inner > 0
    finally:
        server.stop("test over")
        thread.join(5)


def test_a_second_call_on_a_busy_session_is_refused_not_queued(
    server: WorkerServer, certs: Certs
) -> None:
    token = secrets.token_hex(16)
    first = _connect(server, certs, token)
    second = _connect(server, certs, token)  # the same thread in another process: adopted
    assert second.adopted
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(first.run("import time\ntime.sleep(1.5)\n1")))
    t.start()
    time.sleep(0.5)
    busy = second.run("2")
    t.join()
    assert busy.error is not None and busy.error.rule == "remote.busy"
    assert out[0].value == 1  # type: ignore[attr-defined]
    assert second.run("3").value == 3  # nothing was discarded
    first.close()


# -- a hostile pod ----------------------------------------------------------------------------


def _hostile(certs: Certs, chunks: list[bytes], **kw: object) -> HostilePod:
    remote = {"fingerprint": remote_policy().fingerprint(), "stack": ["landlock"], "provider": "x"}
    return HostilePod(certs.server, remote, stream(chunks, **kw))  # type: ignore[arg-type]


def _call(pod: HostilePod, certs: Certs, code: str = "1", timeout: float = 5.0):  # type: ignore[no-untyped-def]
    worker = RemoteWorker.connect(
        remote_policy(),
        pod.url,
        token="t" * 32,
        bind_secret=BIND_SECRET,
        tls=certs.tls(),
        start_timeout=5,
    )
    try:
        return worker.run(code, timeout=timeout), worker
    finally:
        worker.close()


def test_oversized_events_from_a_hostile_pod_are_cut_at_the_cap(certs: Certs) -> None:
    start = encode_event("start", {"call": 1})
    huge = encode_event("stdout", "x" * 5_000_000)
    with _hostile(certs, [start, huge, encode_event("done", {"duration": 0})]) as pod:
        result, worker = _call(pod, certs)
    assert result.error is not None and result.error.rule == "limits.output"
    assert len(result.stdout) <= 100_000
    assert not worker.alive()


def test_malformed_events_from_a_hostile_pod_discard_it(certs: Certs) -> None:
    start = encode_event("start", {"call": 1})
    with _hostile(certs, [start, b"event: exec\ndata: {}\n\n"]) as pod:
        result, _ = _call(pod, certs)
    assert result.error is not None and result.error.rule == "worker.protocol"


def test_a_comment_cannot_hide_an_event(certs: Certs) -> None:
    start = encode_event("start", {"call": 1})
    with _hostile(certs, [start, b": keep-alive\nevent: result\ndata: 1\n\n"]) as pod:
        result, _ = _call(pod, certs)
    assert result.error is not None and result.error.rule == "worker.protocol"


def test_an_endless_trickle_still_ends_at_the_deadline(certs: Certs) -> None:
    start = encode_event("start", {"call": 1})
    # A trickle far longer than the test's own timeout (20 000 comments, 10 ms apart): the
    # call can only return because its 1 s deadline ended it.
    chunks = [start] + [b": keep-alive\n\n"] * 20_000
    with _hostile(certs, chunks, end=False, delay=0.01) as pod:
        result, _ = _call(pod, certs, timeout=1.0)
    assert result.error is not None and result.error.rule == "limits.timeout"


def test_a_stream_cut_before_done_is_a_crash(certs: Certs) -> None:
    start = encode_event("start", {"call": 1})
    with _hostile(certs, [start, encode_event("stdout", "partial")], end=True) as pod:
        result, _ = _call(pod, certs)
    assert result.error is not None and result.error.kind == "crashed"


def test_a_pod_without_a_kernel_boundary_is_refused(certs: Certs) -> None:
    """A pod that reports no kernel boundary is refused for a policy that did not opt out."""
    strict = remote_policy(provider="auto", no_kernel_boundary="")
    remote = {"fingerprint": strict.fingerprint(), "stack": ["subprocess"], "provider": "x"}
    with HostilePod(certs.server, remote, stream([])) as pod:
        with pytest.raises(WorkerStartError, match="no kernel boundary"):
            RemoteWorker.connect(
                strict, pod.url, token="t" * 32, bind_secret=BIND_SECRET, tls=certs.tls()
            )


def test_a_pod_running_another_policy_is_refused(certs: Certs) -> None:
    remote = {"fingerprint": "0" * 16, "stack": ["landlock"], "provider": "x"}
    with HostilePod(certs.server, remote, stream([])) as pod:
        with pytest.raises(WorkerStartError, match="runs policy"):
            RemoteWorker.connect(
                remote_policy(),
                pod.url,
                token="t" * 32,
                bind_secret=BIND_SECRET,
                tls=certs.tls(),
            )
