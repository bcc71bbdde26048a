"""Which accelerator the `qemu` provider uses: KVM only after a probe boot succeeded.

`/dev/kvm` existing (or even opening) does not mean KVM boots a stock kernel: on this
project's machines it is `kvm_pvm`, which runs only PVM-enabled guest kernels; QEMU aborts
at once with `-cpu host` (MSR 0x10a), and a stock kernel without it dies in PVM's
instruction emulator minutes later. So the verdict comes from a boot:

1. no `/dev/kvm`, or no read-write access to it: TCG, no boot (one `stat`, nothing cached);
2. otherwise QEMU boots the guest image with `-accel kvm -cpu host` (the flags a KVM
   template would use), in a session of its own, until the guest agent prints `SBREADY` on
   the console, within `PROBE_TIMEOUT` seconds. Anything else (QEMU exits, the timeout, no
   marker) is TCG. QEMU's process group is killed by pid in every case, and waited for.
3. The verdict, KVM or TCG, is remembered in `$XDG_CACHE_HOME/agent-sandbox/qemu/kvm-probe.json`
   under its key: the host kernel (`uname` release and version), every loaded `kvm*` module
   with its parameters (`/sys/module/kvm*`), QEMU's version and the image's digest. Any
   change of them probes again; the file keeps the `MAX_ENTRIES` newest keys. Unlike the
   providers' trial probes (`_probe_cache.py`), a "no" is kept: TCG is the same boundary as
   KVM (the guest kernel), only slower, so a stale "no" never weakens a sandbox, and a probe
   that hangs costs its whole timeout. The file is trusted as `_probe_cache` trusts its
   own (owned by the user, writable by nobody else); `AGENT_SANDBOX_PROBE_CACHE=off` and
   `agent-sandbox doctor` probe afresh, and `agent-sandbox qemu clean` forgets it.

The reason given for TCG names the KVM module actually loaded (`kvm_intel`, `kvm_amd`,
`kvm_pvm`, from `/sys/module`): "KVM present but cannot boot stock kernels: kvm_pvm" here.
Concurrent probes of one key are serialised by a lock file, so only one boots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import select
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_ENTRIES",
    "PROBE_TIMEOUT",
    "Verdict",
    "accel_verdict",
    "kvm_key",
    "kvm_modules",
    "probe_file",
    "unprobed_verdict",
]

#: How long the probe boot may take to reach the guest agent (a KVM boot takes ~1-2 s).
PROBE_TIMEOUT = 15.0
MAX_ENTRIES = 8
_FORMAT = 1
_MARKER = b"SBREADY"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The accelerator to use, and why (`reason` is empty for KVM)."""

    accel: str  # "kvm" or "tcg"
    reason: str
    #: What the probe boot saw (QEMU's last words, the timeout), for `qemu status --json`.
    detail: str = ""
    #: True when this call booted QEMU (False: remembered, or no boot needed).
    probed: bool = False

    def describe(self) -> str:
        return "KVM" if self.accel == "kvm" else f"TCG ({self.reason})"


def kvm_modules(sys_module: str = "/sys/module") -> dict[str, dict[str, str]]:
    """Every loaded `kvm*` module (built in or not) and its readable parameters."""
    out: dict[str, dict[str, str]] = {}
    try:
        names = sorted(n for n in os.listdir(sys_module) if n == "kvm" or n.startswith("kvm_"))
    except OSError:
        return out
    for name in names:
        params: dict[str, str] = {}
        folder = os.path.join(sys_module, name, "parameters")
        with contextlib.suppress(OSError):
            for param in sorted(os.listdir(folder)):
                with contextlib.suppress(OSError):
                    with open(os.path.join(folder, param)) as fh:
                        params[param] = fh.read(4096).strip()
        out[name] = params
    return out


def _vendor(modules: dict[str, dict[str, str]]) -> str:
    """The vendor module(s) beside `kvm` itself (`kvm_pvm` here), or "kvm"."""
    vendors = [name for name in modules if name != "kvm"]
    return ", ".join(vendors) or ("kvm" if modules else "no kvm module loaded")


def kvm_key(qemu_version: str, image_digest: str, sys_module: str = "/sys/module") -> str:
    """The probe's key: the host kernel, the kvm modules and their parameters, QEMU's
    version and the image."""
    uname = os.uname()
    parts = {
        "kernel": [uname.release, uname.version],
        "modules": kvm_modules(sys_module),
        "qemu": qemu_version,
        "image": image_digest,
    }
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def probe_file(cache_root: str) -> str:
    return os.path.join(cache_root, "qemu", "kvm-probe.json")


def _remembered(path: str, key: str) -> Verdict | None:
    from agent_sandbox.providers._probe_cache import _load

    entries = _load(path)  # {} unless trusted and of the expected format
    entry = entries.get(key)
    if not isinstance(entry, dict) or set(entry) != {"accel", "reason", "detail", "when"}:
        return None
    accel, reason, detail = entry["accel"], entry["reason"], entry["detail"]
    if accel not in ("kvm", "tcg") or not isinstance(reason, str) or not isinstance(detail, str):
        return None
    if (accel == "kvm") != (reason == ""):
        return None
    return Verdict(accel, reason, detail)


