"""The host's verdicts on a remote worker: the guard counter is read in the pod by `worker
serve` (as the local host reads it) and a tampered call's output never reaches the host."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox._host.remote.provider import RemoteProvider, RemoteSession

from .conftest import remote_policy

CANARY = "canary-remote-guard-7c2e"
#: `guard.tampered` when the pod read the counter; `worker.crashed` when the worker (which
#: ends itself after such a call) was gone before the pod could verify the call's end: then,
#: as on a local host, what was held after the disarming is withheld.
VERDICTS = ("guard.tampered", "worker.crashed")


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("remote-guard-secret")
    (folder / "canary.txt").write_text(CANARY)
    return folder


@pytest.fixture
def session(remote: RemoteProvider) -> Iterator[RemoteSession]:
    # The guards' own package is granted: the arming state is in reach without a foothold,
    # so what is measured is the count read from outside the worker.
    policy = remote_policy(imports={"allow": ["agent_sandbox.guards"]}, code={"enabled": False})
    with remote.session(policy, thread="guard-check") as s:
        yield s


def _leaked(result: object) -> bool:
    return CANARY in repr(result)


def test_a_replaced_tamper_check_is_caught_by_the_pod(session: RemoteSession, secret: Path) -> None:
    """It withholds the output of a call that switched the guards off after replacing the
    worker's own tamper check: `worker serve` reads the counter itself."""
    session.run("marker = 1")
    result = session.run(
        textwrap.dedent(
            f"""
            from agent_sandbox.guards import _install
            from agent_sandbox.guards._state import state
            _install.Guards.tamper_check = lambda self: []
            _install.Guards.exit = lambda self: None
            state.armed = False
            print(open({str(secret / "canary.txt")!r}).read())
            """
        )
    )
    assert not _leaked(result)
    assert result.error is not None and result.error.rule in VERDICTS, result.error
    assert result.stdout == "" and result.value is None
    if result.error.rule == "guard.tampered":
        pod = [d for d in result.denials if d.rule == "guard.tampered"]
        assert pod and "the pod read the worker's guard counter" in pod[0].target
    after = session.run("'marker' in globals()")
    assert after.value is False and after.state_lost


def test_a_flag_cleared_and_set_back_is_caught_by_the_pod(
    session: RemoteSession, secret: Path
) -> None:
    """It catches the flag cleared and restored within one call before anything read while
    it was off reaches the host."""
    result = session.run(
        textwrap.dedent(
            f"""
            from agent_sandbox.guards._state import state
            state.armed = False
            data = open({str(secret / "canary.txt")!r}).read()
            state.armed = True
            print(data)
            data
            """
        )
    )
    assert not _leaked(result)
    assert result.error is not None and result.error.rule in VERDICTS, result.error
