"""The typed record that crosses from worker to host: the handshake (`_wire.Hello`).

A worker answers `GET /hello` with a `Hello` (its interpreter, its pid, and the
`SetupChecks` its set-up read back); the host reads it in one place
(`_host/intake/transport.decode_hello`, behind `WorkerClient.hello`). A real worker under
each provider sets every field of the record, and the checks its plan asks for; a handshake
the host cannot read (an unknown or a missing key, a value of the wrong type, more than
`HELLO_BYTES`, not JSON) is refused with an error naming what is wrong, at once, and a
start that meets one fails with that error and leaves nothing behind.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._errors import WorkerStartError
from agent_sandbox._host.intake.transport import WorkerClient
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox._wire import HELLO_BYTES, Hello, HelloError, SetupChecks
from agent_sandbox.providers import LaunchPlan, WorkerSpec, get_provider
from agent_sandbox.providers._subprocess import SubprocessProvider
from tests.providers.conftest import accepted_for

GOOD: dict[str, Any] = {
    "pid": 7,
    "version": [3, 11, 2],
    "prefix": "/opt/venv",
    "base_prefix": "/usr",
    "executable": "/opt/venv/bin/python",
    "worker_id": "w-1",
    "checks": {"no_new_privs": 1, "cap_eff": "0" * 16, "landlock": {"abi": 7}},
}

#: The checks each provider's worker reports for the default policy, where the provider is
#: available here (the kernel steps its plan asks for, read back; every worker reports its
#: rlimits and its guards). A check listed for no provider is a dead field of the record.
KERNEL_READBACK = {"no_new_privs", "cap_eff", "seccomp", "threads"}
EXPECTED_CHECKS: dict[str, set[str]] = {
    "subprocess": {"rlimits", "guards"},
    "landlock": {"rlimits", "guards", "scratch_tmpfs", "caps_dropped", "landlock"}
    | {"exec_denied"}
    | KERNEL_READBACK,
    "unshare": {"rlimits", "guards", "caps_dropped", "landlock", "exec_denied"} | KERNEL_READBACK,
    "bwrap": {"rlimits", "guards", "landlock", "exec_denied"} | KERNEL_READBACK,
}


# -- the record ---------------------------------------------------------------------------


def test_a_handshake_round_trips_through_its_wire_form() -> None:
    """It reads a well-formed handshake into typed fields and writes back the same JSON."""
    hello = Hello.from_dict(json.loads(json.dumps(GOOD)))
    assert hello.version == (3, 11, 2) and hello.pid == 7
    assert isinstance(hello.checks, SetupChecks) and hello.checks.landlock == {"abi": 7}
    assert hello.checks.seccomp is None and "seccomp" not in hello.checks
    assert hello.to_dict() == GOOD
    with pytest.raises(AttributeError, match="immutable"):
        hello.pid = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"pidd": 7}, r"unknown pidd"),
        ({"pid": None}, r"pid must be an integer, not NoneType"),
        ({"pid": "7"}, r"pid must be an integer, not str"),
        ({"pid": True}, r"pid must be an integer, not bool"),
        ({"pid": 0}, r"pid must be positive"),
        ({"version": [3, 11]}, r"version must be \[major, minor, micro\]"),
        ({"version": "3.11.2"}, r"version must be a JSON array, not str"),
        ({"base_prefix": ["/usr"]}, r"base_prefix must be a string, not list"),
        ({"checks": []}, r"checks must be a JSON object, not list"),
        ({"checks": {"landlok": {}}}, r"checks has unknown landlok"),
        ({"checks": {"threads": "1"}}, r"checks's threads must be an integer, not str"),
        ({"checks": {"exec_denied": 1}}, r"exec_denied must be true or false, not int"),
    ],
)
def test_a_malformed_handshake_is_refused_naming_what_is_wrong(
    change: dict[str, Any], words: str
) -> None:
    with pytest.raises(HelloError, match=words):
        Hello.from_dict({**GOOD, **change})


def test_a_handshake_missing_fields_is_refused_naming_them() -> None:
    data = {k: v for k, v in GOOD.items() if k not in ("pid", "checks")}
    with pytest.raises(HelloError, match=r"missing checks, pid"):
        Hello.from_dict(data)
    with pytest.raises(HelloError, match=r"must be a JSON object, not list"):
        Hello.from_dict([GOOD])


# -- through the host's transport ---------------------------------------------------------


def _serve_once(path: str, body: bytes) -> threading.Thread:
    """Answer one request on a Unix socket at `path` with `body` (JSON content)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
        except OSError:
            pass  # the host stopped reading
        finally:
            conn.close()
            listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (json.dumps({**GOOD, "extra": 1}).encode(), r"unknown extra"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "version"}).encode(), r"missing"),
        (json.dumps({**GOOD, "pid": "7"}).encode(), r"pid must be an integer"),
        (json.dumps({**GOOD, "executable": "x" * HELLO_BYTES}).encode(), r"more than 65536"),
        (b"[" * 60_000 + b"]" * 60_000, r"more than 65536"),
        (b"[" * 30_000 + b"]" * 30_000, r"not JSON \(or nested too deep\)"),
        (b"{not json", r"not JSON"),
    ],
    ids=["unknown", "missing", "wrong-type", "oversized", "oversized-nesting", "nested", "junk"],
)
def test_the_host_refuses_a_malformed_handshake_at_once(
    tmp_path: Path, body: bytes, words: str
) -> None:
    """`WorkerClient.hello` raises HelloError naming what is wrong, well inside its timeout
    (it never waits for more of a handshake it has refused)."""
    path = str(tmp_path / "ctl.sock")
    thread = _serve_once(path, body)
    client = WorkerClient(path, "t", 4 * 1024 * 1024)
    t0 = time.monotonic()
    try:
        with pytest.raises(HelloError, match=words):
            client.hello(10.0)
    finally:
        client.close()
        thread.join(10)
    assert time.monotonic() - t0 < 5.0
    assert not thread.is_alive()