def _remember(path: str, key: str, verdict: Verdict) -> None:
    from agent_sandbox.providers._probe_cache import _load, _trusted

    directory = os.path.dirname(path)
    with contextlib.suppress(OSError, TypeError, ValueError):
        if not _trusted(os.stat(directory), stat.S_IFDIR):
            return  # a folder others can write: nothing of ours is written there
        entries = _load(path)
        entries.pop(key, None)
        entries[key] = {
            "accel": verdict.accel,
            "reason": verdict.reason,
            "detail": verdict.detail[:2000],
            "when": round(time.time()),
        }
        for old in list(entries)[: max(0, len(entries) - MAX_ENTRIES)]:
            del entries[old]
        fd, tmp = tempfile.mkstemp(prefix=".kvm-probe-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"format": _FORMAT, "entries": entries}, fh)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


#: What every guest of this provider is given after its memory: one vCPU, no default
#: devices, no display, the console on stdio and the bus of the virtio-serial ports. The
#: probe boot and the templates (`_qemu.qemu_argv`) share it, so a probe boots what a
#: template would.
MACHINE_DEVICES = (
    "-smp",
    "1",
    "-nodefaults",
    "-no-user-config",
    "-display",
    "none",
    "-no-reboot",
    "-serial",
    "stdio",
    "-device",
    "virtio-serial-device",
)


def probe_argv(qemu: str, vmlinux: str, initrd: str, append: str) -> list[str]:
    """The probe boot: the image under KVM with the CPU model a KVM template would use, and
    the two virtio-serial ports the guest agent looks for (to nothing)."""
    return [
        qemu,
        "-M",
        "microvm",
        "-accel",
        "kvm",
        "-cpu",
        "host",
        "-m",
        "256M",
        *MACHINE_DEVICES,
        "-chardev",
        "null,id=sb",
        "-device",
        "virtserialport,chardev=sb,name=sb",
        "-chardev",
        "null,id=net",
        "-device",
        "virtserialport,chardev=net,name=net",
        "-kernel",
        vmlinux,
        "-initrd",
        initrd,
        "-append",
        append,
    ]


def _boot(argv: Sequence[str], timeout: float) -> tuple[bool, str]:
    """Run the probe boot; (reached the marker, what was seen). QEMU's process group is
    killed and reaped before this returns, whatever happened."""
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return False, f"QEMU did not start: {exc}"
    assert proc.stdout is not None
    output = b""
    ok = False
    try:
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        while True:
            if _MARKER in output:
                ok = True
                break
            left = t0 + timeout - time.monotonic()
            if left <= 0:
                output += f"\n(no ready guest within {timeout:g} s: killed)".encode()
                break
            ready, _, _ = select.select([fd], [], [], min(left, 0.1))
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    proc.wait()
                    output += f"\n(QEMU exited with {proc.returncode})".encode()
                    break
                output = (output + chunk)[-8192:]
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
        proc.stdout.close()
    seen = output.decode("utf-8", "replace").strip()
    return ok, f"{time.monotonic() - t0:.2f} s: {seen[-600:]}"


def unprobed_verdict(dev_kvm: str = "/dev/kvm", sys_module: str = "/sys/module") -> Verdict | None:
    """TCG without a boot when KVM cannot even be opened; None when a probe boot decides."""
    if not os.path.exists(dev_kvm):
        return Verdict("tcg", "no /dev/kvm")
    if not os.access(dev_kvm, os.R_OK | os.W_OK):
        return Verdict(
            "tcg",
            f"KVM present ({_vendor(kvm_modules(sys_module))}) but {dev_kvm} is not "
            "read-writable by this user (the kvm group)",
        )
    return None


def accel_verdict(
    *,
    qemu: str,
    qemu_version: str,
    image_digest: str,
    vmlinux: str,
    initrd: str,
    append: str,
    cache_root: str,
    timeout: float = PROBE_TIMEOUT,
    afresh: bool = False,
    remember: bool = True,
    dev_kvm: str = "/dev/kvm",
    sys_module: str = "/sys/module",
) -> Verdict:
    """The accelerator for this image, QEMU and host: remembered under its key, or probed
    (one boot of at most `timeout` seconds; concurrent callers wait for that one).
    `afresh` ignores what is remembered; `remember=False` writes nothing."""
    quick = unprobed_verdict(dev_kvm, sys_module)
    if quick is not None:
        return quick
    key = kvm_key(qemu_version, image_digest, sys_module)
    path = probe_file(cache_root)
    if not afresh:
        found = _remembered(path, key)
        if found is not None:
            return found
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        # Never through a link planted at the lock's path (O_NOFOLLOW: a dangling one
        # would otherwise create its target).
        lock_fd = os.open(
            path + ".lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError:
        lock_fd = -1  # probe unlocked and remember nothing
        remember = False
    try:
        if lock_fd >= 0:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if not afresh:
            found = _remembered(path, key)  # another process probed meanwhile
            if found is not None:
                return found
        ok, seen = _boot(probe_argv(qemu, vmlinux, initrd, append), timeout)
        if ok:
            verdict = Verdict("kvm", "", seen, probed=True)
        else:
            vendor = _vendor(kvm_modules(sys_module))
            verdict = Verdict(
                "tcg", f"KVM present but cannot boot stock kernels: {vendor}", seen, probed=True
            )
        if remember:
            _remember(path, key, verdict)
        return verdict
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)


def as_json(verdict: Verdict) -> dict[str, Any]:
    return dataclasses.asdict(verdict)
