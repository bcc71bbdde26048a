"""The worker side: what runs inside the sandbox, in the process that runs the user's code.

The host trusts none of it, and none of it may rely on the host's code being there: the
worker imports nothing of `agent_sandbox._host` or `agent_sandbox._tools` (a test checks the
import graph), only its own modules, the shared ones at the top of the package and the guards
(`agent_sandbox.guards`). In the order of a worker's life:

* `boot`: the entry point (`python -I -S -B <folder>/_worker/boot.py <fd>`): the boot
  configuration, the import roots, the bare package objects; standard library only.
* `template`: a pre-imported process that forks workers (`subprocess`, `landlock`).
* `_ns_launch`: the `unshare` provider's launcher, inside the namespaces, before the worker
  (standard library only, imported standalone).
* `setup`: rlimits, the provider's in-worker restrictions, the code layer, the guards.
* `_inworker`: those restrictions, in the order the kernel needs them (Landlock through
  the shared `agent_sandbox._landlock_sys`, seccomp, capabilities, the scratch tmpfs);
  standard library only, imported standalone by a probe too.
* `_nsfork.c`, `_nsinit.c`: a namespace template's fork of a worker in C, and its init.
* `server`: HTTP/1.1 with h11 on the inherited socket; one call's events as a stream.
* `run`: one call of user code: its output, its value or exception, as events.
* `objects`: values and exceptions as objects mode sends them.
* `audit`: the worker's record of every refusal, kept even when the code swallows it.

This `__init__` imports nothing, so a worker loads only the modules it uses.
"""

__all__: list[str] = []
