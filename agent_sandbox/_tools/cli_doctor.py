"""`agent-sandbox doctor`: which providers work on this machine, and why the others do not.

It prints one line per provider (available or not, version or ABI, the reason when not),
then the kernel facilities the providers build on: the Landlock ABI and what it covers,
seccomp (libseccomp), per-worker cgroups, user namespaces. In a container or pod (and under
gVisor, detected from its kernel) it also says which layer would hold a remote worker's code
there: the runtime, the in-pod provider `worker serve --provider auto` would start it under,
the boundary every RunResult then names, and whether the pod's secret files stay out of the
code's reach (`_host/placement.py`, shared with `worker check` and `worker serve`).
`--live` also starts one worker under each available provider and shows what the worker
reported about itself (NoNewPrivs, CapEff, Landlock, seccomp) and how long it took to become
ready. `--json` prints the same as one JSON object. The exit status is 0 when at least one
kernel boundary works here (a provider, or the gVisor runtime detected).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

__all__ = ["add_parser", "collect"]

_LANDLOCK_ABI_FEATURES = {
    1: "files",
    2: "file renames across directories (REFER)",
    3: "truncation (TRUNCATE)",
    4: "TCP bind/connect ports",
    5: "device ioctls (IOCTL_DEV)",
    6: "abstract Unix sockets and signals scoped",
    7: "denial logging flags",
}


def add_parser(subparsers: Any) -> None:
    doctor = subparsers.add_parser(
        "doctor", help="show which sandbox providers work here, their versions, and why not"
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument(
        "--live", action="store_true", help="also start one worker per available provider"
    )
    doctor.set_defaults(func=_cmd_doctor)


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def collect(*, live: bool = False) -> dict[str, Any]:
    """Everything `doctor` reports, as JSON-safe data."""
    from agent_sandbox._host.limits import cgroup_support
    from agent_sandbox.providers import probe_all
    from agent_sandbox.providers._landlock import probe_landlock
    from agent_sandbox.providers._probe_cache import probe_afresh
    from agent_sandbox.providers._seccomp import probe_seccomp

    probe_afresh()  # the doctor reports what this machine does now, not what it did
    providers = []
    for result in probe_all():
        providers.append(
            {
                "name": result.name,
                "available": result.available,
                "version": result.version,
                "reason": result.reason,
                "details": {k: v for k, v in result.details.items() if _json_safe(v)},
            }
        )
    from agent_sandbox._host.denial_log import probe_denial_logging

    landlock = probe_landlock()
    abi = int(landlock.details.get("abi", 0) or 0)
    seccomp_ok, seccomp_info = probe_seccomp()
    report: dict[str, Any] = {
        "kernel": platform.release(),
        "machine": platform.machine(),
        "uid": os.getuid(),
        "providers": providers,
        "landlock": {
            "abi": abi,
            "features": [
                _LANDLOCK_ABI_FEATURES[i] for i in sorted(_LANDLOCK_ABI_FEATURES) if i <= abi
            ],
            "missing": [
                _LANDLOCK_ABI_FEATURES[i] for i in sorted(_LANDLOCK_ABI_FEATURES) if i > abi
            ],
            "reason": "" if abi else landlock.reason,
        },
        "seccomp": {"available": seccomp_ok, "info": seccomp_info},
        "denial_log": probe_denial_logging(abi),
        "cgroups": cgroup_support(),
        "user_namespaces": _read("/proc/sys/user/max_user_namespaces") or "unknown",
        "gvisor": _gvisor(providers),
    }
    from agent_sandbox._host.placement import detect_place, inpod_report

    place = detect_place()
    report["placement"] = {
        "container": place.container,
        "runtime": place.runtime,
        "evidence": list(place.evidence),
    }
    if place.in_container:
        # Where `worker serve` runs: the layer a remote worker gets here, decided as a bind
        # decides it (`--provider auto`, the runtime detected, not declared).
        inpod = inpod_report("auto", "", place)
        report["in_pod"] = {**inpod.to_json(), "lines": inpod.lines()}
    if live:
        report["live"] = [_live(str(p["name"])) for p in providers if p["available"]]
    return report


def _gvisor(providers: list[dict[str, Any]]) -> dict[str, Any]:
    """The gvisor provider's facts: runsc's version and release, the Sentry's platform, and
    the install command when it is missing or too old."""
    from agent_sandbox.providers.gvisor.provider import (
        INSTALL_HINT,
        MIN_RELEASE,
        PLATFORM,
        PLATFORM_NOTE,
    )

    probe = next((p for p in providers if p["name"] == "gvisor"), None)
    if probe is None:
        return {"available": False, "reason": "not registered", "install": INSTALL_HINT}
    out: dict[str, Any] = {
        "available": probe["available"],
        "version": probe["version"],
        "release": probe["details"].get("release"),
        "min_release": MIN_RELEASE,
        "platform": probe["details"].get("platform", PLATFORM),
        "platform_note": PLATFORM_NOTE,
        "rootless": True,
    }
    if not probe["available"]:
        out["reason"] = probe["reason"]
        out["install"] = INSTALL_HINT
    return out


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _live(name: str) -> dict[str, Any]:
    from agent_sandbox._errors import SandboxError
    from agent_sandbox._host.process import WorkerProcess
    from agent_sandbox.policies import Policy
    from agent_sandbox.providers import get_provider

    started = time.perf_counter()
    try:
        # A trial start of the provider, not a user's policy: `visible_names` is read only
        # under landlock, which starts no worker for a policy without it.
        policy = Policy(name="doctor", visible_names="accepted")
        worker = WorkerProcess.start(policy, get_provider(name))
    except SandboxError as exc:
        return {"provider": name, "ok": False, "error": str(exc)}
    try:
        ready_ms = (time.perf_counter() - started) * 1000
        checks = worker.hello.checks.to_dict() if worker.hello is not None else {}
        checks.pop("rlimits", None)
        return {"provider": name, "ok": True, "ready_ms": round(ready_ms, 1), "checks": checks}
    finally:
        worker.close()


def _cmd_doctor(args: argparse.Namespace) -> int:
    from agent_sandbox._tools.cli import EXIT_ERROR, EXIT_OK, Style

    report = collect(live=args.live)
    boundary = any(p["available"] and p["details"].get("boundary") for p in report["providers"])
    # Under gVisor (detected) the runtime is a boundary even where no provider works inside.
    boundary = boundary or bool(report["placement"]["runtime"])
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return EXIT_OK if boundary else EXIT_ERROR
    style = Style(__import__("sys").stdout)
    print(
        style.bold(
            f"agent-sandbox doctor: Linux {report['kernel']} ({report['machine']}), "
            f"uid {report['uid']}"
        )
    )
    print(style.bold("providers"))
    for p in report["providers"]:
        mark = style.green("ok  ") if p["available"] else style.red("no  ")
        version = f" ({p['version']})" if p["version"] else ""
        line = f"  {mark}{p['name']:<11}{version}"
        if not p["available"]:
            line += f": {p['reason']}"
        elif not p["details"].get("boundary", p["name"] != "subprocess"):
            line += style.dim(": no kernel boundary (guards and rlimits only)")
        print(line)
    ll = report["landlock"]
    print(style.bold("kernel"))
    if ll["abi"]:
        print(f"  landlock ABI {ll['abi']}: {', '.join(ll['features'])}")
        if ll["missing"]:
            print(f"    not in this kernel: {', '.join(ll['missing'])}")
    else:
        print(f"  landlock: {ll['reason']}")
    dl = report["denial_log"]
    print(f"  landlock denials in results: {'yes' if dl['works'] else 'no'} ({dl['reason']})")
    sc = report["seccomp"]
    print(f"  seccomp: {sc['info'] if sc['available'] else style.red(sc['info'])}")
    cg = report["cgroups"]
    parts = [
        f"{k} {'yes' if cg.get(k) else style.red('no')}"
        for k in ("memory", "processes", "cpu", "kill")
    ]
    print(f"  per-worker cgroups: {', '.join(parts)}")
    if not (cg["memory"] and cg["processes"]):
        print(style.dim("    without them only rlimits and the wall-clock timeout bound a worker"))
    print(f"  user namespaces: max {report['user_namespaces']}")
    gv = report["gvisor"]
    if gv["available"]:
        print(
            f"  gvisor: runsc release {gv['release']}, platform {gv['platform']}, rootless "
            '(a user-space kernel: `min_boundary = "user-space-kernel"`)'
        )
        if gv["platform"] == "ptrace":
            print(style.dim(f"    {gv['platform_note']}"))
    else:
        hint = "" if gv["install"] in gv["reason"] else f"; install: {gv['install']}"
        print(f"  gvisor: {style.red('unavailable')} ({gv['reason']}){hint}")
    for p in report["providers"]:
        if p["name"] == "qemu" and p["details"].get("accel"):
            # The accelerator: KVM only after a probe boot (`providers/qemu/accel.py`).
            print(f"  qemu: {p['details']['accel']}")
    for item in report.get("live", []):
        if item["ok"]:
            checks = ", ".join(f"{k}={_short(v)}" for k, v in sorted(item["checks"].items()))
            print(f"  live {item['provider']}: ready in {item['ready_ms']} ms; {checks or '-'}")
        else:
            print(style.red(f"  live {item['provider']}: {item['error']}"))
    if "in_pod" in report:
        kind = report["placement"]["container"]
        where = "a Kubernetes pod" if kind == "kubernetes" else f"a container ({kind})"
        print(style.bold(f"in {where}: what `agent-sandbox worker serve` would run here"))
        for line in report["in_pod"]["lines"]:
            print("  " + line)
    if not boundary:
        print(style.yellow("no kernel boundary works here: only the `subprocess` provider runs"))
    return EXIT_OK if boundary else EXIT_ERROR


def _short(value: Any) -> str:
    if isinstance(value, dict):
        if "abi" in value:
            return f"ABI {value['abi']} enforced={value.get('enforced')}"
        return json.dumps(value, sort_keys=True)[:60]
    return str(value)
