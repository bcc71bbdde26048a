"""The qemu provider's accelerator: KVM only after a probe boot, remembered per key.

A fake QEMU (a shell script) stands in for the boot where the test is about the probe's
bookkeeping (reuse, re-probe on a changed key, the kill of a hung probe); the real probe
boot runs where QEMU and the session's image exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_sandbox.providers.qemu.accel import Verdict, accel_verdict, kvm_modules

FAKE_QEMU = """#!/bin/sh
# A stand-in for qemu-system-x86_64's probe boot: $FAKE_QEMU_MODE says how it goes.
echo "boot $$" >> "$FAKE_QEMU_LOG"
case "$FAKE_QEMU_MODE" in
  ready) echo "Linux booting"; echo SBREADY; exec sleep 600 ;;
  fail) echo "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69"; exit 134 ;;
  hang) sleep 600 & echo "child $!" >> "$FAKE_QEMU_LOG"; wait ;;
esac
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A fake QEMU, a fake /dev/kvm and a fake /sys/module with kvm and kvm_intel loaded."""
    qemu = tmp_path / "qemu-system-x86_64"
    qemu.write_text(FAKE_QEMU)
    qemu.chmod(0o755)
    log = tmp_path / "boots.log"
    log.write_text("")
    dev = tmp_path / "kvm"
    dev.write_text("")
    dev.chmod(0o600)
    modules = tmp_path / "module"
    for name, param, value in (("kvm", "halt_poll_ns", "200000"), ("kvm_intel", "nested", "Y")):
        (modules / name / "parameters").mkdir(parents=True)
        (modules / name / "parameters" / param).write_text(value + "\n")
    (modules / "ext4").mkdir()  # not a kvm module: not in the key
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("FAKE_QEMU_LOG", str(log))
    monkeypatch.setenv("FAKE_QEMU_MODE", "fail")
    return {"qemu": qemu, "log": log, "dev": dev, "modules": modules, "cache": cache}


def verdict(fake: dict[str, Path], **over: object) -> Verdict:
    args: dict[str, object] = {
        "qemu": str(fake["qemu"]),
        "qemu_version": "7.2.22",
        "image_digest": "image-a",
        "vmlinux": "/nonexistent/vmlinux",
        "initrd": "/nonexistent/initrd.cpio",
        "append": "console=ttyS0",
        "cache_root": str(fake["cache"]),
        "timeout": 10.0,
        "dev_kvm": str(fake["dev"]),
        "sys_module": str(fake["modules"]),
    }
    args.update(over)
    return accel_verdict(**args)  # type: ignore[arg-type]


def boots(fake: dict[str, Path]) -> int:
    return sum(1 for line in fake["log"].read_text().splitlines() if line.startswith("boot "))


def gone(pid: int, within: float = 3.0) -> bool:
    """The process has exited and been reaped (a zombie counts as gone after `within`)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z" and time.monotonic() > end - 0.1:
            return True
        time.sleep(0.05)
    return False


def test_a_failed_probe_boot_is_tcg_naming_the_loaded_kvm_module(fake: dict[str, Path]) -> None:
    v = verdict(fake)
    assert (v.accel, v.reason, v.probed) == (
        "tcg",
        "KVM present but cannot boot stock kernels: kvm_intel",
        True,
    )
    assert v.describe() == "TCG (KVM present but cannot boot stock kernels: kvm_intel)"
    assert "MSR 0x10a" in v.detail and "exited with 134" in v.detail
    assert boots(fake) == 1


