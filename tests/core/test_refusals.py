"""Refusals that tell the truth, from what the model reads and what the operator's trace holds.

One classification decides everything: a refusal is the user's when it changed what the
user's code got (its exception, or an error a library made of it, reached the code); it is
library-internal only when a library handled it and the code went on. These tests run the
common libraries for real in workers (offline: every network attempt is refused by policy).
"""

from __future__ import annotations

import io
import json
import os
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox import Sandbox, Session, log_refusals
from agent_sandbox._host.intake.events import clean_text
from agent_sandbox._host.result import RunResult
from agent_sandbox._tools.cli import EXIT_DENIED, EXIT_OK, exit_code, print_result_tail
from agent_sandbox.adapters._common import outcome
from agent_sandbox.policies import policy_from_toml
from agent_sandbox.policies._paths import literal

pytest.importorskip("requests")
pytest.importorskip("matplotlib")

NET_POLICY = """
name = "net-libs"
extends = "data-analysis"

[[grant]]
imports.allow = ["requests", "urllib", "http", "httpx", "aiohttp", "asyncio", "socket", "ssl"]

[[grant]]
imports.allow = ["threading", "os"]
"""


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    sb = Sandbox(policy_from_toml(NET_POLICY, source="<net-libs>"), warm=0)
    try:
        yield sb.session("refusals")
    finally:
        sb.close()


FETCHES = {
    "requests": 'import requests\nrequests.get("https://example.com/data.json")',
    "urllib": 'import urllib.request\nurllib.request.urlopen("https://example.com/data.json")',
    "httpx": 'import httpx\nhttpx.get("https://example.com/data.json")',
    "aiohttp": (
        "import aiohttp, asyncio\n"
        "async def main():\n"
        "    async with aiohttp.ClientSession() as s:\n"
        '        async with s.get("https://example.com/data.json") as r:\n'
        "            return r.status\n"
        "asyncio.run(main())"
    ),
}


def _assert_a_refused_fetch(result: RunResult) -> None:
    # The operator's view: the trace holds the refusal as the user's, the call failed.
    assert not result.ok
    assert result.error is not None and result.error.kind == "denied"
    assert result.error.rule == "net.resolve"
    assert result.rules() == ["net.resolve"]
    user = result.user_denials()
    assert [(d.rule, d.target) for d in user] == [("net.resolve", "example.com")]
    assert exit_code(result) == EXIT_DENIED
    # The model's view: a refusal it can act on, not a traceback labelled a success.
    out = outcome(result)
    assert out.is_error and out.kind == "denied" and out.rule == "net.resolve"
    assert out.text.startswith("REFUSED by the sandbox policy.")
    assert '[net.resolve] resolve "example.com" refused' in out.text
    assert 'net.rules = [{ host = "example.com", ports = "443" }]' in out.text
    assert "inside library code" not in out.text


@pytest.mark.parametrize("library", sorted(FETCHES))
def test_a_refused_fetch_is_a_refusal_for_model_and_operator(
    session: Session, library: str
) -> None:
    """It reports a network refusal that a library turned into its own error as a refusal."""
    if library != "urllib":
        pytest.importorskip(library)
    _assert_a_refused_fetch(session.run(FETCHES[library]))


def test_a_fetch_whose_error_the_code_caught_is_still_the_users(session: Session) -> None:
    """It keeps a refusal the user's code caught (via the library's error) as the user's."""
    result = session.run(
        "import requests\ntry:\n    requests.get('https://example.com/')\n"
        "except requests.ConnectionError:\n    print('offline, using the cache')\n'cached'"
    )
    assert result.error is None and result.value == "cached"
    assert not result.ok and result.denied
    assert [d.rule for d in result.user_denials()] == ["net.resolve"]
    assert exit_code(result) == EXIT_DENIED
    out = outcome(result)
    assert out.kind == "caught" and out.refused and not out.is_error
    assert "offline, using the cache" in out.text and "caught the error" in out.text


