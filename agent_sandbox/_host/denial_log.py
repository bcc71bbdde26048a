"""Landlock's denials as host-recorded denials in a worker's result, where the kernel logs them.

Landlock ABI 7 logs each denial as a kernel audit record: type 1423 (`AUDIT_LANDLOCK_ACCESS`:
`domain=... blockers=fs.read_file path="/etc/hostname" ...`) and, the first time a domain
shows, type 1424 (`AUDIT_LANDLOCK_DOMAIN`: `domain=... status=allocated ... pid=N`, the pid,
in the host's pid namespace, of the process that created the domain). A host process can
read them from the audit netlink socket's read-log group (`CAP_AUDIT_READ`), but only while
the kernel's audit is enabled. Switching the host's auditing on is the administrator's
decision (`auditctl -e 1`), never this library's: where it is off (measured here: `enabled
0`) the denials stay in the kernel and a result carries only what the Python guards and the
host saw; `agent-sandbox doctor` says which.

Where it is on, `subscribe()` (called by the parent before it launches a Landlock worker:
the kernel logs a domain's pid only with its first denial, which may come during the boot)
starts one reader thread per process, lazily, and `watch_worker()` (after the handshake)
registers the worker's pid. The reader joins the read-log group once, keeps the
domain -> pid map of the 1424 records, and files each 1423 record of a domain created by a
watched worker's pid (the worker applies Landlock itself, `_worker/_inworker.py`) under that worker.
After each call the parent drains the worker's watch (`Watch.drain`, after `settle()`: the
kernel hands records over from its own thread) and adds them to the result as denials
recorded by the host, unless the Python guards already reported the same target.

The records are kernel data, but they quote paths the sandboxed code chose: every target is
cut to `MAX_TARGET` characters and stays data (rendered through `Denial.message`'s escaping,
hints built by the TOML serializer). Everything is bounded: the bytes read per record, the
domains remembered, the records waiting for their domain, the distinct denials per worker.

The worker's domain logs because `restrict_self` passes `LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON`
on ABI 7 (denials of programs the worker runs are logged too; the default already logs the
worker's own process); it never passes `..._LOG_SAME_EXEC_OFF`.

`probe_denial_logging()` only asks (AUDIT_GET); it changes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from agent_sandbox._denial import Denial

__all__ = [
    "Watch",
    "subscribe",
    "decode_untrusted",
    "merge_into",
    "parse_record",
    "probe_denial_logging",
    "reader",
    "record_denial",
    "watch_worker",
]

_NETLINK_AUDIT = 9
_AUDIT_GET = 1000
_NLGRP_READLOG = 1
AUDIT_LANDLOCK_ACCESS = 1423
AUDIT_LANDLOCK_DOMAIN = 1424

#: Bounds (see the module docstring).
MAX_RECORD = 8192  # bytes of one netlink message read (the kernel's records are shorter)
MAX_TARGET = 1024  # characters of a path or address kept
MAX_DOMAINS = 4096  # domain -> pid entries remembered (oldest forgotten first)
MAX_PENDING = 256  # access records waiting for their domain's 1424 record
MAX_DENIALS = 256  # distinct denials kept per worker between two drains
RCVBUF = 1 << 20
#: How long a probe's "off" answer stands before a new worker asks again.
PROBE_TTL = 10.0
#: At most this long after a call for the kernel's thread to hand its records over.
SETTLE_SECONDS = 0.05


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
        status = _audit_status(sock)
    finally:
        sock.close()
    if status is None:
        return {"works": False, "audit_enabled": None, "reason": "no answer to AUDIT_GET"}
    if not status["enabled"]:
        return {
            "works": False,
            "audit_enabled": False,
            "reason": "the kernel's audit is off (enabled 0): Landlock logs nothing; turning "
            "it on is a host decision (auditctl -e 1), not this library's",
        }
    return {
        "works": True,
        "audit_enabled": True,
        "reason": "the kernel's audit is on and its read-log group is readable: a Landlock "
        "worker's denials come back as denials recorded by the host",
    }


def _audit_status(sock: socket.socket) -> dict[str, int] | None:
    """AUDIT_GET on `sock`: {"enabled", "backlog"}, or None without an answer."""
    sock.settimeout(0.5)
    try:
        sock.send(struct.pack("=IHHII", 16, _AUDIT_GET, 1 | 4, 1, 0))
    except OSError:
        return None
    for _ in range(8):
        try:
            data = sock.recv(MAX_RECORD)
        except OSError:
            return None
        if len(data) < 16:
            continue
        _length, kind = struct.unpack_from("=IH", data)
        if kind == _AUDIT_GET and len(data) >= 16 + 32:
            # struct audit_status: mask, enabled, failure, pid, rate_limit, backlog_limit,
            # lost, backlog, ...
            fields = struct.unpack_from("=8I", data, 16)
            return {"enabled": fields[1], "backlog": fields[7]}
    return None


# -- parsing one record (pure) -------------------------------------------------------------


def _value(text: str, at: int) -> tuple[str, int]:
    """The value starting at `at` (quoted, or a bare token) and where the next field starts."""
    if at < len(text) and text[at] == '"':
        end = text.find('"', at + 1)
        if end < 0:
            return text[at + 1 :], len(text)
        return text[at + 1 : end], end + 1
    end = text.find(" ", at)
    if end < 0:
        end = len(text)
    return text[at:end], end


def parse_record(text: str) -> dict[str, str]:
    """The `key=value` fields of one audit record's text (`audit(...): k=v k="v" ...`).

    A quoted value is kept as written; a bare one too (`decode_untrusted` turns the hex
    form the kernel gives a path with spaces or control characters back into text).
    """
    head = text.find("): ")
    body = text[head + 3 :] if text.startswith("audit(") and head > 0 else text
    fields: dict[str, str] = {}
    at = 0
    while at < len(body) and len(fields) < 64:
        while at < len(body) and body[at] == " ":
            at += 1
        eq = body.find("=", at)
        if eq < 0:
            break
        key = body[at:eq]
        if " " in key:  # not a field: skip the word
            at = body.find(" ", at)
            if at < 0:
                break
            continue
        value, at = _value(body, eq + 1)
        fields.setdefault(key, value)
    return fields


def decode_untrusted(raw: str, quoted: bool) -> str:
    """A path field as text: quoted as is; unquoted, the kernel's hex form decoded."""
    if quoted or not raw or len(raw) % 2 or any(c not in "0123456789ABCDEFabcdef" for c in raw):
        return raw
    return bytes.fromhex(raw).decode("utf-8", "backslashreplace")


