"""The `subprocess` provider: a plain child process, no kernel boundary.

What it enforces: a separate process in its own session and process group, an environment
holding only what the policy passes, a private scratch directory as working directory, and
the policy's rlimits (applied by the worker to itself before it serves). The Python guards
run inside it as in every provider.

What it does not enforce: anything against hostile code. Native code (ctypes, a C
extension, `posix.system`) reaches the whole machine with the user's rights. Use a kernel
provider (`landlock`, `unshare`, `bwrap`, `firejail`) or `auto` for untrusted code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from agent_sandbox.providers._base import (
    Answer,
    LaunchPlan,
    ProbeResult,
    Provider,
    WorkerSetup,
    WorkerSpec,
    base_env,
    worker_argv,
)
from agent_sandbox.providers._netcheck import opted_out, standard_answers

__all__ = ["SubprocessProvider"]


class SubprocessProvider(Provider):
    """Start the worker as an ordinary child process (guards and rlimits only)."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(opted_out, opted_out)

    name: ClassVar[str] = "subprocess"
    strength: ClassVar[int] = 0
    is_boundary: ClassVar[bool] = False

    def probe(self) -> ProbeResult:
        return ProbeResult(self.name, True, version="", details={"boundary": False})

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        return LaunchPlan(
            provider=self.name,
            argv=worker_argv(spec),
            env=base_env(spec),
            pass_fds=(spec.listen_fd, spec.boot_fd),
            cwd=spec.scratch,
            worker_setup=WorkerSetup(),
            stack=(self.name,),
            worker_depth=1,  # its keeper, then the worker
            keeper=True,
        )
