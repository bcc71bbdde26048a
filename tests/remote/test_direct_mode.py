"""Direct pod-IP mode (`--hop direct`, inside the cluster, no router): one certificate serves
every pod of a template, so it cannot name each pod's IP; `RemoteTLS(server_name=...)` checks
it against a fixed name instead (also sent as SNI), on both the httpx path (bind, handshake)
and the client's own socket (calls)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from agent_sandbox._errors import WorkerStartError
from agent_sandbox._host.intake import remote_transport
from agent_sandbox._host.intake.remote_transport import RemoteTLS
from agent_sandbox._host.remote.serve import ServeConfig, WorkerServer
from agent_sandbox._host.remote.worker import RemoteWorker

from .conftest import BIND_SECRET, remote_policy
from .fakes import serving

NAME = "ags-worker.agents.svc"


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """(CA, a pod certificate naming only NAME, one naming another service)."""
    import trustme

    d = tmp_path_factory.mktemp("named")
    ca = trustme.CA()
    paths = []
    for file, pem in (
        ("ca.pem", ca.cert_pem),
        ("pod.pem", ca.issue_cert(NAME).private_key_and_cert_chain_pem),
        ("other.pem", ca.issue_cert("other.agents.svc").private_key_and_cert_chain_pem),
    ):
        pem.write_to_path(os.path.join(d, file))
        paths.append(os.path.join(d, file))
    yield paths[0], paths[1], paths[2]


def _server(cert: str) -> ServeConfig:
    return ServeConfig(
        host="127.0.0.1",
        port=0,
        tls_cert=cert,
        tls_key=cert,
        bind_secret=BIND_SECRET,
        provider="subprocess",
    )


def _connect(server: WorkerServer, tls: RemoteTLS) -> RemoteWorker:
    return RemoteWorker.connect(
        remote_policy(),
        f"https://127.0.0.1:{server.port}",  # the pod's IP, which the certificate lacks
        token=secrets.token_hex(16),
        bind_secret=BIND_SECRET,
        tls=tls,
        start_timeout=15,
    )


@pytest.mark.parametrize("direct", [True, False])
def test_a_pod_ip_is_checked_against_the_fixed_name(
    named: tuple[str, str, str], direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote_transport, "DIRECT_RUNS", direct)
    ca, pod, _ = named
    with serving(_server(pod)) as server:
        worker = _connect(server, RemoteTLS(ca_file=ca, server_name=NAME))
        try:
            assert worker.run("6 * 7").value == 42
        finally:
            worker.close()


def test_it_denies_a_pod_ip_without_the_name_override(named: tuple[str, str, str]) -> None:
    """It denies the connection: the certificate does not name the IP dialled."""
    ca, pod, _ = named
    with serving(_server(pod)) as server:
        with pytest.raises(WorkerStartError, match=r"certificate|TLS|handshake"):
            _connect(server, RemoteTLS(ca_file=ca))
        assert not server._bound


def test_it_denies_a_pod_whose_certificate_names_another_service(
    named: tuple[str, str, str],
) -> None:
    ca, _, other = named
    with serving(_server(other)) as server:
        with pytest.raises(WorkerStartError, match=r"certificate|TLS|handshake"):
            _connect(server, RemoteTLS(ca_file=ca, server_name=NAME))
        assert not server._bound
