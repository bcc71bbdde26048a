"""Which `[net]` rules a provider enforces below Python; the others refuse the policy at build.

Every provider's `build()` calls `refuse_unenforceable(provider, policy)` (through it,
`Sandbox`, tools, `sandboxed()` and `agent-sandbox policy check`, which all do a dry build,
refuse too). What each one enforces, by the kind of rule:

| rule                                        | landlock | bwrap / unshare / qemu | firejail  |
|---------------------------------------------|----------|------------------------|-----------|
| TCP connect, any host (name, IP, CIDR, `*`) | no (1)   | yes (egress proxy)     | no (2)    |
| TCP connect, a loopback address             | no (1)   | yes (proxy to host lo) | no (2)    |
| TCP connect, a LAN address (5)              | no (1)   | no (5)                 | no (2)    |
| TCP bind, any address (`*`)                 | yes      | no (3)                 | no (2)    |
| TCP bind, a loopback address                | no (1)   | yes (own loopback)     | yes       |
| TCP bind, another address                   | no (1)   | no (3)                 | no (2)    |
| UDP, a loopback address                     | no (4)   | yes (own loopback)     | yes       |
| UDP, another address                        | no (4)   | no (3)                 | no (2)    |
| deny, one host, on a port an allow opens    | no (1)   | yes (proxy)            | n/a       |
| deny, any host                              | yes      | yes                    | yes       |

`gvisor` has the column of bwrap (the Sentry's own loopback, the host's egress proxy through
a relay).

(1) Landlock filters TCP by port only: the rule would open its port to every address,
    including the agent's own loopback services and the cloud metadata address, which the
    same rule under the proxy never reaches. (2) firejail runs the worker with `--net=none`:
    no route out and only its own loopback, where the host's services are not. (3) The
    only way out of the namespace is the host's TCP proxy (refused here).
    (4) Landlock does not filter UDP at all; the seccomp filter then allows datagram sockets
    to every address. (5) An IP or CIDR inside 10/8, 172.16/12, 192.168/16, 100.64/10,
    169.254/16, fc00::/7 or fe80::/10: the proxy would serve it to clients reading
    HTTP_PROXY only, while a direct socket in the namespace reaches nothing (only allowed
    loopback services are forwarded inside); "allowed" must mean reachable by every client,
    so the policy is refused, naming the loopback forward that works instead.

`subprocess` (no kernel boundary, taken only with `no_kernel_boundary = "accepted"`)
enforces no rule below Python; the opt-out says so, so nothing more is refused here.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from agent_sandbox._errors import ProviderUnavailable

__all__ = [
    "describe_rule",
    "lan_network",
    "refuse_unenforceable",
    "rule_location",
    "unenforceable",
]

_ANY_HOST = frozenset({"*", "0.0.0.0/0", "::/0", "any"})
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})

_NAMESPACE = "bwrap or unshare"


def _is_loopback(host: str) -> bool:
    if host.strip().lower() in _LOOPBACK_NAMES:
        return True
    try:
        net = ipaddress.ip_network(host.strip(), strict=False)
    except ValueError:
        return False
    return net.network_address.is_loopback and net.broadcast_address.is_loopback


def _is_any(host: str) -> bool:
    return host.strip().lower() in _ANY_HOST


def _tcp(rule: Any) -> bool:
    return str(rule.protocol) in ("tcp", "any")


def _udp(rule: Any) -> bool:
    return str(rule.protocol) in ("udp", "any")


def _dirs(rule: Any) -> set[str]:
    d = str(rule.direction)
    return {"connect", "bind"} if d == "any" else {d}


def _overlaps(a: Any, b: Any) -> bool:
    return any(
        lo <= hi2 and lo2 <= hi for lo, hi in a.port_ranges() for lo2, hi2 in b.port_ranges()
    )


def describe_rule(rule: Any) -> str:
    """`host = "api.example.com" ports = "443"`, with protocol/direction/action when set."""
    parts = [f'host = "{rule.host}"', f'ports = "{rule.ports}"']
    if rule.protocol != "tcp":
        parts.append(f'protocol = "{rule.protocol}"')
    if rule.direction != "connect":
        parts.append(f'direction = "{rule.direction}"')
    if rule.action != "allow":
        parts.append(f'action = "{rule.action}"')
    return " ".join(parts)


def rule_location(policy: Any, index: int) -> str:
    """Where the rule is written: `file:line [net] rules[i]` (the line best effort)."""
    where = f"[net] rules[{index}]"
    source = getattr(policy, "source", None)
    if not source or str(source).startswith("preset:") or str(source) == "<string>":
        return where
    rule = policy.net.rules[index]
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read(1 << 20)
    except (OSError, UnicodeError):
        return f"{source} {where}"
    pattern = re.compile(r"""host\s*=\s*["']""" + re.escape(rule.host) + r"""["']""")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.search(line):
            return f"{source}:{number} {where}"
    return f"{source} {where}"


