"""What a provider enforces below Python, section by section; the rest refuses the policy.

Each provider declares it on its class (`Provider.answers`: for every section of the policy,
one of the functions here); a section it does not answer is unenforceable, so a new provider
refuses every policy until it says what it holds, and a test generated from the policy model
(tests/providers/test_enforceable.py) names the provider and the section. The refusal is
`refuse_unenforceable(provider, policy)`: called by the builders that take network rules and
by `_host/boundary.resolve_boundary` for every provider (so `Sandbox`, tools, `sandboxed()`
and `agent-sandbox policy check`, which all resolve the boundary, refuse too).

The `[net]` section is where providers differ; what each one enforces, by the kind of rule:

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

The `[files]` section differs in one way: Landlock alone cannot hide that a name exists
(stat and listing succeed outside the grants; seccomp cannot see paths), so the landlock
provider answers `[files]` with `landlock_files`, which refuses every policy that does not
say `visible_names = "accepted"` (the operation matrix's hidden, deny and not-granted
list/stat cells, `_matrix.VISIBLE`). Under bwrap or unshare Landlock is a second layer
inside a view that holds only what is granted, and this does not apply.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Any

from agent_sandbox._errors import ProviderUnavailable

__all__ = [
    "by_the_chosen_candidate",
    "by_the_pods_provider",
    "describe_rule",
    "firejail_net",
    "held_as_planned",
    "lan_network",
    "landlock_files",
    "landlock_net",
    "namespace_net",
    "opted_out",
    "refuse_unenforceable",
    "rule_location",
    "standard_answers",
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


def _landlock(policy: Any) -> list[tuple[int | None, str, str]]:
    out: list[tuple[int | None, str, str]] = []
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


def _firejail(policy: Any) -> list[tuple[int | None, str, str]]:
    out: list[tuple[int | None, str, str]] = []
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
    None. One address is judged as the proxy judges it (`_host/egress/addresses.normalise_host`)."""
    text = host.strip()
    if _is_any(text) or _is_loopback(text):
        return None
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        net = None
    if net is None or net.num_addresses == 1:
        # Only now (a policy without network loads no egress module): the proxy's own reader.
        from agent_sandbox._host.egress.addresses import normalise_host

        try:
            spelled = normalise_host(text if net is None else str(net.network_address))
        except ValueError:
            return None
        if spelled.ip is None:
            return None  # a host name: the proxy judges its addresses when it resolves
        net = ipaddress.ip_network(spelled.judged)
    from agent_sandbox._host.egress.addresses import in_lan

    return (net.network_address if net.num_addresses == 1 else net) if in_lan(net) else None


def _namespace(policy: Any) -> list[tuple[int | None, str, str]]:
    out: list[tuple[int | None, str, str]] = []
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


def opted_out(policy: Any) -> list[tuple[int | None, str, str]]:
    """The explicit opt-out (`subprocess` with `no_kernel_boundary = "accepted"`): it
    enforces nothing below Python, and the opt-out says so."""
    return []


def held_as_planned(policy: Any) -> list[tuple[int | None, str, str]]:
    """A section the provider's plan holds as written (files: its view, Landlock or the
    guest's mounts; limits: rlimits and the cgroups the host makes), or one that is the
    Python layer's and the host's alike under every provider (imports, env, api, code,
    tools; remote, read only by the remote provider): nothing refused."""
    return []


def landlock_files(policy: Any) -> list[tuple[int | None, str, str]]:
    """`landlock` alone: its rules hold every cell of the operation matrix but the names
    (stat and listing outside the grants), which only a policy that accepts them as visible
    may leave open (`visible_names = "accepted"`)."""
    from agent_sandbox.policies._model import VISIBLE_NAMES_FIX, VISIBLE_NAMES_WHY

    if getattr(policy, "visible_names", "") == "accepted":
        return []
    why = f'{VISIBLE_NAMES_WHY}, and the policy does not say visible_names = "accepted"'
    return [(None, why, VISIBLE_NAMES_FIX)]


def by_the_chosen_candidate(policy: Any) -> list[tuple[int | None, str, str]]:
    """`auto`: the candidate it chooses answers (its build refuses what it cannot hold, and
    `auto` takes only a candidate whose build succeeded)."""
    return []


def by_the_pods_provider(policy: Any) -> list[tuple[int | None, str, str]]:
    """`remote`: the pod's own provider answers, when the pod resolves its boundary."""
    return []


#: The functions by provider, for `[net]` (see the table above).
landlock_net = _landlock
firejail_net = _firejail
namespace_net = _namespace


def standard_answers(
    net: Callable[[Any], list[tuple[int | None, str, str]]],
    other: Callable[[Any], list[tuple[int | None, str, str]]] = held_as_planned,
    files: Callable[[Any], list[tuple[int | None, str, str]]] | None = None,
) -> dict[str, Callable[[Any], list[tuple[int | None, str, str]]]]:
    """A provider's answers: `net` for `[net]`, `files` for `[files]` (default `other`),
    `other` for every other section. The sections are written out here, not read from the
    model: a section the model gains is unanswered by every provider until someone decides
    here what each holds of it."""
    return {
        "files": files or other,
        "net": net,
        "imports": other,
        "env": other,
        "api": other,
        "code": other,
        "limits": other,
        "tools": other,
        "remote": other,
    }


def unenforceable(provider: Any, policy: Any) -> list[tuple[int | None, str, str]]:
    """(rule index, why `provider` cannot enforce it, which provider can) for each `[net]`
    rule it cannot hold below Python (`Provider.unenforceable` has every section)."""
    return [
        (index, why, alternative)
        for section, index, why, alternative in provider.unenforceable(policy)
        if section == "net"
    ]


def refuse_unenforceable(provider: Any, policy: Any) -> None:
    """Raise ProviderUnavailable naming everything of `policy` that `provider` cannot
    enforce below Python: each `[net]` rule, each unanswered section."""
    problems = provider.unenforceable(policy)
    if not problems:
        return
    lines = []
    for section, index, why, alternative in problems:
        if section == "net" and index is not None:
            rule = policy.net.rules[index]
            where = f"{rule_location(policy, index)} {describe_rule(rule)}"
        else:
            where = f"[{section}]" if index is None else f"[{section}] rules[{index}]"
        lines.append(f"{where}: {why}; enforced by: {alternative}")
    net_only = all(section == "net" for section, *_ in problems)
    what = (
        ("this [net] rule" if len(lines) == 1 else "these [net] rules")
        if net_only
        else ("this part of the policy" if len(lines) == 1 else "these parts of the policy")
    )
    raise ProviderUnavailable(
        provider.name,
        f"it cannot enforce {what} below Python, so the policy is refused: {' | '.join(lines)}",
    )
