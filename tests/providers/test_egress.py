"""The host's egress proxy: host-name rules, host-side resolution and denials, no other way out.

No test reaches the internet: the servers are loopback servers started here, and names are
mapped to them by a resolver injected into the proxy (`resolver.set_resolver`). End-to-end
tests run for each namespace provider (`bwrap`, `unshare`); hostile ones use ctypes, so the
Python guards are not what refuses them.
"""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox, WorkerStartError
from agent_sandbox._denial import Denial
from agent_sandbox._host.egress.handoff import PROXY_PORT, EgressError
from agent_sandbox._host.egress.proxy import MAX_DENIALS, EgressProxy, Route, egress_proxy
from agent_sandbox._host.egress.resolver import set_resolver
from agent_sandbox._host.egress.rules import EgressRules
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers import get_provider

from .conftest import METADATA_STAND_IN, NATIVE, received_connection, skip_unless_available

NAMESPACE_PROVIDERS = ("unshare", "bwrap", "gvisor")


# -- servers and names ----------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = f"hello from {self.server.server_address[1]} {self.path}".encode()  # type: ignore[index]
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    def log_message(self, *args: Any) -> None:
        pass


class _Server:
    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        if context is not None:
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def http_server() -> Iterator[_Server]:
    server = _Server()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[tuple[_Server, Path]]:
    """An HTTPS server for `tls.test` and the CA file that verifies it."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("tls.test").configure_cert(context)
    folder = tmp_path / "ca"
    folder.mkdir()
    ca.cert_pem.write_to_path(str(folder / "ca.crt"))
    server = _Server(context)
    try:
        yield server, folder / "ca.crt"
    finally:
        server.close()


@pytest.fixture
def names() -> Iterator[dict[str, list[str]]]:
    """The proxy's resolver for this test: a dict the test fills; other names fail."""
    table: dict[str, list[str]] = {}

    def resolve(host: str) -> list[str]:
        if host not in table:
            raise OSError(f"[Errno -2] Name or service not known: {host!r}")
        return list(table[host])

    old = set_resolver(resolve)
    try:
        yield table
    finally:
        set_resolver(old)