_READ_RIGHTS = {"fs.read_file": "read", "fs.read_dir": "list"}
_WRITE_RIGHTS = {
    "fs.write_file": "write",
    "fs.truncate": "write",
    "fs.remove_dir": "remove",
    "fs.remove_file": "remove",
    "fs.make_char": "create",
    "fs.make_dir": "create",
    "fs.make_reg": "create",
    "fs.make_sock": "create",
    "fs.make_fifo": "create",
    "fs.make_block": "create",
    "fs.make_sym": "create",
    "fs.refer": "rename",
    "fs.ioctl_dev": "ioctl",
}


def record_denial(text: str, policy_name: str) -> Denial | None:
    """The Denial for one AUDIT_LANDLOCK_ACCESS record's text, or None for one we do not map.

    The rule comes from `blockers=` (`fs.read_*` -> files.read, the other `fs.*` rights ->
    files.write, `fs.execute` -> api.process-exec, `net.connect_tcp` -> net.connect,
    `net.bind_tcp` -> net.bind, `scope.signal` -> api.process-control, `scope.abstract_unix_socket`
    -> net.connect); the target from the path or the address. The hint is rebuilt by the
    serializer from the target; nothing of the record's text is used as prose.
    """
    from agent_sandbox._hints import grant_hint

    fields = parse_record(text[:MAX_RECORD])
    blockers = [b for b in fields.get("blockers", "").split(",") if b]
    if not blockers:
        return None
    quoted_path = _is_quoted(text, "path")
    path = decode_untrusted(fields.get("path", ""), quoted_path)[:MAX_TARGET]
    hint = ""
    first = blockers[0]
    writes = [b for b in blockers if b in _WRITE_RIGHTS]
    if writes or any(b in _READ_RIGHTS for b in blockers):
        rule = "files.write" if writes else "files.read"
        action = _WRITE_RIGHTS[writes[0]] if writes else _READ_RIGHTS[first]
        target = path or "?"
        if target.startswith("/"):
            from agent_sandbox.policies._paths import literal

            hint = grant_hint({rule: [literal(target)]})
    elif first == "fs.execute":
        rule, action, target = "api.process-exec", "exec", path or "?"
    elif first in ("net.connect_tcp", "net.bind_tcp"):
        bind = first == "net.bind_tcp"
        addr = fields.get("saddr" if bind else "daddr", "")
        port = fields.get("src" if bind else "dest", "")
        if not addr and not port:
            addr, port = (
                fields.get("laddr", "") or fields.get("faddr", ""),
                fields.get("lport", "") or fields.get("fport", ""),
            )
        host = f"[{addr}]" if ":" in addr else addr
        target = f"{host or '?'}:{port or '?'}"[:MAX_TARGET]
        rule, action = ("net.bind", "bind") if bind else ("net.connect", "connect")
        if addr and port.isdigit():
            entry: dict[str, Any] = {"host": addr, "ports": port}
            if bind:
                entry["direction"] = "bind"
            hint = grant_hint({"net.rules": [entry]})
    elif first == "scope.signal":
        rule, action = "api.process-control", "signal"
        target = f"pid {fields.get('opid', '?')}"[:MAX_TARGET]
    elif first == "scope.abstract_unix_socket":
        rule, action, target = "net.connect", "connect", path or "an abstract Unix socket"
    else:
        return None
    return Denial(
        rule=rule,
        action=action,
        target=target,
        policy=policy_name,
        hint=hint,
        detail=f"Landlock refused it in the kernel, blockers {','.join(blockers)[:200]}; the "
        "host read it from the kernel's audit log, where the worker cannot drop or forge it",
    )


