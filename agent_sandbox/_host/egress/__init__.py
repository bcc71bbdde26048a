"""The host's egress proxy: the only way out of a worker that has a `[net]` rule.

Cut by concern (the overview is `proxy`'s docstring):

* `proxy`: the server, one process-wide event-loop thread (`egress_proxy()`), and one
  `Route` per worker: its rules, bounds, connections and recorded refusals.
* `session`: one client connection: its deadlines, the byte bound, the refusals it sends.
* `rules`: a policy's `[net]` rules as the proxy judges them, and the decision for one
  target; `addresses`: a target's one spelling, the special and LAN ranges; `resolver`:
  the pinned resolver.
* `http1`: HTTP/1.1 read and written by h11, each message rebuilt; `socks`: SOCKS5.
* `handoff`: what a sandbox is given (the proxy's address and variables, loopback
  forwards) and sends back (its listeners, checked here).

This `__init__` imports nothing.
"""

__all__: list[str] = []
