"""The `qemu` provider: each worker in its own micro-VM, restored from a snapshot.

The boundary is a guest kernel: the worker (the same code and wire protocol as under every
other provider) runs inside a QEMU `microvm` guest booted from an image built on this machine
(`qemu/image.py`, `agent-sandbox qemu build`). What the guest can reach of the host:

* one virtio-serial port, bound to a Unix socket in the worker's private control directory,
  which carries the parent's connections to the worker (`qemu/relay.py` relays them);
* the policy's read paths as 9p shares, read-only in QEMU (`readonly=on`: the guest's root
  cannot remount them writable), mounted at their host paths after the restore;
* with `[net]` allow rules, a second virtio-serial port (`net`) to a Unix socket whose
  listening end the host relay hands the parent's egress proxy (`_host/egress/proxy.py`); the guest
  agent forwards the proxy address on the guest's loopback over it (`qemu/guest.py`), and
  each allowed loopback service (`loopback_forwards`) at its own address there, which the
  proxy judges and joins to the host's service (one host socket per service);
* nothing else: no network device at all (`-nodefaults`, no `-nic`), no other share, no
  disk; the scratch directory and `/tmp` are size-capped tmpfs inside the guest, gone with
  the VM. QEMU runs under its own seccomp filter (`-sandbox on` with spawn, privilege
  elevation and resource control denied).

Limits: the VM's RAM is at least the policy's `memory_mb` plus `GUEST_HEADROOM_MB` (at least
256 MiB; a roomier saved template serves too), one vCPU; inside the guest the worker's
cgroup has `pids.max` and `memory.max` from the policy, whose hits the guest agent reports
(`LaunchPlan.limit_reports`, taken as the worker side's word); the wall limit, the output
bounds and the kill by pid stay on the host as for every provider; the rlimits apply inside
the guest too. What the policy hides or denies
inside a shared directory is covered by the host relay before QEMU starts (`qemu/relay.py`).

Start-up: one template per (image, QEMU version, RAM size, device set) is booted once and
saved with file-backed RAM and the `x-ignore-shared` migration capability
(`ensure_template`); each worker restores a private copy-on-write mapping of it in about
0.1 s (TCG, this machine), then reseeds the guest RNG and mounts its shares.

Not served (refused at construction, naming the rule): UDP `[net]` rules and listeners off
loopback (`_netcheck.py`), `files.write` outside the scratch directory, more than
`SHARE_SLOTS` read directories, read grants of single files (9p shares directories).
Inside the guest the worker applies the same seccomp filter and exec program as under
Landlock (`_seccomp.seccomp_setup`). The parent's interrupt signals the host relay, which
forwards it into the guest (`LaunchPlan.interrupt_launcher`).

First use: with the kernel package but no image, the probe says available and `prepare()`
builds the image and the template before the start's timeout begins (`FirstUseProgress`).

Acceleration: `/dev/kvm` may exist and still not boot a stock kernel (`kvm_pvm`, which only
runs PVM-enabled guests), so KVM is used only after a probe boot of the image reached the
guest agent within a timeout, remembered per host kernel, kvm modules, QEMU and image
(`qemu/accel.py`); templates are per accelerator. `probe()` says which one and why.

This module is longer than 600 lines because the plan, the template (boot, snapshot,
restore) and the probe of one VM share QEMU's command line and the template's state; the
image, the host relay, the guest and the accelerator are modules of their own beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, ClassVar

from agent_sandbox._errors import ProviderUnavailable
from agent_sandbox._host.egress.handoff import forward_socket_name
from agent_sandbox.providers._base import (
    Answer,
    LaunchPlan,
    ProbeResult,
    Provider,
    WorkerSetup,
    WorkerSpec,
    base_env,
    package_folder,
)
from agent_sandbox.providers._netcheck import namespace_net, standard_answers
from agent_sandbox.providers._view import egress_plan, policy_paths
from agent_sandbox.providers.qemu.accel import MACHINE_DEVICES, Verdict
from agent_sandbox.providers.qemu.image import (
    Image,
    ImageError,
    build_image,
    cache_root,
    find_image,
    install_hint,
    locate_kernel_deb,
    missing_tools,
    no_space,
)

__all__ = [
    "SHARE_SLOTS",
    "QemuProvider",
    "Template",
    "FirstUseProgress",
    "TemplateError",
    "accel_for",
    "ensure_template",
    "guest_ram_mb",
    "kvm_state",
    "qemu_argv",
    "vm_memory_mb",
]

#: 9p devices every VM has (a template's device set is fixed; unused slots share an empty dir).
SHARE_SLOTS = 4
#: Bumped when the device set or the guest protocol changes (a new template).
DEVICE_SET = "3"
_HOST_SCRIPT = os.path.join(os.path.dirname(os.path.realpath(__file__)), "relay.py")
_TEMPLATE_BOOT_TIMEOUT = 120.0
_QEMU = "qemu-system-x86_64"
_KERNEL_ARGS = (
    "console=ttyS0 panic=-1 reboot=t tsc=reliable quiet loglevel=1 mitigations=off nokaslr "
    "8250.nr_uarts=1 cryptomgr.notests no_timer_check random.trust_cpu=on audit=0 "
    "apparmor=0 security=none pci=off"
)
_SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


class TemplateError(Exception):
    """The template could not be booted or saved; the message says why."""


#: Guest RAM beyond the policy's memory limit: the guest kernel, the initramfs and the agent
#: (~70 MiB at ready), so the worker's RLIMIT_AS ends a balloon (a `limits.memory` error)
#: before the guest's OOM killer would end the worker.
GUEST_HEADROOM_MB = 128


def guest_ram_mb(memory_mb: int) -> int:
    """The guest's RAM for a policy memory limit of `memory_mb`: that plus the headroom, at
    least 256 MiB, in 2 MiB steps (each size is a template of its own)."""
    mb = max(256, int(memory_mb) + GUEST_HEADROOM_MB)
    return (mb + 1) // 2 * 2


def vm_memory_mb(policy: Any) -> int:
    """The guest's RAM for `policy` (`guest_ram_mb` of its memory limit)."""
    return guest_ram_mb(int(policy.limits.memory_mb))


