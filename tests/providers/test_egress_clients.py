"""Every HTTP client sees the same refusal from the egress proxy, with the rule and hint.

For each client (requests, urllib, httpx sync and async, aiohttp, http.client, raw sockets)
a host the policy does not allow, asked for over plain HTTP and over HTTPS: the code gets
the client's own connection error whose text names the rule and the hint, the result's
error is `denied` with that rule and its message starts with the rule, the target and the
hint (the host's record of the refusal, then what the client made of it), and the refusal
is recorded by the host. The servers are
loopback servers started here; names are mapped by the proxy's injected resolver.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.egress.resolver import set_resolver
from agent_sandbox.adapters._common import outcome

from .conftest import skip_unless_available

# (client, code fetching URL; {url} is replaced)
CLIENTS = {
    "requests": "import requests\nrequests.get({url!r}, timeout=20).text",
    "urllib": "import urllib.request\nurllib.request.urlopen({url!r}, timeout=20).read()",
    "httpx": "import httpx\nhttpx.get({url!r}, timeout=20).text",
    "httpx-async": (
        "import asyncio, httpx\n"
        "async def main():\n"
        "    async with httpx.AsyncClient(timeout=20) as c:\n"
        "        return (await c.get({url!r})).text\n"
        "asyncio.run(main())"
    ),
    "aiohttp": (
        "import asyncio, aiohttp\n"
        "async def main():\n"
        "    async with aiohttp.ClientSession(trust_env=True) as s:\n"
        "        async with s.get({url!r}) as r:\n"
        "            return await r.text()\n"
        "asyncio.run(main())"
    ),
    "http.client": (
        "import http.client, os, urllib.parse\n"
        "u = urllib.parse.urlsplit({url!r})\n"
        "p = urllib.parse.urlsplit(os.environ['HTTP_PROXY'])\n"
        "if u.scheme == 'https':\n"
        "    c = http.client.HTTPSConnection(p.hostname, p.port, timeout=20)\n"
        "    c.set_tunnel(u.hostname, u.port or 443)\n"
        "    c.request('GET', u.path or '/')\n"
        "else:\n"
        "    c = http.client.HTTPConnection(p.hostname, p.port, timeout=20)\n"
        "    c.request('GET', {url!r})\n"
        "c.getresponse().read()"
    ),
    "socket": (
        "import socket, urllib.parse\n"
        "u = urllib.parse.urlsplit({url!r})\n"
        "socket.create_connection((u.hostname, u.port or 80), timeout=20).close()"
    ),
}

TARGETS = {
    "http-name": ("http://refused.test:8080/x", "net.resolve", "refused.test"),
    "https-name": ("https://refused.test:8443/x", "net.resolve", "refused.test"),
    "http-ip": ("http://198.51.100.7:8080/x", "net.connect", "198.51.100.7:8080"),
}


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Any]:
    provider = next(
        (p for p in ("bwrap", "unshare") if _available(p)),
        None,
    )
    if provider is None:
        pytest.skip("no namespace provider here")
    old = set_resolver(lambda host: ["127.0.0.1"] if host == "allowed.test" else [])
    policy = Policy(
        name="clients-danger",
        imports={"allow": ["*"]},
        net={"rules": [{"host": "allowed.test", "ports": "9"}]},
        limits={"wall_seconds": 60},
    )
    try:
        with Sandbox(policy, provider=provider, warm=0) as sb:
            yield sb.session("clients")
    finally:
        set_resolver(old)


def _available(name: str) -> bool:
    try:
        skip_unless_available(name)
    except pytest.skip.Exception:
        return False
    return True


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("client", list(CLIENTS))
def test_every_client_sees_the_refusal_with_its_rule(
    sandbox: Any, client: str, target: str
) -> None:
    """It denies a host outside the policy to every client alike: the client's own error
    names the rule and hint, the result is `denied` with that rule, the host recorded it."""
    pytest.importorskip(client.split("-")[0].split(".")[0])
    url, rule, where = TARGETS[target]
    result = sandbox.run(CLIENTS[client].format(url=url))
    error = result.error
    net = [d for d in result.denials if d.rule.startswith("net.") and not d.internal]
    other = [d for d in result.denials if not d.internal and not d.rule.startswith("net.")]
    row = (client, target, error and error.kind, error and error.rule, error and error.type)
    print("ROW", row, error and error.message[:100])
    assert error is not None, row
    assert (error.kind, error.rule) == ("denied", rule), row
    # The message starts with the rule, the target and the hint (the line that allows it),
    # whatever the client library wrapped around the refusal; the client's text follows.
    head = error.message.split("\n(the code's error")[0]
    assert error.message.startswith(f"[{rule}] "), row
    assert where in head and "To allow it" in head, (row, error.message)
    assert f"[{rule}]" in error.code_message  # what the code got names it too
    assert any((d.rule, d.target) == (rule, where) for d in net), (row, net)
    assert not other, (row, other)  # no probe by a library is shown as the user's refusal
    told = outcome(result)  # what LangChain's and CrewAI's tools report
    assert (told.is_error, told.kind, told.rule) == (True, "denied", rule), (row, told)
    assert "hide" not in told.text and "files.hidden" not in told.text
    if not error.type.startswith("agent_sandbox."):  # the library's own words, once
        assert f"Your code got {error.type}: {error.code_message[:40]}" in told.text, told.text


@pytest.mark.parametrize("mode", ["enforce", "learn"])
def test_a_socket_the_kernel_refuses_names_its_rule_and_learn_proposes_the_line(
    mode: str,
) -> None:
    """With no `[net]` rule the kernel (seccomp) refuses every internet socket; code that
    connects to an address gets `net.connect` with the target and the hint (not a bare
    EPERM), and learning mode proposes the `[[net.rules]]` line for it."""
    from agent_sandbox._tools.learn.propose import propose

    provider = next((p for p in ("bwrap", "unshare") if _available(p)), None)
    if provider is None:
        pytest.skip("no namespace provider here")
    policy = Policy(
        name="no-network", mode=mode, imports={"allow": ["socket"]}, limits={"wall_seconds": 30}
    )
    code = "import socket\nsocket.create_connection(('198.51.100.7', 8080), timeout=5)"
    with Sandbox(policy, provider=provider, warm=0) as sb:
        result = sb.run(code)
        bare = sb.run("import socket\nsocket.socket()")
    assert result.error is not None
    if mode == "enforce":
        assert (result.error.kind, result.error.rule) == ("denied", "net.connect"), result.error
        [denial] = [d for d in result.denials if not d.internal]
        assert denial.target == "198.51.100.7:8080"
        assert 'host = "198.51.100.7", ports = "8080"' in denial.hint
        assert bare.error is not None and bare.error.rule == "net.connect"  # no bare EPERM
    else:
        assert result.error.type == "PermissionError"  # the kernel still refuses it
        rules = [(r.host, r.ports) for r in propose(policy, [result]).proposed.net.rules]
        assert rules == [("198.51.100.7", "8080")]


@pytest.mark.parametrize("provider", ["bwrap", "unshare"])
def test_an_allowed_loopback_service_is_reached_by_every_client(provider: str) -> None:
    """`host = "127.0.0.1" ports = "<p>"` behind the egress proxy: requests (through the
    proxy), http.client and a raw socket (directly, at the same address inside, forwarded
    by the host) all reach the service; a port no rule names reaches nothing; the tool
    description says exactly that."""
    import http.server
    import threading

    from agent_sandbox._host.boundary import resolve_boundary
    from agent_sandbox.adapters._common import describe_policy

    skip_unless_available(provider)

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    policy = Policy(
        name="loopback-service",
        provider=provider,
        imports={"allow": ["requests", "socket", "http", "urllib"]},
        net={"rules": [{"host": "127.0.0.1", "ports": str(port)}]},
        limits={"wall_seconds": 30},
    )
    clients = {
        "requests": f"import requests\nrequests.get('http://127.0.0.1:{port}/').text",
        "http.client": (
            "import http.client\n"
            f"c = http.client.HTTPConnection('127.0.0.1', {port}, timeout=10)\n"
            "c.request('GET', '/')\n"
            "c.getresponse().read().decode()"
        ),
        "socket": (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=10)\n"
            "s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')\n"
            "data = b''\n"
            "while chunk := s.recv(4096):\n"
            "    data += chunk\n"
            "data.decode().split('\\r\\n\\r\\n', 1)[1]"
        ),
    }
    try:
        boundary = resolve_boundary(policy)
        text = describe_policy(policy, boundary=boundary.name)
        assert f"Network: only 127.0.0.1:{port}." in text
        assert f"127.0.0.1:{port} also by any client directly" in text, text
        with Sandbox(policy, warm=0) as sb:
            got = {name: sb.run(code) for name, code in clients.items()}
            other = sb.run(
                f"import socket\nsocket.create_connection(('127.0.0.1', {port + 1}), timeout=5)"
            )
        for name, result in got.items():
            assert result.value == "hello", (name, result.error)
        assert other.error is not None and other.error.kind == "denied", other.error
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize(
    ("boundary", "direct"),
    [
        ("bwrap+seccomp+egress-proxy", True),
        ("unshare+seccomp+egress-proxy", True),
        ("gvisor+seccomp+egress-proxy", True),
        ("qemu+seccomp+egress-proxy", False),
    ],
)
def test_the_tool_description_promises_direct_access_only_where_it_is_wired(
    boundary: str, direct: bool
) -> None:
    """The description says an allowed loopback service is reached by any client only under
    the providers that forward it (bwrap, unshare, gvisor: test_egress.py reaches it
    natively under each); under QEMU it says a direct socket reaches nothing."""
    from agent_sandbox.adapters._common import describe_policy

    policy = Policy(name="svc", net={"rules": [{"host": "127.0.0.1", "ports": "8765"}]})
    text = describe_policy(policy, boundary=boundary)
    assert ("127.0.0.1:8765 also by any client directly" in text) is direct, text
    assert ("a direct socket (socket.create_connection" in text) is not direct, text
