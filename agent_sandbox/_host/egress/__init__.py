"""The host's egress proxy: the only way out of a worker that has a `[net]` rule.

Cut by concern (the overview is `proxy`'s docstring):

* `proxy`: the server, one process-wide event-loop thread (`egress_proxy()`), and one
  `Route` per worker: its rules, bounds, connections and recorded refusals.
* `session`: one client connection's life: its deadlines, the byte bound, the upstream
  connection and tunnel, each refusal recorded before it is sent; it hands the connection
  to its protocol.
* `rules`: a policy's `[net]` rules as the proxy judges them, and the decision for one
  target; `addresses`: a target's one spelling, the special and LAN ranges; `resolver`:
  the pinned resolver.
* `http1`: HTTP/1.1 served on a session (`Http1`: `CONNECT`, plain HTTP, the refusals
  as HTTP words), read and written by h11, each message rebuilt; `socks`: SOCKS5 served
  on a session (its parsers, the flow, the reply codes).
* `handoff`: what a sandbox is given (the proxy's address and variables, loopback
  forwards) and sends back (its listeners, checked here).

This `__init__` imports nothing.
"""

__all__: list[str] = []
