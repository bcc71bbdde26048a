"""Every target's one spelling, and the address ranges the proxy judges by.

`normalise_host` puts a host as a client spelled it into its one canonical form (`Host`);
`is_special` says which addresses a host-name rule never reaches; `LAN_NETWORKS` and `in_lan`
are the LAN ranges (`providers._netcheck` refuses a rule naming one). Pure: no I/O here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

__all__ = ["LAN_NETWORKS", "Host", "in_lan", "is_special", "normalise_host"]


#: LAN ranges (RFC 1918 private, RFC 6598 shared, link-local, IPv6 unique-local and
#: link-local): an allow rule naming an address inside one is refused by the namespace
#: providers (`providers._netcheck.lan_network`), and the proxy's refusal of one says why.
LAN_NETWORKS = tuple(
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


def in_lan(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """Whether `net` (an address as a /32 or /128, or a range) lies inside a LAN range."""
    return any(net.version == lan.version and net.subnet_of(lan) for lan in LAN_NETWORKS)  # type: ignore[arg-type]


#: Address ranges a host-name rule never reaches: only a rule naming an address inside one
#: of them (an IP or a CIDR within it) does.
_SPECIAL_NETS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "224.0.0.0/3",
        "::/127",
        "::ffff:0:0/96",
        "64:ff9b:1::/48",
        "fc00::/7",
        "fe80::/10",
        "ff00::/8",
    )
)


# -- one spelling for every host ---------------------------------------------------------

#: The longest host name DNS carries (RFC 1035: 253 characters in text form).
MAX_NAME = 253
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPAT = ipaddress.ip_network("::/96")
_LABEL = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclasses.dataclass(frozen=True)
class Host:
    """A target host in its one canonical spelling (see `normalise_host`).

    `name` is set for a host name (lower case, no trailing dot); `ip` for an address (the
    one the proxy connects to), and `judged` is the address the rules judge: the IPv4
    address embedded in an IPv4-mapped, IPv4-compatible, NAT64, 6to4 or Teredo address
    (the host such an address reaches), else `ip` itself. `form` names the spelling.
    """

    text: str
    name: str | None = None
    ip: Any = None
    judged: Any = None
    form: str = "name"


def _legacy_ipv4(text: str) -> Any:
    """`inet_aton`'s forms (1 to 4 parts, each decimal, 0-octal or 0x-hex, the last one
    filling the remaining bytes: `2130706433`, `0x7f.1`, `0177.0.0.01`, `127.1`); None when
    `text` is not one."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values: list[int] = []
    for part in parts:
        try:
            if part[:2] in ("0x", "0X"):
                values.append(int(part[2:] or "0", 16))
            elif part[:1] == "0" and len(part) > 1:
                values.append(int(part[1:], 8))
            elif part.isdigit() and part.isascii():
                values.append(int(part, 10))
            else:
                return None
        except ValueError:
            return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    number = last
    for i, v in enumerate(head):
        number |= v << (8 * (3 - i))
    return ipaddress.IPv4Address(number)


def _embedded_ipv4(ip: Any) -> tuple[Any, str]:
    """The IPv4 address an IPv6 address carries, and the form that carries it."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, "ipv4-mapped"
    if ip in _IPV4_COMPAT and int(ip) > 1:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "ipv4-compatible"
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "nat64"
    if ip.sixtofour is not None:
        return ip.sixtofour, "6to4"
    if ip.teredo is not None:
        return ip.teredo[1], "teredo"
    return None, "ipv6"


def normalise_host(text: str) -> Host:
    """The one canonical form of a host as a client spelled it; ValueError when it is
    neither an address nor a valid host name (the error says which part is wrong).

    Every judgement starts here: brackets, case, one trailing dot and an IPv6 zone
    (`%eth0`, `%25eth0`) are dropped; IPv4 is read in all of `inet_aton`'s spellings;
    an IPv4-mapped or IPv4-compatible address becomes its IPv4 address (connected to as
    IPv4); a NAT64, 6to4 or Teredo address is judged by the IPv4 address it reaches.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("an empty host")
    if len(text) > MAX_NAME + 2:
        raise ValueError(f"a host of {len(text)} characters (a name has at most {MAX_NAME})")
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host.lower()
    if host.endswith(".") and not host.endswith(".."):
        host = host[:-1]
    if ":" in host:
        address = host.split("%", 1)[0]
        try:
            ip6 = ipaddress.IPv6Address(address)
        except ValueError:
            raise ValueError(f"{text[:80]!r} is not an IPv6 address") from None
        embedded, form = _embedded_ipv4(ip6)
        if form in ("ipv4-mapped", "ipv4-compatible"):
            return Host(str(embedded), ip=embedded, judged=embedded, form=form)
        return Host(str(ip6), ip=ip6, judged=embedded or ip6, form=form)
    ip4 = _legacy_ipv4(host)
    if ip4 is not None:
        return Host(str(ip4), ip=ip4, judged=ip4, form="ipv4")
    if not host or len(host) > MAX_NAME:
        raise ValueError(f"a host name of {len(host)} characters (at most {MAX_NAME})")
    raw = host.encode("ascii", "replace")
    for label in raw.split(b"."):
        if not 1 <= len(label) <= 63 or not _LABEL.issuperset(label):
            raise ValueError(
                f"{text[:80]!r} is not a valid host name (labels of 1 to 63 letters, digits, "
                "'-' or '_')"
            )
    if raw.replace(b".", b"").isdigit():
        raise ValueError(f"{text[:80]!r} is neither an IPv4 address nor a host name")
    return Host(host, name=host)


def is_special(ip: Any) -> bool:
    """Whether a name rule must not reach `ip`: loopback, private, link-local, metadata..."""
    return not ip.is_global or ip.is_multicast or any(ip in net for net in _SPECIAL_NETS)


def _special_only(net: Any) -> bool:
    """Whether a rule's network names non-global addresses on purpose: it lies inside one
    of the special ranges, or it is one address (`0.0.0.0/0` is neither)."""
    return net.prefixlen == net.max_prefixlen or any(
        net.version == s.version and net.subnet_of(s) for s in _SPECIAL_NETS
    )


def _kind(ip: Any) -> str:
    if ip.is_loopback:
        return "loopback"
    if str(ip) == "169.254.169.254":
        return "cloud metadata (link-local)"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_private:
        return "private"
    return "non-global"


def _address_or_none(text: str) -> Any:
    try:
        spelled = normalise_host(text)
    except ValueError:
        return None
    return spelled.judged if spelled.ip is not None else None
