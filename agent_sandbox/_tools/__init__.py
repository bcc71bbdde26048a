"""The tools around the sandbox: the command line, learning mode and the offline demo.

They run in the agent's or the operator's process, with the host's trust: they use the
public API and the host side (`agent_sandbox._host`), never the worker side.

* `cli`: the `agent-sandbox` command (also `python -m agent_sandbox`); `cli_demo`,
  `cli_doctor` and `cli_learn` add their sub-commands.
* `learn/`: learning mode, from what a run needed to a proposal a person reviews.
* `demo`: the offline demo, and the scripted models behind `agent_sandbox.testing`.
* `leftovers`: what an agent left behind (processes, directories, cgroups), for the lifecycle
  tests and `benchmarks/soak_lifecycle.py`; the library itself never imports it.
"""

__all__: list[str] = []
