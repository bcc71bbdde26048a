"""The host's evidence about a call, behind one interface (`agent_sandbox._host.evidence`).

Every source of the module is an `EvidenceSource` with the protocol's methods and a place in
`ORDER`; a call (`agent_sandbox._host.call.Call`) arms, collects from and asks to judge
exactly the sources its worker registered, in `ORDER`, collecting from all before any
judges; a source that says the worker cannot be kept ends it; a source that screens events
decides what the caller sees while the call runs. A real start registers the sources it
opened.
"""

from __future__ import annotations

import inspect
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._host import evidence
from agent_sandbox._host.evidence import (
    ORDER,
    EventScreen,
    EvidenceSet,
    EvidenceSource,
    LimitEvidence,
)
from agent_sandbox._host.intake.events import HostBounds
from agent_sandbox._host.intake.transport import WorkerClient
from agent_sandbox._host.intake.unpickle import Decoder
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox._wire import encode_event
from agent_sandbox.providers import get_provider

START = encode_event("start", {"call": 1})
DONE = encode_event("done", {"duration": 0.0, "discard": False, "denials": 0})
POLICY = Policy(name="evidence-test", limits={"wall_seconds": 30})


def _source_classes() -> list[type]:
    return [
        obj
        for _, obj in inspect.getmembers(evidence, inspect.isclass)
        if obj.__module__ == evidence.__name__ and isinstance(getattr(obj, "name", None), str)
    ]


def test_every_evidence_source_satisfies_the_protocol() -> None:
    """Each source class of the module has the protocol's methods with its parameters, and
    the names of the sources are exactly `ORDER` (none left out of the order, none extra)."""
    classes = _source_classes()
    assert sorted(c.name for c in classes) == sorted(ORDER)
    for cls in classes:
        for method in ("arm", "collect", "judge", "close"):
            want = list(inspect.signature(getattr(EvidenceSource, method)).parameters)
            got = list(inspect.signature(getattr(cls, method)).parameters)
            assert got == want, (cls.__name__, method, got)
    fake: Any = object()
    made = [
        evidence.EgressEvidence(fake),
        evidence.KernelLogEvidence(fake),
        evidence.GuardEvidence(fake),
        LimitEvidence(),
    ]
    assert sorted(s.name for s in made) == sorted(ORDER)
    for source in made:
        assert isinstance(source, EvidenceSource), type(source).__name__
    assert [isinstance(s, EventScreen) for s in made] == [False, False, True, False]


def test_a_set_keeps_its_sources_in_order_and_replaces_by_name() -> None:
    """Registered in any order, the sources come out in `ORDER`; a name registered again
    replaces the earlier source (the start's limit report replaces the bare one)."""
    sources = EvidenceSet()
    bare, real = LimitEvidence(), LimitEvidence(scratch="/x")
    sources.register(bare)
    for name in reversed(ORDER[:-1]):
        sources.register(_Recorder(name, []))
    sources.register(real)
    assert [s.name for s in sources] == list(ORDER)
    assert real in list(sources) and bare not in list(sources)


# -- a call consults exactly the registered sources ----------------------------------------


class _Recorder:
    """A source that records what the call asks of it (into a log shared by all)."""

    def __init__(
        self, name: str, log: list[tuple[str, str]], *, replace: str = "", hold: str = ""
    ) -> None:
        self.name = name
        self.log = log
        self.replace = replace
        self.hold = hold

    def arm(self) -> None:
        self.log.append((self.name, "arm"))

    def collect(self, call: Any) -> None:
        self.log.append((self.name, "collect"))

    def judge(self, call: Any) -> None:
        self.log.append((self.name, "judge"))
        if self.replace and not call.worker_dead:
            call.replace_worker(self.replace)

    def close(self) -> None:
        self.log.append((self.name, "close"))


class _Screen(_Recorder):
    """A recording source that also screens events: it holds back those of one kind."""

    def screen(self, builder: Any, kind: str, accepted: Any) -> list[Any]:
        self.log.append((self.name, f"screen {kind}"))
        return [] if kind == self.hold else [accepted]