@pytest.fixture(params=NAMESPACE_PROVIDERS)
def ns_provider(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    skip_unless_available(name)
    return name


def _policy(rules: list[dict[str, Any]], **extra: Any) -> Policy:
    data: dict[str, Any] = {
        "name": "egress-test",
        "imports": {"allow": ["requests", "urllib", "ssl", "socket", "os"]},
        "net": {"rules": rules},
        "limits": {"wall_seconds": 30},
    }
    data.update(extra)
    return Policy(**data)


def _net_denials(result: Any) -> list[Any]:
    return [d for d in result.denials if d.rule.startswith("net.") and not d.internal]


# -- the rules (pure) -------------------------------------------------------------------


def _rules(*rules: dict[str, Any]) -> EgressRules:
    return EgressRules(Policy(name="p", net={"rules": list(rules)}))


def test_a_name_rule_reaches_global_addresses_only() -> None:
    """A host-name rule reaches what the name resolves to, unless it is loopback, private,
    link-local or the metadata address: then a rule must name that address."""
    rules = _rules({"host": "api.example.com", "ports": "443"})
    assert rules.before_resolve("API.example.com.", 443) is None
    assert rules.judge("api.example.com", 443, ["93.184.216.34"], by_name=True) == (
        ["93.184.216.34"],
        None,
    )
    for address, kind in (
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("169.254.169.254", "metadata"),
        ("::ffff:127.0.0.1", "loopback"),
    ):
        usable, denial = rules.judge("api.example.com", 443, [address], by_name=True)
        assert usable == [] and denial is not None
        assert denial.rule == "net.connect" and kind in denial.detail
        assert denial.target == "api.example.com:443"
    named = _rules({"host": "svc.internal", "ports": "80"}, {"host": "10.1.2.3", "ports": "80"})
    assert named.judge("svc.internal", 80, ["10.1.2.3"], by_name=True)[0] == ["10.1.2.3"]


def test_a_wide_cidr_does_not_name_loopback_or_metadata() -> None:
    """`0.0.0.0/0` allows global addresses, never the host's loopback or the metadata one."""
    rules = _rules({"host": "0.0.0.0/0", "ports": "80"})
    assert rules.judge("93.184.216.34", 80, ["93.184.216.34"], by_name=False)[1] is None
    for address in ("127.0.0.1", "169.254.169.254", "192.168.1.1"):
        denial = rules.judge(address, 80, [address], by_name=False)[1]
        assert denial is not None and denial.rule == "net.connect"
    assert _rules({"host": "127.0.0.1", "ports": "80"}).judge(
        "127.0.0.1", 80, ["127.0.0.1"], by_name=False
    ) == (["127.0.0.1"], None)
    assert _rules({"host": "localhost", "ports": "80"}).judge(
        "127.0.0.1", 80, ["127.0.0.1"], by_name=False
    ) == (["127.0.0.1"], None)


def test_an_unnamed_host_is_refused_before_it_is_resolved() -> None:
    """A name no rule names is `net.resolve` (never looked up); a named host on another port
    is `net.connect` with the line that would allow it; a deny rule beats an allow."""
    rules = _rules(
        {"host": "api.example.com", "ports": "443"},
        {"host": "127.0.0.1", "ports": "8765"},
        {"host": "api.example.com", "ports": "443", "action": "deny"},
    )
    denial = rules.before_resolve("other.example.com", 443)
    assert denial is not None and denial.rule == "net.resolve"
    assert denial.target == "other.example.com"
    assert 'host = "other.example.com", ports = "443"' in denial.hint
    denial = _rules({"host": "api.example.com", "ports": "443"}).before_resolve(
        "api.example.com", 80
    )
    assert denial is not None and denial.rule == "net.connect"
    assert denial.hint == '[[grant]]\nnet.rules = [{ host = "api.example.com", ports = "80" }]'
    denial = rules.before_resolve("api.example.com", 443)
    assert denial is not None and "deny beats allow" in denial.detail


def test_route_bounds_the_denials_it_keeps() -> None:
    """It keeps at most MAX_DENIALS per drain and says how many more it refused."""
    route = Route(egress_proxy(), _rules(), socket.socket())
    try:
        for i in range(MAX_DENIALS + 10):
            route.record(Denial("net.connect", "connect", f"h:{i}"))
        kept = route.drain()
        assert len(kept) == MAX_DENIALS + 1
        assert kept[-1].target == "10 more connections"
        assert route.drain() == []
    finally:
        route.listener.close()


# -- the proxy in this process (a listener standing in for the worker's) ---------------------


@pytest.fixture
def local_route(names: dict[str, list[str]], http_server: _Server) -> Iterator[Any]:
    other = _Server()
    names["a.test"] = ["127.0.0.1"]
    names["b.test"] = ["127.0.0.1"]
    policy = _policy(
        [
            {"host": "a.test", "ports": str(http_server.port)},
            {"host": "b.test", "ports": str(other.port)},
            {"host": "127.0.0.1", "ports": f"{http_server.port},{other.port}"},
        ]
    )
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    route = egress_proxy().attach(policy, listener)
    try:
        yield route, port, http_server.port, other.port
    finally:
        route.close()
        other.close()


def test_one_client_connection_serves_requests_to_several_hosts(local_route: Any) -> None:
    """Keep-alive through the proxy: each request goes to its own host, never the last one."""
    requests = pytest.importorskip("requests")
    route, proxy_port, a, b = local_route
    session = requests.Session()
    session.trust_env = False
    proxies = {"http": f"http://127.0.0.1:{proxy_port}"}
    for _ in range(2):
        assert session.get(f"http://a.test:{a}/x", proxies=proxies).text == f"hello from {a} /x"
        assert session.get(f"http://b.test:{b}/y", proxies=proxies).text == f"hello from {b} /y"
    # A refusal is the client's own connection error naming the rule, never a response.
    with pytest.raises(requests.exceptions.ConnectionError, match=r"\[net\.resolve\]"):
        session.get(f"http://c.test:{a}/", proxies=proxies)
    assert [d.rule for d in route.drain()] == ["net.resolve"]
    session.close()


def test_an_upstream_that_refuses_is_a_502_not_a_denial() -> None:
    """A closed port behind an allowed rule is the server's answer (502), not the policy's."""
    requests = pytest.importorskip("requests")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    policy_route = egress_proxy().attach(
        _policy([{"host": "127.0.0.1", "ports": str(closed)}]), _listener_for_test()
    )
    try:
        port = policy_route.listener.getsockname()[1]
        response = requests.get(
            f"http://127.0.0.1:{closed}/", proxies={"http": f"http://127.0.0.1:{port}"}
        )
        assert response.status_code == 502
        assert policy_route.drain() == []
    finally:
        policy_route.close()


def test_a_host_that_does_not_resolve_is_a_denial_naming_it(
    names: dict[str, list[str]],
) -> None:
    """A named host the host's resolver cannot find is `net.resolve` naming it, not a raw
    error (and the resolver's own failure, whatever it raises, is contained)."""
    requests = pytest.importorskip("requests")
    route = egress_proxy().attach(
        _policy([{"host": "gone.test", "ports": "80"}]), _listener_for_test()
    )
    try:
        port = route.listener.getsockname()[1]
        with pytest.raises(requests.exceptions.ConnectionError, match="does not resolve"):
            requests.get("http://gone.test/", proxies={"http": f"http://127.0.0.1:{port}"})
        [denial] = route.drain()
        assert (denial.rule, denial.target) == ("net.resolve", "gone.test")
        assert "does not resolve" in denial.detail
    finally:
        route.close()


def _listener_for_test() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener


def test_the_proxy_thread_ends_with_its_last_route(local_route: Any) -> None:
    """Nothing outlives the workers: closing the last route stops the proxy's thread."""
    route = local_route[0]
    assert egress_proxy().running
    route.close()
    assert not egress_proxy().running
    assert not [t for t in threading.enumerate() if t.name == "agent-sandbox-egress"]


# -- end to end, per namespace provider --------------------------------------------------------


def test_requests_reaches_an_allowed_server_by_name(
    ns_provider: str, names: dict[str, list[str]], http_server: _Server
) -> None:
    """`requests.get` by name, unchanged, goes through the proxy to the host's server."""
    names["allowed.test"] = ["127.0.0.1"]
    port = http_server.port
    policy = _policy(
        [{"host": "allowed.test", "ports": str(port)}, {"host": "127.0.0.1", "ports": str(port)}]
    )
    with Sandbox(policy, provider=ns_provider, warm=0) as sb:
        result = sb.run(f"import requests\nrequests.get('http://allowed.test:{port}/p').text")
        direct = sb.run(f"import requests\nrequests.get('http://127.0.0.1:{port}/q').text")
    assert result.error is None, result.error
    assert result.value == f"hello from {port} /p"
    assert direct.value == f"hello from {port} /q"
    assert result.stack[0] == ns_provider and result.stack[-1] == "egress-proxy"
    assert _net_denials(result) == [] and _net_denials(direct) == []


def test_requests_reaches_an_allowed_https_server_through_connect(
    ns_provider: str, names: dict[str, list[str]], tls: tuple[_Server, Path]
) -> None:
    """HTTPS goes through a CONNECT tunnel; the worker verifies the server's certificate."""
    server, ca = tls
    names["tls.test"] = ["127.0.0.1"]
    policy = _policy(
        [
            {"host": "tls.test", "ports": str(server.port)},
            {"host": "127.0.0.1", "ports": str(server.port)},
        ],
        files={"read": [str(ca.parent)]},
    )
    code = f"import requests\nrequests.get('https://tls.test:{server.port}/s', verify={str(ca)!r}).text"
    with Sandbox(policy, provider=ns_provider, warm=0) as sb:
        result = sb.run(code)
    assert result.error is None, result.error
    assert result.value == f"hello from {server.port} /s"


def test_refusals_are_recorded_by_the_host_with_their_rule(
    ns_provider: str, names: dict[str, list[str]], http_server: _Server
) -> None:
    """A name outside the policy, a loopback port no rule names, the metadata address (its
    documentation stand-in), and an allowed name that resolves to it: each is refused, and the result carries the rule."""
    names["allowed.test"] = ["127.0.0.1"]
    names["rebind.test"] = [METADATA_STAND_IN]
    port = http_server.port
    policy = _policy(
        [
            {"host": "allowed.test", "ports": str(port)},
            {"host": "127.0.0.1", "ports": str(port)},
            {"host": "rebind.test", "ports": "80"},
        ]
    )
    cases = {
        f"http://other.test:{port}/": ("net.resolve", "other.test"),
        f"http://127.0.0.1:{port + 1}/": ("net.connect", f"127.0.0.1:{port + 1}"),
        f"http://{METADATA_STAND_IN}/latest/meta-data/": (
            "net.connect",
            f"{METADATA_STAND_IN}:80",
        ),
        "http://rebind.test/": ("net.connect", "rebind.test:80"),
        f"https://other.test:{port}/": ("net.resolve", "other.test"),
    }
    with Sandbox(policy, provider=ns_provider, warm=0) as sb:
        session = sb.session("refusals")
        for url, (rule, target) in cases.items():
            result = session.run(f"import requests\nrequests.get({url!r}).status_code")
            denials = _net_denials(result)
            assert [(d.rule, d.target) for d in denials] == [(rule, target)], url
            assert "egress proxy" in denials[0].detail
            # the code got the client's own connection error, naming the rule: a refusal
            assert result.error is not None and result.error.kind == "denied", url
            assert result.error.rule == rule
            assert result.error.type.startswith("requests.exceptions.")
            assert f"[{rule}]" in result.error.message
            assert not result.ok
    with socket.socket() as probe:
        probe.settimeout(0.2)
        assert probe.connect_ex(("127.0.0.1", port)) == 0  # the server is still there


def test_a_refusal_reaches_the_result_without_the_workers_help(
    ns_provider: str, names: dict[str, list[str]], http_server: _Server, tmp_path: Path
) -> None:
    """Code past the Python layer talks to the proxy with raw syscalls (no guard sees it) and
    still gets its refusal recorded: the host writes it into the result."""
    from .conftest import hostile_policy

    arena = {"ro": tmp_path, "rw": tmp_path}
    policy = hostile_policy(
        arena, net={"rules": [{"host": "127.0.0.1", "ports": str(http_server.port)}]}
    )
    code = NATIVE + (
        "s = _libc.socket(2, 1, 0)\n"
        "a = struct.pack('=H', 2) + struct.pack('!H4s8x', 3128, bytes([127, 0, 0, 1]))\n"
        "assert _libc.connect(s, a, len(a)) == 0, _err()\n"
        "req = b'CONNECT secret.test:443 HTTP/1.1\\r\\nhost: secret.test:443\\r\\n\\r\\n'\n"
        "_libc.send(s, req, len(req), 0)\n"
        "buf = ctypes.create_string_buffer(4096)\n"
        "n = _libc.recv(s, buf, 4096, 0)\n"
        "buf.raw[:12].decode()\n"
    )
    with Sandbox(policy, provider=ns_provider, warm=0) as sb:
        result = sb.run(code)
    assert result.value == "HTTP/1.1 403", result
    assert [(d.rule, d.target) for d in _net_denials(result)] == [("net.resolve", "secret.test")]


def test_without_the_guards_no_address_is_reachable_and_udp_fails(
    ns_provider: str,
    http_server: _Server,
    tcp_listener: Any,
    tmp_path: Path,
) -> None:
    """With network rules, native code reaches directly only what they allow: an allowed
    loopback service (forwarded by the host, `loopback_forwards`; under gvisor through the
    sandbox's relay and a socket of the host's for it); the host's loopback
    listener on a port no rule names gets no connection, an address off the machine has no
    route (a documentation address: were containment gone, nothing would be sent off the
    machine), UDP sockets are refused."""
    from .conftest import hostile_policy

    sock, port = tcp_listener
    arena = {"ro": tmp_path, "rw": tmp_path}
    policy = hostile_policy(
        arena,
        net={
            "rules": [
                {"host": "127.0.0.1", "ports": str(http_server.port)},
                {"host": "0.0.0.0/0", "ports": "80"},
            ]
        },
    )
    code = NATIVE + (
        f"(nconnect_tcp({port}), nconnect_tcp(80, bytes([203, 0, 113, 34])), "
        f"nsend_udp({port}), nsend_udp(53, host=bytes([198, 51, 100, 53])), "
        f"nconnect_tcp({http_server.port}))"
    )
    with Sandbox(policy, provider=ns_provider, warm=0) as sb:
        result = sb.run(code)
    assert result.error is None, result.error
    local, remote, udp_local, udp_remote, allowed = result.value
    assert tuple(allowed) == ("connect", 0)  # the allowed service, forwarded by the host
    assert local[0] == "connect" and local[1] != 0  # ECONNREFUSED: the namespace's own lo
    # ENETUNREACH; gVisor's netstack says EHOSTUNREACH for the same missing route.
    unreachable = -113 if ns_provider == "gvisor" else -101
    assert remote == ["connect", unreachable] or remote == ("connect", unreachable)
    assert udp_local[0] == "socket" and udp_local[1] == -1  # EPERM from seccomp
    assert udp_remote[0] == "socket" and udp_remote[1] == -1
    assert not received_connection(sock)


def test_a_proxy_that_cannot_start_fails_the_workers_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It never starts a networked worker without its proxy, and says why."""
    skip_unless_available("bwrap")

    def broken(self: Any) -> None:
        raise EgressError("no thread for you")

    monkeypatch.setattr(EgressProxy, "start", broken)
    policy = _policy([{"host": "api.example.com", "ports": "443"}])
    with pytest.raises(WorkerStartError, match="egress proxy could not start: no thread"):
        WorkerProcess.start(policy, get_provider("bwrap"))


def test_the_proxy_stops_with_the_sandbox(
    ns_provider: str, names: dict[str, list[str]], http_server: _Server
) -> None:
    """Closing the sandbox ends its workers' routes and the proxy's thread."""
    policy = _policy([{"host": "127.0.0.1", "ports": str(http_server.port)}])
    with Sandbox(policy, provider=ns_provider, warm=0) as sb:
        session = sb.session("s")
        assert session.run("1").value == 1
        assert egress_proxy().running
    assert not egress_proxy().running


def test_the_refusal_reaches_the_langsmith_metadata(
    ns_provider: str,
    names: dict[str, list[str]],
    http_server: _Server,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy's refusal is in the tool run's LangSmith tags and metadata."""
    pytest.importorskip("langchain_core")
    from langchain_core.tracers.langchain import LangChainTracer
    from langsmith import Client

    from agent_sandbox._tools.demo import tool_call
    from agent_sandbox.adapters.langchain import SandboxedPythonTool

    class RecordingClient(Client):
        def __init__(self) -> None:
            super().__init__(
                api_key="test-key", api_url="http://127.0.0.1:9", auto_batch_tracing=False
            )
            self.payloads: list[dict[str, Any]] = []

        def create_run(self, *args: Any, **kwargs: Any) -> None:
            self.payloads.append(dict(kwargs))

        def update_run(self, run_id: Any, **kwargs: Any) -> None:
            self.payloads.append(dict(kwargs))

    policy = _policy([{"host": "127.0.0.1", "ports": str(http_server.port)}], provider=ns_provider)
    tool = SandboxedPythonTool(policy=policy, warm=0)
    client = RecordingClient()
    tracer = LangChainTracer(client=client, project_name="offline")
    try:
        code = f"import requests\nrequests.get('http://{METADATA_STAND_IN}/').status_code"
        tool.invoke(tool_call(code, call_id="c1"), config={"callbacks": [tracer]})
        tracer.wait_for_futures()
    finally:
        tool.close()
    tags = [t for p in client.payloads for t in (p.get("tags") or [])]
    metadata: dict[str, Any] = {}
    for p in client.payloads:
        metadata.update((p.get("extra") or {}).get("metadata") or {})
    assert "sandbox.rule:net.connect" in tags
    assert "net.connect" in metadata["sandbox.rules"]
    assert any(
        d["rule"] == "net.connect" and d["target"] == f"{METADATA_STAND_IN}:80"
        for d in metadata["sandbox.denials"]
    )


def test_a_udp_rule_is_refused_at_construction_under_auto() -> None:
    """`auto` does not hand a UDP rule to Landlock's open UDP: it names the rule instead."""
    skip_unless_available("bwrap")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = _policy([{"host": "10.0.0.0/8", "ports": "53", "protocol": "udp"}])
    with pytest.raises(
        Exception,
        match=r'host = "10\.0\.0\.0/8" ports = "53" protocol = "udp": UDP does not go through',
    ):
        with Sandbox(policy, provider="auto", warm=0) as sb:
            sb.run("1")


def test_learning_mode_proposes_the_hosts_the_proxy_refused(
    ns_provider: str, names: dict[str, list[str]], http_server: _Server
) -> None:
    """In learning mode the proxy still refuses a host outside the rules (the envelope never
    widens the network), records it as learned, and the proposal gets a `[[net]]` rule for
    that host and port."""
    from agent_sandbox._tools.learn.propose import propose

    names["allowed.test"] = ["127.0.0.1"]
    port = http_server.port
    policy = _policy(
        [{"host": "allowed.test", "ports": str(port)}, {"host": "127.0.0.1", "ports": str(port)}],
        mode="learn",
    )
    code = (
        "import requests\n"
        "try:\n"
        "    requests.get('http://wanted.test:8080/').status_code\n"
        "except requests.exceptions.ConnectionError:\n"
        "    pass\n"
        f"requests.get('http://allowed.test:{port}/ok').text"
    )
    with Sandbox(policy, provider=ns_provider, warm=0) as sb:
        result = sb.run(code)
    assert result.value == f"hello from {port} /ok", result
    seen = [(d.rule, d.target, d.learned) for d in _net_denials(result)]
    assert ("net.resolve", "wanted.test", True) in seen, seen
    proposal = propose(policy, [result])
    rules = [(r.host, r.ports) for r in proposal.proposed.net.rules]
    assert ("wanted.test", "8080") in rules, proposal
    assert ("allowed.test", str(port)) in rules


def test_a_host_that_does_not_resolve_is_a_denial_in_the_result_not_a_warning(
    ns_provider: str, names: dict[str, list[str]]
) -> None:
    """End to end: the model reads a `net.resolve` denial naming the host, recorded by the
    host's proxy; no UserWarning reaches the host's warnings or the call's stderr."""
    policy = _policy([{"host": "gone.test", "ports": "80"}])
    code = "import requests\nrequests.get('http://gone.test/').status_code"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Sandbox(policy, provider=ns_provider, warm=0) as sb:
            result = sb.run(code)
    assert result.error is not None and result.error.kind == "denied", result
    assert result.error.rule == "net.resolve"
    denials = [(d.rule, d.target) for d in _net_denials(result)]
    assert ("net.resolve", "gone.test") in denials, denials
    [denial] = [d for d in _net_denials(result) if d.target == "gone.test"]
    assert "does not resolve" in denial.detail and "egress proxy" in denial.detail
    assert "Warning" not in result.stderr
    assert not [w for w in caught if "does not resolve" in str(w.message)]


def test_subprocess_a_named_host_that_does_not_resolve_is_a_resolve_denial() -> None:
    """Under `subprocess` (the opt-out; names pinned when the policy loads), a rule's host
    that does not resolve is a `net.resolve` denial naming the host that says it did not
    resolve (not "no rule names this host"), and the host prints no warning."""
    policy = Policy(
        name="unresolved",
        imports={"allow": ["socket"]},
        net={"rules": [{"host": "no-such-host.invalid", "ports": "80"}]},
        limits={"wall_seconds": 30},
        no_kernel_boundary="accepted",
    )
    code = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('no-such-host.invalid', 80), timeout=2)\n"
        "    r = 'connected'\n"
        "except OSError as exc:\n"
        "    r = type(exc).__name__\n"
        "r"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Sandbox(policy, provider="subprocess", warm=0) as sb:
            result = sb.run(code)
    assert result.value == "NetworkDenied", result
    resolves = [d for d in result.denials if d.rule == "net.resolve"]
    assert [d.target for d in resolves] == ["no-such-host.invalid"], result.denials
    assert "did not resolve" in resolves[0].detail, resolves[0].detail
    assert "no [net] rule names" not in resolves[0].detail
    assert "Warning" not in result.stderr
    assert not [w for w in caught if "resolve" in str(w.message)], [str(w.message) for w in caught]


