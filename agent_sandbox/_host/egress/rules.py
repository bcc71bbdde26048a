"""A policy's `[net]` rules as the proxy judges them, and the decision for one target.

`EgressRules` judges a target (pure: no I/O): a name before it is resolved, then the
addresses it resolved to; `_decide` puts the steps in order for one connection (its one
spelling, the judgement by name, the pinned resolver, the judgement by address).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from agent_sandbox._denial import Denial
from agent_sandbox._hints import grant_hint
from agent_sandbox._host.egress.addresses import (
    Host,
    _address_or_none,
    _kind,
    _special_only,
    in_lan,
    is_special,
    normalise_host,
)
from agent_sandbox._host.egress.resolver import _lookup

if TYPE_CHECKING:
    from agent_sandbox._host.egress.proxy import Route

__all__ = ["EgressRules"]


_LOOPBACK_NAMES = {
    "localhost": ("127.0.0.0/8", "::1/128"),
    "localhost.localdomain": ("127.0.0.0/8", "::1/128"),
    "ip6-localhost": ("::1/128",),
}


@dataclasses.dataclass(frozen=True)
class _Rule:
    action: str
    host: str
    name: str | None
    networks: tuple[Any, ...]
    ports: tuple[tuple[int, int], ...]
    #: `*` (or `any`): every host name and every global address.
    every_name: bool = False

    def has_port(self, port: int) -> bool:
        return any(lo <= port <= hi for lo, hi in self.ports)

    def holds(self, ip: Any) -> bool:
        return any(ip.version == net.version and ip in net for net in self.networks)

    def names(self, name: str) -> bool:
        return self.every_name or self.name == name


_EVERY_HOST = frozenset({"*", "any"})


class EgressRules:
    """A policy's TCP connect rules, as the proxy judges them (pure: no I/O here).

    Every target is first put in its one spelling (`normalise_host`), then:

    * A target given by name needs an allow rule naming that host on that port (names
      compare case-insensitively, without a trailing dot), or a `*` rule; only then is it
      resolved. An IP/CIDR rule never makes a name resolvable: a name no rule names is
      refused before any resolver sees it (`net.resolve`), so names carry no data out.
    * A deny rule naming a host beats any allow, for the name and for every address the
      name resolves to (`deny_addresses`, filled by the proxy from the same resolver), so
      the denied host is not reachable by its address either.
    * A name rule reaches only global addresses: a name that resolves to a loopback,
      private, link-local (the metadata address 169.254.169.254), shared or multicast
      address is refused unless an IP or CIDR rule lying inside such a range covers it
      (`0.0.0.0/0` does not count: it names no such address).
    * A target given as an address needs an IP/CIDR rule covering it (the address it
      reaches, for NAT64, 6to4 and Teredo), with the same rule for non-global addresses;
      `localhost` in a rule names the loopback addresses.
    """

    def __init__(self, policy: Any) -> None:
        self.policy_name = str(policy.name)
        # In learning mode a refusal still refuses (the envelope never widens the network)
        # and is marked learned, so `agent-sandbox learn` proposes a rule for the host.
        self.learn = str(getattr(policy, "mode", "enforce")) == "learn"
        self.rules: list[_Rule] = []
        for rule in policy.net.rules:
            if rule.protocol not in ("tcp", "any") or rule.direction not in ("connect", "any"):
                continue
            host = rule.host.strip()
            name: str | None = None
            networks: tuple[Any, ...] = ()
            every = host.lower() in _EVERY_HOST
            if every:
                networks = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
            elif host.lower() in _LOOPBACK_NAMES:
                networks = tuple(ipaddress.ip_network(n) for n in _LOOPBACK_NAMES[host.lower()])
            else:
                try:
                    networks = (ipaddress.ip_network(host, strict=False),)
                except ValueError:
                    try:
                        spelled = normalise_host(host)
                    except ValueError:
                        spelled = Host(host.lower(), name=host.lower())
                    if spelled.ip is not None:
                        networks = (ipaddress.ip_network(spelled.judged),)
                    else:
                        name = spelled.name
            self.rules.append(
                _Rule(rule.action, host, name, networks, tuple(rule.port_ranges()), every)
            )
        #: The names deny rules name, and the addresses they resolved to (by the proxy).
        self.deny_names = sorted(
            {r.name for r in self.rules if r.action == "deny" and r.name is not None}
        )
        self.deny_addresses: dict[str, list[Any]] = {}

    def _denial(self, rule: str, action: str, target: str, detail: str, hint: str) -> Denial:
        return Denial(
            rule,
            action,
            target,
            self.policy_name,
            hint=hint,
            detail=detail + " (refused by the host's egress proxy)",
            learned=self.learn,
        )

    def bad_host(self, host: str, port: int, why: str) -> Denial:
        """The denial for a host that is neither an address nor a valid name."""
        return self._denial(
            "net.resolve",
            "resolve",
            host[:120] + ("..." if len(host) > 120 else ""),
            f"not a host the proxy connects to ({why}; port {port})",
            "name the host by a valid DNS name or an IP address",
        )

    def before_resolve(self, host: str, port: int) -> Denial | None:
        """Judge a host name before it is looked up: None only when an allow rule names it
        (or `*`) on this port and no deny rule names it; nothing else is ever resolved."""
        try:
            name = normalise_host(host).name or host.lower()
        except ValueError as exc:
            return self.bad_host(host, port, str(exc))
        named = [r for r in self.rules if r.names(name)]
        for rule in named:
            if rule.action == "deny" and rule.has_port(port):
                return self._denial(
                    "net.connect",
                    "connect",
                    f"{host}:{port}",
                    f"a deny rule for {rule.host!r} matches, and deny beats allow",
                    f"remove the deny rule for {rule.host!r} from [net] rules",
                )
        if any(r.action == "allow" and r.has_port(port) for r in named):
            return None
        if any(r.action == "allow" for r in named):
            ports = ",".join(r.host + ":" + _ports_text(r.ports) for r in named)
            return self._denial(
                "net.connect",
                "connect",
                f"{host}:{port}",
                f"the [net] rules name this host for other ports only ({ports})",
                grant_hint({"net.rules": [{"host": name, "ports": str(port)}]}),
            )
        return self._denial(
            "net.resolve",
            "resolve",
            name,
            f"no [net] rule names this host, so it is not resolved (port {port})",
            grant_hint({"net.rules": [{"host": name, "ports": str(port)}]}),
        )

    def judge(
        self, host: str, port: int, addresses: Iterable[str], *, by_name: bool
    ) -> tuple[list[str], Denial | None]:
        """The addresses a connection may use, in order; else the denial for the first."""
        name = host.lower().rstrip(".")
        name_allows = by_name and any(
            r.action == "allow" and r.names(name) and r.has_port(port) for r in self.rules
        )
        usable: list[str] = []
        first: Denial | None = None
        for text in addresses:
            try:
                spelled = normalise_host(text)
            except ValueError:
                continue
            if spelled.ip is None:
                continue
            denial = self._judge_address(host, port, spelled, name_allows)
            if denial is None:
                usable.append(str(spelled.ip))
            elif first is None:
                first = denial
        if usable:
            return usable, None
        if first is None:
            first = self._denial(
                "net.resolve",
                "resolve",
                host,
                "the host name resolves to no usable address",
                "",
            )
        return [], first

    def _judge_address(
        self, host: str, port: int, spelled: Host, name_allows: bool
    ) -> Denial | None:
        target = f"{host}:{port}"
        ip = spelled.judged
        both = (ip,) if spelled.ip == ip else (ip, spelled.ip)
        special = is_special(ip) or spelled.form == "teredo"
        shown = str(ip) if spelled.ip == ip else f"{spelled.ip} ({spelled.form} for {ip})"
        for rule in self.rules:
            if rule.action == "deny" and rule.has_port(port) and any(map(rule.holds, both)):
                return self._denial(
                    "net.connect",
                    "connect",
                    target,
                    f"{shown} is covered by a deny rule for {rule.host!r}, and deny beats allow",
                    f"remove the deny rule for {rule.host!r} from [net] rules",
                )
        for rule in self.rules:
            if rule.action != "deny" or rule.name is None or not rule.has_port(port):
                continue
            if any(a in self.deny_addresses.get(rule.name, ()) for a in both):
                return self._denial(
                    "net.connect",
                    "connect",
                    target,
                    f"{shown} is an address of {rule.host!r}, which a deny rule names, and "
                    "deny beats allow",
                    f"remove the deny rule for {rule.host!r} from [net] rules",
                )
        for rule in self.rules:
            if rule.action != "allow" or rule.name is not None or not rule.has_port(port):
                continue
            if any(
                a.version == net.version and a in net and (not special or _special_only(net))
                for net in rule.networks
                for a in both
            ):
                return None
        if name_allows and not special:
            return None
        hint = grant_hint({"net.rules": [{"host": str(ip), "ports": str(port)}]})
        if in_lan(ipaddress.ip_network(ip)):
            # A rule naming a LAN address refuses the policy (`_netcheck`): the way that works.
            hint = (
                f"{ip} is a LAN address, which a sandbox in a network namespace cannot reach "
                f"for every client: forward {ip}:{port} to a port on the host's loopback (ssh "
                'or socat) and allow host = "127.0.0.1" with that port'
            )
        if special and name_allows:
            return self._denial(
                "net.connect",
                "connect",
                target,
                f"{host} resolves to {shown}, a {_kind(ip)} address, which a host-name rule "
                "never reaches; a rule must name that address",
                hint,
            )
        if special:
            detail = f"{shown} is a {_kind(ip)} address and no [net] rule names it"
        else:
            detail = "no [net] rule allows tcp connect to this address"
        return self._denial("net.connect", "connect", target, detail, hint)


def _ports_text(ports: Iterable[tuple[int, int]]) -> str:
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ports)


async def _decide(route: Route, host: str, port: int) -> tuple[list[str], Denial | None]:
    """Judge a target: its one spelling first (`normalise_host`); an address is judged as
    it is; a name is judged, then (only when a rule names it) resolved on the host by the
    pinned resolver, then judged by address. A deny rule's names are resolved too, so
    their addresses are refused whatever the spelling."""
    rules = route.rules
    try:
        spelled = normalise_host(host)
    except ValueError as exc:
        return [], rules.bad_host(host, port, str(exc))
    for name in rules.deny_names:
        with contextlib.suppress(Exception):
            found = await _lookup(name)
            rules.deny_addresses[name] = [
                a for a in (_address_or_none(t) for t in found) if a is not None
            ]
    if spelled.ip is not None:
        return rules.judge(spelled.text, port, [spelled.text], by_name=False)
    assert spelled.name is not None
    denial = rules.before_resolve(spelled.name, port)
    if denial is not None:
        return [], denial
    try:
        addresses = await _lookup(spelled.name)
    except Exception as exc:  # whatever the resolver raises, the name did not resolve
        why = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc) or repr(exc)
        return [], rules._denial(
            "net.resolve",
            "resolve",
            spelled.name,
            f"the host does not resolve ({why})",
            "check the host name in the policy's [net] rules",
        )
    return rules.judge(spelled.name, port, addresses, by_name=True)
