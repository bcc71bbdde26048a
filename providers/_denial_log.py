"""Whether Landlock's denials can reach a worker's result here (a read-only probe).

Landlock ABI 7 logs each denial as a kernel audit record (type 1423, with the domain, the
blocked right and the path; type 1424 ties the domain to the worker's pid). A host process
can read them from the audit netlink socket's read-log group, but only while the kernel's
audit is enabled. Measured on this machine: audit is off (`enabled 0`); switched on for one
probe with AUDIT_SET, a worker's denied read came back as
`domain=... blockers=fs.read_file path="/etc/hostname"`. Switching the host's auditing on is
the administrator's decision (`auditctl -e 1`), never this library's, so here the denials
stay in the kernel and the results carry only what the Python guards and the host saw.

`probe_denial_logging()` only asks (AUDIT_GET); it changes nothing.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

__all__ = ["probe_denial_logging"]

_NETLINK_AUDIT = 9
_AUDIT_GET = 1000
_NLGRP_READLOG = 1


def probe_denial_logging(abi: int) -> dict[str, Any]:
    """{"works": bool, "reason": str, "audit_enabled": bool | None} for this host."""
    if abi < 7:
        return {"works": False, "audit_enabled": None, "reason": f"Landlock ABI {abi} < 7"}
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_AUDIT)
    except OSError as exc:
        return {"works": False, "audit_enabled": None, "reason": f"no audit socket ({exc})"}
    try:
        try:
            sock.bind((0, _NLGRP_READLOG))
        except OSError as exc:
            return {
                "works": False,
                "audit_enabled": None,
                "reason": f"cannot join the audit read-log group ({exc}; CAP_AUDIT_READ)",
            }
        sock.settimeout(0.5)
        sock.send(struct.pack("=IHHII", 16, _AUDIT_GET, 1 | 4, 1, 0))
        enabled = None
        for _ in range(3):
            try:
                data = sock.recv(8192)
            except OSError:
                break
            _length, kind = struct.unpack_from("=IH", data)
            if kind == _AUDIT_GET and len(data) >= 24:
                enabled = bool(struct.unpack_from("=I", data, 20)[0])
                break
    finally:
        sock.close()
    if enabled is None:
        return {"works": False, "audit_enabled": None, "reason": "no answer to AUDIT_GET"}
    if not enabled:
        return {
            "works": False,
            "audit_enabled": False,
            "reason": "the kernel's audit is off (enabled 0): Landlock logs nothing; turning "
            "it on is a host decision (auditctl -e 1), not this library's",
        }
    return {
        "works": False,
        "audit_enabled": True,
        "reason": "audit is on and the records are readable, but agent-sandbox does not yet "
        "turn them into denials in a result",
    }
