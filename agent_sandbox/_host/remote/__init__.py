"""Remote placement: a conversation thread's worker runs elsewhere, reached over TLS.

* `provider`: the `remote` provider and its `LocalClaimBackend` (no launch plan: it claims a
  worker and binds it to the session); `k8s`: `K8sClaimBackend`, claims of
  kubernetes-sigs/agent-sandbox; `k8s_manifests`: `agent-sandbox k8s manifests`.
* `worker`: a worker in a pod, bound over TLS and judged like a local one (its stream is
  read by `_host/intake/remote_transport.py`); `pool`: the worker pool of a `Sandbox` whose
  policy places its workers remotely.
* `serve`: the pod's own process (`agent-sandbox worker serve`), which is the host of the
  worker it starts there; `serve_relay`, `serve_guard`, `serve_limits`: its relay of the
  worker's stream, its guard counter, its bounds.

This `__init__` imports nothing.
"""

__all__: list[str] = []