def _is_quoted(text: str, key: str) -> bool:
    at = text.find(f" {key}=")
    return at >= 0 and text[at + len(key) + 2 : at + len(key) + 3] == '"'


# -- the reader (one thread per process) ---------------------------------------------------


class Watch:
    """One worker's Landlock denials as the host read them (bounded, thread-safe)."""

    def __init__(self, reader: _Reader, pid: int, policy_name: str) -> None:
        self.reader = reader
        self.pid = pid
        self.policy_name = policy_name
        self._lock = threading.Lock()
        self._denials: dict[tuple[str, str, str], Denial] = {}
        self._dropped = 0
        self.closed = False

    def add(self, text: str) -> None:
        denial = record_denial(text, self.policy_name)
        if denial is None:
            return
        key = (denial.rule, denial.action, denial.target)
        with self._lock:
            old = self._denials.get(key)
            if old is not None:
                self._denials[key] = old.replace(count=old.count + 1)
            elif len(self._denials) < MAX_DENIALS:
                self._denials[key] = denial
            else:
                self._dropped += 1

    def drain(self, *, settle: bool = True) -> list[Denial]:
        """The denials read since the last drain (after `settle()` when asked)."""
        if settle:
            self.reader.settle()
        with self._lock:
            out = list(self._denials.values())
            dropped, self._dropped = self._dropped, 0
            self._denials = {}
        if dropped:
            out.append(
                Denial(
                    "files.read",
                    "*",
                    f"{dropped} more refusals",
                    self.policy_name,
                    detail=f"Landlock refused {dropped} more accesses than the host keeps per "
                    f"call ({MAX_DENIALS} distinct)",
                )
            )
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reader.unwatch(self)


