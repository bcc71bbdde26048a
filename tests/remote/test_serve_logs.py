"""The session token and the bind secret never reach what a pod's process writes.

`agent-sandbox worker serve` runs here as the pod runs it, a process of its own, with every
logger at DEBUG and its output (and its worker's, which inherits it) captured whole; the
test then goes through a session's life and the attacks that touch the secrets: a bind, a
replayed bind, calls with a wrong and a missing token, a call that prints, an interrupt,
a shutdown. Neither secret, nor the token's hash (what the pod keeps), appears anywhere in
that output, in any reply, or in the result."""

from __future__ import annotations

import hashlib
import os
import secrets
import select
import subprocess
import sys
from pathlib import Path

import httpx

from agent_sandbox._host.intake.remote_transport import BIND_HEADER, TOKEN_HEADER, RemoteTLS
from agent_sandbox._host.remote.worker import RemoteWorker

from .conftest import Certs, remote_policy

_LAUNCH = (
    "import logging, sys, runpy; logging.basicConfig(level=logging.DEBUG); "
    "sys.argv = ['agent-sandbox', *sys.argv[1:]]; "
    "runpy.run_module('agent_sandbox', run_name='__main__')"
)


def test_no_secret_reaches_the_pods_output(certs: Certs, tmp_path: Path) -> None:
    secret = "bind-" + secrets.token_hex(16)
    token = secrets.token_hex(16)
    log = tmp_path / "serve.log"
    argv = [
        sys.executable,
        "-c",
        _LAUNCH,
        "worker",
        "serve",
        "--listen",
        "tcp://127.0.0.1:0",
        "--tls-cert",
        certs.server,
        "--tls-key",
        certs.server,
        "--client-ca",
        certs.ca,
        "--provider",
        "subprocess",
    ]
    env = {**os.environ, "AGENT_SANDBOX_BIND_SECRET": secret}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=out, env=env)
    replies: list[str] = []
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "worker serve did not start"
        first = proc.stdout.readline().decode()
        assert first.startswith("listening on tcp://"), first
        url = "https://" + first.strip()[len("listening on tcp://") :]
        tls = RemoteTLS(ca_file=certs.ca, client_cert=certs.client)
        policy = remote_policy(no_kernel_boundary="accepted")
        worker = RemoteWorker.connect(policy, url, token=token, bind_secret=secret, tls=tls)
        try:
            result = worker.run(f"print('hello')\n{token!r}[::-1]")
            assert result.stdout == "hello\n"
            replies += [repr(result), repr(worker.hello)]
            with httpx.Client(verify=tls.ssl_context()) as http:
                payload = {
                    "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
                    "policy": policy.model_dump(mode="json", by_alias=True, exclude={"remote"}),
                    "fingerprint": policy.fingerprint(),
                }
                for response in (
                    http.post(url + "/v1/bind", json=payload, headers={BIND_HEADER: secret}),
                    http.post(url + "/v1/bind", json=payload, headers={BIND_HEADER: token}),
                    http.post(url + "/run", json={"code": "1"}, headers={TOKEN_HEADER: secret}),
                    http.post(url + "/run", json={"code": "1"}),
                    http.get(url + "/hello", headers={"Authorization": "Bearer " + token}),
                ):
                    assert response.status_code in (403, 409), response.text
                    replies.append(response.text + repr(response.headers))
            assert worker.interrupt(0.1) is False  # nothing running; the route answers
            assert worker.run("2").value == 2
        finally:
            worker.close()  # POST /shutdown: the pod exits
        proc.wait(30)
        rest = proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    output = log.read_text(errors="replace") + rest
    assert "bound a session" in output  # the DEBUG logging reached the file
    assert "exiting:" in rest
    for text in (output, *replies):
        assert token not in text
        assert secret not in text
        assert hashlib.sha256(token.encode()).hexdigest() not in text