@functools.cache
def tsc_khz() -> int:
    """The host's TSC rate in kHz (microvm under TCG has no timer to calibrate against)."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":")[1]) * 1000)
    return 2_000_000


@functools.cache
def qemu_version(qemu: str) -> str:
    try:
        out = subprocess.run([qemu, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    match = re.search(r"version (\S+)", out.stdout)
    return match.group(1) if match else ""


def kvm_state() -> str:
    """Why KVM is not used here, before any probe boot (one phrase): no /dev/kvm, no access
    to it, or not probed yet (`accel_for` decides, with an image to boot)."""
    from agent_sandbox.providers.qemu.accel import kvm_modules, unprobed_verdict

    quick = unprobed_verdict()
    if quick is not None:
        return quick.reason
    vendor = ", ".join(n for n in kvm_modules() if n != "kvm") or "kvm"
    return f"KVM present ({vendor}), not probed yet: no guest image to boot"


def accel_for(qemu: str, image: Image, *, afresh: bool = False) -> Verdict:
    """The accelerator for `image` under `qemu` here: KVM only after a probe boot reached
    the guest agent; remembered per host kernel, kvm modules, QEMU and image
    (`qemu/accel.py`)."""
    from agent_sandbox.providers import _probe_cache
    from agent_sandbox.providers.qemu.accel import accel_verdict

    cached = _probe_cache.enabled()
    return accel_verdict(
        qemu=qemu,
        qemu_version=qemu_version(qemu),
        image_digest=image.digest,
        vmlinux=image.vmlinux,
        initrd=image.initrd,
        append=kernel_args(),
        cache_root=cache_root(),
        afresh=afresh or not cached,
        remember=cached,
    )


def kernel_args(extra: str = "") -> str:
    khz = tsc_khz()
    return f"{_KERNEL_ARGS} tsc_early_khz={khz} lpj={khz * 4} {extra}".strip()


def qemu_argv(
    *,
    qemu: str,
    mem_mb: int,
    ram_path: str,
    run_dir: str,
    shares: Sequence[str],
    image: Image | None = None,
    restore: bool = False,
    accel: str = "tcg",
) -> list[str]:
    """The QEMU command line; a template's save (`image` given) and every restore share the
    device set exactly (a migration needs the same devices)."""
    if len(shares) != SHARE_SLOTS:
        raise ValueError(f"need {SHARE_SLOTS} share directories")
    argv = [
        qemu,
        "-M",
        "microvm,memory-backend=mem",
        "-object",
        f"memory-backend-file,id=mem,size={mem_mb}M,mem-path={ram_path},"
        f"share={'off' if restore else 'on'}",
        "-accel",
        "kvm" if accel == "kvm" else "tcg,tb-size=32",
        "-cpu",
        "host" if accel == "kvm" else "max",
        "-m",
        f"{mem_mb}M",
        *MACHINE_DEVICES,
        "-chardev",
        f"socket,id=sb,path={os.path.join(run_dir, 'port.sock')},server=on,wait=off",
        "-device",
        "virtserialport,chardev=sb,name=sb",
        # The egress channel (used only under a policy with [net] allow rules).
        "-chardev",
        f"socket,id=net,path={os.path.join(run_dir, 'net.sock')},server=on,wait=off",
        "-device",
        "virtserialport,chardev=net,name=net",
    ]
    for slot, path in enumerate(shares):
        argv += [
            "-fsdev",
            f"local,id=ro{slot},path={path},security_model=none,readonly=on",
            "-device",
            f"virtio-9p-device,fsdev=ro{slot},mount_tag=ro{slot}",
        ]
    argv += ["-qmp", f"unix:{os.path.join(run_dir, 'qmp.sock')},server=on,wait=off"]
    if restore:
        argv += ["-incoming", "defer", "-sandbox", _SANDBOX]
    elif image is not None:
        argv += ["-kernel", image.vmlinux, "-initrd", image.initrd, "-append", kernel_args()]
    return argv


# -- templates -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Template:
    """A saved guest: its RAM file, its device state, and what it was made from."""

    directory: str
    ram: str
    state: str
    mem_mb: int
    key: str
    accel: str = "tcg"


def _template_key(image: Image, qemu: str, mem_mb: int, accel: str = "tcg") -> str:
    parts = [image.digest, qemu_version(qemu), str(mem_mb), DEVICE_SET, str(tsc_khz())]
    if accel != "tcg":  # a migration stream does not cross accelerators
        parts.append(accel)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def template_dir(image: Image, qemu: str, mem_mb: int, accel: str = "tcg") -> str:
    key = _template_key(image, qemu, mem_mb, accel)
    return os.path.join(cache_root(), "qemu", "templates", key)


def find_template(image: Image, qemu: str, mem_mb: int, accel: str = "tcg") -> Template | None:
    directory = template_dir(image, qemu, mem_mb, accel)
    if not os.path.isfile(os.path.join(directory, "template.json")):
        return None
    return Template(
        directory,
        os.path.join(directory, "ram"),
        os.path.join(directory, "state"),
        mem_mb,
        os.path.basename(directory),
        accel,
    )


def find_roomy_template(
    image: Image, qemu: str, mem_mb: int, accel: str = "tcg"
) -> Template | None:
    """The smallest saved template of this image, QEMU and device set with at least
    `mem_mb` of guest RAM: the policy's memory limit is the guest's memory cgroup
    (`memory.max`, set after the restore), so a roomier guest serves it as well, and the
    tests and a mixed pool need one template boot, not one per size."""
    exact = find_template(image, qemu, mem_mb, accel)
    if exact is not None:
        return exact
    root = os.path.dirname(template_dir(image, qemu, mem_mb, accel))
    best: tuple[int, str] | None = None
    try:
        names = os.listdir(root)
    except OSError:
        return None
    want = {
        "qemu": qemu_version(qemu),
        "image": image.digest,
        "device_set": DEVICE_SET,
        "tsc_khz": tsc_khz(),
    }
    for name in names:
        try:
            with open(os.path.join(root, name, "template.json")) as fh:
                meta = json.load(fh)
        except (OSError, ValueError):
            continue
        size = meta.get("mem_mb")
        if not isinstance(size, int) or size < mem_mb or size > 2 * mem_mb + 512:
            continue
        if any(meta.get(k) != v for k, v in want.items()):
            continue
        if meta.get("accel", "tcg") != accel or _template_key(image, qemu, size, accel) != name:
            continue
        if best is None or size < best[0]:
            best = (size, name)
    if best is None:
        return None
    return find_template(image, qemu, best[0], accel)


def ensure_template(
    image: Image, mem_mb: int, *, qemu: str = _QEMU, accel: str | None = None
) -> Template:
    """The template for (image, QEMU, RAM size, accelerator): found, or booted once and
    saved (~5-10 s under TCG). `accel=None`: the one `accel_for` gives (a probe boot the
    first time, when /dev/kvm is usable)."""
    if accel is None:
        accel = accel_for(shutil.which(qemu) or qemu, image).accel
    found = find_template(image, qemu, mem_mb, accel)
    if found is not None:
        return found
    directory = template_dir(image, qemu, mem_mb, accel)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    lock_fd = os.open(os.path.join(parent, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        found = find_template(image, qemu, mem_mb, accel)
        if found is not None:
            return found
        work = tempfile.mkdtemp(prefix=".save-", dir=parent)
        try:
            _save_template(image, qemu, mem_mb, work, accel)
            if os.path.isdir(directory):
                shutil.rmtree(directory)
            os.rename(work, directory)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        os.close(lock_fd)
    found = find_template(image, qemu, mem_mb, accel)
    assert found is not None
    return found


def _save_template(image: Image, qemu: str, mem_mb: int, work: str, accel: str = "tcg") -> None:
    """Boot the image to the guest agent's SBREADY, then save it (file-backed RAM)."""
    run_dir = tempfile.mkdtemp(prefix="agent-sandbox-qemu-save-")
    empty = os.path.join(run_dir, "empty")
    os.mkdir(empty)
    ram = os.path.join(work, "ram")
    state = os.path.join(work, "state")
    argv = qemu_argv(
        qemu=qemu,
        mem_mb=mem_mb,
        ram_path=ram,
        run_dir=run_dir,
        shares=[empty] * SHARE_SLOTS,
        image=image,
        accel=accel,
    )
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output = b""
    try:
        assert proc.stdout is not None
        deadline = t0 + _TEMPLATE_BOOT_TIMEOUT
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        while b"SBREADY" not in output:
            if time.monotonic() > deadline:
                raise TemplateError(
                    f"the guest was not ready within {_TEMPLATE_BOOT_TIMEOUT:g} s (a kernel "
                    "that does not boot here? rebuild with another one: agent-sandbox qemu "
                    "build --kernel-deb PATH --force)"
                )
            if proc.poll() is not None:
                raise TemplateError(
                    f"QEMU exited ({proc.returncode}) before the guest was ready (a kernel "
                    "that does not boot here? rebuild with another one: agent-sandbox qemu "
                    "build --kernel-deb PATH --force)"
                )
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            output = (output + chunk)[-65536:]
        booted = time.monotonic() - t0
        from agent_sandbox.providers.qemu.relay import QMP

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(os.path.join(run_dir, "qmp.sock"))
        qmp = QMP(sock, time.monotonic() + 60)
        qmp.cmd(
            "migrate-set-capabilities",
            capabilities=[{"capability": "x-ignore-shared", "state": True}],
        )
        # No "stop" first: a stopped source stays paused after the restore.
        qmp.cmd("migrate", uri=f"exec:cat > {shlex.quote(state)}")
        while True:
            status = qmp.cmd("query-migrate")
            done = status.get("status") if isinstance(status, dict) else None
            if done == "completed":
                break
            if done in ("failed", "cancelled"):
                raise TemplateError(f"saving the template failed: {status}")
            if time.monotonic() > deadline:
                raise TemplateError("saving the template did not finish in time")
            time.sleep(0.01)
        with contextlib.suppress(Exception):
            qmp.cmd("quit")
        proc.wait(10)
        meta = {
            "qemu": qemu_version(qemu),
            "image": image.digest,
            "mem_mb": mem_mb,
            "device_set": DEVICE_SET,
            "tsc_khz": tsc_khz(),
            "accel": accel,
            "boot_seconds": round(booted, 2),
            "created": time.time(),
        }
        with open(os.path.join(work, "template.json"), "w") as fh:
            json.dump(meta, fh)
    except (OSError, RuntimeError, TemplateError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise TemplateError(no_space(work)) from None
        tail = output[-2000:].decode("utf-8", "replace").strip()
        raise TemplateError(f"saving the template failed: {exc}; the guest said: {tail}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(run_dir, ignore_errors=True)


# -- the first use ---------------------------------------------------------------------


class FirstUseProgress:
    """The first use's progress on stderr (the image, ~15-30 s, then the template boot,
    ~5-30 s under TCG): a one-line bar redrawn in place on a terminal, else plain lines, one
    per step and one every `_PLAIN_EVERY` seconds of the boot (a log or a pipe gets no
    carriage returns). `maybe()` shows it unless `AGENT_SANDBOX_PROGRESS=0`; `=1` asks for
    the bar even where stderr is not a terminal."""

    #: Seconds between the plain lines while the template boots (no step to report).
    _PLAIN_EVERY = 5.0

    #: (what a step's message starts with, the share of the whole done when it starts)
    _STEPS = (
        ("kernel package", 0.02),
        ("unpacking", 0.04),
        ("staging", 0.12),
        ("interpreter", 0.14),
        ("bytecode", 0.3),
        ("stripping", 0.38),
        ("writing", 0.44),
        ("image", 0.5),
        ("booting", 0.5),
        ("ready", 1.0),
    )
    #: The template boot's expected length: the bar creeps toward 98 % over it.
    _BOOT_SECONDS = 20.0

    def __init__(self, out: IO[str] | None, *, plain: bool = False) -> None:
        self.out = out
        self.plain = plain
        self.t0 = time.monotonic()
        self.done = 0.0
        self.what = ""
        self.booting_since: float | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @classmethod
    def maybe(cls) -> FirstUseProgress:
        wanted = os.environ.get("AGENT_SANDBOX_PROGRESS", "")
        if wanted == "0":
            return cls(None)
        try:
            terminal = sys.stderr.isatty()
        except (AttributeError, ValueError):
            terminal = False
        return cls(sys.stderr, plain=wanted != "1" and not terminal)

    def step(self, message: str) -> None:
        for prefix, share in self._STEPS:
            if message.startswith(prefix):
                self.done = max(self.done, share)
                break
        self.what = message
        if message.startswith("booting"):
            self.booting_since = time.monotonic()
            if self.out is not None and self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, daemon=True)
                self._ticker.start()
        self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(self._PLAIN_EVERY if self.plain else 0.5):
            self._draw()

    def _draw(self) -> None:
        if self.out is None:
            return
        done = self.done
        if self.booting_since is not None and done < 1.0:
            ran = time.monotonic() - self.booting_since
            done = 0.5 + 0.48 * min(1.0, ran / self._BOOT_SECONDS)
        width = 24
        filled = int(done * width)
        bar = "#" * filled + "-" * (width - filled)
        line = (
            f"agent-sandbox qemu first use: [{bar}] {done * 100:3.0f}% "
            f"{self.what[:48]} ({time.monotonic() - self.t0:.0f} s)"
        )
        with contextlib.suppress(OSError, ValueError):
            if self.plain:
                self.out.write(line.replace(f"[{bar}] ", "") + "\n")
            else:
                self.out.write("\r" + line.ljust(110))
            self.out.flush()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.out is not None and self.what and not self.plain:
            with contextlib.suppress(OSError, ValueError):
                self.out.write("\n")
                self.out.flush()


# -- the provider ----------------------------------------------------------------------


def _landlock_works() -> bool:
    from agent_sandbox.providers._landlock import probe_landlock

    return probe_landlock().available


def qemu_landlock_rules(
    run_dir: str, template: Template, shares: Sequence[str]
) -> list[tuple[str, str]]:
    """What QEMU (and the host relay) may touch under Landlock: the system's programs and
    libraries, its configuration, the template (its RAM file opened read-write, as QEMU
    opens every memory-backend file, but mapped privately: nothing is written), the read
    shares, `/dev/null` and `/dev/urandom`, and the run directory for its sockets. Nothing
    else of the host: not `/proc` of other processes, not the user's files."""
    rules: list[tuple[str, str]] = []
    for path in ("/usr", "/lib", "/lib64", "/bin", "/sbin", sys.base_prefix, sys.prefix):
        if os.path.exists(path):
            rules.append((path, "rx"))
    rules += [
        ("/etc", "ro"),
        (template.state, "dev-ro"),
        (template.ram, "dev-rw"),
        ("/dev/null", "dev-rw"),
        *([("/dev/kvm", "dev-rw")] if template.accel == "kvm" else []),
        ("/dev/urandom", "dev-ro"),
        (run_dir, "rw"),
    ]
    rules += [(path, "ro") for path in shares]
    return rules


@functools.cache
def _probe(qemu: str, _cache: str) -> ProbeResult:
    path = shutil.which(qemu)
    missing = missing_tools()
    if path is None or missing:
        names = ", ".join(tool for tool, _pkg in missing) or qemu
        return ProbeResult("qemu", False, f"missing {names}: {install_hint(missing)}")
    image = find_image()
    verdict = accel_for(path, image) if image is not None else None
    accel = verdict.describe() if verdict is not None else f"TCG ({kvm_state()})"
    version = f"{qemu_version(path)}; {accel}"
    if image is None:
        try:
            deb = locate_kernel_deb()
        except ImageError:
            return ProbeResult(
                "qemu",
                False,
                "no guest image for this interpreter and agent_sandbox version, and no Debian "
                "kernel package to build one: run `agent-sandbox qemu build` (as root the "
                "first time: it fetches the Debian kernel)",
                version=version,
                details={"path": path, "accel": accel},
            )
        # Built on first use (`QemuProvider.prepare`), from the kernel package found.
        return ProbeResult(
            "qemu",
            True,
            version=version,
            details={"path": path, "accel": accel, "image": None, "kernel_deb": deb},
        )
    return ProbeResult(
        "qemu",
        True,
        version=version,
        details={
            "path": path,
            "accel": accel,
            "accel_name": verdict.accel if verdict is not None else "tcg",
            "image": image.directory,
            "boundary": True,
        },
    )


def _share_plan(policy: Any, spec: WorkerSpec) -> list[str]:
    """The read directories to share (refusing what the VM cannot serve)."""
    read, write, _deny = policy_paths(policy, spec)
    scratch = os.path.normpath(spec.scratch)
    for path in write:
        if not (path == scratch or path.startswith(scratch + "/")):
            raise ProviderUnavailable(
                "qemu",
                f"files.write {path!r} is outside the scratch directory, which is the only "
                "writable place in the VM; use provider bwrap or landlock for host writes",
            )
    dirs: list[str] = []
    for path in sorted(set(read), key=lambda p: (p.count("/"), p)):
        if path == scratch or path.startswith(scratch + "/"):
            continue
        if any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs):
            continue
        if os.path.isdir(path):
            dirs.append(path)
        elif os.path.exists(path):
            raise ProviderUnavailable(
                "qemu",
                f"files.read {path!r} is a file; the VM shares directories only (grant its "
                "directory, or use provider bwrap)",
            )
    if len(dirs) > SHARE_SLOTS:
        raise ProviderUnavailable(
            "qemu",
            f"files.read names {len(dirs)} directories; the VM has {SHARE_SLOTS} share slots "
            "(grant a common parent, or use provider bwrap)",
        )
    return dirs