def _landlock(policy: Any) -> list[tuple[int, str, str]]:
    out: list[tuple[int, str, str]] = []
    rules = list(policy.net.rules)
    for i, rule in enumerate(rules):
        if rule.action == "allow":
            if _udp(rule):
                out.append(
                    (
                        i,
                        "Landlock does not filter UDP: it would reach every address",
                        _NAMESPACE if _is_loopback(rule.host) else "none (remove the rule)",
                    )
                )
            if _tcp(rule) and "connect" in _dirs(rule):
                out.append(
                    (
                        i,
                        "Landlock filters TCP by port only: the port would be open to every "
                        "address, the agent's own loopback services and the cloud metadata "
                        "address too",
                        f"{_NAMESPACE} (the host's egress proxy enforces host and port)",
                    )
                )
            if _tcp(rule) and "bind" in _dirs(rule) and not _is_any(rule.host):
                out.append(
                    (
                        i,
                        "Landlock filters bind by port only: a listener could take any address",
                        _NAMESPACE if _is_loopback(rule.host) else 'host = "*" under landlock',
                    )
                )
        elif not _is_any(rule.host) and _tcp(rule):
            opened = any(
                r.action == "allow" and _tcp(r) and _dirs(r) & _dirs(rule) and _overlaps(r, rule)
                for r in rules
            )
            if opened:
                out.append(
                    (
                        i,
                        "Landlock cannot close a port to one host while a rule opens it",
                        f"{_NAMESPACE} (the host's egress proxy applies deny rules)",
                    )
                )
    return out


def _firejail(policy: Any) -> list[tuple[int, str, str]]:
    out: list[tuple[int, str, str]] = []
    rules = list(policy.net.rules)
    for i, rule in enumerate(rules):
        if rule.action != "allow":
            continue
        if not _is_loopback(rule.host):
            out.append(
                (
                    i,
                    "firejail runs the worker with --net=none: there is no route out",
                    f"{_NAMESPACE} (the host's egress proxy enforces host names)",
                )
            )
            continue
        if _tcp(rule) and "connect" in _dirs(rule):
            served = any(
                r.action == "allow"
                and _tcp(r)
                and "bind" in _dirs(r)
                and (_is_loopback(r.host) or _is_any(r.host))
                and _overlaps(r, rule)
                for r in rules
            )
            if not served:
                out.append(
                    (
                        i,
                        "firejail's --net=none gives the worker its own loopback: the host's "
                        "service on that port is not reachable, and nothing in the sandbox "
                        "may listen there",
                        f"{_NAMESPACE} (the egress proxy reaches the host's loopback service "
                        "a rule names)",
                    )
                )
    return out


#: LAN ranges (RFC 1918 private, RFC 6598 shared, link-local, IPv6 unique-local and
#: link-local): an allow rule naming an address inside one is refused by the namespace
#: providers (`lan_network`).
_LAN_NETS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "fc00::/7",
        "fe80::/10",
    )
)

_LAN_WHY = (
    "{net} is a LAN address: the host's egress proxy would reach it only for clients that "
    "read HTTP_PROXY (requests, urllib, httpx, pip), while a direct socket in the sandbox "
    "(http.client, database drivers, gRPC) reaches nothing, for the sandbox's network "
    "namespace has only its own loopback; an allowed service must be reachable by every client"
)
_LAN_INSTEAD = (
    "none in a network namespace: forward the service to a port on the host's loopback "
    '(ssh -L or socat) and allow host = "127.0.0.1" with that port, which every client reaches'
)