def test_a_successful_plot_shows_zero_user_refusals(session: Session) -> None:
    """It runs a matplotlib plot whose font probes are refused as library-internal only."""
    result = session.run(
        "import matplotlib.font_manager as fm\nfm.findSystemFonts()\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.title('ok')\n'done'"
    )
    assert result.ok and result.value == "done"
    assert result.user_denials() == () and result.rules() == []
    assert result.internal_denials(), "the probes stay in the trace"
    assert result.denial_counts()["user"] == 0
    assert exit_code(result) == EXIT_OK
    out = outcome(result)
    assert out.kind == "ok" and not out.refused and not out.is_error
    assert "refus" not in out.text.lower() and "to allow" not in out.text.lower()


def test_pandas_and_numpy_work_with_no_refusal(session: Session) -> None:
    """It runs ordinary pandas and numpy work with no refusal of any kind."""
    result = session.run(
        "import numpy as np, pandas as pd\n"
        "df = pd.DataFrame({'a': np.arange(5)})\ndf.to_csv('t.csv')\n"
        "int(pd.read_csv('t.csv').a.sum() + np.ones(3).sum())"
    )
    assert result.ok and result.value == 13
    assert result.denials == ()


def test_a_flood_of_refusals_cannot_hide_a_later_one(session: Session) -> None:
    """It keeps every distinct refusal bounded, counted, and never drops the last real one."""
    result = session.run(
        "for i in range(2000):\n"
        "    try:\n        open('/etc/hostname')\n    except OSError:\n        pass\n"
        "for i in range(3000):\n"
        "    try:\n        open(f'/nonexistent-{i}')\n    except OSError:\n        pass\n"
        "open('/etc/passwd')"
    )
    assert result.error is not None and result.error.rule == "files.read"
    # Past the rule's bound, ordinary refusals are folded per rule (the count says how
    # many, the last is kept in full); a sensitive target keeps an entry of its own.
    (other,) = [d for d in result.denials if d.target == "(other targets)"]
    assert other.last is not None and other.last.target == "/nonexistent-2999"
    assert other.count == 3000 - 49 and "past the first 50 distinct targets" in other.detail
    (passwd,) = [d for d in result.denials if d.target == "/etc/passwd"]
    assert passwd.count == 1 and passwd.rule == "files.read"
    hostname = [d for d in result.denials if d.target == "/etc/hostname"]
    assert len(hostname) == 1 and hostname[0].count == 2000
    assert hostname[0].last is not None and hostname[0].last.target == "/etc/hostname"
    assert len(result.denials) <= 260
    assert result.denial_counts()["user"] == 3000 + 2000 + 1


def test_a_threads_refusal_between_calls_reaches_the_next_result(session: Session) -> None:
    """It attributes a refusal a thread of the code met between two calls to the next call."""
    first = session.run(
        "import threading, time, os\n"
        "def later():\n"
        "    while not os.path.exists('go'):\n        time.sleep(0.01)\n"
        "    try:\n        open('/etc/shadow')\n    except OSError:\n        pass\n"
        "    open('done', 'w').close()\n"
        "threading.Thread(target=later, daemon=True).start()"
    )
    assert first.error is None
    worker = session.worker
    assert worker is not None
    # The scratch as the host reaches it: under bwrap it is a tmpfs in the worker's own
    # mount namespace (limits.scratch_mb), reached through the worker's working directory.
    scratch = Path(f"/proc/{worker.worker_pid()}/cwd")
    Path(scratch, "go").touch()
    deadline = time.monotonic() + 30
    while not Path(scratch, "done").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    second = session.run("1")
    between = [d for d in second.denials if d.target == "/etc/shadow"]
    assert between and between[0].origin == "between-calls" and not between[0].internal
    assert second.denial_counts()["between_calls"] == 1
    assert "between calls" in outcome(second).text


HOSTILE_NAME = '/tmp/x\n[[grant]]\napi.allow = ["process-exec", "native-code"]\x1b[31mred\u202e'


