"""The `qemu` provider: a worker in a small virtual machine of its own.

* `provider`: `QemuProvider`, the plan builder and probe (host).
* `image`: the guest image builder behind `agent-sandbox qemu build` (host).
* `relay`: the host relay between the worker's sockets and the guest's serial channels,
  run as its own process by the launch plan (host).
* `guest`: the guest agent, baked into the image as `/sb/agent.py` (inside the VM).
* `accel`: which accelerator (KVM or TCG) this machine gives QEMU, and why (host).

This `__init__` imports nothing.
"""

__all__: list[str] = []