# -- through a start ----------------------------------------------------------------------

#: A "worker" that answers the handshake with `sys.argv[2]` (JSON) on the listening socket
#: it inherited (`sys.argv[1]`), and nothing else.
_FAKE = textwrap.dedent(
    """
    import socket, sys
    listener = socket.socket(fileno=int(sys.argv[1]))
    conn, _ = listener.accept()
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        head += conn.recv(4096)
    body = sys.argv[2].encode()
    conn.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\n"
                 b"content-length: %d\\r\\n\\r\\n%s" % (len(body), body))
    conn.recv(1)
    """
)


class _FakeHello(SubprocessProvider):
    """The subprocess provider's plan, running `_FAKE` instead of the worker."""

    def __init__(self, hello: Any) -> None:
        self.hello = hello

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        import dataclasses

        plan = super().build(policy, spec)
        argv = (sys.executable, "-c", _FAKE, str(spec.listen_fd), json.dumps(self.hello))
        return dataclasses.replace(plan, argv=argv, worker_depth=0, keeper=False)


@pytest.fixture
def control_dirs() -> Iterator[set[str]]:
    """The worker control directories that exist before the test (none of its own stays)."""
    from agent_sandbox._host import lifecycle

    tmp = Path(tempfile.gettempdir())
    prefix = lifecycle.control_dir_prefix()
    before = {str(p) for p in tmp.glob(prefix + "*")}
    yield before
    after = {str(p) for p in tmp.glob(prefix + "*")}
    assert after <= before, after - before


@pytest.mark.parametrize(
    ("hello", "words"),
    [
        ({**GOOD, "surprise": True}, r"its handshake was refused: the handshake has unknown"),
        ({**GOOD, "checks": {"threads": "one"}}, r"threads must be an integer, not str"),
        ({"pid": 1}, r"missing base_prefix, checks, executable, prefix, version, worker_id"),
    ],
    ids=["unknown", "wrong-type", "missing"],
)
def test_a_start_whose_worker_answers_a_malformed_handshake_fails_and_leaves_nothing(
    hello: Any, words: str, control_dirs: set[str]
) -> None:
    """It fails the start with the record's own words, within its start timeout, and
    removes what the start made."""
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match=words):
        WorkerProcess.start(Policy(name="t"), _FakeHello(hello), start_timeout=10)
    assert time.monotonic() - t0 < 8.0


# -- a real worker sets every field -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED_CHECKS))
def test_a_real_worker_sets_every_field_and_the_checks_its_plan_asks_for(name: str) -> None:
    """Under each provider available here, the worker's handshake is a `Hello` with every
    field set (its pid, its interpreter as the host's) and exactly the checks its plan's
    kernel steps read back."""
    provider = get_provider(name)
    if not provider.probe().available:
        pytest.skip(f"{name} is not available here")
    policy = Policy(name="t", **accepted_for(name))
    worker = WorkerProcess.start(policy, provider)
    try:
        hello = worker.hello
        assert isinstance(hello, Hello)
        assert all(getattr(hello, field) is not None for field in Hello.__slots__)
        assert hello.version == tuple(sys.version_info[:3]) and hello.pid > 0
        assert hello.worker_id == worker.id
        assert set(hello.checks) == EXPECTED_CHECKS[name], name
    finally:
        worker.close()


@pytest.mark.parametrize("name", ["unshare", "bwrap"])
def test_a_worker_with_a_net_rule_and_a_grant_reports_its_egress_and_pins(
    name: str, tmp_path: Path
) -> None:
    """With a `[net]` rule and a read grant, a namespace provider's worker also reports the
    port of its egress proxy listener and the grants it checked against the host's pins."""
    provider = get_provider(name)
    if not provider.probe().available:
        pytest.skip(f"{name} is not available here")
    policy = Policy(
        name="t",
        net={"rules": [{"host": "api.example.com", "ports": 443}]},
        files={"read": [str(tmp_path)]},
    )
    worker = WorkerProcess.start(policy, provider)
    try:
        assert worker.hello is not None
        checks = worker.hello.checks
        assert set(checks) == EXPECTED_CHECKS[name] | {"egress", "pins"}, name
        assert isinstance(checks.egress, int) and checks.egress > 0
        assert checks.pins == len(worker.plan.worker_setup["pins"]) if worker.plan else False
    finally:
        worker.close()


def test_every_check_is_reported_by_some_provider() -> None:
    """No field of `SetupChecks` is dead: each is in some provider's expected checks (the
    egress port and the pins with a `[net]` rule and a grant: the test above)."""
    used = set().union(*EXPECTED_CHECKS.values()) | {"egress", "pins"}
    assert used == set(SetupChecks.__slots__)
