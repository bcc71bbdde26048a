"""`agent-sandbox qemu build|status|clean`: the `qemu` provider's guest image and templates.

* `build [--kernel-deb PATH] [--memory MB ...] [--force] [--no-template]`: build the kernel
  and initramfs for this interpreter and this `agent_sandbox` (`providers/qemu/image.py`),
  then boot and save the snapshot template for each memory size (default: the default
  policy's). Progress goes to stderr, one line per step with the elapsed time. A missing tool
  or kernel package is one line naming the command that fixes it (exit 69).
* `status [--json]`: the cache directory, the current image (or why there is none), the
  templates, and the accelerator.
* `clean`: remove every cached image and template, and the remembered KVM probe verdicts
  (the kernel packages stay).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    qemu = subparsers.add_parser("qemu", help="build or inspect the qemu provider's guest image")
    sub = qemu.add_subparsers(dest="qemu_command", metavar="ACTION")
    build = sub.add_parser("build", help="build the guest image and its snapshot template")
    build.add_argument("--kernel-deb", help="a linux-image-*-amd64 .deb to use")
    build.add_argument(
        "--memory",
        type=int,
        action="append",
        metavar="MB",
        help="save the template for policies with this memory_mb (repeatable; default: the "
        "default policy's); the guest gets that plus headroom for its kernel",
    )
    build.add_argument(
        "--package",
        action="append",
        metavar="NAME",
        help="also bake this installed package into the image (repeatable; the list is "
        "remembered for later builds; --package '' clears it)",
    )
    build.add_argument("--force", action="store_true", help="rebuild even when up to date")
    build.add_argument("--no-template", action="store_true", help="build the image only")
    build.set_defaults(func=_cmd_build)
    status = sub.add_parser("status", help="show the cached image and templates")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=_cmd_status)
    clean = sub.add_parser("clean", help="remove the cached images and templates")
    clean.set_defaults(func=_cmd_clean)
    qemu.set_defaults(func=lambda _args: _usage(qemu))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 64


def _cmd_build(args: argparse.Namespace) -> int:
    from agent_sandbox.policies import Policy
    from agent_sandbox.providers.qemu.image import ImageError, build_image
    from agent_sandbox.providers.qemu.provider import TemplateError, ensure_template, guest_ram_mb

    t0 = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f} s] {message}", file=sys.stderr, flush=True)

    try:
        packages = None if args.package is None else [p for p in args.package if p]
        image = build_image(
            args.kernel_deb, download=True, force=args.force, packages=packages, progress=say
        )
    except ImageError as exc:
        print(f"agent-sandbox qemu build: {exc}", file=sys.stderr)
        return 69
    if not args.no_template:
        sizes = args.memory or [int(Policy(name="default").limits.memory_mb)]
        for mb in sizes:
            say(f"booting and saving the template ({guest_ram_mb(mb)} MiB of guest RAM)")
            try:
                template = ensure_template(image, guest_ram_mb(mb))
            except TemplateError as exc:
                print(f"agent-sandbox qemu build: {exc}", file=sys.stderr)
                return 70
            say(f"template {template.key} ready")
    print(image.directory)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from agent_sandbox.providers.qemu.image import cache_root, find_image
    from agent_sandbox.providers.qemu.provider import QemuProvider, kvm_state

    probe = QemuProvider().probe()
    image = find_image()
    templates_dir = os.path.join(cache_root(), "qemu", "templates")
    templates = []
    if os.path.isdir(templates_dir):
        for name in sorted(os.listdir(templates_dir)):
            meta_path = os.path.join(templates_dir, name, "template.json")
            if os.path.isfile(meta_path):
                with open(meta_path) as fh:
                    templates.append({"key": name, **json.load(fh)})
    info: dict[str, Any] = {
        "available": probe.available,
        "reason": probe.reason,
        "qemu": probe.version,
        "accel": str(probe.details.get("accel") or f"TCG ({kvm_state()})"),
        "cache": os.path.join(cache_root(), "qemu"),
        "image": image.directory if image else None,
        "templates": [t for t in templates if image is not None and t.get("image") == image.digest],
        "stale_templates": sum(
            1 for t in templates if image is None or t.get("image") != image.digest
        ),
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0 if probe.available else 69
    print(f"qemu: {'available' if probe.available else 'unavailable'} {info['accel']}")
    if probe.reason:
        print(f"  why: {probe.reason}")
    print(f"  cache: {info['cache']}")
    print(f"  image: {info['image'] or '(none for this interpreter and version)'}")
    for t in info["templates"]:
        print(f"  template {t['key']}: {t['mem_mb']} MiB, booted in {t['boot_seconds']} s")
    if info["stale_templates"]:
        print(f"  {info['stale_templates']} template(s) of other images (qemu clean removes them)")
    return 0 if probe.available else 69


def _cmd_clean(_args: argparse.Namespace) -> int:
    from agent_sandbox.providers.qemu.image import cache_root

    for sub in ("images", "templates"):
        shutil.rmtree(os.path.join(cache_root(), "qemu", sub), ignore_errors=True)
    for name in ("kvm-probe.json", "kvm-probe.json.lock"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(cache_root(), "qemu", name))
    print(f"removed {os.path.join(cache_root(), 'qemu')}/{{images,templates,kvm-probe.json}}")
    return 0
