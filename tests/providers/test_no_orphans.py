"""Nothing outlives the agent, under every provider, at every moment of a worker's life.

Each test runs an *agent* as a child process of the test (a small script using
`agent_sandbox`). Its sandboxed code makes a setsid double fork with ctypes (so no Python
guard is involved) and names the grandchild with a random marker (`PR_SET_NAME`). The test
then ends the agent (SIGKILL to that one child pid, or a normal exit without `close()`)
and looks for any survivor: a process named with the marker, or a process started with the
agent's owner mark (a worker, a launcher, a template), plus the agent's control
directories in the temp dir. The survivors are looked for until a bound passes (the
guardian cleans up asynchronously); none may remain. The agent and the survey are in
`agent_sandbox/_tools/leftovers.py`, shared with `benchmarks/soak_lifecycle.py`.
"""

from __future__ import annotations

import pytest

from agent_sandbox._tools.leftovers import run_agent

from .conftest import skip_unless_available

PROVIDERS = ("subprocess", "landlock", "unshare", "bwrap", "firejail", "gvisor")


def _run_agent(
    provider: str, moment: str, extra: str = "0", *, guardian: bool = True, bound: float = 15
) -> None:
    skip_unless_available(provider)
    left = run_agent(provider, moment, extra, guardian=guardian, bound=bound)
    assert left.ready == "READY", left.ready
    if moment not in ("exit", "closing") and provider == "gvisor":
        # The double fork ran inside gVisor's Sentry (the agent saw its output): no host
        # process carries the marker; the sandbox's own processes were running.
        assert left.before, "no process of the agent's sandbox ran when it was ended"
    elif moment not in ("exit", "closing"):  # (those may have ended it already)
        assert left.forked, "the double fork did not run"
    assert (left.named, left.marked, left.dirs) == ([], [], []), (
        f"survivors after the agent ended: {left}"
    )


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("moment", ["idle", "running", "closing", "exit"])
def test_nothing_outlives_a_killed_agent(provider: str, moment: str) -> None:
    """It ends the worker, its launcher and the code's setsid double fork when the agent is
    SIGKILLed while a worker is idle, running a call or being closed, and when the agent
    exits normally without closing anything; no control directory stays."""
    _run_agent(provider, moment)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("delay", [0, 1, 3])
def test_nothing_outlives_an_agent_killed_while_workers_start(provider: str, delay: int) -> None:
    """It ends workers that were being started when the agent was SIGKILLed."""
    _run_agent(provider, "starting", str(delay))


@pytest.mark.parametrize("provider", ["unshare", "bwrap", "firejail", "gvisor"])
def test_a_normal_exit_right_after_a_call_cleans_up_by_itself(provider: str) -> None:
    """It ends every worker (those the pool's refill and three other sessions were starting
    included: the bwrap exit race) and removes every control directory at a normal exit
    without close(), by the exit hook alone: the agent's guardian is switched off, and what
    is left one second after the agent's exit is a failure. (Under subprocess and landlock
    the code's setsid double fork has no pid namespace to die with; the guardian ends it,
    as the tests above check.)"""
    _run_agent(provider, "exit", guardian=False, bound=1.0)


@pytest.mark.parametrize(
    "provider",
    [
        "subprocess",
        "landlock",
        "unshare",
        "bwrap",
        "firejail",
        "gvisor",
    ],
)
@pytest.mark.parametrize("moment", ["idle", "running"])
def test_nothing_outlives_an_agent_killed_with_its_guardian(provider: str, moment: str) -> None:
    """It ends the worker and everything it started when the agent dies with no guardian
    (a container or unit killed as a whole: here the guardian is switched off and the
    agent SIGKILLed): parent-death signals on every launch path (under firejail, whose
    set-user-ID exec clears them, the worker's life line: the kernel SIGKILLs it when the
    agent's end of a pipe closes), and what the code
    detached ends with the sandbox's pid namespace (unshare, bwrap, firejail, gvisor's
    Sentry), with the
    worker's keeper (subprocess, landlock: a subreaper that ends its descendants when the
    agent's launch thread dies) or with the pool's template (the same, for a forked
    worker); the next agent's sweep then removes the control directories."""
    import tempfile

    from agent_sandbox._host import guardian
    from agent_sandbox._host.limits import hierarchy_bases
    from agent_sandbox._tools.leftovers import control_dirs

    skip_unless_available(provider)
    left = run_agent(provider, moment, guardian=False, bound=10)
    assert left.ready == "READY", left.ready
    if provider == "gvisor":  # (the double fork ran inside the Sentry: see `_run_agent`)
        assert left.before, "no process of the agent's sandbox ran when it was ended"
    else:
        assert left.forked, "the double fork did not run"
    # The worker, its launcher and template died with the agent (parent-death signals):
    # whatever is left is the code's own double fork.
    if set(left.marked) - set(left.named):
        raise RuntimeError(f"the worker or its launcher outlived the agent: {left}")
    assert (left.named, left.marked) == ([], []), f"survivors: {left}"
    # Its directories stay for the next agent's sweep: this one, unless another agent on
    # the machine swept first (any agent's guardian sweeps what owners proven dead left).
    assert left.tag, "the agent made nothing"
    guardian.sweep(hierarchy_bases(), tempfile.gettempdir())
    assert control_dirs(left.tag) == []


@pytest.mark.parametrize("provider", ["subprocess", "landlock"])
def test_a_forked_workers_detached_processes_end_with_the_template(provider: str) -> None:
    """It ends, when the agent dies with no guardian, what a worker forked by a plain
    template detached (a setsid double fork): the template is the subreaper of its
    workers' orphans and ends them all when the agent's end of its socket closes."""
    skip_unless_available(provider)
    left = run_agent(provider, "forked", guardian=False, bound=10)
    assert left.ready == "READY", left.ready
    assert left.forked, "the double fork did not run"
    assert (left.named, left.marked) == ([], []), f"survivors: {left}"
