"""Every place the host reads what a worker sent: a security review starts here.

A worker may be fully compromised, so all it sends is attacker-controlled data. The host
reads it only through this package, in this order:

1. `transport`: the h11 client on the worker's Unix socket; reads are bounded (one `recv`
   of at most 256 KiB, h11's caps on headers and chunk lines) and every wait has a deadline.
   `remote_transport` is its twin for a remote worker (httpx, TLS), through the same parser.
2. `framing`: the SSE parser; a cap per event kind, known from the event's first line, a
   budget of JSON values for an outcome, strict UTF-8; anything malformed is a
   `TransportError`.
3. `events`: the judge of one call's stream: order, shape, the host's bounds
   (`HostBounds`) and the host's wording (notices, denial details, hints).
4. `builder`: `ResultBuilder` keeps what the judge accepted and builds the `RunResult`;
   `errors` judges the worker's `error` event and has its exception rebuilt.
5. `unpickle`, with `unpickle_prescan` and `unpickle_classes` (objects mode only): an
   opcode prescan under budgets, a `find_class` that imports nothing, then the C unpickler;
   the worker's exceptions are rebuilt fail-closed.
6. `guard_block`: the host reads the worker's guard counter from the worker's memory and
   never asks the worker.

No other host-side module imports `pickle`, `marshal`, `h11`, `httpx` or `tblib`
(`tests/core/test_layout.py`). Outside this package the host compares the handshake's
fields with its own (`_host/startup.py`) and reads the JSON lines of a worker template,
which never runs user code (`_host/templates.py`).
"""

__all__: list[str] = []
