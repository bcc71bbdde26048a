"""`worker serve` before authentication: nothing of a body is read before the token or the
bind secret is checked, connections that have not authenticated are bounded (a setting) and
cut after `head_timeout`, health checks are not session activity, the certificate's dates are
checked at the start, and malformed or unknown requests get one-line 400 / 404 answers.

The flood (`test_an_unauthenticated_flood_leaves_the_server_bounded_and_serving`) runs a real
`worker serve` process and measures its memory and threads from `/proc`; its figures are
printed (`-s`)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from agent_sandbox._host.intake.remote_transport import BIND_HEADER, RemoteTLS
from agent_sandbox._host.remote.serve import ServeConfig, WorkerServer
from agent_sandbox._host.remote.serve_limits import cert_dates, check_cert_dates, default_pending
from agent_sandbox._host.remote.worker import RemoteWorker

from .conftest import BIND_SECRET, Certs, remote_policy
from .fakes import serving

MiB = 1024 * 1024


def _plain(**changes: object) -> ServeConfig:
    config = ServeConfig(
        host="127.0.0.1",
        port=0,
        plaintext="accepted",
        bind_secret=BIND_SECRET,
        provider="subprocess",
    )
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _exchange(port: int, data: bytes, *, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if not read:
            return b""
        out = b""
        while True:
            piece = sock.recv(65536)
            if not piece:
                return out
            out += piece


def _status_and_body(reply: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.fixture
def plain() -> Iterator[WorkerServer]:
    with serving(_plain()) as srv:
        yield srv


def test_it_denies_a_run_body_before_the_token_is_checked(plain: WorkerServer) -> None:
    """It denies a 16 MiB `/run` without a token from its head alone: the answer comes while
    the body has not been sent at all (the server would otherwise wait for it)."""
    head = b"POST /run HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (16 * MiB)
    status, body = _status_and_body(_exchange(plain.port, head))
    assert status == 403 and body == {"error": "missing or wrong session token"}


def test_it_denies_a_bind_body_before_the_secret_is_checked(plain: WorkerServer) -> None:
    """It denies a bind with a wrong secret from its head, the 1 MiB body never sent."""
    head = b"POST /v1/bind HTTP/1.1\r\nhost: x\r\n%b: wrong\r\ncontent-length: %d\r\n\r\n" % (
        BIND_HEADER.encode(),
        MiB,
    )
    status, body = _status_and_body(_exchange(plain.port, head))
    assert status == 403 and body == {"error": "missing or wrong bind secret"}
    assert not plain._bound


def test_an_empty_bind_body_is_a_one_line_400(plain: WorkerServer) -> None:
    head = b"POST /v1/bind HTTP/1.1\r\nhost: x\r\n%b: %b\r\nconnection: close\r\n" % (
        BIND_HEADER.encode(),
        BIND_SECRET.encode(),
    )
    status, body = _status_and_body(_exchange(plain.port, head + b"content-length: 0\r\n\r\n"))
    assert status == 400
    error = str(body["error"])
    assert error.startswith("bad bind request: empty body") and "\n" not in error
    assert "KeyError" not in error and not plain._bound


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"[]", "the body is not a JSON object"),
        (b"{", "the body is not JSON"),
        (b'{"policy": {}}', "missing token_sha256, fingerprint"),
        (b'{"token_sha256": "zz", "policy": {}, "fingerprint": "x"}', "token_sha256 must be"),
    ],
)
def test_a_malformed_bind_body_names_what_is_wrong(
    plain: WorkerServer, payload: bytes, expected: str
) -> None:
    head = b"POST /v1/bind HTTP/1.1\r\nhost: x\r\n%b: %b\r\nconnection: close\r\n" % (
        BIND_HEADER.encode(),
        BIND_SECRET.encode(),
    )
    reply = _exchange(plain.port, head + b"content-length: %d\r\n\r\n%b" % (len(payload), payload))
    status, body = _status_and_body(reply)
    assert status == 400 and expected in str(body["error"])


def test_unknown_paths_are_404_and_wrong_methods_405(plain: WorkerServer) -> None:
    status, body = _status_and_body(
        _exchange(plain.port, b"GET /admin HTTP/1.1\r\nhost: x\r\n\r\n")
    )
    assert status == 404 and body == {"error": "no such route"}
    status, _ = _status_and_body(_exchange(plain.port, b"GET /run HTTP/1.1\r\nhost: x\r\n\r\n"))
    assert status == 405


def test_a_malformed_request_is_a_one_line_400(plain: WorkerServer) -> None:
    status, body = _status_and_body(_exchange(plain.port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400
    assert str(body["error"]).startswith("malformed request") and "\n" not in str(body["error"])


def test_health_checks_do_not_keep_an_idle_session_alive() -> None:
    """Probes every 0.1 s (the shipped ones come every 2 s) while bound: `--idle-exit` fires."""
    server = WorkerServer(_plain(idle_exit=1.0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        worker = RemoteWorker.connect(
            remote_policy(),
            f"http://127.0.0.1:{server.port}",
            token=secrets.token_hex(16),
            bind_secret=BIND_SECRET,
            tls=RemoteTLS(plaintext="accepted"),
            start_timeout=15,
        )
        probes = 0
        while thread.is_alive() and probes < 600:
            with contextlib.suppress(OSError):
                _exchange(
                    server.port, b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                )
            probes += 1
            thread.join(0.1)
        assert not thread.is_alive(), "health checks kept the idle session alive"
        assert server.exit_reason.startswith("idle") and probes >= 5
        worker.close()
    finally:
        server.stop("test over")
        thread.join(5)


def test_unauthenticated_connections_are_bounded_and_cut() -> None:
    """It denies more than `max_pending` unauthenticated connections (closed at accept, no
    thread) and cuts those it holds once `head_timeout` passes without a head."""
    with serving(_plain(max_pending=4, head_timeout=0.5)) as srv:
        before = threading.active_count()
        socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(12)]
        try:
            for sock in socks:
                sock.settimeout(10)
            # Each held one gets its cut; the others their close, at accept: all see EOF.
            ends = [sock.recv(1) for sock in socks]
            assert ends == [b""] * 12
            assert srv.refused >= 8
        finally:
            for sock in socks:
                sock.close()
        peak = max(0, threading.active_count() - before)
        assert peak <= 4
        # Still serving: a health check answers.
        status, _ = _status_and_body(
            _exchange(srv.port, b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        )
        assert status == 200


def test_the_default_bound_follows_the_memory_limit() -> None:
    assert default_pending(256 * 1024, 128, limit=768 * MiB) == 192
    assert default_pending(256 * 1024, 128, limit=64 * MiB) == 16
    assert default_pending(256 * 1024, 128, limit=16 * MiB) == 8
    assert default_pending(256 * 1024, 128, limit=64 * 1024 * MiB) == 256


# -- certificate dates --------------------------------------------------------------------


def _issue(tmp_path: object, **dates: datetime.datetime) -> str:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", **dates)  # type: ignore[arg-type]
    path = os.path.join(str(tmp_path), "cert.pem")
    cert.private_key_and_cert_chain_pem.write_to_path(path)
    return path


def test_it_refuses_to_start_with_an_expired_certificate(tmp_path: object) -> None:
    now = datetime.datetime.now(datetime.UTC)
    path = _issue(
        tmp_path,
        not_before=now - datetime.timedelta(days=30),
        not_after=now - datetime.timedelta(days=1),
    )
    config = ServeConfig(host="127.0.0.1", port=0, tls_cert=path, tls_key=path, bind_secret="s")
    with pytest.raises(ValueError, match=r"expired .* renew the Secret"):
        config.check()


def test_it_refuses_to_start_with_a_certificate_not_yet_valid(tmp_path: object) -> None:
    now = datetime.datetime.now(datetime.UTC)
    path = _issue(
        tmp_path,
        not_before=now + datetime.timedelta(days=1),
        not_after=now + datetime.timedelta(days=30),
    )
    config = ServeConfig(host="127.0.0.1", port=0, tls_cert=path, tls_key=path, bind_secret="s")
    with pytest.raises(ValueError, match="not valid before"):
        config.check()


def test_the_certificate_dates_are_read_from_its_der(certs: Certs) -> None:
    with open(certs.server, "rb") as fh:
        not_before, not_after = cert_dates(fh.read())
    now = datetime.datetime.now(datetime.UTC)
    assert not_before < now < not_after
    check_cert_dates(certs.server)  # valid: no error
    with pytest.raises(ValueError, match="expired"):
        check_cert_dates(certs.server, now=not_after + datetime.timedelta(seconds=1))


# -- the flood ----------------------------------------------------------------------------


def _proc_figures(pid: int) -> tuple[int, int]:
    """(VmRSS in KiB, threads) of `pid`."""
    rss = threads = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


@contextlib.contextmanager
def _serve_process(*extra: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    env = {**os.environ, "AGENT_SANDBOX_BIND_SECRET": BIND_SECRET}
    argv = [sys.executable, "-m", "agent_sandbox", "worker", "serve"]
    argv += ["--listen", "tcp://127.0.0.1:0", "--plaintext", "accepted"]
    argv += ["--provider", "subprocess", "--exit-with-parent", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("listening on tcp://"), line
        yield proc, int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


def _slow_head(port: int, stop: threading.Event) -> None:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(b"POST /run HTTP/1.1\r\n")
        while not stop.is_set():
            s.sendall(b"x")  # one byte of a header name at a time, never finished
            if stop.wait(0.3):
                break


def _big_body(port: int) -> None:
    head = b"POST /run HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (16 * MiB)
    block = b"a" * MiB
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(head)
        for _ in range(16):
            s.sendall(block)


@pytest.mark.parametrize("given", [32, 0])
def test_an_unauthenticated_flood_leaves_the_server_bounded_and_serving(given: int) -> None:
    """It denies 1,000 unauthenticated connections (a third slow heads, a third 16 MiB
    bodies without a token, a third silent) their memory and threads: the server's threads
    stay within `--max-connections` (given, or its default here) plus its own, its memory
    within 48 MiB of its size once bound, and the bound session's calls go on through the
    flood."""
    from agent_sandbox._host.remote import serve as remote_serve

    flags = ["--max-connections", str(given)] if given else []
    max_pending = given or default_pending(remote_serve._CONN_BUDGET, remote_serve._DEFAULT_PENDING)
    with _serve_process(*flags, "--head-timeout", "2") as (proc, port):
        worker = RemoteWorker.connect(
            remote_policy(),
            f"http://127.0.0.1:{port}",
            token=secrets.token_hex(16),
            bind_secret=BIND_SECRET,
            tls=RemoteTLS(plaintext="accepted"),
            start_timeout=15,
        )
        try:
            assert worker.run("x = 1\nx").value == 1
            base_rss, base_threads = _proc_figures(proc.pid)
            peak = [base_rss, base_threads]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    with contextlib.suppress(OSError):
                        rss, threads = _proc_figures(proc.pid)
                        peak[0], peak[1] = max(peak[0], rss), max(peak[1], threads)
                    stop.wait(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            attackers: list[threading.Thread] = []
            silent: list[socket.socket] = []
            calls = []
            try:
                for i in range(1000):
                    if i % 100 == 99:
                        calls.append(worker.run("x += 1\nx").value)  # mid-flood
                        # Keep the test's own thread count bounded.
                        attackers = [a for a in attackers if a.is_alive()]
                    kind = i % 3
                    if kind == 0:
                        t = threading.Thread(target=_slow_head, args=(port, stop), daemon=True)
                    elif kind == 1:
                        t = threading.Thread(target=_big_body, args=(port,), daemon=True)
                    else:
                        with contextlib.suppress(OSError):
                            silent.append(socket.create_connection(("127.0.0.1", port), 5))
                        continue
                    t.start()
                    attackers.append(t)
                calls.append(worker.run("x").value)
            finally:
                stop.set()
                for t in attackers:
                    t.join(10)
                for s in silent:
                    s.close()
                sampler.join(5)
            assert calls == [*range(2, 12), 11]
            grown_mib = (peak[0] - base_rss) / 1024
            extra_threads = peak[1] - base_threads
            print(
                f"\nflood of 1000: RSS {base_rss / 1024:.1f} MiB bound -> peak "
                f"{peak[0] / 1024:.1f} MiB (+{grown_mib:.1f}); threads {base_threads} -> peak "
                f"{peak[1]} (+{extra_threads}, bound {max_pending})"
            )
            assert extra_threads <= max_pending + 1
            assert grown_mib < 48
            assert proc.poll() is None
        finally:
            worker.close()


def test_an_authenticated_connection_outlives_the_head_timeout() -> None:
    """`head_timeout` bounds connections that have not authenticated; the session's own
    keep-alive connection waits `_READ_TIMEOUT` between calls and is reused."""
    import time

    with serving(_plain(head_timeout=0.3)) as srv:
        worker = RemoteWorker.connect(
            remote_policy(),
            f"http://127.0.0.1:{srv.port}",
            token=secrets.token_hex(16),
            bind_secret=BIND_SECRET,
            tls=RemoteTLS(plaintext="accepted"),
            start_timeout=15,
        )
        try:
            assert worker.run("x = 1\nx").value == 1
            client = worker.remote_client
            assert client is not None
            first = client._sock
            time.sleep(1.0)  # past the head timeout, idle between calls
            assert worker.run("x + 1").value == 2
            assert client._sock is first  # the same connection: not cut
        finally:
            worker.close()
