"""Pods for tests, started from a generated SandboxTemplate as the kubelet would start them.

`start_pod(template, ...)` reads the template's container (`k8s manifests`' output, not a
command line written again here): the image's entry point (`ENTRYPOINT` of
deploy/worker.Dockerfile, `agent-sandbox` = this interpreter's `-m agent_sandbox`), the
container's `args` and `env`, its secret volumes (materialised in a temporary directory with
the Secrets' keys: `secret` for the bind secret, `tls.crt` / `tls.key` / `ca.crt` for TLS) and
its `emptyDir` at /tmp (`TMPDIR`). The only rewrites are mechanical: a mount path becomes the
directory standing for it, and the port of `--listen tcp://0.0.0.0:8888` becomes 0 (tests run
side by side); the address stays `0.0.0.0`. Each pod gets a Pod IP of its own from
198.51.100.0/24 (a documentation range), which the test's pod network
(`UpstreamRouter.network`) carries to the pod's loopback port: tests reach no other address,
and the upstream router refuses loopback Pod IPs.

What the kubelet does and this does not: the runtime class, the read-only root, the user,
resources; `restartPolicy` is the template's (`Never`: an exited pod is not restarted here
either).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "worker.Dockerfile"


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT, as this interpreter runs it."""
    match = re.search(r"^ENTRYPOINT (\[.*?\])$", DOCKERFILE.read_text(), re.M)
    assert match is not None, "deploy/worker.Dockerfile has no ENTRYPOINT"
    argv = json.loads(match.group(1))
    assert argv == ["agent-sandbox"], argv  # the console script of this package
    return [sys.executable, "-m", "agent_sandbox"]


@dataclasses.dataclass
class Pod:
    name: str
    proc: subprocess.Popen[bytes]
    ip: str  # its Pod IP
    port: int  # where it listens on this machine
    root: str
    argv: list[str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.root, ignore_errors=True)


def start_pod(
    template: dict[str, Any],
    name: str,
    *,
    bind_secret: str,
    tls: dict[str, str] | None = None,
    ip: str,
) -> Pod:
    """Start the template's container as a process; `tls`: Secret key -> PEM file."""
    spec = template["spec"]["podTemplate"]["spec"]
    assert spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    root = tempfile.mkdtemp(prefix="agent-sandbox-pod-")
    paths: dict[str, str] = {}
    env_tmp = ""
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        local = os.path.join(root, mount["name"])
        os.makedirs(local, mode=0o700)
        paths[mount["mountPath"]] = local
        if "secret" in volume:
            if volume["secret"]["secretName"] == "ags-bind-secret":
                Path(local, "secret").write_text(bind_secret)
            else:
                assert tls is not None, "the template mounts TLS files: pass tls="
                for key, pem in tls.items():
                    shutil.copyfile(pem, os.path.join(local, key))
        elif mount["mountPath"] == "/tmp":
            env_tmp = local
    args: list[str] = []
    for arg in container["args"]:
        for mount_path, local in paths.items():
            if arg.startswith(mount_path + "/"):
                arg = local + arg[len(mount_path) :]
                break
        if arg.startswith("tcp://0.0.0.0:"):
            arg = "tcp://0.0.0.0:0"
        args.append(arg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_SANDBOX_")}
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    env["TMPDIR"] = env_tmp
    argv = [*entrypoint(), *args]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("listening on tcp://"):
        proc.kill()
        proc.wait(5)
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"the pod did not start: {line!r} (exit {proc.poll()})")
    port = int(line.rsplit(":", 1)[1])
    # The kubelet's readiness probe (tcpSocket): the port accepts.
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return Pod(name, proc, ip, port, root, argv)
