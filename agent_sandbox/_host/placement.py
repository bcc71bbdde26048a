"""Where this process runs (a plain host, a container, a Kubernetes pod; gVisor or not) and,
there, which layer holds a remote worker's code: the one answer `worker serve`, `worker check`
and `doctor` share.

Detection (`detect_place`) reads only what the kernel or the container runtime writes before
any user code runs:

* gVisor: `/proc/version` carries the fixed version string of gVisor's Sentry
  (`#1 SMP Sun Jan 10 15:06:54 PST 2016`, release `4.4.0` or `4.19.0-gvisor`), not the host
  kernel's; a real kernel shows its own build.
* a pod: `KUBERNETES_SERVICE_HOST` (set by the kubelet in every container, service links or
  not), the kubelet's `/etc/hosts` header, or `kubepods` in PID 1's cgroup (cgroup v1);
  a container: `/.dockerenv`, `/run/.containerenv` (podman), `container=` in the environment.

Kata is not detected (its guest kernel is an ordinary kernel): it is declared by the operator
(`--runtime-boundary kata`), as gVisor may be. A declared gVisor that the kernel contradicts is
a pod whose `runtimeClassName` did not apply; `worker serve` refuses to start then
(`runtime_mismatch`).

The in-pod provider (`choose_inpod`): with `--provider auto`, the strongest local kernel
provider whose probe works here (a real trial start: `bwrap`, `unshare`, `landlock`; see
`providers/_auto.py`), so a runtime that allows user namespaces gets a mount namespace that
leaves the pod's secrets out of the worker's view; only where none works and the runtime is
itself a boundary, `subprocess`, whose worker can read whatever the pod's user can (the TLS
key, the bind secret's file): the documented weak case (docs/scale-out.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "GVISOR_VERSION",
    "InPod",
    "Place",
    "check_runtime",
    "choose_inpod",
    "detect_place",
    "effective_runtime",
    "inpod_report",
    "runtime_mismatch",
    "serve_provider",
    "serve_runtime",
]

#: The build string gVisor's Sentry reports for its emulated kernel (its syscall table's
#: `Version`); no kernel built by a distribution carries it.
GVISOR_VERSION = "#1 SMP Sun Jan 10 15:06:54 PST 2016"

#: Where `/proc`, `/etc` and the marker files are read from (tests point it at a fake tree).
ROOT = "/"


@dataclasses.dataclass(frozen=True)
class Place:
    """What `detect_place` found: `container` ("kubernetes", "docker", "podman", another
    runtime's name, "container", or "" on a plain host), `runtime` ("gvisor" or ""), and the
    evidence for each, as short sentences."""

    container: str = ""
    runtime: str = ""
    evidence: tuple[str, ...] = ()

    @property
    def in_container(self) -> bool:
        return bool(self.container or self.runtime)


def _read(root: str, path: str, limit: int = 65536) -> str:
    try:
        with open(os.path.join(root, path.lstrip("/")), errors="replace") as fh:
            return fh.read(limit)
    except OSError:
        return ""


def detect_place(root: str | None = None, environ: Mapping[str, str] | None = None) -> Place:
    """Where this process runs (see the module docstring); never raises."""
    root = ROOT if root is None else root
    env = os.environ if environ is None else environ
    evidence: list[str] = []
    runtime = ""
    version = _read(root, "/proc/version").strip()
    if GVISOR_VERSION in version or "-gvisor" in version:
        runtime = "gvisor"
        evidence.append(f"/proc/version is gVisor's ({version[:60]!r})")
    container = ""
    if env.get("KUBERNETES_SERVICE_HOST"):
        container = "kubernetes"
        evidence.append("KUBERNETES_SERVICE_HOST is set (a pod)")
    elif "Kubernetes-managed hosts file" in _read(root, "/etc/hosts", 4096):
        container = "kubernetes"
        evidence.append("/etc/hosts is the kubelet's (a pod)")
    elif "kubepods" in _read(root, "/proc/1/cgroup"):
        container = "kubernetes"
        evidence.append("PID 1's cgroup is under kubepods (a pod)")
    elif os.path.exists(os.path.join(root, ".dockerenv")):
        container = "docker"
        evidence.append("/.dockerenv exists (a Docker-style container)")
    elif os.path.exists(os.path.join(root, "run/.containerenv")):
        container = "podman"
        evidence.append("/run/.containerenv exists (a Podman container)")
    elif env.get("container"):
        container = str(env["container"])[:20]
        evidence.append(f"container={container} in the environment")
    if runtime and not container:
        container = "container"  # gVisor runs containers only
    return Place(container, runtime, tuple(evidence))


def effective_runtime(declared: str, place: Place) -> tuple[str, str]:
    """The runtime that is the boundary and where that comes from: `(runtime, "declared")`,
    `(runtime, "detected")`, or `("", "")`."""
    if declared:
        return declared, "declared"
    if place.runtime:
        return place.runtime, "detected"
    return "", ""


def runtime_mismatch(declared: str, place: Place) -> str:
    """Why a declared runtime cannot be believed here ("" when it can, or cannot be checked):
    gVisor declared on a kernel that is not gVisor's (the runtime class did not apply)."""
    if declared == "gvisor" and not place.runtime:
        return (
            "--runtime-boundary gvisor is declared, but this kernel is not gVisor's "
            f"(/proc/version: {_read(ROOT, '/proc/version').strip()[:60]!r}): the pod's "
            "runtimeClassName did not apply, so gVisor is no boundary here; fix the runtime "
            "class, or drop the flag and run a kernel provider (--provider auto)"
        )
    return ""


def check_runtime(declared: str) -> None:
    """Raise ValueError when the declared runtime is contradicted here (`worker serve`)."""
    mismatch = runtime_mismatch(declared, detect_place())
    if mismatch:
        raise ValueError(mismatch)


def serve_runtime(declared: str) -> tuple[str, str]:
    """`effective_runtime` for this place (`worker serve`, at its start)."""
    return effective_runtime(declared, detect_place())


def serve_provider(requested: str, runtime: str) -> tuple[str, bool]:
    """`choose_inpod` with this place's probe (`worker serve`, at each bind; the probe is a
    real trial start, cached)."""
    return choose_inpod(requested, runtime, requested == "auto" and _auto_works()[0])


def _auto_works() -> tuple[bool, str]:
    from agent_sandbox.providers import AutoProvider

    probe = AutoProvider().probe()
    return probe.available, probe.reason


def choose_inpod(requested: str, runtime: str, auto_works: bool) -> tuple[str, bool]:
    """The provider `worker serve` starts its worker under, and whether that worker may run
    without a kernel boundary of its own (pure).

    A named provider is taken as named (`subprocess` is accepted only with a runtime that is
    a boundary). `auto` is the strongest kernel provider that works here; where none does,
    `subprocess` under a runtime that is a boundary, else `auto` (which the bind then refuses,
    naming what each provider lacks)."""
    if requested != "auto":
        return requested, bool(runtime) and requested == "subprocess"
    if auto_works or not runtime:
        return "auto", False
    return "subprocess", True


@dataclasses.dataclass(frozen=True)
class InPod:
    """Which layer holds a remote worker's code in this place (`inpod_report`)."""

    place: Place
    runtime: str
    runtime_source: str
    requested: str
    provider: str  # the concrete provider a default policy's worker starts under, or ""
    stack: tuple[str, ...]  # the runtime first, then the provider's stack
    boundary: str  # "gvisor+bwrap+landlock+seccomp", "landlock", "none", or "" (cannot start)
    secrets_masked: bool  # the worker cannot read the pod's secret files (a kernel provider)
    error: str = ""  # why no worker could start here
    mismatch: str = ""
    #: `--provider landlock`: only a policy with `visible_names = "accepted"` binds (Landlock
    #: cannot hide names); the report is for such a policy, and says so.
    names_visible: bool = False

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["place"] = dataclasses.asdict(self.place)
        return out

    def lines(self) -> list[str]:
        """The report as text, one fact a line (`worker check`, `doctor`)."""
        out = []
        if self.runtime_source == "declared":
            out.append(f"runtime: {self.runtime} (declared by the operator; it is a boundary)")
        elif self.runtime_source == "detected":
            out.append(f"runtime: {self.runtime} (detected; it is a boundary)")
        else:
            out.append("runtime: none that is a boundary (runc or a plain host)")
        for fact in self.place.evidence:
            out.append(f"  seen: {fact}")
        if self.mismatch:
            out.append(f"  MISMATCH: {self.mismatch}")
        if self.error:
            out.append(
                f"in-pod provider ({self.requested}): a bind of a default policy is refused "
                f"here: {self.error}"
            )
        else:
            out.append(f"in-pod provider ({self.requested}): {self.provider}")
            out.append(f"boundary: {self.boundary} (what every RunResult says)")
            if self.names_visible:
                out.append(
                    "names outside the grants: VISIBLE to the code (Landlock cannot hide "
                    'them): only a policy that says visible_names = "accepted" binds here, '
                    "others are refused; --provider auto takes bwrap or unshare where they work"
                )
            out.append(
                "pod secrets (TLS key, bind secret file): "
                + (
                    "outside the worker's view (its kernel provider; unless the policy "
                    "grants their paths)"
                    if self.secrets_masked
                    else "READABLE by the code (no kernel provider in the pod; "
                    "the runtime holds the node, not the pod's own files)"
                )
            )
        return out


def inpod_report(requested: str = "auto", declared: str = "", place: Place | None = None) -> InPod:
    """What `worker serve --provider REQUESTED [--runtime-boundary DECLARED]` would run here:
    the same decision (`choose_inpod`) and the same resolution (`resolve_boundary`) a bind
    makes, for a default policy."""
    from agent_sandbox._errors import SandboxError
    from agent_sandbox._host.boundary import resolve_boundary
    from agent_sandbox._host.result import NO_BOUNDARY, boundary_name
    from agent_sandbox.policies import Policy
    from agent_sandbox.policies._model import VISIBLE_NAMES_PROVIDERS

    place = detect_place() if place is None else place
    runtime, source = effective_runtime(declared, place)
    works, _why = _auto_works() if requested == "auto" else (False, "")
    name, accept = choose_inpod(requested, runtime, works)
    common = dict(
        place=place,
        runtime=runtime,
        runtime_source=source,
        requested=requested,
        mismatch=runtime_mismatch(declared, place),
    )
    outer: tuple[str, ...] = (runtime,) if runtime else ()
    try:
        # Landlock alone takes only a policy accepting visible names: the report is for one.
        policy = Policy(
            name="inpod-check",
            provider=name,
            no_kernel_boundary="accepted" if accept else "",
            visible_names="accepted" if name in VISIBLE_NAMES_PROVIDERS else "",
        )
        chosen = resolve_boundary(policy, name)
    except (SandboxError, ValueError) as exc:
        return InPod(
            **common,  # type: ignore[arg-type]
            provider="",
            stack=outer,
            boundary="",
            secrets_masked=False,
            error=str(exc).splitlines()[0][:300],
        )
    stack = outer + tuple(chosen.stack)
    name = boundary_name(stack)
    return InPod(
        **common,  # type: ignore[arg-type]
        provider=chosen.provider.name,
        stack=stack,
        boundary=name,
        secrets_masked=chosen.is_kernel and name != NO_BOUNDARY,
        names_visible=chosen.provider.name in VISIBLE_NAMES_PROVIDERS,
    )
