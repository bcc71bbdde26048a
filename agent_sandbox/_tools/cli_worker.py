"""`agent-sandbox worker serve|check` and `agent-sandbox k8s manifests POLICY`.

`worker serve|check`: the remote worker's entry point and its self-report.

`serve --listen tcp://0.0.0.0:8888` is a pod's command (see docs/scale-out.md and
`_host/remote/serve.py`); the first line it prints is `listening on tcp://HOST:PORT` (the real
port when `:0` was asked). `check` says which layer is the kernel boundary in this place
(`_host/placement.py`, shared with `doctor` and `worker serve`): the runtime the operator
declares (`--runtime-boundary gvisor`) or that is detected (gVisor's kernel), the in-pod
provider a bind would start the worker under (`auto`: the strongest that works here), and
whether the pod's secret files are in the worker's reach.
`k8s manifests` prints the SandboxTemplate and SandboxWarmPool for a policy
(`_host/remote/k8s_manifests.py`), as YAML (when PyYAML is installed) or a JSON `List`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

__all__ = ["add_parser", "prewarm"]

_SECRET_ENV = "AGENT_SANDBOX_BIND_SECRET"


def add_parser(subparsers: Any) -> None:
    worker = subparsers.add_parser("worker", help="run as a remote worker (a pod's entry point)")
    wsub = worker.add_subparsers(dest="worker_command", required=True)
    serve = wsub.add_parser("serve", help="serve the worker protocol on TCP with TLS")
    serve.add_argument("--listen", default="tcp://0.0.0.0:8888", help="tcp://HOST:PORT")
    serve.add_argument("--tls-cert", help="the server certificate (PEM)")
    serve.add_argument("--tls-key", help="its private key (PEM)")
    serve.add_argument("--client-ca", help="require client certificates signed by this CA (mTLS)")
    serve.add_argument(
        "--plaintext",
        choices=("accepted",),
        default="",
        help="serve without TLS (only behind a TLS-terminating router); explicit opt-out",
    )
    serve.add_argument(
        "--bind-secret-file",
        help=f"the template-wide bootstrap secret for POST /v1/bind (or ${_SECRET_ENV})",
    )
    _common(serve)
    serve.add_argument("--idle-exit", type=float, default=900.0, help="seconds idle once bound")
    serve.add_argument("--keepalive", type=float, default=15.0, help="SSE keep-alive period")
    serve.add_argument(
        "--exit-with-parent", action="store_true", help="exit when the starting process is gone"
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=0,
        help="connections not yet authenticated held at once (default: from the pod's memory "
        "limit, a sixteenth of it at 256 KiB each, 8-256; 128 without a limit); more are "
        "closed at accept",
    )
    serve.add_argument(
        "--head-timeout",
        type=float,
        default=10.0,
        help="seconds from accept for the TLS handshake and an authenticated request head",
    )
    serve.set_defaults(func=_cmd_serve)
    check = wsub.add_parser("check", help="say which layer is the kernel boundary here")
    _common(check)
    check.set_defaults(func=_cmd_check)
    k8s = subparsers.add_parser("k8s", help="Kubernetes agent-sandbox manifests for a policy")
    ksub = k8s.add_subparsers(dest="k8s_command", required=True)
    man = ksub.add_parser("manifests", help="print the SandboxTemplate and SandboxWarmPool")
    man.add_argument("policy", help="a policy file or the name of a shipped policy")
    man.add_argument("--image", required=True, help="the worker image (see docs/scale-out.md)")
    man.add_argument("--namespace", default="default", help="a DNS label (default: default)")
    man.add_argument(
        "--runtime",
        default=None,
        help="required: gvisor or kata (the runtime is the boundary), or runc (Landlock in "
        "the pod); it must exist as a RuntimeClass on the cluster",
    )
    man.add_argument("--replicas", default="2", help="warm pods, 0-1000 (default 2)")
    man.add_argument(
        "--hop",
        default="router",
        help="router (default: plain HTTP from the agent-sandbox router, which agents reach "
        "over TLS) or direct (TLS to the pod's IP from inside the cluster)",
    )
    man.add_argument("--mtls", action="store_true", help="require client certificates (direct)")
    man.add_argument(
        "--router-namespace",
        default="agent-sandbox-system",
        help="the namespace of the pods allowed to dial the workers (the router's)",
    )
    man.add_argument(
        "--router-labels",
        default="app=sandbox-router",
        help="their labels, KEY=VALUE[,KEY=VALUE] (default app=sandbox-router)",
    )
    man.add_argument("--idle-exit", default="900", help="seconds idle once bound (default 900)")
    man.add_argument(
        "--pool",
        default="",
        help="the name of the template and warm pool, the policy's [remote] pool (default: "
        "ags-<policy name>-<fingerprint[:8]>); printed on stderr either way",
    )
    man.add_argument("--format", choices=("yaml", "json"), default="yaml")
    man.set_defaults(func=_cmd_manifests)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--provider",
        default="auto",
        help="the local provider inside (auto: the strongest that works here; landlock, "
        'which cannot hide names, binds only policies with visible_names = "accepted"; '
        "subprocess only under a runtime that is a boundary)",
    )
    parser.add_argument(
        "--runtime-boundary",
        default="",
        choices=("", "gvisor", "kata"),
        help="the container runtime that is itself a boundary (declared by the operator)",
    )


def _read_secret(args: argparse.Namespace) -> str | None:
    if args.bind_secret_file:
        with open(args.bind_secret_file, encoding="utf-8") as fh:
            return fh.read().strip() or None
    value = os.environ.pop(_SECRET_ENV, None)  # not inherited by anything started later
    return value or None


def prewarm(provider: str) -> None:
    """What a bind would load, loaded before the pod is ready: the host side's modules (the
    policy model, the worker start) and the provider's probe, so a warm, policy-less pod
    spends its bind on starting the worker only (~0.4 s less here). Nothing that depends on
    a session's policy is done here; a failure is left for the bind to report."""
    try:
        from agent_sandbox._host import boundary, process  # noqa: F401
        from agent_sandbox.policies import Policy
        from agent_sandbox.providers import get_provider

        Policy(name="prewarm").fingerprint()
        get_provider(provider).probe()  # `auto`: every candidate's trial start, cached
    except Exception as exc:  # the bind reports what is wrong, with the session's policy
        logging.getLogger("agent_sandbox.serve").info("prewarm: %s", exc)


