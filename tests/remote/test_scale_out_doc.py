"""docs/scale-out.md's walkthrough, executed from the page's own text: the `k8s manifests`
command of step 3 as written (its pool and namespace must be those of the `[remote]` table in
"Using it"), then pods from the template it prints (with `--runtime runc` for `gvisor`: there
is no gVisor here) behind the upstream router's stand-in and a fake API server for the SDK,
and the page's policy (its secrets' paths and router URL pointed at the test's) running
`Sandbox` calls on them. Not run: the image build, kubectl, a real cluster."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("k8s_agent_sandbox")
pytest.importorskip("yaml")

import yaml  # type: ignore[import-untyped]

from agent_sandbox import Sandbox

from .conftest import BIND_SECRET, SESSION_KEY, Certs
from .fake_k8s import FakeKube
from .template_pods import Pod, start_pod
from .upstream_router import UpstreamRouter

DOC = Path(__file__).resolve().parents[2] / "docs" / "scale-out.md"


def _doc() -> str:
    return DOC.read_text()


def _policy_toml(text: str) -> str:
    section = text[text.index("## Using it") :]
    match = re.search(r"```toml\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def _manifests_command(text: str) -> list[str]:
    section = text[text.index("## Walkthrough on a cluster") : text.index("## Manifests")]
    match = re.search(r"^ *(agent-sandbox k8s manifests .*?)$\n(?!.*\\$)", section, re.M | re.S)
    assert match is not None
    lines = []
    for line in section[match.start() :].splitlines():
        lines.append(line.strip().rstrip("\\"))
        if not line.rstrip().endswith("\\"):
            break
    argv = shlex.split(" ".join(lines))
    return argv[: argv.index(">")] if ">" in argv else argv


def _run(argv: list[str]) -> tuple[list[dict[str, object]], str]:
    assert argv[:3] == ["agent-sandbox", "k8s", "manifests"], argv
    done = subprocess.run(
        [sys.executable, "-m", "agent_sandbox", *argv[1:]],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return list(yaml.safe_load_all(done.stdout)), done.stderr


def test_the_walkthroughs_pool_is_the_one_the_policy_names() -> None:
    """The pool name mismatch the walkthrough once had (`ags-data-analysis` in the policy,
    `ags-data-analysis-<fingerprint>` from the tool) cannot come back unnoticed."""
    text = _doc()
    remote = tomllib.loads(_policy_toml(text))["remote"]
    docs, stderr = _run(_manifests_command(text))
    _template, pool = docs
    assert pool["kind"] == "SandboxWarmPool"
    assert pool["metadata"]["name"] == remote["pool"]  # type: ignore[index]
    assert pool["metadata"]["namespace"] == remote["namespace"]  # type: ignore[index]
    assert f'[remote] pool = "{remote["pool"]}"' in stderr
    # The step's own words about what it prints.
    assert f"SandboxWarmPool {remote['namespace']}/{remote['pool']}" in text


def test_the_walkthrough_runs_against_the_router_and_template_pods(
    certs: Certs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _doc()
    argv = _manifests_command(text)
    argv[argv.index("--runtime") + 1] = "runc"  # no gVisor here
    (template, _pool), _ = _run(argv)
    namespace = template["metadata"]["namespace"]  # type: ignore[index]
    pods: list[Pod] = []
    with UpstreamRouter(certs.server, token="doc-router-token") as router:

        def new_pod() -> tuple[str, str, int]:
            name, ip = f"doc-pod-{len(pods)}", f"198.51.100.{50 + len(pods)}"
            pod = start_pod(template, name, bind_secret=BIND_SECRET, ip=ip)  # type: ignore[arg-type]
            pods.append(pod)
            router.network[f"{ip}:8888"] = ("127.0.0.1", pod.port)
            return name, ip, 8888

        try:
            with FakeKube([new_pod()], namespace=namespace, factory=new_pod) as kube:  # type: ignore[arg-type]
                kubeconfig = tmp_path / "kubeconfig"
                kubeconfig.write_text(
                    "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
                    f"clusters: [{{name: t, cluster: {{server: '{kube.url}'}}}}]\n"
                    "users: [{name: t, user: {}}]\n"
                    "contexts: [{name: t, context: {cluster: t, user: t}}]\n"
                )
                from kubernetes.config import kube_config

                monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
                monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
                files = {
                    "router_token_file": b"doc-router-token",
                    "session_key_file": SESSION_KEY,
                    "bind_secret_file": BIND_SECRET.encode(),
                }
                policy = _policy_toml(text)
                for key, content in files.items():
                    path = tmp_path / key
                    path.write_bytes(content)
                    policy = re.sub(rf'^{key} = ".*?"', f'{key} = "{path}"', policy, flags=re.M)
                policy = re.sub(r'^ca_file = ".*?"', f'ca_file = "{certs.ca}"', policy, flags=re.M)
                policy = re.sub(
                    r'^router_url = ".*?"', f'router_url = "{router.url}"', policy, flags=re.M
                )
                policy_file = tmp_path / "data-analysis-remote.toml"
                policy_file.write_text(policy)
                with Sandbox(str(policy_file)) as sandbox:
                    session = sandbox.session("conversation-42")
                    session.run("import math\nr = math.pi")
                    result = session.run("r")
                    assert abs(result.value - 3.14159) < 1e-4
                    assert result.provider == "remote" and "landlock" in result.stack
                    session.close()
                assert (
                    kube.created_bodies[0]["spec"]["warmPoolRef"]["name"]
                    == _pool["metadata"]["name"]
                )  # type: ignore[index]
        finally:
            for pod in pods:
                pod.stop()