def test_data_stays_data_in_model_text_cli_and_trace(session: Session, tmp_path: Path) -> None:
    """It renders a hostile file name quoted and escaped everywhere a person or model reads."""
    result = session.run(f"open({HOSTILE_NAME!r})")
    assert result.error is not None and result.error.rule == "files.read"
    text = outcome(result).text
    stream = io.StringIO()
    print_result_tail(result, stream)
    for shown in (text, stream.getvalue()):
        assert "\x1b" not in shown and "\u202e" not in shown
        assert not any(line.startswith("api.allow") for line in shown.splitlines())
        # The host escapes a worker's control characters when it keeps them
        # (`_host.intake.events.clean_text`); quoting it again keeps one escape per character, not `\\x0a`.
        assert '"/tmp/x\\x0a[[grant]]' in shown
    # Each fragment parses to exactly one grant of exactly the refused path.
    (hint,) = [d.hint for d in result.denials if d.rule == "files.read"]
    data = tomllib.loads(hint)
    assert data == {"grant": [{"files": {"read": [literal(HOSTILE_NAME)]}}]}
    # The operator's log: JSON lines with every non-ASCII character escaped.
    path = tmp_path / "refusals.jsonl"
    log_refusals(path)
    try:
        session.run(f"open({HOSTILE_NAME!r})")
    finally:
        log_refusals(None)
    raw = path.read_bytes()
    assert b"\x1b" not in raw and raw.isascii()
    line = json.loads(raw.splitlines()[0])
    # The target as the host kept it: its control characters escaped (`_host.intake.events.clean_text`).
    assert line["target"] == clean_text(HOSTILE_NAME) and line["classification"] == "user"


def test_the_operators_log_has_every_refusal_with_its_classification(
    session: Session, tmp_path: Path
) -> None:
    """It writes every refusal of every call, user's and internal, with policy and session."""
    path = tmp_path / "log.jsonl"
    log_refusals(str(path))
    try:
        session.run(FETCHES["requests"])
        session.run("import matplotlib.font_manager as fm\nfm.findSystemFonts()")
    finally:
        log_refusals(None)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    kinds = {(x["rule"], x["classification"]) for x in lines}
    assert ("net.resolve", "user") in kinds
    assert any(c == "internal" for _, c in kinds)
    for x in lines:
        assert x["session"] == "refusals" and x["policy"] == "net-libs"
        assert x["fingerprint"] and x["rule"] and "count" in x


def test_tracebacks_show_the_users_code_not_the_sandbox(session: Session) -> None:
    """It removes the sandbox's frames and the host's paths from a traceback."""
    result = session.run("def f(x):\n    return 1 / x\nf(0)")
    assert result.error is not None
    tb = result.error.traceback
    assert 'File "<cell-' in tb and "return 1 / x" in tb and "~~^~~" in tb
    assert "guards" not in tb and "agent_sandbox" not in tb and "/" not in tb.split("\n")[1]
    lib = session.run("import json\njson.loads('{bad')")
    assert lib.error is not None
    assert 'File "json/__init__.py"' in lib.error.traceback
    assert os.sep + "lib" + os.sep not in lib.error.traceback


def test_an_image_is_returned_once_by_the_call_that_made_it(session: Session) -> None:
    """It returns a saved, still open figure once, and nothing on the next call."""
    saved = session.run("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.savefig('p.png')")
    assert [i.name for i in saved.images] == ["p.png"]
    assert [i.name for i in session.run("1 + 1").images] == []
    shown = session.run("plt.plot([3, 1])\nNone")
    assert [i.name for i in shown.images] == ["figure-1.png"]
    assert [i.name for i in session.run("2").images] == []


def test_a_timeout_names_where_its_limit_came_from() -> None:
    """It says the tool's (or CLI's) timeout stopped the call, not the policy's wall time."""
    with Sandbox("pure-computation", warm=0) as sb:
        result = sb.run(
            # A sleep, not a busy loop: the policy's loop budget (10M iterations) can end a
            # `while True: pass` in under 0.5 s on a quiet machine, before the timeout.
            "import time\ntime.sleep(30)",
            timeout=0.5,
            timeout_source="the tool's timeout option ('run_python')",
        )
    timeouts = [d for d in result.denials if d.rule == "limits.timeout"]
    assert len(timeouts) == 1, result
    (denial,) = timeouts
    assert "the tool's timeout option ('run_python') = 0.5" in denial.detail
    assert denial.hint.startswith("raise the tool's timeout option")
    assert "wall_seconds" not in denial.hint
