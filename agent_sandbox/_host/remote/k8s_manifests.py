"""Pure builders from a Policy to agent-sandbox manifests: a SandboxTemplate and a SandboxWarmPool.

No cluster, no I/O: the same policy and options always give the same dicts, compared exactly
in tests and printed by `agent-sandbox k8s manifests POLICY`. What they encode:

* the runtime class (`gvisor`, `kata`, or none for runc) and the in-pod provider that goes
  with it: under runc `landlock` for a policy that says `visible_names = "accepted"` (Landlock
  cannot hide names; it takes no other policy), else `auto` (bwrap or unshare where the pod
  allows user namespaces; elsewhere the bind is refused, naming why, never Landlock alone
  accepted on the policy's behalf); `auto` with `--runtime-boundary` under gVisor/Kata: the
  strongest kernel provider that works in the pod, else `subprocess`, the runtime holding;
* resources from the policy's limits (`memory_mb` plus the pod's own overhead, `cpu_cores`),
  and the scratch `emptyDir` sized by `scratch_mb` on a read-only root filesystem;
* an egress NetworkPolicy from the policy's `[[net.rules]]`: allow-only, addresses only. A
  rule the NetworkPolicy cannot hold (a host *name*, a `deny`) refuses the build with the rule
  and the alternative, never a silently wider or narrower policy;
* the hop: `router` (default) serves plain HTTP, as both upstream routers dial pods; `direct`
  serves TLS (optionally mTLS) to agents that dial pod IPs (docs/scale-out.md, "Trust");
* ingress only from the router's namespace and labels (default `agent-sandbox-system`,
  `app=sandbox-router`, the controller's own default); a TCP readiness probe; `restartPolicy:
  Never` (the worker's exit ends the Sandbox); non-root; no service-account token; claims may
  not inject env (it would force cold starts, and the session's secrets come through
  `/v1/bind`).
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any

from agent_sandbox.policies import Policy

__all__ = [
    "ManifestError",
    "check_inputs",
    "manifests",
    "sandbox_template",
    "sandbox_warm_pool",
    "template_name",
]

GROUP = "extensions.agents.x-k8s.io/v1beta1"
#: What the pod needs besides the worker: `worker serve` and its interpreter.
OVERHEAD_MB = 256
RUNTIMES = {"": "", "runc": "", "gvisor": "gvisor", "kata": "kata"}
HOPS = ("router", "direct")
#: Where the agent-sandbox controller's default NetworkPolicy and the upstream router
#: manifests put the router.
ROUTER_NAMESPACE = "agent-sandbox-system"
ROUTER_LABELS = {"app": "sandbox-router"}


class ManifestError(ValueError):
    """The policy cannot be expressed in the manifests; the message names the rule and the fix."""


def template_name(policy: Policy) -> str:
    """`ags-<policy name>-<fingerprint[:8]>`, as a DNS-1123 label."""
    base = "".join(c if c.isalnum() else "-" for c in policy.name.lower()).strip("-")[:40]
    return f"ags-{base or 'policy'}-{policy.fingerprint()[:8]}"


def _ports(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        out.append((int(first), int(last or first)))
    return out


def _egress(policy: Policy) -> list[dict[str, Any]]:
    rules = []
    for i, rule in enumerate(policy.net.rules):
        where = f"[[net.rules]] #{i + 1} ({rule.action} {rule.host} {rule.ports})"
        if rule.direction == "bind":
            continue  # listening inside the pod: enforced there; ingress is the router's only
        if rule.action == "deny":
            raise ManifestError(
                f"{where}: a NetworkPolicy only allows; drop the deny rule and narrow the "
                "allow rules around it, or keep this policy on a local provider"
            )
        try:
            network = ipaddress.ip_network(rule.host, strict=False)
        except ValueError:
            raise ManifestError(
                f"{where}: a NetworkPolicy matches addresses, not host names; give the host "
                "as an IP address or CIDR (the names it resolves to today would go stale)"
            ) from None
        protocols = ["TCP", "UDP"] if rule.protocol == "any" else [rule.protocol.upper()]
        ports: list[dict[str, Any]] = []
        for proto in protocols:
            for first, last in _ports(rule.ports):
                if (first, last) == (1, 65535):
                    ports.append({"protocol": proto})
                elif first == last:
                    ports.append({"protocol": proto, "port": first})
                else:
                    ports.append({"protocol": proto, "port": first, "endPort": last})
        rules.append({"to": [{"ipBlock": {"cidr": str(network)}}], "ports": ports})
    return rules


def _ingress_peer(namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """The pods allowed to dial the workers: `labels` in namespace `namespace` (both must
    match: one peer with both selectors, as the controller's own default policy has)."""
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": dict(labels)},
    }


