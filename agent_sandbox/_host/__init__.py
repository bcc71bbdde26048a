"""The host side: what runs in the agent's process, and never trusts a worker.

Code here may believe the policy, the provider's launch plan, the kernel and its own bounds.
Nothing a worker sends is believed before `agent_sandbox._host.intake` has judged it, and
what is shown in the sandbox's voice is host text. The host never arms a guard and imports
nothing of the worker side (`agent_sandbox._worker`); both sides import the shared modules
at the top of the package (`_wire`, `_denial`, `_errors`, `_render`, `_hints`, `_landlock_sys`).

* `sandbox`: `Sandbox` and `Session`, the public entry points; `calllock`: a session's
  call lock.
* `boundary`: the provider a policy resolves to, and the opt-out from a kernel boundary.
* `pool`: ready workers per policy fingerprint; `templates`: pre-imported processes that
  fork them.
* `launch`: what a worker starts from (interpreter, import roots, package folders,
  environment, bounded log); `process`: one worker seen from the host, from its start to
  a certain end.
* `lifecycle` and `guardian`: nothing outlives the agent.
* `result`: `RunResult`, `RunError` and `Image`; `oplog`: refusals to the operator's log.
* `limits`: per-worker cgroups and the limits report; `denial_log`: Landlock's denials
  from the kernel's audit log; `egress/`: the egress proxy, the sandbox's only way out.
* `remote/`: workers placed elsewhere: the `remote` provider and its claim backends, a
  worker in a pod bound over TLS and judged like a local one (`remote/worker`), and the
  pod's own process (`remote/serve`, `agent-sandbox worker serve`), which is the host of the
  worker it starts there.
* `intake/`: every place the host reads what a worker sent (a security review starts there).
"""

__all__: list[str] = []