class QemuProvider(Provider):
    """Run the worker in a micro-VM restored from a snapshot template."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(namespace_net)

    name: ClassVar[str] = "qemu"
    #: Stronger than every namespace sandbox (its own kernel), but `auto` never picks it
    #: (`_auto.py` chooses among the others): guest Python under TCG is ~20x slower.
    strength: ClassVar[int] = 60
    is_boundary: ClassVar[bool] = True

    def __init__(self, *, qemu: str = _QEMU, trace: bool = False) -> None:
        self.qemu = qemu
        #: Timing lines for each start-up step in the worker log (benchmarks, debugging).
        self.trace = trace

    def probe(self) -> ProbeResult:
        return _probe(self.qemu, cache_root())

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        # [net]: no NIC; the host's egress proxy behind the guest's loopback (see above).
        egress, proxy_vars, egress_fds = egress_plan(self, policy, spec)
        shares = _share_plan(policy, spec)
        from agent_sandbox.providers import _seccomp

        setup: dict[str, Any] = {}
        layers: tuple[str, ...] = ()
        if _seccomp.probe_seccomp()[0]:
            # Inside the guest too: the same filter and exec program as under Landlock.
            setup = _seccomp.seccomp_setup(policy)
            layers = ("guest-seccomp",)
        if egress:
            # For the parent (it starts the proxy and takes the relay's listener); the host
            # relay drops it from what the guest's worker applies.
            setup.update(egress)
            layers += ("egress-proxy",)
        run_dir = os.path.join(spec.control_dir, "vm")
        from agent_sandbox.providers._masks import find_masks

        # 9p shares whole directories: what the policy hides or denies inside a shared one
        # is covered on the host, in QEMU's own mount namespace, before QEMU starts.
        masks = [
            [path, kind]
            for path, kind in find_masks(policy, spec).paths.items()
            if any(path == d or path.startswith(d.rstrip("/") + "/") for d in shares)
        ]
        config = {
            "mem_mb": vm_memory_mb(policy),
            "run_dir": run_dir,
            "share_paths": shares,
            "masks": masks,
            "listen_fd": spec.listen_fd,
            "boot_fd": spec.boot_fd,
            "scratch_mb": int(policy.limits.scratch_mb),
            "processes": int(policy.limits.processes),
            "memory_mb": int(policy.limits.memory_mb),
            "egress_fd": spec.egress_fd if egress else None,
            # Allowed loopback services, listened for at their address in the guest and
            # joined to the host's proxy (`qemu/guest.py`, `qemu/relay.py`).
            "forwards": egress["egress"]["forwards"] if egress else [],
        }
        return LaunchPlan(
            provider=self.name,
            argv=(spec.python, "-I", "-S", "-B", _HOST_SCRIPT, json.dumps(config)),
            env=base_env(spec, proxy_vars),
            pass_fds=(spec.listen_fd, spec.boot_fd, *egress_fds),
            cwd=spec.control_dir,
            worker_setup=WorkerSetup(**setup),
            stack=(self.name, *layers),
            worker_depth=None,
            interrupt_launcher=True,
            limit_reports=os.path.join(run_dir, "guest-limits.json"),
            warm_up=True,
        )

    def prepare(self, policy: Any) -> None:
        """The first use's build: the image (when the probe found only the kernel package)
        and the template for the policy's guest RAM, with a progress bar on stderr when it
        is a terminal or `AGENT_SANDBOX_PROGRESS=1`. Quick once both exist."""
        probe = self.require()
        qemu = str(probe.details.get("path", self.qemu))
        mem_mb = vm_memory_mb(policy)
        image = find_image()
        if image is not None:
            accel = accel_for(qemu, image).accel
            if find_roomy_template(image, qemu, mem_mb, accel) is not None:
                return
        bar = FirstUseProgress.maybe()
        try:
            if image is None:
                image = build_image(progress=bar.step)
            bar.step(f"booting and saving the template ({mem_mb} MiB of guest RAM)")
            ensure_template(image, mem_mb, qemu=qemu, accel=accel_for(qemu, image).accel)
            bar.step("ready")
        except (ImageError, TemplateError) as exc:
            raise ProviderUnavailable("qemu", str(exc)) from None
        finally:
            bar.close()

    def launch(self, plan: LaunchPlan, log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Find the image and template (saving the template on first use), then start the
        host side (`qemu/relay.py`) with the full QEMU command line."""
        probe = self.require()
        qemu = str(probe.details.get("path", self.qemu))
        image = find_image()
        if image is None:
            raise ProviderUnavailable(
                "qemu", "the guest image is gone: run `agent-sandbox qemu build`"
            )

        config = json.loads(plan.argv[-1])
        mem_mb = int(config["mem_mb"])
        accel = accel_for(qemu, image).accel
        try:
            template = find_roomy_template(image, qemu, mem_mb, accel) or ensure_template(
                image, mem_mb, qemu=qemu, accel=accel
            )
        except TemplateError as exc:
            raise ProviderUnavailable("qemu", str(exc)) from None
        mem_mb = template.mem_mb
        run_dir = config["run_dir"]
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        empty = os.path.join(run_dir, "empty")
        os.makedirs(empty, mode=0o500, exist_ok=True)
        dirs = list(config["share_paths"])
        slots = dirs + [empty] * (SHARE_SLOTS - len(dirs))
        host = {
            "qemu_argv": qemu_argv(
                qemu=qemu,
                mem_mb=mem_mb,
                ram_path=template.ram,
                run_dir=run_dir,
                shares=slots,
                restore=True,
                accel=template.accel,
            ),
            "state": template.state,
            "qmp": os.path.join(run_dir, "qmp.sock"),
            "port": os.path.join(run_dir, "port.sock"),
            "net_port": os.path.join(run_dir, "net.sock"),
            "net": (
                {
                    "socket": os.path.join(run_dir, "egress.sock"),
                    "egress_fd": config["egress_fd"],
                    "forwards": [
                        [h, p, os.path.join(run_dir, forward_socket_name(h, p))]
                        for h, p in config.get("forwards", [])
                    ],
                }
                if config.get("egress_fd") is not None
                else None
            ),
            "listen_fd": config["listen_fd"],
            "boot_fd": config["boot_fd"],
            "shares": [[f"ro{i}", path] for i, path in enumerate(dirs)],
            "scratch_mb": config["scratch_mb"],
            "processes": config["processes"],
            "memory_mb": config["memory_mb"],
            "masks": config["masks"],
            "start_timeout": 30.0,
            "trace": self.trace,
        }
        if _landlock_works():
            host["landlock"] = qemu_landlock_rules(run_dir, template, dirs)
            host["landlock_module"] = os.path.join(package_folder(), "_landlock_sys.py")
        real = dataclasses.replace(plan, argv=(*plan.argv[:-1], json.dumps(host)))
        return super().launch(real, log)