def _socks_connect(proxy_port: int, host: str, port: int) -> tuple[socket.socket, int]:
    """A SOCKS5 handshake by hand (no auth, CONNECT to a name); the socket and reply code."""
    s = socket.create_connection(("127.0.0.1", proxy_port), timeout=5)
    s.sendall(b"\x05\x01\x00")
    assert s.recv(2) == b"\x05\x00"
    name = host.encode()
    s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big"))
    reply = b""
    while len(reply) < 10:
        chunk = s.recv(10 - len(reply))
        if not chunk:
            break
        reply += chunk
    return s, reply[1]


def test_socks5_connect_is_judged_like_connect(
    names: dict[str, list[str]], http_server: _Server
) -> None:
    """A SOCKS5 client on the proxy's port reaches an allowed name (resolved on the host) and
    gets reply 2 for a name no rule names, recorded as the same `net.resolve` denial."""
    names["allowed.test"] = ["127.0.0.1"]
    port = http_server.port
    route = egress_proxy().attach(
        _policy(
            [
                {"host": "allowed.test", "ports": str(port)},
                {"host": "127.0.0.1", "ports": str(port)},
            ]
        ),
        _listener_for_test(),
    )
    try:
        proxy_port = route.listener.getsockname()[1]
        s, code = _socks_connect(proxy_port, "allowed.test", port)
        with s:
            assert code == 0
            s.sendall(b"GET /socks HTTP/1.0\r\nhost: allowed.test\r\n\r\n")
            body = b""
            while b"/socks" not in body:
                chunk = s.recv(4096)
                if not chunk:
                    break
                body += chunk
        assert f"hello from {port} /socks".encode() in body
        s, code = _socks_connect(proxy_port, "other.test", port)
        s.close()
        assert code == 2
        assert [(d.rule, d.target) for d in route.drain()] == [("net.resolve", "other.test")]
    finally:
        route.close()


