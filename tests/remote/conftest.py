"""Fixtures for the remote transport: certificates made here (trustme), loopback workers.

`certs` is a throw-away CA with a server certificate for 127.0.0.1/localhost and a client
certificate (mTLS), plus a rogue CA for the wrong-certificate attacks; all in one temporary
directory removed at the end of the session. `backend` starts `agent-sandbox worker serve`
processes on loopback (`LocalClaimBackend`) and ends them at the end of the module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import tempfile
from collections.abc import Iterator

import pytest

from agent_sandbox import Policy
from agent_sandbox._host.intake.remote_transport import RemoteTLS
from agent_sandbox._host.remote.provider import (
    LocalClaimBackend,
    RemoteProvider,
    ServerFiles,
)
from agent_sandbox._host.remote.serve import ServeConfig

#: Without the test certificates' maker or the remote extra, this folder is not collected
#: (a skip raised in a conftest would stop the whole run instead).
MISSING = [m for m in ("trustme", "httpx") if importlib.util.find_spec(m) is None]
if MISSING:
    collect_ignore_glob = ["test_*.py"]

BIND_SECRET = "bind-" + secrets.token_hex(16)
SESSION_KEY = secrets.token_bytes(32)


@dataclasses.dataclass(frozen=True)
class Certs:
    dir: str
    ca: str
    server: str  # key + chain, one PEM
    client: str  # key + chain, one PEM
    rogue_ca: str
    rogue_server: str
    rogue_client: str

    def files(self, mtls: bool = True) -> ServerFiles:
        return ServerFiles(self.server, self.server, self.ca if mtls else None)

    def tls(self, **changes: object) -> RemoteTLS:
        base = RemoteTLS(ca_file=self.ca, client_cert=self.client)
        return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def certs() -> Iterator[Certs]:
    import trustme

    with tempfile.TemporaryDirectory(prefix="agent-sandbox-certs-") as d:
        ca, rogue = trustme.CA(), trustme.CA()
        paths = {}
        for name, pem in (
            ("ca", ca.cert_pem),
            ("server", ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem),
            ("client", ca.issue_cert("agent@tenant.example").private_key_and_cert_chain_pem),
            ("rogue_ca", rogue.cert_pem),
            (
                "rogue_server",
                rogue.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem,
            ),
            (
                "rogue_client",
                rogue.issue_cert("agent@tenant.example").private_key_and_cert_chain_pem,
            ),
        ):
            path = os.path.join(d, name + ".pem")
            pem.write_to_path(path)
            paths[name] = path
        yield Certs(dir=d, **paths)


def remote_policy(**changes: object) -> Policy:
    """The contract tests' policy: the Python layer only inside the worker (no kernel
    provider in the loopback 'pod'), accepted in so many words."""
    base: dict[str, object] = dict(
        name="test-remote",
        provider="subprocess",
        no_kernel_boundary="accepted",
        imports={"allow": ["math", "json", "time", "os", "sys", "signal", "asyncio"]},
        api={"allow": ["process-control"]},
        limits={"wall_seconds": 10, "output_bytes": 100_000},
    )
    base.update(changes)
    return Policy(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def backend(certs: Certs) -> Iterator[LocalClaimBackend]:
    be = LocalClaimBackend(
        certs.files(), bind_secret=BIND_SECRET, warm=2, max_workers=6, provider="subprocess"
    )
    try:
        yield be
    finally:
        be.close()


@pytest.fixture
def remote(backend: LocalClaimBackend, certs: Certs) -> RemoteProvider:
    return RemoteProvider(
        backend, session_key=SESSION_KEY, bind_secret=BIND_SECRET, tls=certs.tls()
    )


def serve_config(certs: Certs, provider: str = "subprocess", **changes: object) -> ServeConfig:
    """A loopback `worker serve` configuration with the test certificates (mTLS), the test
    bind secret and `provider` inside, changed by `changes`."""
    config = ServeConfig(
        host="127.0.0.1",
        port=0,
        tls_cert=certs.server,
        tls_key=certs.server,
        client_ca=certs.ca,
        bind_secret=BIND_SECRET,
        provider=provider,
    )
    for key, value in changes.items():
        setattr(config, key, value)
    return config
