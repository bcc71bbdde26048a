"""What `worker serve` checks before it listens: its certificate's dates and its bounds.

* `check_cert_dates(path)`: the server certificate's validity window, read from the PEM
  file's DER (notBefore, notAfter of the first certificate); a certificate that is expired or
  not yet valid refuses the start with both dates, instead of a pod whose every handshake
  fails. The file is the operator's (a Secret volume), not a worker's output.
* `default_pending()`: how many connections not yet authenticated the server holds at once
  when `--max-connections` is not given: a sixteenth of the pod's memory limit (cgroup v2
  `memory.max`, or v1 `memory.limit_in_bytes`) at `budget` bytes a connection, in [8, 256];
  `fallback` where no limit is set.
"""

from __future__ import annotations

import base64
import datetime
import re

__all__ = ["cert_dates", "check_cert_dates", "default_pending", "memory_limit"]

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.+?)\s*-----END CERTIFICATE-----", re.DOTALL)


def _tlv(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of content, end of content) of the DER element at `pos`."""
    if pos + 2 > len(der):
        raise ValueError("truncated DER")
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        count = length & 0x7F
        if count == 0 or count > 4 or pos + count > len(der):
            raise ValueError("bad DER length")
        length = int.from_bytes(der[pos : pos + count], "big")
        pos += count
    if pos + length > len(der):
        raise ValueError("truncated DER")
    return tag, pos, pos + length


def _time(tag: int, text: bytes) -> datetime.datetime:
    value = text.decode("ascii")
    if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ (RFC 5280: 50-99 -> 19xx)
        year = int(value[:2])
        value = ("19" if year >= 50 else "20") + value
    elif tag != 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
        raise ValueError("bad validity time")
    when = datetime.datetime.strptime(value, "%Y%m%d%H%M%SZ")
    return when.replace(tzinfo=datetime.UTC)


def cert_dates(pem: bytes) -> tuple[datetime.datetime, datetime.datetime]:
    """(notBefore, notAfter) of the first certificate in `pem`; ValueError when none."""
    match = _PEM.search(pem)
    if match is None:
        raise ValueError("no PEM certificate in it")
    der = base64.b64decode(b"".join(match.group(1).split()))
    _, cert, _ = _tlv(der, 0)  # Certificate
    _, pos, _ = _tlv(der, cert)  # tbsCertificate
    tag, _, end = _tlv(der, pos)
    if tag == 0xA0:  # [0] version
        pos = end
    for _ in range(3):  # serialNumber, signature, issuer
        pos = _tlv(der, pos)[2]
    tag, start, _ = _tlv(der, pos)  # validity
    if tag != 0x30:
        raise ValueError("no validity")
    t1, s1, e1 = _tlv(der, start)
    t2, s2, e2 = _tlv(der, e1)
    return _time(t1, der[s1:e1]), _time(t2, der[s2:e2])


def check_cert_dates(path: str, now: datetime.datetime | None = None) -> None:
    """ValueError naming the dates when the certificate at `path` is not valid now."""
    with open(path, "rb") as fh:
        pem = fh.read()
    try:
        not_before, not_after = cert_dates(pem)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"--tls-cert {path}: cannot read the certificate's dates ({exc})"
        ) from None
    now = now or datetime.datetime.now(datetime.UTC)
    if now < not_before:
        raise ValueError(
            f"--tls-cert {path}: not valid before {not_before:%Y-%m-%d %H:%M:%S} UTC (now "
            f"{now:%Y-%m-%d %H:%M:%S}); every handshake would fail: check the pod's clock or "
            "issue the certificate again"
        )
    if now > not_after:
        raise ValueError(
            f"--tls-cert {path}: expired {not_after:%Y-%m-%d %H:%M:%S} UTC (now "
            f"{now:%Y-%m-%d %H:%M:%S}); every handshake would fail: renew the Secret"
        )


def memory_limit() -> int | None:
    """This cgroup's memory limit in bytes, or None when there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
        return None
    return None


def default_pending(budget: int, fallback: int, limit: int | None = None) -> int:
    """The default bound on unauthenticated connections (see the module docstring)."""
    limit = memory_limit() if limit is None else limit
    if limit is None:
        return fallback
    return max(8, min(256, limit // 16 // budget))
