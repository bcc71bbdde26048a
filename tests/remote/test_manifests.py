"""The pure builders Policy -> SandboxTemplate / SandboxWarmPool, compared exactly, and the
`agent-sandbox k8s manifests` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent_sandbox import Policy
from agent_sandbox._host.remote.k8s_manifests import ManifestError, manifests, template_name


def _policy(**changes: object) -> Policy:
    base: dict[str, object] = {
        "name": "Net_Small.v2",
        "limits": {"memory_mb": 512, "cpu_cores": 0.5, "scratch_mb": 64},
        "net": {
            "rules": [
                {"host": "10.1.2.0/24", "ports": "443"},
                {"host": "192.0.2.7", "ports": "8000-8100,53", "protocol": "any"},
                {"host": "127.0.0.1", "ports": "9000", "direction": "bind"},
            ]
        },
    }
    base.update(changes)
    return Policy(**base)  # type: ignore[arg-type]


def test_the_template_and_pool_are_exactly_these() -> None:
    policy = _policy()
    template, pool = manifests(
        policy, image="registry.example/ags:0.1", namespace="agents", runtime="runc", replicas=3
    )
    name = template_name(policy)
    assert name == f"ags-net-small-v2-{policy.fingerprint()[:8]}"
    labels = {
        "app.kubernetes.io/managed-by": "agent-sandbox-kit",
        "agent-sandbox-kit/policy-fingerprint": policy.fingerprint(),
    }
    assert template == {
        "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
        "kind": "SandboxTemplate",
        "metadata": {"name": name, "namespace": "agents", "labels": labels},
        "spec": {
            "envVarsInjectionPolicy": "Disallowed",
            "networkPolicyManagement": "Managed",
            "networkPolicy": {
                "ingress": [
                    {
                        "from": [
                            {
                                "namespaceSelector": {
                                    "matchLabels": {
                                        "kubernetes.io/metadata.name": "agent-sandbox-system"
                                    }
                                },
                                "podSelector": {"matchLabels": {"app": "sandbox-router"}},
                            }
                        ],
                        "ports": [{"protocol": "TCP", "port": 8888}],
                    }
                ],
                "egress": [
                    {
                        "to": [{"ipBlock": {"cidr": "10.1.2.0/24"}}],
                        "ports": [{"protocol": "TCP", "port": 443}],
                    },
                    {
                        "to": [{"ipBlock": {"cidr": "192.0.2.7/32"}}],
                        "ports": [
                            {"protocol": "TCP", "port": 8000, "endPort": 8100},
                            {"protocol": "TCP", "port": 53},
                            {"protocol": "UDP", "port": 8000, "endPort": 8100},
                            {"protocol": "UDP", "port": 53},
                        ],
                    },
                ],
            },
            "podTemplate": {
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
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
                            "image": "registry.example/ags:0.1",
                            "args": [
                                "worker",
                                "serve",
                                "--listen",
                                "tcp://0.0.0.0:8888",
                                "--plaintext",
                                "accepted",
                                "--bind-secret-file",
                                "/bind/secret",
                                "--provider",
                                "auto",
                                "--idle-exit",
                                "900",
                            ],
                            "ports": [{"containerPort": 8888, "name": "worker", "protocol": "TCP"}],
                            "readinessProbe": {"tcpSocket": {"port": 8888}, "periodSeconds": 2},
                            "resources": {
                                "requests": {"cpu": "500m", "memory": "768Mi"},
                                "limits": {"cpu": "500m", "memory": "768Mi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [
                                {"name": "bind", "mountPath": "/bind", "readOnly": True},
                                {"name": "scratch", "mountPath": "/tmp"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "bind", "secret": {"secretName": "ags-bind-secret"}},
                        {"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                }
            },
        },
    }
    assert pool == {
        "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
        "kind": "SandboxWarmPool",
        "metadata": {"name": name, "namespace": "agents", "labels": labels},
        "spec": {
            "replicas": 3,
            "sandboxTemplateRef": {"name": name},
            "updateStrategy": {"type": "Recreate"},
        },
    }


def test_runc_runs_landlock_only_for_a_policy_that_accepts_visible_names() -> None:
    """Under runc the in-pod provider is `landlock` only for a policy that says
    `visible_names = "accepted"` (Landlock cannot hide names, and the manifests never accept
    that for the policy); any other policy gets `auto`, which takes bwrap or unshare where the
    pod allows user namespaces and otherwise refuses the bind, naming why."""
    for accepted, provider in (("accepted", "landlock"), ("", "auto")):
        template, _ = manifests(_policy(visible_names=accepted), image="i", runtime="runc")
        spec = template["spec"]["podTemplate"]["spec"]
        assert "runtimeClassName" not in spec
        args = spec["containers"][0]["args"]
        assert args[args.index("--provider") + 1] == provider, accepted
        assert "--runtime-boundary" not in args


def test_gvisor_runs_the_strongest_provider_inside_and_declares_the_runtime() -> None:
    """Under gVisor the in-pod provider is `auto` (a probe at the pod's start picks what
    works there, `subprocess` only where nothing does), never a fixed `subprocess`."""
    template, _ = manifests(_policy(), image="i", runtime="gvisor", hop="direct", mtls=True)
    spec = template["spec"]["podTemplate"]["spec"]
    assert spec["runtimeClassName"] == "gvisor"
    args = spec["containers"][0]["args"]
    assert args[args.index("--provider") + 1] == "auto"
    assert args[args.index("--runtime-boundary") + 1] == "gvisor"
    assert args[args.index("--client-ca") + 1] == "/tls/ca.crt"


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ({"host": "api.example.com", "ports": "443"}, "not host names"),
        ({"host": "10.0.0.0/8", "action": "deny"}, "only allows"),
    ],
)
def test_rules_a_networkpolicy_cannot_hold_refuse_the_build(
    rule: dict[str, str], words: str
) -> None:
    with pytest.raises(ManifestError, match=words) as info:
        manifests(_policy(net={"rules": [rule]}), image="i")
    assert "[[net.rules]] #1" in str(info.value)


def test_the_pod_spec_deserializes_as_a_kubernetes_podspec() -> None:
    client = pytest.importorskip("kubernetes.client")
    template, _ = manifests(_policy(), image="i", runtime="kata")
    spec = client.ApiClient()._ApiClient__deserialize(  # the client's own model check
        template["spec"]["podTemplate"]["spec"], "V1PodSpec"
    )
    assert spec.runtime_class_name == "kata"
    assert spec.containers[0].security_context.read_only_root_filesystem is True


def test_the_command_prints_the_same_manifests() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_sandbox",
            "k8s",
            "manifests",
            "data-analysis",
            "--image",
            "reg/ags:1",
            "--format",
            "json",
            "--runtime",
            "runc",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    from agent_sandbox.policies import resolve_policy

    expected = manifests(resolve_policy("data-analysis"), image="reg/ags:1", runtime="runc")
    assert json.loads(out)["items"] == expected


def test_the_worker_image_runs_what_the_template_expects() -> None:
    """deploy/worker.Dockerfile (never built here): its user is the template's `runAsUser`,
    its entry point plus default command parse as a `worker serve` command line, and the
    template's own args parse too (flags renamed on one side and not the other fail here)."""
    import re
    from pathlib import Path

    from agent_sandbox._tools.cli import build_parser

    text = (Path(__file__).resolve().parents[2] / "deploy" / "worker.Dockerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    template, _ = manifests(_policy(), image="i", runtime="gvisor")
    pod = template["spec"]["podTemplate"]["spec"]
    assert user is not None
    assert int(user.group(1)) == pod["securityContext"]["runAsUser"]
    assert int(user.group(2)) == pod["securityContext"]["runAsGroup"]
    assert re.search(r'^ENTRYPOINT \["agent-sandbox"\]$', text, re.M)
    cmd = re.search(r"^CMD (\[.*?\])$", text, re.M | re.S)
    assert cmd is not None
    argv = json.loads(cmd.group(1).replace("\\\n", ""))
    parser = build_parser()
    for args in (argv, pod["containers"][0]["args"]):
        parsed = parser.parse_args(args)
        assert parsed.worker_command == "serve" and parsed.bind_secret_file == "/bind/secret"
    assert "bubblewrap" in text  # `auto`'s first candidate, under gVisor and Kata


def test_the_worker_image_builds_its_wheel_inside() -> None:
    """deploy/worker.Dockerfile is multi-stage: the wheel (with its C extensions, checked)
    is built in the image for the image's platform and Python, and the runtime stage takes
    it from there; nothing built outside (a `dist/` of the builder's platform) is copied."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "deploy" / "worker.Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", text, re.M)
    assert stages == [("python:3.11-slim-bookworm", "build"), ("python:3.11-slim-bookworm", "")]
    build, runtime = text.split("\nFROM python:3.11-slim-bookworm\n")
    assert "pip wheel" in build and "the wheel lacks its C extensions" in build
    assert "COPY --from=build /dist/" in runtime and "COPY dist/" not in text
    assert "gcc" not in runtime  # no compiler in the image that runs
    ignored = (root / ".dockerignore").read_text().split()
    assert {".venv", "build", "dist", "**/*.so"} <= set(ignored)


@pytest.mark.parametrize("runtime", ["runc", "gvisor", "kata"])
def test_the_pod_and_network_rules_validate_against_the_kubernetes_schema(runtime: str) -> None:
    """The template's pod spec as a v1 Pod and its network rules as a NetworkPolicy spec,
    against the Kubernetes OpenAPI schema (`kubernetes-validate`, strict: unknown fields
    fail). The CRDs themselves (SandboxTemplate, SandboxWarmPool) are not in that schema."""
    kv = pytest.importorskip("kubernetes_validate")
    template, _ = manifests(_policy(), image="i", runtime=runtime, hop="direct", mtls=True)
    version = kv.latest_version()
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "worker"},
        "spec": template["spec"]["podTemplate"]["spec"],
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "worker"},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress", "Egress"],
            **template["spec"]["networkPolicy"],
        },
    }
    kv.validate(pod, version, strict=True)
    kv.validate(policy, version, strict=True)
    typo = {**pod, "spec": {**pod["spec"], "automountServiceAccountTokn": False}}
    with pytest.raises(kv.ValidationError):  # the check can fail
        kv.validate(typo, version, strict=True)


def test_the_direct_hop_serves_tls_and_mtls_with_the_same_probe() -> None:
    """`hop="direct"`: TLS files and (with `mtls`) the client CA; the readiness probe is the
    same TCP probe (the kubelet presents no client certificate, so an HTTPS probe would never
    pass under mTLS); the router hop refuses `mtls` (the routers present none either)."""
    template, _ = manifests(_policy(), image="i", runtime="runc", hop="direct", mtls=True)
    spec = template["spec"]["podTemplate"]["spec"]
    container = spec["containers"][0]
    args = container["args"]
    assert args[args.index("--tls-cert") + 1] == "/tls/tls.crt"
    assert args[args.index("--client-ca") + 1] == "/tls/ca.crt"
    assert "--plaintext" not in args
    assert container["readinessProbe"] == {"tcpSocket": {"port": 8888}, "periodSeconds": 2}
    assert {"name": "tls", "secret": {"secretName": "ags-worker-tls"}} in spec["volumes"]
    assert spec["restartPolicy"] == "Never"
    with pytest.raises(ManifestError, match="--mtls needs --hop direct"):
        manifests(_policy(), image="i", runtime="runc", mtls=True)


def test_the_router_peer_is_selectable() -> None:
    template, _ = manifests(
        _policy(), image="i", router_namespace="edge", router_labels={"role": "gw"}
    )
    (rule,) = template["spec"]["networkPolicy"]["ingress"]
    assert rule["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "edge"}},
            "podSelector": {"matchLabels": {"role": "gw"}},
        }
    ]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "agent_sandbox", "k8s", "manifests", "data-analysis"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, check=False)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--image", "reg/ags:1", "--runtime", "runc", "--replicas", "-1"], "--replicas -1"),
        (["--image", "reg/ags:1", "--runtime", "runc", "--replicas", "x"], "whole number"),
        (["--image", "", "--runtime", "runc"], "--image ''"),
        (["--image", "Reg/A B", "--runtime", "runc"], "image reference"),
        (["--image", "reg/ags:1", "--runtime", "runc", "--namespace", "Team_A"], "DNS label"),
        (["--image", "reg/ags:1", "--runtime", "runc", "--namespace", "a" * 64], "DNS label"),
        (["--image", "reg/ags:1"], "--runtime is required"),
        (["--image", "reg/ags:1", "--runtime", "docker"], "gvisor, kata or runc"),
        (["--image", "reg/ags:1", "--runtime", "runc", "--router-labels", "a b"], "KEY=VALUE"),
        (["--image", "reg/ags:1", "--runtime", "runc", "--idle-exit", "0"], "--idle-exit"),
        (["--image", "reg/ags:1", "--runtime", "runc", "--hop", "tunnel"], "router or direct"),
    ],
)
def test_inputs_the_api_server_would_reject_exit_64_with_the_reason(
    args: list[str], reason: str
) -> None:
    done = _cli(*args, "--format", "json")
    assert done.returncode == 64, done.stderr
    assert reason in done.stderr and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1
