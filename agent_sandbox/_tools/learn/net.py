"""Learning mode's judgement of network use: connects, binds and name look-ups.

A proposal names exactly the host the run used (a name or one address, never a network
or a wildcard) with the ports it used; cloud metadata endpoints and link-local addresses
are flagged, the local machine and private networks marked RISKY, and what the current
policy denies stays denied.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from typing import TYPE_CHECKING, Literal

from agent_sandbox._tools.learn.findings import _METADATA_HOSTS, Finding, _ports_text, _rule_text
from agent_sandbox.policies import NetRule
from agent_sandbox.policies._paths import risky_name
from agent_sandbox.providers._netcheck import lan_network

if TYPE_CHECKING:
    from agent_sandbox._tools.learn.findings import Status, _Context

__all__: list[str] = []


# -- network ----------------------------------------------------------------------------


def _split_host_port(target: str) -> tuple[str, int | None]:
    text = target.strip()
    if "://" in text:
        text = text.split("://", 1)[1]
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        # `::1:8080`, as the guard writes an IPv6 address and a port.
        left, _, right = text.rpartition(":")
        host, port = text, ""
        if right.isdigit():
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(left.split("%")[0])
                host, port = left, right
    try:
        number = int(port) if port else None
    except ValueError:
        number = None
    if number is not None and not 0 <= number <= 65535:
        number = None
    return host.strip().lower().rstrip("."), number


#: A host name as a rule may name it literally: DNS labels (underscores allowed).
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME_RE = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")


def _host_unwritable(host: str) -> str:
    """Why `host` cannot be proposed as the one host it is ("" when it can): a rule's host
    is a name, one address or a CIDR, so anything else (a network such as `0.0.0.0/0`, a
    wildcard, control characters) would mean more than what the run used."""
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    if _HOSTNAME_RE.match(host) and host not in ("any",):
        return ""
    what = risky_name(host) or "it is not a plain host name or one address"
    return (
        f"{what}; a rule naming it would not mean this one host, and a proposal names "
        "exactly what the run used (write the rule by hand if you mean it)"
    )


def _protocol(action: str, target: str, detail: str) -> Literal["tcp", "udp"]:
    text = f"{action} {target} {detail}".lower()
    return "udp" if "udp" in text or "sendto" in text or "datagram" in text else "tcp"


def _host_risk(host: str, direction: str) -> tuple[Status, str] | None:
    if host in _METADATA_HOSTS:
        return ("flagged", "a cloud metadata endpoint: it hands out the host's credentials")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host in ("localhost", "localhost.localdomain"):
            return ("risky", "the local machine: reaches services on this host")
        return None
    if address.is_unspecified and direction == "bind":
        return ("risky", "listens on every interface")
    if address.is_link_local:
        return ("flagged", "a link-local address (metadata and neighbour services)")
    if address.is_loopback:
        return ("risky", "the local machine: reaches services on this host")
    if address.is_private:
        return ("risky", "a private network address")
    return None


def _net_allowed(ctx: _Context, host: str, port: int, direction: str, protocol: str) -> str:
    """'deny' when a deny rule matches, 'allow' when an allow rule does, else ''."""
    verdict = ""
    for rule in ctx.current.net.rules:
        if rule.direction not in ("any", direction) or rule.protocol not in ("any", protocol):
            continue
        if not any(lo <= port <= hi for lo, hi in rule.port_ranges()):
            continue
        if not _host_matches(rule.host, host):
            continue
        if rule.action == "deny":
            return "deny"
        verdict = "allow"
    return verdict


def _host_matches(rule_host: str, host: str) -> bool:
    if rule_host.lower() == host:
        return True
    if "/" in rule_host:
        try:
            return ipaddress.ip_address(host) in ipaddress.ip_network(rule_host, strict=False)
        except ValueError:
            return False
    return False


def _learn_net(
    ctx: _Context,
    connects: list[tuple[str, str, str]],
    binds: list[tuple[str, str, str]],
    resolves: list[tuple[str, str, str]],
) -> tuple[list[NetRule], list[Finding]]:
    findings: list[Finding] = []
    wanted: dict[tuple[str, str, str], set[int]] = {}
    protocol: str
    named: set[str] = set()
    observed = [("connect", c) for c in connects] + [("bind", b) for b in binds]
    for direction, (action, target, detail) in observed:
        rule = f"net.{direction}"
        host, port = _split_host_port(target)
        if not host or port is None:
            findings.append(
                Finding(
                    "net.rules",
                    target,
                    "flagged",
                    "no host and port could be read from the record",
                    rule,
                )
            )
            continue
        unwritable = _host_unwritable(host)
        if unwritable:
            findings.append(Finding("net.rules", target, "flagged", unwritable, rule))
            continue
        protocol = _protocol(action, target, detail)
        key = (direction, protocol, host)
        wanted.setdefault(key, set()).add(port)
        named.add(host)
    pending_resolves: list[tuple[str, str]] = []
    for action, target, detail in resolves:
        host, port = _split_host_port(target)
        if not host:
            continue
        unwritable = _host_unwritable(host)
        if unwritable:
            findings.append(Finding("net.rules", target, "flagged", unwritable, "net.resolve"))
            continue
        if port is None:
            # The host's egress proxy says which port the name was wanted for.
            asked = re.search(r"\(port (\d{1,5})\)", detail)
            if asked and 0 < int(asked.group(1)) < 65536:
                port = int(asked.group(1))
        if port is None:
            pending_resolves.append((host, target))
            continue
        protocol = _protocol(action, target, detail)
        wanted.setdefault(("connect", protocol, host), set()).add(port)
        named.add(host)
    remote_ports = {
        port
        for (direction, protocol, host), ports in wanted.items()
        if direction == "connect" and protocol == "tcp" and not _host_risk(host, direction)
        for port in ports
    }
    inferred: set[str] = set()
    for host, target in pending_resolves:
        covered = host in named or any(_host_matches(r.host, host) for r in ctx.current.net.rules)
        if not covered and remote_ports and not _host_risk(host, "connect"):
            # The guard records the lookup by name and the connection by address; the name
            # gets the ports the run connected to, marked for review.
            wanted.setdefault(("connect", "tcp", host), set()).update(remote_ports)
            inferred.add(host)
            continue
        if not covered:
            findings.append(
                Finding(
                    "net.rules",
                    target,
                    "flagged",
                    "a name looked up without a port and never connected to; "
                    "add a rule with the ports it needs by hand",
                    "net.resolve",
                )
            )
    rules: list[NetRule] = []
    for (direction, protocol, host), ports in sorted(wanted.items()):
        rule_name = f"net.{direction}"
        new_ports: set[int] = set()
        for port in ports:
            verdict = _net_allowed(ctx, host, port, direction, protocol)
            if verdict == "deny":
                findings.append(
                    Finding(
                        "net.rules",
                        f"{direction} {protocol} {host}:{port}",
                        "flagged",
                        "the policy denies it explicitly",
                        rule_name,
                    )
                )
            elif verdict == "":
                new_ports.add(port)
        if not new_ports:
            continue
        risk = _host_risk(host, direction)
        if risk and risk[0] == "flagged":
            findings.append(
                Finding(
                    "net.rules",
                    f"{direction} {protocol} {host}:{_ports_text(new_ports)}",
                    "flagged",
                    risk[1],
                    rule_name,
                )
            )
            continue
        if direction == "connect" and protocol == "tcp" and lan_network(host) is not None:
            # A rule naming it would refuse the policy under the namespace providers (only
            # clients reading HTTP_PROXY could reach it): the way every client does.
            findings.append(
                Finding(
                    "net.rules",
                    f"{direction} {protocol} {host}:{_ports_text(new_ports)}",
                    "flagged",
                    "a LAN address, which a rule cannot allow under bwrap, unshare, gVisor "
                    "or QEMU (a direct socket in the sandbox could not reach it); forward it "
                    "to a port on the host's loopback (ssh -L or socat) and allow "
                    '"127.0.0.1" with that port',
                    rule_name,
                )
            )
            continue
        try:
            new_rule = NetRule.model_validate(
                {
                    "host": host,
                    "ports": _ports_text(new_ports),
                    "direction": direction,
                    "protocol": protocol,
                }
            )
        except ValueError as exc:
            findings.append(Finding("net.rules", f"{host}", "flagged", str(exc), rule_name))
            continue
        rules.append(new_rule)
        status: Status = risk[0] if risk else "proposed"
        if host in inferred and not risk:
            status = "risky"
            risk = ("risky", "a name the run looked up; its ports are those the run connected to")
        findings.append(
            Finding(
                "net.rules",
                _rule_text(new_rule),
                status,
                risk[1] if risk else "",
                rule_name,
                tuple(f"{host}:{p}" for p in sorted(new_ports)),
            )
        )
    return rules, findings
