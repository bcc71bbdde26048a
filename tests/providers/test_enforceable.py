"""A `[net]` rule the chosen provider cannot enforce below Python refuses the policy at build.

One test per refused combination (the message names the rule, its place, the provider and the
provider that can), the allowed cases beside them, and the same refusal through `Sandbox`,
`sandboxed()` and `agent-sandbox policy check`. The allowed case end to end per namespace
provider is `test_egress.py::test_requests_reaches_an_allowed_server_by_name`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, ProviderUnavailable, Sandbox
from agent_sandbox.policies._model import SECTIONS
from agent_sandbox.providers import Provider, get_provider
from agent_sandbox.providers._netcheck import refuse_unenforceable, unenforceable

from .conftest import skip_unless_available

NS = "enforced by: bwrap or unshare"

#: (provider, rules, the text the refusal must contain)
REFUSED: list[tuple[str, list[dict[str, Any]], str]] = [
    (
        "landlock",
        [{"host": "api.example.com", "ports": "443"}],
        '[net] rules[0] host = "api.example.com" ports = "443": Landlock filters TCP by port '
        f"only: the port would be open to every address, the agent's own loopback services "
        f"and the cloud metadata address too; {NS}",
    ),
    (
        "landlock",
        [{"host": "10.0.0.0/8", "ports": "8000-8080"}],
        'host = "10.0.0.0/8" ports = "8000-8080": Landlock filters TCP by port only',
    ),
    (
        "landlock",
        [{"host": "127.0.0.1", "ports": "8765"}],
        'host = "127.0.0.1" ports = "8765": Landlock filters TCP by port only',
    ),
    (
        "landlock",
        [{"host": "*", "ports": "443"}],
        'host = "*" ports = "443": Landlock filters TCP by port only',
    ),
    (
        "landlock",
        [{"host": "127.0.0.1", "ports": "53", "protocol": "udp"}],
        'protocol = "udp": Landlock does not filter UDP: it would reach every address; '
        "enforced by: bwrap or unshare",
    ),
    (
        "landlock",
        [{"host": "8.8.8.8", "ports": "53", "protocol": "udp"}],
        'protocol = "udp": Landlock does not filter UDP: it would reach every address; '
        "enforced by: none (remove the rule)",
    ),
    (
        "landlock",
        [{"host": "127.0.0.1", "ports": "9000", "direction": "bind"}],
        'direction = "bind": Landlock filters bind by port only: a listener could take any '
        f"address; {NS}",
    ),
    (
        "landlock",
        [
            {"host": "*", "ports": "9000", "direction": "bind"},
            {"host": "10.0.0.1", "ports": "9000", "direction": "bind", "action": "deny"},
        ],
        '[net] rules[1] host = "10.0.0.1" ports = "9000" direction = "bind" action = "deny": '
        "Landlock cannot close a port to one host while a rule opens it; " + NS,
    ),
    (
        "firejail",
        [{"host": "api.example.com", "ports": "443"}],
        'host = "api.example.com" ports = "443": firejail runs the worker with --net=none: '
        f"there is no route out; {NS}",
    ),
    (
        "firejail",
        [{"host": "127.0.0.1", "ports": "8765"}],
        "firejail's --net=none gives the worker its own loopback: the host's service on that "
        f"port is not reachable, and nothing in the sandbox may listen there; {NS}",
    ),
    (
        "bwrap",
        [{"host": "10.0.0.0/8", "ports": "53", "protocol": "udp"}],
        'protocol = "udp": UDP does not go through the host\'s egress proxy (TCP only); '
        "enforced by: none (remove the rule)",
    ),
    (
        "unshare",
        [{"host": "10.0.0.0/8", "ports": "53", "protocol": "udp"}],
        "UDP does not go through the host's egress proxy",
    ),
    (
        "bwrap",
        [{"host": "*", "ports": "9000", "direction": "bind"}],
        "a listener in the sandbox's network namespace is reachable from inside it only; "
        'enforced by: landlock, for host = "*"',
    ),
    (
        "unshare",
        [{"host": "192.168.1.2", "ports": "9000", "direction": "bind"}],
        "a listener in the sandbox's network namespace is reachable from inside it only",
    ),
    # A LAN service: the proxy would serve only clients reading HTTP_PROXY (issue 31).
    (
        "bwrap",
        [{"host": "10.0.0.5", "ports": "5432"}],
        'host = "10.0.0.5" ports = "5432": 10.0.0.5 is a LAN address: the host\'s egress '
        "proxy would reach it only for clients that read HTTP_PROXY (requests, urllib, httpx, "
        "pip), while a direct socket in the sandbox (http.client, database drivers, gRPC) "
        "reaches nothing, for the sandbox's network namespace has only its own loopback; an "
        "allowed service must be reachable by every client; enforced by: none in a network "
        "namespace: forward the service to a port on the host's loopback (ssh -L or socat) "
        'and allow host = "127.0.0.1" with that port, which every client reaches',
    ),
    ("unshare", [{"host": "192.168.0.0/16", "ports": "80"}], "192.168.0.0/16 is a LAN address"),
    ("gvisor", [{"host": "fd00::5", "ports": "80"}], "fd00::5 is a LAN address"),
    ("qemu", [{"host": "169.254.10.1", "ports": "80"}], "169.254.10.1 is a LAN address"),
    # Other spellings of one LAN address: judged as the proxy reads them.
    ("bwrap", [{"host": "::ffff:10.0.0.1", "ports": "80"}], "10.0.0.1 is a LAN address"),
    ("bwrap", [{"host": "64:ff9b::a00:1", "ports": "80"}], "10.0.0.1 is a LAN address"),
    ("bwrap", [{"host": "172.16.0.1", "ports": "80", "protocol": "any"}], "LAN address"),
]

#: (provider, rules) that are enforced below Python as written.
ALLOWED: list[tuple[str, list[dict[str, Any]]]] = [
    ("landlock", [{"host": "*", "ports": "9000", "direction": "bind"}]),
    ("landlock", [{"host": "*", "ports": "22", "action": "deny"}]),
    ("landlock", [{"host": "10.0.0.1", "ports": "22", "action": "deny"}]),
    (
        "firejail",
        [
            {"host": "127.0.0.1", "ports": "8765", "direction": "bind"},
            {"host": "127.0.0.1", "ports": "8765"},
        ],
    ),
    (
        "bwrap",
        [
            {"host": "api.example.com", "ports": "443"},
            {"host": "10.0.0.1", "ports": "1-65535", "action": "deny"},
        ],
    ),
    (
        "unshare",
        [
            {"host": "127.0.0.1", "ports": "8765"},
            {"host": "127.0.0.1", "ports": "53", "protocol": "udp"},
        ],
    ),
    # Not LAN: a wide range (the proxy never reaches its LAN part), a deny, a listener.
    ("bwrap", [{"host": "0.0.0.0/0", "ports": "443"}, {"host": "8.8.8.8", "ports": "53"}]),
    ("bwrap", [{"host": "10.0.0.0/7", "ports": "443"}]),
    ("unshare", [{"host": "svc.internal", "ports": "443"}]),
]


def _policy(rules: list[dict[str, Any]], **extra: Any) -> Policy:
    with _quiet():
        return Policy(name="enf", net={"rules": rules}, **extra)


class _quiet:
    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)


@pytest.mark.parametrize(("provider", "rules", "text"), REFUSED)
def test_a_rule_the_provider_cannot_enforce_is_refused_naming_it(
    provider: str, rules: list[dict[str, Any]], text: str
) -> None:
    with pytest.raises(ProviderUnavailable) as info:
        refuse_unenforceable(get_provider(provider), _policy(rules))
    message = str(info.value)
    assert f"provider {provider!r}" in message
    assert "it cannot enforce" in message and "below Python" in message
    assert text in message, message


@pytest.mark.parametrize(("provider", "rules"), ALLOWED)
def test_a_rule_the_provider_enforces_is_accepted(
    provider: str, rules: list[dict[str, Any]]
) -> None:
    assert unenforceable(get_provider(provider), _policy(rules)) == []


def test_subprocess_with_the_opt_out_refuses_nothing_more() -> None:
    """No rule holds below Python there; the policy's opt-out says so in words."""
    rules = [{"host": "api.example.com", "ports": "443"}]
    assert unenforceable(get_provider("subprocess"), _policy(rules)) == []


