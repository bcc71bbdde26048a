"""The host's egress proxy: the only way out of a worker that has a `[net]` rule.

* `proxy`: the proxy itself (the rules it judges by, the HTTP and SOCKS front ends, the
  hand-off of the worker's listener), one process-wide thread that every worker's
  connections reach through the provider's plan.

This `__init__` imports nothing.
"""

__all__: list[str] = []