class _Reader:
    """The read-log subscriber: records in, filed under the watched worker of their domain."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._watches: dict[int, Watch] = {}
        self._domains: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._pending: collections.deque[tuple[str, str]] = collections.deque(maxlen=MAX_PENDING)
        self.received = 0
        self.lost = 0
        self._probed_at = -PROBE_TTL
        self._probe: dict[str, Any] = {"works": False, "reason": "not probed"}

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ensure(self, abi: int) -> bool:
        """Whether the reader runs (started now when the kernel's audit is readable)."""
        with self._lock:
            if self.running:
                return True
            now = time.monotonic()
            if now - self._probed_at < PROBE_TTL and not self._probe["works"]:
                return False
            self._probed_at = now
            self._probe = probe_denial_logging(abi)
            if not self._probe["works"]:
                return False
            try:
                sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_AUDIT)
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
                sock.bind((0, _NLGRP_READLOG))
            except OSError:
                return False
            self._sock = sock
            thread = threading.Thread(target=self._run, name="agent-sandbox-denial-log")
            thread.daemon = True
            thread.start()
            self._thread = thread
            return True

    def forget_probe(self) -> None:
        """Ask the kernel again at the next worker (tests switching audit on use it)."""
        with self._lock:
            self._probed_at = -PROBE_TTL

    def watch(self, pid: int, policy_name: str) -> Watch:
        watch = Watch(self, pid, policy_name)
        with self._lock:
            self._watches[pid] = watch
        return watch

    def unwatch(self, watch: Watch) -> None:
        with self._lock:
            if self._watches.get(watch.pid) is watch:
                del self._watches[watch.pid]

    def settle(self, timeout: float = SETTLE_SECONDS) -> None:
        """Wait (bounded) until the kernel's audit queue is empty and this reader idle."""
        if not self.running:
            return
        deadline = time.monotonic() + timeout
        try:
            ctl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_AUDIT)
        except OSError:
            return
        try:
            ctl.bind((0, 0))
            while time.monotonic() < deadline:
                seen = self.received
                status = _audit_status(ctl)
                if status is None:
                    return
                time.sleep(0.001)
                if status["backlog"] == 0 and self.received == seen:
                    return
        except OSError:
            return
        finally:
            ctl.close()

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                data = sock.recv(MAX_RECORD)
            except OSError as exc:
                if getattr(exc, "errno", None) == 105:  # ENOBUFS: the socket overran
                    self.lost += 1
                    continue
                return
            self.received += 1
            if len(data) < 16:
                continue
            length, kind = struct.unpack_from("=IH", data)
            if kind not in (AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN):
                continue
            text = data[16 : min(length, len(data))].rstrip(b"\0").decode("utf-8", "replace")
            with contextlib.suppress(Exception):  # a record we cannot read is skipped
                self._dispatch(kind, text)

    def _dispatch(self, kind: int, text: str) -> None:
        fields = parse_record(text)
        domain = fields.get("domain", "")
        if not domain:
            return
        if kind == AUDIT_LANDLOCK_DOMAIN:
            pid = fields.get("pid", "")
            if fields.get("status") == "deallocated":
                with self._lock:
                    self._domains.pop(domain, None)
                return
            if fields.get("status") != "allocated" or not pid.isdigit():
                return
            with self._lock:
                self._domains[domain] = int(pid)
                while len(self._domains) > MAX_DOMAINS:
                    self._domains.popitem(last=False)
                waiting = [t for d, t in self._pending if d == domain]
                if waiting:
                    kept = [(d, t) for d, t in self._pending if d != domain]
                    self._pending.clear()
                    self._pending.extend(kept)
                watch = self._watches.get(int(pid))
            if watch is not None:
                for waited in waiting:
                    watch.add(waited)
            return
        with self._lock:
            pid_of = self._domains.get(domain)
            if pid_of is None:
                # The kernel logs the domain right after its first access record.
                self._pending.append((domain, text))
                return
            watch = self._watches.get(pid_of)
        if watch is not None:
            watch.add(text)


_READER = _Reader()


def reader() -> _Reader:
    """This process's reader (not necessarily running)."""
    return _READER


def subscribe() -> bool:
    """Before a Landlock worker is launched: have the reader running where the kernel's
    audit is readable, so the worker's first denial (the only one the kernel logs with
    its domain's pid, even one during its boot) is not missed."""
    try:
        from agent_sandbox._landlock_sys import landlock_abi

        abi = landlock_abi()
    except OSError:
        return False
    return abi >= 7 and _READER.ensure(abi)


def watch_worker(pid: int | None, policy_name: str, abi: int) -> Watch | None:
    """A watch on `pid`'s Landlock domain when the kernel's audit is readable, else None."""
    if pid is None or pid <= 0 or abi < 7 or not _READER.ensure(abi):
        return None
    return _READER.watch(pid, policy_name)


def merge_into(add: Callable[[Denial], object], existing: list[Denial], found: list[Denial]) -> int:
    """Add each kernel denial unless one for the same target and rule family is there."""
    seen = {(d.rule.split(".", 1)[0], d.target) for d in existing}
    added = 0
    for denial in found:
        if (denial.rule.split(".", 1)[0], denial.target) in seen:
            continue
        add(denial)
        added += 1
    return added