def test_sandbox_construction_refuses_a_host_rule_under_landlock() -> None:
    skip_unless_available("landlock")
    policy = _policy(
        [{"host": "api.example.com", "ports": "443"}], provider="landlock", visible_names="accepted"
    )
    with pytest.raises(ProviderUnavailable, match="Landlock filters TCP by port only"):
        Sandbox(policy, warm=0)


@pytest.mark.parametrize("ns_provider", ["bwrap", "unshare"])
def test_an_allowed_lan_service_that_direct_sockets_cannot_reach_is_refused_at_construction(
    ns_provider: str,
) -> None:
    """An allowed LAN address is never a service only some clients reach: the namespace
    providers forward allowed loopback services only, so `Sandbox` refuses the policy,
    naming the loopback forward that every client reaches instead."""
    skip_unless_available(ns_provider)
    policy = _policy([{"host": "192.168.7.7", "ports": "5432"}], provider=ns_provider)
    with pytest.raises(ProviderUnavailable, match=r"192\.168\.7\.7 is a LAN address") as info:
        Sandbox(policy, warm=0)
    assert 'allow host = "127.0.0.1" with that port' in str(info.value)


def test_the_proxy_hint_for_a_lan_address_is_the_loopback_forward() -> None:
    """A name resolving to a LAN address is refused by the proxy with the way that works,
    not the rule line the providers would refuse."""
    from agent_sandbox._host.egress.rules import EgressRules

    rules = EgressRules(_policy([{"host": "db.internal", "ports": "5432"}]))
    usable, denial = rules.judge("db.internal", 5432, ["10.9.8.7"], by_name=True)
    assert usable == [] and denial is not None and denial.rule == "net.connect"
    assert denial.hint.startswith("10.9.8.7 is a LAN address"), denial.hint
    assert 'allow host = "127.0.0.1" with that port' in denial.hint
    assert unenforceable(get_provider("bwrap"), _policy([{"host": "10.9.8.7", "ports": "5432"}]))