def sandbox_template(
    policy: Policy,
    *,
    image: str,
    namespace: str = "default",
    runtime: str = "",
    port: int = 8888,
    hop: str = "router",
    tls_secret: str = "ags-worker-tls",
    bind_secret: str = "ags-bind-secret",
    mtls: bool = False,
    idle_exit: float = 900.0,
    router_namespace: str = ROUTER_NAMESPACE,
    router_labels: dict[str, str] | None = None,
    name: str = "",
) -> dict[str, Any]:
    """The SandboxTemplate for `policy`'s workers (see the module docstring); `name` (also
    the warm pool's, the `[remote] pool`): default `template_name(policy)`.

    `hop="router"` (the default): the pods serve plain HTTP, as the upstream routers dial
    them (`http://<pod>:<port>`), and admit only `router_labels` pods of `router_namespace`;
    `hop="direct"`: the pods serve TLS (and mTLS with `mtls`) to agents inside the cluster
    that dial their IPs, and admit only the pods `router_labels` / `router_namespace` name
    (the agents'). Either way the bind secret and the per-claim token guard every route."""
    if runtime not in RUNTIMES:
        raise ManifestError(f"runtime {runtime!r}: expected one of gvisor, kata, runc")
    if hop not in HOPS:
        raise ManifestError(f"hop {hop!r}: expected router or direct")
    if mtls and hop != "direct":
        raise ManifestError(
            "--mtls needs --hop direct: the agent-sandbox routers dial pods in plain HTTP and "
            "present no client certificate (their own TLS and mTLS face the agents)"
        )
    runtime_class = RUNTIMES[runtime]
    if runtime_class:
        # The strongest kernel provider that works inside this runtime (a trial start at
        # the pod's start), `subprocess` only where none does (`_host/placement.py`).
        inner = ["--provider", "auto", "--runtime-boundary", runtime_class]
    elif policy.visible_names == "accepted":
        inner = ["--provider", "landlock"]  # the policy accepts what Landlock cannot hide
    else:
        # Landlock alone would refuse this policy (it cannot hide names): the strongest
        # provider that works in the pod, a view where user namespaces work, else a refusal.
        inner = ["--provider", "auto"]
    if hop == "router":
        transport = ["--plaintext", "accepted"]
    else:
        transport = ["--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key"]
        transport += ["--client-ca", "/tls/ca.crt"] if mtls else []
    args = [
        "worker",
        "serve",
        "--listen",
        f"tcp://0.0.0.0:{port}",
        *transport,
        "--bind-secret-file",
        "/bind/secret",
        *inner,
        "--idle-exit",
        f"{idle_exit:g}",
    ]
    limits = policy.limits
    memory = f"{limits.memory_mb + OVERHEAD_MB}Mi"
    cpu = f"{round(limits.cpu_cores * 1000)}m"
    mounts = [{"name": "bind", "mountPath": "/bind", "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "bind", "secret": {"secretName": bind_secret}}]
    if hop == "direct":
        mounts.insert(0, {"name": "tls", "mountPath": "/tls", "readOnly": True})
        volumes.insert(0, {"name": "tls", "secret": {"secretName": tls_secret}})
    mounts.append({"name": "scratch", "mountPath": "/tmp"})
    volumes.append({"name": "scratch", "emptyDir": {"sizeLimit": f"{limits.scratch_mb}Mi"}})
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # `worker serve` exits when its session ends (idle, shutdown, its worker's death):
        # the pod then ends (Succeeded), the Sandbox is Finished and the claim's lifecycle
        # reaps it; never restarted unbound in the same pod.
        "restartPolicy": "Never",
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "worker",
                "image": image,
                "args": args,
                "ports": [{"containerPort": port, "name": "worker", "protocol": "TCP"}],
                # A TCP probe: the kubelet can make it under every option (TLS, mTLS, plain)
                # and it carries nothing; the port opens once `worker serve` is ready.
                "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
                "resources": {
                    "requests": {"cpu": cpu, "memory": memory},
                    "limits": {"cpu": cpu, "memory": memory},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if runtime_class:
        pod_spec = {"runtimeClassName": runtime_class, **pod_spec}
    peer = _ingress_peer(router_namespace, router_labels or dict(ROUTER_LABELS))
    return {
        "apiVersion": GROUP,
        "kind": "SandboxTemplate",
        "metadata": {
            "name": name or template_name(policy),
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/managed-by": "agent-sandbox-kit",
                "agent-sandbox-kit/policy-fingerprint": policy.fingerprint(),
            },
        },
        "spec": {
            "envVarsInjectionPolicy": "Disallowed",
            "networkPolicyManagement": "Managed",
            "networkPolicy": {
                "ingress": [{"from": [peer], "ports": [{"protocol": "TCP", "port": port}]}],
                "egress": _egress(policy),
            },
            "podTemplate": {"spec": pod_spec},
        },
    }


def sandbox_warm_pool(template: dict[str, Any], *, replicas: int = 2) -> dict[str, Any]:
    """The SandboxWarmPool of `replicas` ready pods from `template`."""
    meta = template["metadata"]
    return {
        "apiVersion": GROUP,
        "kind": "SandboxWarmPool",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": meta["labels"],
        },
        "spec": {
            "replicas": replicas,
            "sandboxTemplateRef": {"name": meta["name"]},
            "updateStrategy": {"type": "Recreate"},
        },
    }


def manifests(policy: Policy, *, replicas: int = 2, **template: Any) -> list[dict[str, Any]]:
    """[SandboxTemplate, SandboxWarmPool] for `policy`."""
    built = sandbox_template(policy, **template)
    return [built, sandbox_warm_pool(built, replicas=replicas)]


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
#: An image reference (the distribution grammar, simplified): [host[:port]/]path[:tag][@digest].
_IMAGE = re.compile(
    r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
    r"(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?"
)


def _dns_label(what: str, value: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
        raise ManifestError(
            f"{what} {value!r}: must be a DNS label (at most 63 characters: lower-case "
            "letters, digits and '-', starting and ending with a letter or digit)"
        )
    return value


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        prefix, _, name = key.rpartition("/")
        if (
            not sep
            or not name
            or len(name) > 63
            or not _LABEL_NAME.fullmatch(name)
            or (prefix and (len(prefix) > 253 or not _LABEL_PREFIX.fullmatch(prefix)))
            or len(value) > 63
            or (value and not _LABEL_NAME.fullmatch(value))
        ):
            raise ManifestError(
                f"--router-labels {item.strip()!r}: expected KEY=VALUE with a Kubernetes label "
                "key ([prefix/]name, name at most 63 characters) and value (at most 63 "
                "characters: letters, digits, '-', '_', '.')"
            )
        out[key] = value
    return out


def check_inputs(
    *,
    image: str,
    namespace: str,
    runtime: str | None,
    replicas: str | int,
    hop: str = "router",
    mtls: bool = False,
    router_namespace: str = ROUTER_NAMESPACE,
    router_labels: str = "app=sandbox-router",
    idle_exit: str | float = 900.0,
    pool: str = "",
) -> dict[str, Any]:
    """The manifest options from the command line, checked as the API server would check
    what they become (ManifestError naming the input and the rule); the keyword arguments
    of `manifests()`."""
    if runtime is None:
        raise ManifestError(
            "--runtime is required: gvisor or kata (the runtime is the kernel boundary), or "
            "runc (Landlock inside the pod); the RuntimeClass must exist on the cluster "
            "(kubectl get runtimeclass), or no pod of the pool will start"
        )
    if runtime not in ("gvisor", "kata", "runc"):
        raise ManifestError(f"--runtime {runtime!r}: expected gvisor, kata or runc")
    if image != image.strip() or not image or not _IMAGE.fullmatch(image):
        raise ManifestError(
            f"--image {image!r}: expected an image reference such as "
            "registry.example/agent-sandbox-worker:0.1.0 (no spaces, lower-case path)"
        )
    try:
        count = int(replicas)
    except ValueError:
        raise ManifestError(f"--replicas {replicas!r}: expected a whole number") from None
    if not 0 <= count <= 1000:
        raise ManifestError(f"--replicas {count}: expected 0 to 1000 warm pods")
    if hop not in HOPS:
        raise ManifestError(f"--hop {hop!r}: expected router or direct")
    try:
        idle = float(idle_exit)
    except ValueError:
        raise ManifestError(f"--idle-exit {idle_exit!r}: expected seconds") from None
    if not math.isfinite(idle) or not 0 < idle <= 7 * 86400:
        raise ManifestError(f"--idle-exit {idle_exit!r}: expected 0 < seconds <= 604800")
    return {
        "image": image,
        "namespace": _dns_label("--namespace", namespace),
        "runtime": runtime,
        "replicas": count,
        "hop": hop,
        "mtls": mtls,
        "router_namespace": _dns_label("--router-namespace", router_namespace),
        "router_labels": _labels(router_labels),
        "idle_exit": idle,
        "name": _dns_label("--pool", pool) if pool else "",
    }