def test_a_probe_boot_that_reaches_the_guest_agent_is_kvm(
    fake: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_QEMU_MODE", "ready")
    v = verdict(fake)
    assert (v.accel, v.reason, v.probed, v.describe()) == ("kvm", "", True, "KVM")
    pid = int(fake["log"].read_text().split()[1])
    assert gone(pid), "the probe's QEMU outlived its successful boot"


def test_a_remembered_verdict_is_reused_without_a_second_boot(
    fake: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = verdict(fake)
    monkeypatch.setenv("FAKE_QEMU_MODE", "ready")  # a boot now would say KVM
    again = verdict(fake)
    assert boots(fake) == 1
    assert (again.accel, again.reason, again.probed) == (first.accel, first.reason, False)
    # afresh (doctor, AGENT_SANDBOX_PROBE_CACHE=off) boots again; remember=False writes nothing
    fresh = verdict(fake, afresh=True, remember=False)
    assert (fresh.accel, fresh.probed, boots(fake)) == ("kvm", True, 2)
    assert verdict(fake).accel == "tcg" and boots(fake) == 2


@pytest.mark.parametrize("change", ["module parameter", "module loaded", "qemu", "image"])
def test_a_changed_key_probes_again(fake: dict[str, Path], change: str) -> None:
    verdict(fake)
    over: dict[str, object] = {}
    if change == "module parameter":
        (fake["modules"] / "kvm" / "parameters" / "halt_poll_ns").write_text("0\n")
    elif change == "module loaded":
        shutil.rmtree(fake["modules"] / "kvm_intel")
        (fake["modules"] / "kvm_amd" / "parameters").mkdir(parents=True)
    elif change == "qemu":
        over["qemu_version"] = "8.2.0"
    else:
        over["image_digest"] = "image-b"
    v = verdict(fake, **over)
    assert v.probed and boots(fake) == 2
    if change == "module loaded":
        assert v.reason.endswith(": kvm_amd")
    # ... and the new key is remembered (beside the old one, where that is still current)
    assert not verdict(fake, **over).probed
    if over:
        assert not verdict(fake).probed
    assert boots(fake) == 2


def test_a_hung_probe_is_killed_within_its_timeout_and_leaves_nothing(
    fake: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_QEMU_MODE", "hang")
    v = verdict(fake, timeout=1.0)  # the fake hangs for ever: only the timeout returns
    assert v.accel == "tcg" and "no ready guest within 1 s" in v.detail
    words = fake["log"].read_text().split()
    qemu_pid, child_pid = int(words[words.index("boot") + 1]), int(words[words.index("child") + 1])
    assert gone(qemu_pid), "the hung probe QEMU is still running"
    assert gone(child_pid), "a process the probe QEMU started is still running"
    # the hang is remembered too: the next session does not wait for it again
    booted = boots(fake)
    assert not verdict(fake, timeout=1.0).probed and boots(fake) == booted


def test_no_usable_dev_kvm_is_tcg_without_a_boot(fake: dict[str, Path]) -> None:
    v = verdict(fake, dev_kvm=str(fake["dev"]) + "-missing")
    assert (v.accel, v.reason, v.probed) == ("tcg", "no /dev/kvm", False)
    assert boots(fake) == 0


def test_an_untrusted_verdict_file_is_ignored(fake: dict[str, Path]) -> None:
    verdict(fake)
    path = fake["cache"] / "qemu" / "kvm-probe.json"
    path.chmod(0o666)  # writable by others: another user could have planted "kvm"
    assert verdict(fake).probed and boots(fake) == 2


# -- the real probe boot, on this machine ---------------------------------------------


def test_the_probe_boot_here_gives_the_verdict_doctor_reports(
    qemu_cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_sandbox.providers.qemu.image import find_image
    from agent_sandbox.providers.qemu.provider import accel_for

    if not os.path.exists("/dev/kvm"):
        pytest.skip("no /dev/kvm here: TCG without a probe boot")
    monkeypatch.setenv("XDG_CACHE_HOME", qemu_cache)
    image = find_image()
    assert image is not None
    qemu = shutil.which("qemu-system-x86_64")
    assert qemu is not None
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        v = accel_for(qemu, image, afresh=True)  # this user is not in the kvm group
        assert v.accel == "tcg" and "not read-writable by this user" in v.reason, v
        assert not v.probed
        return
    v = accel_for(qemu, image, afresh=True)
    vendor = [name for name in kvm_modules() if name != "kvm"]
    if "kvm_pvm" not in vendor:
        pytest.skip(f"this host loads {vendor or 'no vendor module'}, not kvm_pvm: {v.describe()}")
    assert v.describe() == "TCG (KVM present but cannot boot stock kernels: kvm_pvm)"
    assert v.probed
    # Only the probe boots this image under KVM (templates here are TCG): none of those left.
    probes = f"accel kvm .*-kernel {re.escape(image.vmlinux)}"
    assert not subprocess.run(["pgrep", "-f", probes], capture_output=True).stdout
    again = accel_for(qemu, image)
    assert not again.probed and again.describe() == v.describe()
    out = subprocess.run(
        [sys.executable, "-m", "agent_sandbox", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XDG_CACHE_HOME": qemu_cache},
    ).stdout
    assert "  qemu: TCG (KVM present but cannot boot stock kernels: kvm_pvm)\n" in out


@pytest.mark.parametrize("planted", ["kvm-probe.json", "kvm-probe.json.lock"])
def test_a_link_planted_at_the_kvm_probe_files_is_not_followed(
    fake: dict[str, Path], tmp_path: Path, planted: str
) -> None:
    """It denies a link planted at the verdict file or its lock (dangling, so following it
    would create the target): the probe runs, the link's target is never created; a
    verdict file's link is replaced by the answer, a lock's link makes the probe run
    unlocked and remember nothing."""
    folder = fake["cache"] / "qemu"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    (folder / planted).symlink_to(victim)
    v = verdict(fake)
    assert v.probed and boots(fake) == 1  # the attack ran against a real probe
    assert not victim.exists()
    if planted.endswith(".lock"):
        assert (folder / planted).is_symlink()  # left alone, not opened
        assert not (folder / "kvm-probe.json").exists()
    else:
        assert not (folder / planted).is_symlink()
        assert json.loads((folder / planted).read_text())["entries"]