def lan_network(host: str) -> Any:
    """The network a rule's host names when it lies inside a LAN range (every spelling the
    proxy reads: CIDR, short or legacy IPv4, IPv6 forms embedding an IPv4 address), else
    None. One address is judged as the proxy judges it (`_egress.normalise_host`)."""
    text = host.strip()
    if _is_any(text) or _is_loopback(text):
        return None
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        net = None
    if net is None or net.num_addresses == 1:
        # Only now: the proxy's module (asyncio) reads the spellings it accepts.
        from agent_sandbox._host.egress.proxy import normalise_host

        try:
            spelled = normalise_host(text if net is None else str(net.network_address))
        except ValueError:
            return None
        if spelled.ip is None:
            return None  # a host name: the proxy judges its addresses when it resolves
        net = ipaddress.ip_network(spelled.judged)
    if any(net.version == lan.version and net.subnet_of(lan) for lan in _LAN_NETS):  # type: ignore[arg-type]
        return net.network_address if net.num_addresses == 1 else net
    return None


def _namespace(policy: Any) -> list[tuple[int, str, str]]:
    out: list[tuple[int, str, str]] = []
    for i, rule in enumerate(policy.net.rules):
        if rule.action != "allow" or _is_loopback(rule.host):
            continue
        if _tcp(rule) and "connect" in _dirs(rule):
            lan = lan_network(rule.host)
            if lan is not None:
                out.append((i, _LAN_WHY.format(net=lan), _LAN_INSTEAD))
        if _udp(rule):
            out.append(
                (
                    i,
                    "UDP does not go through the host's egress proxy (TCP only)",
                    "none (remove the rule)",
                )
            )
        if "bind" in _dirs(rule):
            out.append(
                (
                    i,
                    "a listener in the sandbox's network namespace is reachable from inside "
                    "it only",
                    'landlock, for host = "*"',
                )
            )
    return out


def unenforceable(provider: str, policy: Any) -> list[tuple[int, str, str]]:
    """(rule index, why `provider` cannot enforce it, which provider can) for each rule."""
    net = getattr(policy, "net", None)
    if net is None or not getattr(net, "rules", None):
        return []
    check = _CHECKS.get(provider)
    if check is None:
        # Fail closed: a provider this table does not know (a new one, a typo) is taken to
        # enforce no rule below Python, so every rule refuses the policy until it is added.
        return [
            (
                i,
                f"no statement of which [net] rules {provider!r} enforces below Python "
                "(providers/_netcheck.py)",
                _NAMESPACE,
            )
            for i in range(len(policy.net.rules))
        ]
    return check(policy)


def _none(policy: Any) -> list[tuple[int, str, str]]:
    """The explicit opt-out (`subprocess` with `no_kernel_boundary = "accepted"`): it
    enforces nothing below Python, and the opt-out says so."""
    return []


#: What each provider enforces, by name: every provider is listed, or refuses every rule.
_CHECKS = {
    "landlock": _landlock,
    "firejail": _firejail,
    "bwrap": _namespace,
    "unshare": _namespace,
    "qemu": _namespace,
    "gvisor": _namespace,
    "subprocess": _none,
}


def refuse_unenforceable(provider: str, policy: Any) -> None:
    """Raise ProviderUnavailable naming every `[net]` rule `provider` cannot enforce."""
    problems = unenforceable(provider, policy)
    if not problems:
        return
    lines = []
    for index, why, alternative in problems:
        rule = policy.net.rules[index]
        lines.append(
            f"{rule_location(policy, index)} {describe_rule(rule)}: {why}; "
            f"enforced by: {alternative}"
        )
    raise ProviderUnavailable(
        provider,
        f"it cannot enforce {'this [net] rule' if len(lines) == 1 else 'these [net] rules'} "
        f"below Python, so the policy is refused: {' | '.join(lines)}",
    )