# -- framing: the proxy parses heads only and relays bodies -------------------------------


class _FramingHandler(http.server.BaseHTTPRequestHandler):
    """Answers in each framing a server may use; POST echoes its body (any framing)."""

    protocol_version = "HTTP/1.1"

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("content-length", "0")))

    def do_POST(self) -> None:
        body = self._body()
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    def do_HEAD(self) -> None:
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")

    def do_GET(self) -> None:
        w = self.wfile.write
        if self.path == "/chunked":
            w(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nkeep-alive: x\r\n\r\n")
            w(b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: t\r\n\r\n")
        elif self.path == "/close":
            w(b"HTTP/1.0 200 OK\r\n\r\nuntil the close")
            self.close_connection = True
        elif self.path == "/empty":
            w(b"HTTP/1.1 204 No Content\r\n\r\n")
        elif self.path == "/continue":
            w(b"HTTP/1.1 100 Continue\r\n\r\n")
            w(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nafter")
        elif self.path == "/big":
            body = bytes(range(256)) * 4096  # 1 MiB
            w(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        elif self.path == "/smuggle":
            w(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\nok")
        else:
            w(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def framing_route() -> Iterator[tuple[Any, int, int]]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FramingHandler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    port = int(httpd.server_address[1])
    route = egress_proxy().attach(
        _policy([{"host": "127.0.0.1", "ports": str(port)}]), _listener_for_test()
    )
    try:
        yield route, route.listener.getsockname()[1], port
    finally:
        route.close()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def _raw_exchange(proxy_port: int, data: bytes) -> bytes:
    """Send `data` to the proxy and read until it closes the connection."""
    with socket.create_connection(("127.0.0.1", proxy_port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_the_proxy_relays_every_framing_on_one_keep_alive_connection(
    framing_route: tuple[Any, int, int],
) -> None:
    """Content-Length and chunked bodies both ways, interim 1xx answers, HEAD, 204 and a big
    body, all on one client connection, byte for byte; hop-by-hop headers are dropped."""
    import http.client

    route, proxy_port, port = framing_route
    base = f"http://127.0.0.1:{port}"
    conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=10)
    try:

        def get(path: str, method: str = "GET", **kw: Any) -> http.client.HTTPResponse:
            conn.request(method, base + path, **kw)
            return conn.getresponse()

        r = get("/chunked")
        assert (r.status, r.read(), r.getheader("keep-alive")) == (200, b"hello world", None)
        r = get("/empty")
        assert (r.status, r.read()) == (204, b"")
        r = get("/x", method="HEAD")
        assert (r.status, r.getheader("content-length"), r.read()) == (200, "1000", b"")
        r = get("/continue")
        assert (r.status, r.read()) == (200, b"after")
        body = b"x" * 300_000
        r = get("/echo", method="POST", body=body)
        assert r.read() == body
        r = get("/echo", method="POST", body=iter([b"abc", b"defg"]), encode_chunked=True)
        assert r.read() == b"abcdefg"
        r = get("/big")
        assert r.read() == bytes(range(256)) * 4096
        r = get("/close")  # an HTTP/1.0 server's answer ends with its connection
        assert (r.status, r.read(), r.getheader("connection")) == (200, b"until the close", "close")
    finally:
        conn.close()
    assert route.drain() == []


def test_the_proxy_unwraps_a_chunked_answer_for_an_http10_client(
    framing_route: tuple[Any, int, int],
) -> None:
    _route, proxy_port, port = framing_route
    out = _raw_exchange(
        proxy_port, f"GET http://127.0.0.1:{port}/chunked HTTP/1.0\r\n\r\n".encode()
    )
    head, _, body = out.partition(b"\r\n\r\n")
    assert body == b"hello world"
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()


@pytest.mark.parametrize(
    "head",
    [
        "POST {url} HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n",
        "POST {url} HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\ncontent-length: 4\r\n",
        "POST {url} HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip\r\n",
        "GET {url} HTTP/1.1\r\nhost : a\r\n",
        "GET {url} HTTP/1.1\r\nhost: a\r\n folded: value\r\n",
        "GET {url} HTTP/1.1\r\nhost: a\nx-bare: lf\r\n",
        "GET {url} HTTP/2.0\r\nhost: a\r\n",
        "GET  {url} HTTP/1.1\r\nhost: a\r\n",
    ],
)
def test_the_proxy_refuses_an_ambiguous_request_head(
    framing_route: tuple[Any, int, int], head: str
) -> None:
    """A head another parser could frame differently (request smuggling) is a 400, not
    forwarded; the host records the refusal (`net.connect`, a malformed head)."""
    route, proxy_port, port = framing_route
    out = _raw_exchange(
        proxy_port, (head.format(url=f"http://127.0.0.1:{port}/") + "\r\n").encode()
    )
    assert out.startswith(b"HTTP/1.1 400 "), out
    [denial] = route.drain()
    assert (denial.rule, denial.target) == ("net.connect", "the proxy")
    assert "malformed request head" in denial.detail


def test_the_proxy_drops_an_answer_with_ambiguous_framing(
    framing_route: tuple[Any, int, int],
) -> None:
    """An upstream answer with both Content-Length and chunked is not relayed; the host
    records the refusal (`net.connect`, a malformed message) with the request's target."""
    route, proxy_port, port = framing_route
    out = _raw_exchange(
        proxy_port, f"GET http://127.0.0.1:{port}/smuggle HTTP/1.1\r\nhost: a\r\n\r\n".encode()
    )
    assert b"ok" not in out
    [denial] = route.drain()
    assert denial.rule == "net.connect" and denial.target.endswith("/smuggle")
    assert "both Content-Length and Transfer-Encoding" in denial.detail


def test_a_malformed_request_body_is_refused_and_recorded(
    framing_route: tuple[Any, int, int],
) -> None:
    """A chunked request body whose chunk size is not hex ends the connection and the host
    records the refusal; nothing of the bad chunk reaches the server as data."""
    route, proxy_port, port = framing_route
    _raw_exchange(
        proxy_port,
        f"POST http://127.0.0.1:{port}/echo HTTP/1.1\r\nhost: a\r\n"
        "transfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n".encode(),
    )
    [denial] = route.drain()
    assert denial.rule == "net.connect" and "malformed message" in denial.detail


# -- SOCKS5 from inside a worker ---------------------------------------------------------------

_SOCKS_IN_WORKER = """
import socket
def socks(host, port):
    s = socket.create_connection(('127.0.0.1', {proxy}), timeout=10)
    s.sendall(b'\\x05\\x01\\x00')
    assert s.recv(2) == b'\\x05\\x00'
    name = host.encode()
    s.sendall(b'\\x05\\x01\\x00\\x03' + bytes([len(name)]) + name + port.to_bytes(2, 'big'))
    reply = b''
    while len(reply) < 10:
        chunk = s.recv(10 - len(reply))
        if not chunk:
            break
        reply += chunk
    return s, reply[1]
s, code = socks({host!r}, {port})
body = b''
if code == 0:
    s.sendall(b'GET /socks HTTP/1.0\\r\\nhost: x\\r\\n\\r\\n')
    while chunk := s.recv(4096):
        body += chunk
s.close()
(code, body.decode(errors='replace'))
"""


def test_socks5_from_inside_a_worker_allowed_and_refused(
    ns_provider: str, names: dict[str, list[str]], http_server: _Server
) -> None:
    """Code in the sandbox speaking SOCKS5 (`socks5h`: the name goes to the proxy) over a raw
    socket reaches an allowed name; a name no rule names gets reply 2 (not allowed by the
    ruleset), and the refusal is the host's recorded `net.resolve` denial in the result."""
    names["allowed.test"] = ["127.0.0.1"]
    port = http_server.port
    policy = _policy(
        [{"host": "allowed.test", "ports": str(port)}, {"host": "127.0.0.1", "ports": str(port)}]
    )
    with Sandbox(policy, provider=ns_provider, warm=0) as sb:
        ok = sb.run(_SOCKS_IN_WORKER.format(proxy=PROXY_PORT, host="allowed.test", port=port))
        refused = sb.run(_SOCKS_IN_WORKER.format(proxy=PROXY_PORT, host="other.test", port=port))
    assert ok.error is None, ok
    code, body = ok.value
    assert code == 0 and f"hello from {port} /socks" in body, ok.value
    assert _net_denials(ok) == []
    assert refused.error is None, refused
    assert list(refused.value) == [2, ""], refused.value
    denials = _net_denials(refused)
    assert [(d.rule, d.target) for d in denials] == [("net.resolve", "other.test")], denials
    assert "egress proxy" in denials[0].detail


# -- the qemu provider: the proxy behind the guest's loopback, over a virtio-serial port ----

_QEMU_NET = """
import json, os, socket, urllib.error, urllib.request
def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return [r.status, r.read().decode()]
    except urllib.error.HTTPError as exc:
        return [exc.code, exc.headers.get("x-agent-sandbox-denial", "")]
    except OSError as exc:
        return ["error", repr(exc)]
    except Exception as exc:  # a refusal: the client's own error, starting with the rule
        return [type(exc).__name__, str(exc).split("]")[0] + "]"]
def raw(port, send=b""):  # past the proxy and the guards, through libc
    s = _libc.socket(2, 1, 0)
    addr = struct.pack("<HH4s8x", 2, socket.htons(port), bytes([127, 0, 0, 1]))
    if _libc.connect(s, addr, len(addr)):
        err = ctypes.get_errno()
        _libc.close(s)
        return ["connect", err]
    _libc.send(s, send, len(send), 0)
    buf, data = ctypes.create_string_buffer(4096), b""
    while send and (n := _libc.recv(s, buf, 4096, 0)) > 0:
        data += buf.raw[:n]
    _libc.close(s)
    return ["connected", data.decode("latin-1")]
get = b"GET /native HTTP/1.0\\r\\n\\r\\n"
out = {{
    "proxy": os.environ.get("HTTP_PROXY"),
    "allowed": fetch("http://allowed.test:{port}/vm"),
    "other": fetch("http://other.test:{port}/"),
    "metadata": fetch("http://{metadata}/latest/meta-data/"),
    "forwarded": raw({port}, get),
    "denied": raw({denied_port}, get),
    "raw": raw({raw_port}),
}}
json.dumps(out)
"""


@pytest.fixture
def qemu_net(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The qemu provider with the session's image and template (`qemu_cache`)."""
    monkeypatch.setenv("XDG_CACHE_HOME", request.getfixturevalue("qemu_cache"))
    skip_unless_available("qemu")
    return "qemu"


def test_qemu_reaches_an_allowed_server_by_name_and_the_host_records_refusals(
    qemu_net: str, names: dict[str, list[str]], http_server: _Server, arena: dict[str, Path]
) -> None:
    """In the VM (no NIC), `urllib` by name goes through the guest's loopback forwarder and
    the second virtio-serial port to the host's proxy and the host's server; a name outside
    the policy and the metadata address are refused by the host and recorded there, with
    their rule in the result. Past the proxy (libc, the Python guards off): the allowed
    loopback service answers at its own address in the guest (forwarded, judged by the
    host's proxy); one the guest listens for but a deny rule refuses is closed by the host
    with its `net.connect` refusal recorded, its server never reached; a port no rule
    names reaches nothing of the host."""
    from .conftest import QEMU_MEMORY_MB, hostile_policy

    names["allowed.test"] = ["127.0.0.1"]
    port = http_server.port
    probes = []
    for _ in range(2):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.bind(("127.0.0.1", 0))
        probe.listen(8)
        probe.setblocking(False)
        probes.append(probe)
    raw_port, denied_port = (p.getsockname()[1] for p in probes)
    rules = [
        {"host": "allowed.test", "ports": str(port)},
        {"host": "127.0.0.1", "ports": f"{port},{denied_port}"},
        {"host": "127.0.0.1", "ports": str(denied_port), "action": "deny"},
    ]
    policy = hostile_policy(
        arena,
        provider="qemu",
        files={"read": [], "write": []},
        net={"rules": rules},
        limits={"memory_mb": QEMU_MEMORY_MB},
    )
    code = _QEMU_NET.format(
        port=port, raw_port=raw_port, denied_port=denied_port, metadata=METADATA_STAND_IN
    )
    try:
        with Sandbox(policy, warm=0) as sb:
            result = sb.run(NATIVE + code)
    finally:
        got_raw, got_denied = (received_connection(p) for p in probes)
        for probe in probes:
            probe.close()
    assert result.error is None, result.error
    out = json.loads(result.value)
    assert out["proxy"] == "http://127.0.0.1:3128"
    assert out["allowed"] == [200, f"hello from {port} /vm"], out
    assert out["other"] == ["BadStatusLine", "[net.resolve]"], out
    assert out["metadata"] == ["BadStatusLine", "[net.connect]"], out
    assert out["forwarded"][0] == "connected", out
    assert out["forwarded"][1].endswith(f"hello from {port} /native"), out
    assert out["denied"] == ["connected", ""] and not got_denied, out  # closed by the host
    assert out["raw"][0] == "connect" and not got_raw, out  # the guest's own loopback
    assert result.stack[0] == "qemu" and result.stack[-1] == "egress-proxy"
    denials = {(d.rule, d.target) for d in _net_denials(result)}
    assert denials == {
        ("net.resolve", "other.test"),
        ("net.connect", f"{METADATA_STAND_IN}:80"),
        ("net.connect", f"127.0.0.1:{denied_port}"),
    }, denials
    assert all("egress proxy" in d.detail for d in _net_denials(result))


#: The clients of the table (and what they import) the guest gets from a read share: the
#: image holds the standard library and the worker's own packages only.
_CLIENT_PACKAGES = {
    "requests": ("requests", "urllib3", "idna", "certifi", "charset_normalizer"),
    "httpx": ("httpx", "httpcore", "anyio", "sniffio", "idna", "certifi"),
    "aiohttp": (
        "aiohttp",
        "aiohappyeyeballs",
        "aiosignal",
        "attr",
        "frozenlist",
        "multidict",
        "propcache",
        "yarl",
        "typing_extensions",
    ),
}

_QEMU_CLIENTS = """
import json, socket, http.client, urllib.request
URL = "http://127.0.0.1:{port}"
out = {{}}
def attempt(name, fetch):
    try:
        out[name] = fetch(URL + "/" + name)
    except Exception as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)
def requests_get(url, direct=False):
    import requests
    session = requests.Session()
    session.trust_env = not direct  # direct: HTTP_PROXY unread, the forwarded address
    return session.get(url, timeout=60).text
def http_client(url):
    c = http.client.HTTPConnection("127.0.0.1", {port}, timeout=60)
    c.request("GET", url[len(URL):])
    return c.getresponse().read().decode()
def raw_socket(url):
    s = socket.create_connection(("127.0.0.1", {port}), timeout=60)
    s.sendall(b"GET " + url[len(URL):].encode() + b" HTTP/1.0\\r\\n\\r\\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data.decode().split("\\r\\n\\r\\n", 1)[1]
def httpx_get(url):
    import httpx
    return httpx.Client(trust_env=False, timeout=60).get(url).text
def aiohttp_get(url):
    import asyncio, aiohttp
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.get(url) as r:
                return await r.text()
    return asyncio.run(main())
attempt("requests", requests_get)
attempt("requests-direct", lambda url: requests_get(url, direct=True))
attempt("urllib", lambda url: urllib.request.urlopen(url, timeout=60).read().decode())
attempt("http.client", http_client)
attempt("socket", raw_socket)
attempt("httpx", httpx_get)
attempt("aiohttp", aiohttp_get)
try:
    socket.create_connection(("127.0.0.1", {unlisted}), timeout=10)
    out["unlisted"] = "connected"
except OSError as exc:
    out["unlisted"] = str(exc)
json.dumps(out)
"""


def test_qemu_every_client_reaches_an_allowed_loopback_service(
    qemu_net: str, http_server: _Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`host = "127.0.0.1" ports = "<p>"` under QEMU: every client of the table reaches the
    host's service from the guest, those that read HTTP_PROXY through the proxy, the others
    (http.client, a raw socket, requests with `trust_env` off, httpx without it, aiohttp) at
    the service's own address on the guest's loopback, which the guest agent forwards and
    the host's proxy judges; a port no rule names is refused with its rule; the tool
    description says so. httpx cannot be imported in the guest (the image has no `_ssl`)."""
    import shutil
    import site

    from agent_sandbox._host.boundary import resolve_boundary
    from agent_sandbox.adapters._common import describe_policy

    from .conftest import QEMU_MEMORY_MB

    packages = tmp_path / "packages"
    packages.mkdir()
    where = next(Path(p) for p in site.getsitepackages() if (Path(p) / "requests").is_dir())
    installed = [c for c in _CLIENT_PACKAGES if (where / c).is_dir()]
    for name in sorted({n for c in installed for n in _CLIENT_PACKAGES[c]}):
        if (where / name).is_dir():
            shutil.copytree(where / name, packages / name, ignore=shutil.ignore_patterns("tests"))
        elif (where / f"{name}.py").is_file():
            shutil.copy2(where / f"{name}.py", packages / f"{name}.py")
    # An import root of the parent's: on the worker's path, its code a library's.
    monkeypatch.syspath_prepend(str(packages))
    port = http_server.port
    unlisted = port + 1 if port < 65535 else port - 1
    policy = Policy(
        name="qemu-clients-danger",
        provider="qemu",
        imports={"allow": ["*"]},
        files={"read": [str(packages)]},
        env={"pass": ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"]},  # what requests reads
        net={"rules": [{"host": "127.0.0.1", "ports": str(port)}]},
        limits={"wall_seconds": 240, "memory_mb": QEMU_MEMORY_MB},
    )
    text = describe_policy(policy, boundary=resolve_boundary(policy).name)
    assert f"127.0.0.1:{port} also by any client directly" in text, text
    with Sandbox(policy, warm=0) as sb:
        result = sb.run(_QEMU_CLIENTS.format(port=port, unlisted=unlisted))
    assert result.error is None, result.error
    out = json.loads(result.value)
    print("CLIENTS", json.dumps(out, indent=1))
    for client in ("urllib", "http.client", "socket", *installed, "requests-direct"):
        if client == "httpx" and out[client] == "ModuleNotFoundError: No module named '_ssl'":
            continue  # the guest image has no OpenSSL (docs/providers.md)
        if client.split("-")[0] in _CLIENT_PACKAGES and client.split("-")[0] not in installed:
            continue
        assert out[client] == f"hello from {port} /{client}", (client, out)
    assert out["unlisted"].startswith(f'[net.connect] connect "127.0.0.1:{unlisted}"'), out
    assert [(d.rule, d.target) for d in _net_denials(result)] == [
        ("net.connect", f"127.0.0.1:{unlisted}")
    ]


def test_qemu_socks5_from_the_guest_is_judged_on_the_host(
    qemu_net: str, names: dict[str, list[str]], http_server: _Server
) -> None:
    """SOCKS5 over a raw socket in the VM reaches an allowed name; a name no rule names gets
    reply 2 and the host's `net.resolve` denial."""
    names["allowed.test"] = ["127.0.0.1"]
    port = http_server.port
    policy = _policy(
        [{"host": "allowed.test", "ports": str(port)}, {"host": "127.0.0.1", "ports": str(port)}],
        provider="qemu",
        limits={"wall_seconds": 30, "memory_mb": 512},
    )
    with Sandbox(policy, warm=0) as sb:
        ok = sb.run(_SOCKS_IN_WORKER.format(proxy=PROXY_PORT, host="allowed.test", port=port))
        refused = sb.run(_SOCKS_IN_WORKER.format(proxy=PROXY_PORT, host="other.test", port=port))
    assert ok.error is None, ok
    assert ok.value[0] == 0 and f"hello from {port} /socks" in ok.value[1], ok.value
    assert list(refused.value) == [2, ""], refused.value
    assert [(d.rule, d.target) for d in _net_denials(refused)] == [("net.resolve", "other.test")]
