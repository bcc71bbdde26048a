"""The `gvisor` provider: a worker behind gVisor's user-space kernel (`runsc`), rootless.

* `provider`: `GvisorProvider`, the plan builder, the probe and the launch (host).
* `bundle`: the OCI bundle of one worker: `GvisorPlan`, `bundle_config` (pure),
  `write_bundle` (host).
* `pins`: the granted paths walked again on the host and in the gofer's root (host).
* `relay`: the host's side of the in-sandbox egress relay (host).

This `__init__` imports nothing.
"""

__all__: list[str] = []
