"""Pure builders from a Policy to agent-sandbox manifests: a SandboxTemplate and a SandboxWarmPool.

No cluster, no I/O: the same policy and options always give the same dicts, compared exactly
in tests and printed by `agent-sandbox k8s manifests POLICY`. What they encode:

* the runtime class (`gvisor`, `kata`, or none for runc) and the in-pod provider that goes
  with it (`landlock` under runc; `auto` with `--runtime-boundary` under gVisor/Kata: the
  strongest kernel provider that works in the pod, else `subprocess`, the runtime holding);
* resources from the policy's limits (`memory_mb` plus the pod's own overhead, `cpu_cores`),
  and the scratch `emptyDir` sized by `scratch_mb` on a read-only root filesystem;
* an egress NetworkPolicy from the policy's `[[net.rules]]`: allow-only, addresses only. A
  rule the NetworkPolicy cannot hold (a host *name*, a `deny`) refuses the build with the rule
  and the alternative, never a silently wider or narrower policy;
* ingress only from the router; non-root; no service-account token; claims may not inject
  env (it would force cold starts, and the session's secrets come through `/v1/bind`).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from agent_sandbox.policies import Policy

__all__ = ["ManifestError", "manifests", "sandbox_template", "sandbox_warm_pool", "template_name"]

GROUP = "extensions.agents.x-k8s.io/v1beta1"
#: What the pod needs besides the worker: `worker serve` and its interpreter.
OVERHEAD_MB = 256
RUNTIMES = {"": "", "runc": "", "gvisor": "gvisor", "kata": "kata"}


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


def sandbox_template(
    policy: Policy,
    *,
    image: str,
    namespace: str = "default",
    runtime: str = "",
    port: int = 8888,
    tls_secret: str = "ags-worker-tls",
    bind_secret: str = "ags-bind-secret",
    mtls: bool = False,
    idle_exit: float = 900.0,
    router_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The SandboxTemplate for `policy`'s workers (see the module docstring)."""
    if runtime not in RUNTIMES:
        raise ManifestError(f"runtime {runtime!r}: expected one of gvisor, kata, runc")
    runtime_class = RUNTIMES[runtime]
    if runtime_class:
        # The strongest kernel provider that works inside this runtime (a trial start at
        # the pod's start), `subprocess` only where none does (`_host/placement.py`).
        inner = ["--provider", "auto", "--runtime-boundary", runtime_class]
    else:
        inner = ["--provider", "landlock"]
    args = [
        "worker",
        "serve",
        "--listen",
        f"tcp://0.0.0.0:{port}",
        "--tls-cert",
        "/tls/tls.crt",
        "--tls-key",
        "/tls/tls.key",
        *(["--client-ca", "/tls/ca.crt"] if mtls else []),
        "--bind-secret-file",
        "/bind/secret",
        *inner,
        "--idle-exit",
        f"{idle_exit:g}",
    ]
    limits = policy.limits
    memory = f"{limits.memory_mb + OVERHEAD_MB}Mi"
    cpu = f"{round(limits.cpu_cores * 1000)}m"
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
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
                "readinessProbe": {
                    "httpGet": {"path": "/healthz", "port": port, "scheme": "HTTPS"},
                    "periodSeconds": 2,
                },
                "resources": {
                    "requests": {"cpu": cpu, "memory": memory},
                    "limits": {"cpu": cpu, "memory": memory},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [
                    {"name": "tls", "mountPath": "/tls", "readOnly": True},
                    {"name": "bind", "mountPath": "/bind", "readOnly": True},
                    {"name": "scratch", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [
            {"name": "tls", "secret": {"secretName": tls_secret}},
            {"name": "bind", "secret": {"secretName": bind_secret}},
            {"name": "scratch", "emptyDir": {"sizeLimit": f"{limits.scratch_mb}Mi"}},
        ],
    }
    if runtime_class:
        pod_spec = {"runtimeClassName": runtime_class, **pod_spec}
    return {
        "apiVersion": GROUP,
        "kind": "SandboxTemplate",
        "metadata": {
            "name": template_name(policy),
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
                "ingress": [
                    {
                        "from": [
                            {
                                "podSelector": {
                                    "matchLabels": router_labels or {"app": "sandbox-router"}
                                }
                            }
                        ],
                        "ports": [{"protocol": "TCP", "port": port}],
                    }
                ],
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