def _cmd_serve(args: argparse.Namespace) -> int:
    from agent_sandbox._host.remote.serve import ServeConfig, WorkerServer, parse_listen

    try:
        host, port = parse_listen(args.listen)
        config = ServeConfig(
            host=host,
            port=port,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            client_ca=args.client_ca,
            plaintext=args.plaintext,
            bind_secret=_read_secret(args),
            provider=args.provider,
            runtime_boundary=args.runtime_boundary,
            idle_exit=args.idle_exit,
            keepalive=args.keepalive,
            exit_with_parent=args.exit_with_parent,
            max_pending=args.max_connections,
            head_timeout=args.head_timeout,
        )
        config.check()
        prewarm(config.provider)  # before the port opens: a ready pod binds fast
        server = WorkerServer(config)
    except (ValueError, OSError) as exc:
        print(f"agent-sandbox worker serve: error: {exc}", file=sys.stderr)
        return 64
    import signal

    signal.signal(signal.SIGTERM, lambda *_: server.stop("SIGTERM"))
    shown = f"[{host}]" if ":" in host else host
    print(f"listening on tcp://{shown}:{server.port}", flush=True)
    reason = server.serve_forever()
    print(f"exiting: {reason}", flush=True)
    return 0


def _cmd_manifests(args: argparse.Namespace) -> int:
    import json

    from agent_sandbox._errors import PolicyError
    from agent_sandbox._host.remote.k8s_manifests import ManifestError, check_inputs, manifests
    from agent_sandbox.policies import resolve_policy

    try:
        options = check_inputs(
            image=args.image,
            namespace=args.namespace,
            runtime=args.runtime,
            replicas=args.replicas,
            hop=args.hop,
            mtls=args.mtls,
            router_namespace=args.router_namespace,
            router_labels=args.router_labels,
            idle_exit=args.idle_exit,
            pool=args.pool,
        )
        policy = resolve_policy(args.policy)
        docs = manifests(policy, **options)
    except (PolicyError, ManifestError) as exc:
        print(f"agent-sandbox k8s manifests: error: {exc}", file=sys.stderr)
        return 78 if isinstance(exc, PolicyError) else 64
    meta = docs[1]["metadata"]
    print(
        f"agent-sandbox k8s manifests: SandboxWarmPool {meta['namespace']}/{meta['name']}: "
        f'the agents\' policy names it: [remote] pool = "{meta["name"]}", '
        f'namespace = "{meta["namespace"]}"',
        file=sys.stderr,
    )
    if args.format == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}, indent=2))
        return 0
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        print(
            "agent-sandbox k8s manifests: no YAML library here: install the k8s extra "
            "(pip install 'agent-sandbox-kit[k8s]') or use --format json",
            file=sys.stderr,
        )
        return 69
    print(yaml.safe_dump_all(docs, sort_keys=False), end="")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    """The report; exit status 1 when no worker could start here or the declared runtime is
    contradicted by the kernel (what `worker serve` would refuse)."""
    from agent_sandbox._host.placement import inpod_report

    report = inpod_report(args.provider, args.runtime_boundary)
    for line in report.lines():
        print(line)
    return 1 if (report.error or report.mismatch) else 0
