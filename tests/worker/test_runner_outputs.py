"""The runner's report of scratch files, in process (no guards, no worker): one listing per
call, the end of one call being the start of the next."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent_sandbox._worker.run import Runner


def _files(runner: Runner, code: str) -> list[Any]:
    events: list[tuple[str, Any]] = []
    runner.run(code, lambda kind, data: events.append((kind, data)))
    assert [kind for kind, _ in events if kind in ("result", "error")] == ["result"], events
    return [data for kind, data in events if kind == "files"]


def test_a_scratch_file_is_reported_by_the_call_that_changed_it_only(tmp_path: Path) -> None:
    """A file a call writes shows in that call's `files`; a call that changes nothing shows
    none; a file changed between calls (a background thread, a child) shows with the next
    call, never lost; rewriting a file with another size shows again."""
    runner = Runner({"name": "t"}, str(tmp_path))
    runner.namespace["d"] = str(tmp_path)
    assert _files(runner, "open(d + '/a.txt', 'w').write('1')") == [[{"name": "a.txt", "size": 1}]]
    assert _files(runner, "1 + 1") == []
    (tmp_path / "b.txt").write_text("22")
    assert _files(runner, "1 + 1") == [[{"name": "b.txt", "size": 2}]]
    assert _files(runner, "2") == []
    assert _files(runner, "open(d + '/a.txt', 'w').write('333')") == [
        [{"name": "a.txt", "size": 3}]
    ]


def _outcome(runner: Runner, code: str) -> tuple[str, Any]:
    events: list[tuple[str, Any]] = []
    runner.run(code, lambda kind, data: events.append((kind, data)))
    outcomes = [event for event in events if event[0] in ("result", "error")]
    assert len(outcomes) == 1, events
    return outcomes[0]


def test_a_plain_scalar_result_is_sent_as_before(tmp_path: Path) -> None:
    """Numbers, booleans and None go out as JSON values; a huge int and a NaN stay marked
    (the scalar fast path never skips the marking)."""
    runner = Runner({"name": "t"}, str(tmp_path))
    for code, value in [("2", 2), ("1.5", 1.5), ("True", True), ("None", None)]:
        assert _outcome(runner, code) == ("result", {"value": value})
    for code, type_name in [("2**70", "int"), ("float('nan')", "float")]:
        kind, data = _outcome(runner, code)
        assert kind == "result" and data["value"]["__type__"] == type_name


def test_the_first_calls_work_done_ahead_leaves_no_trace(tmp_path: Path) -> None:
    """`server._first_call_ahead` (before the handshake) runs the first call's code on the
    worker's own runner and code layer, and leaves nothing a call could see: no call or
    cell counted, no cell kept or reused, no name, no refusal recorded, and the next call is
    still `<cell-1>`."""
    from agent_sandbox._worker import audit, server
    from agent_sandbox.guards._code_budget import make_code_check

    runner = Runner({"name": "t"}, str(tmp_path))
    check = make_code_check({}, runner.namespace, "t")
    runner.code_check, runner.code_start, runner.reuse_compiled = check, check.start, check.pure
    names = set(runner.namespace)
    # What earlier in-process tests recorded (tests/code's refusals, outside any call) is
    # theirs: it stayed in this process's tally when they ran before this file.
    audit.take()
    server._first_call_ahead(runner)
    assert (runner.calls, runner.cells) == (0, 0)
    assert not runner._compiled and set(runner.namespace) == names
    assert not audit._between.entries
    events: list[tuple[str, Any]] = []
    runner.run("1/0", lambda kind, data: events.append((kind, data)))
    errors = [data for kind, data in events if kind == "error"]
    assert errors and "<cell-1>" in str(errors[0]), events