class _FakeWorker:
    """Answers one POST /run on a Unix socket with `events` (chunked SSE)."""

    def __init__(self, path: str, events: list[bytes]) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.events = events
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for data in self.events:
                conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))
            conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.thread.join(30)
        self.listener.close()


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Callable[[list[bytes]], WorkerProcess]]:
    """`shell(events)`: a `WorkerProcess` connected to a fake worker sending `events`."""
    fakes: list[_FakeWorker] = []

    def make(events: list[bytes]) -> WorkerProcess:
        path = str(tmp_path / f"ctl-{len(fakes)}.sock")
        fakes.append(_FakeWorker(path, events))
        wp = WorkerProcess()
        wp.policy = POLICY
        wp.decoder = Decoder.from_policy(POLICY)
        wp.bounds = HostBounds.from_policy(POLICY)
        wp.client = WorkerClient(path, "t", wp.bounds.max_event_bytes(), wp.bounds.kind_caps())
        return wp

    try:
        yield make
    finally:
        for fake in fakes:
            fake.close()


CALL = [START, encode_event("stdout", "hi\n"), encode_event("result", {"value": 1}), DONE]


def test_a_call_consults_exactly_the_registered_sources_in_order(
    shell: Callable[[list[bytes]], WorkerProcess],
) -> None:
    """It arms every registered source, collects from all, then lets each judge, in
    `ORDER`; a source made but not registered is never asked anything."""
    log: list[tuple[str, str]] = []
    wp = shell(CALL)
    unregistered = _Recorder("kernel_log", log)
    for name in ("limits", "egress", "guard"):  # (registered out of order on purpose)
        wp.evidence.register(_Recorder(name, log))
    result = wp.run("1")
    assert result.ok and result.value == 1, result
    names = ["egress", "guard", "limits"]
    assert log == (
        [(n, "arm") for n in names]
        + [(n, "collect") for n in names]
        + [(n, "judge") for n in names]
    )
    assert all(name != unregistered.name for name, _ in log)
    assert not wp.dead


def test_a_source_that_judges_the_worker_unfit_replaces_it(
    shell: Callable[[list[bytes]], WorkerProcess],
) -> None:
    """A source's verdict ends the worker, with its reason as the end cause; the sources
    after it still judge (the limit report reads what the others left)."""
    log: list[tuple[str, str]] = []
    wp = shell(CALL)
    wp.evidence.register(_Recorder("egress", log, replace="the route failed"))
    wp.evidence.register(_Recorder("limits", log))
    result = wp.run("1")
    assert wp.dead and wp.end_cause() == "the route failed"
    assert ("limits", "judge") in log and ("egress", "close") in log
    assert result.value == 1  # (the call's own outcome stands; the worker does not)


def test_a_screening_source_decides_what_the_caller_sees_during_the_call(
    shell: Callable[[list[bytes]], WorkerProcess],
) -> None:
    """Events a screen holds back never reach `on_event`; the others do, each screened."""
    log: list[tuple[str, str]] = []
    wp = shell(CALL)
    wp.evidence.register(_Screen("guard", log, hold="stdout"))
    seen: list[str] = []
    wp.run("1", on_event=lambda kind, data: seen.append(kind))
    assert "stdout" not in seen and "result" in seen
    assert ("guard", "screen stdout") in log and ("guard", "screen result") in log
    assert ("guard", "screen start") not in log  # (framing: never screened)


def test_a_started_worker_registers_the_sources_it_opened() -> None:
    """A real start registers its limit report (with the worker's cgroups and scratch), and
    the guard check exactly when the host could open the worker's guard counter."""
    worker = WorkerProcess.start(POLICY, get_provider("subprocess"))
    try:
        names = [s.name for s in worker.evidence]
        assert names == [n for n in ORDER if n in names]
        assert "limits" in names and "egress" not in names and "kernel_log" not in names
        assert ("guard" in names) == (worker.guard_watch is not None)
        [limits] = [s for s in worker.evidence if isinstance(s, LimitEvidence)]
        assert limits.cgroups is worker.cgroups and limits.scratch == worker.scratch
        assert worker.run("1 + 1").value == 2
    finally:
        worker.close()