def test_sandboxed_refuses_a_host_rule_under_landlock() -> None:
    skip_unless_available("landlock")
    from agent_sandbox.adapters import sandboxed

    policy = _policy(
        [{"host": "api.example.com", "ports": "443"}], provider="landlock", visible_names="accepted"
    )
    with pytest.raises(ProviderUnavailable, match="Landlock filters TCP by port only"):
        sandboxed(_one, policy=policy)


def _one() -> int:
    return 1


def test_policy_check_names_the_file_line_rule_and_alternative(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    skip_unless_available("landlock")
    from agent_sandbox._tools.cli import main

    path = tmp_path / "p.toml"
    path.write_text(
        'name = "p"\nprovider = "landlock"\nvisible_names = "accepted"\n\n'
        '[[net.rules]]\nhost = "127.0.0.1"\nports = "8765"\n'
    )
    status = main(["policy", "check", str(path)])
    out = capsys.readouterr()
    text = out.out + out.err
    assert status != 0
    assert re.search(
        re.escape(f"{path}:6 [net] rules[0]") + r'.*host = "127\.0\.0\.1" ports = "8765": '
        r"Landlock filters TCP by port only.*enforced by: bwrap or unshare",
        text.replace("\n", " "),
    ), text


def test_auto_takes_landlock_for_rules_it_enforces_exactly() -> None:
    """A listener on any address is a port rule Landlock holds as written."""
    from agent_sandbox.providers._auto import AutoProvider

    from .test_auto import SPEC, fake

    auto = AutoProvider((fake("landlock", strength=20, layers=("landlock", "seccomp")),))
    rules = [{"host": "*", "ports": "9000", "direction": "bind"}]
    policy = _policy(rules, visible_names="accepted")
    assert auto.build(policy, SPEC).provider == "landlock"
    with pytest.raises(ProviderUnavailable, match=r'landlock: .*visible_names = "accepted"'):
        auto.build(_policy(rules), SPEC)  # names not accepted: Landlock alone is refused


def test_landlock_answers_files_only_for_a_policy_that_accepts_visible_names() -> None:
    """Its `[files]` answer refuses every policy that does not say `visible_names =
    "accepted"` (Landlock cannot hide names), naming the key and the providers that hide
    them; the namespace providers, whose view hides them, answer `[files]` for any policy."""
    problems = get_provider("landlock").unenforceable(Policy())
    assert [(section, index) for section, index, _why, _fix in problems] == [("files", None)]
    _section, _index, why, fix = problems[0]
    assert "Landlock cannot hide that a file exists" in why and "visible_names" in why
    assert 'provider = "auto", "bwrap" or "unshare"' in fix
    assert get_provider("landlock").unenforceable(Policy(visible_names="accepted")) == []
    for name in ("bwrap", "unshare"):
        assert get_provider(name).unenforceable(Policy()) == [], name


def test_firejail_a_loopback_service_inside_the_sandbox_end_to_end() -> None:
    """firejail's allowed loopback case: with a bind and a connect rule for one loopback port,
    code in the sandbox serves on that port and talks to its own service, on the sandbox's
    own loopback; the host's listener on the same port is never reached (--net=none)."""
    import socket

    from .conftest import received_connection

    skip_unless_available("firejail")
    host_side = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    host_side.bind(("127.0.0.1", 0))
    host_side.listen(4)
    host_side.setblocking(False)
    port = host_side.getsockname()[1]
    policy = _policy(
        [
            {"host": "127.0.0.1", "ports": str(port), "direction": "bind"},
            {"host": "127.0.0.1", "ports": str(port)},
        ],
        imports={"allow": ["socket"]},
        limits={"wall_seconds": 30},
    )
    code = (
        "import socket\n"
        "srv = socket.socket()\n"
        f"srv.bind(('127.0.0.1', {port}))\n"
        "srv.listen(1)\n"
        f"cli = socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
        "conn, _ = srv.accept()\n"
        "cli.sendall(b'ping')\n"
        "conn.sendall(b'inside:' + conn.recv(4))\n"
        "answer = cli.recv(64).decode()\n"
        "for s in (cli, conn, srv):\n"
        "    s.close()\n"
        "answer"
    )
    try:
        with Sandbox(policy, provider="firejail", warm=0) as sb:
            result = sb.run(code)
        assert result.error is None, result
        assert result.value == "inside:ping", result
        assert not [d for d in result.denials if d.rule.startswith("net.")], result.denials
        assert not received_connection(host_side)
    finally:
        host_side.close()


class _Unanswered(Provider):
    """A new provider that has not yet said what it enforces."""

    name = "a-new-provider"


def _every_provider_class() -> list[type[Provider]]:
    from agent_sandbox._host.remote.provider import RemoteBoundary
    from agent_sandbox.providers import AutoProvider
    from agent_sandbox.providers._registry import all_providers

    return [*(type(p) for p in all_providers()), AutoProvider, RemoteBoundary]


def test_a_provider_that_answers_no_section_refuses_every_rule_and_every_policy() -> None:
    """It fails closed: a provider whose class answers nothing (a new provider) enforces no
    `[net]` rule, so the policy is refused naming each rule, and no other section either, so
    even the default policy is refused naming each section, never accepted as if it held."""
    policy = Policy(
        net={"rules": [{"host": "api.example.com", "ports": "443"}, {"host": "*", "ports": "80"}]}
    )
    problems = unenforceable(_Unanswered(), policy)
    assert [index for index, _why, _alternative in problems] == [0, 1]
    with pytest.raises(ProviderUnavailable, match="no statement of what 'a-new-provider'"):
        refuse_unenforceable(_Unanswered(), policy)
    with pytest.raises(ProviderUnavailable) as info:
        refuse_unenforceable(_Unanswered(), Policy())
    for section in SECTIONS:
        assert f"[{section}]: no statement" in str(info.value), section


def test_the_boundary_refuses_a_provider_that_answers_no_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It refuses at `resolve_boundary` (what `Sandbox`, tools and `policy check` do), whatever
    the provider's own build checks: the build here succeeds and checks nothing."""
    from agent_sandbox._host import boundary
    from agent_sandbox.providers import LaunchPlan, ProbeResult

    class Builds(_Unanswered):
        def probe(self) -> ProbeResult:
            return ProbeResult(self.name, True)

        def build(self, policy: Any, spec: Any) -> LaunchPlan:
            return LaunchPlan(self.name, ("true",), {}, (), "/", stack=(self.name,))

    monkeypatch.setattr(boundary, "get_provider", lambda name: Builds())
    monkeypatch.setattr(boundary, "check_min_boundary", lambda name, minimum: None)
    monkeypatch.setattr(boundary, "check_boundary_opt_out", lambda name, opt_out: None)
    with pytest.raises(ProviderUnavailable, match=r"\[files\]: no statement"):
        boundary.resolve_boundary(Policy(), "a-new-provider")


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("cls", _every_provider_class(), ids=lambda cls: cls.__name__)
def test_every_provider_answers_every_section_of_the_policy(
    cls: type[Provider], section: str
) -> None:
    """Generated from the policy model (`SECTIONS`): each provider's class says what it holds
    of each section; a section the model gains fails here for every provider until answered."""
    assert section in cls.answers, f"{cls.__name__} does not answer [{section}]"
