"""The agent-sandbox command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "agent_sandbox"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, input=stdin, timeout=60)


def test_run_streams_output_and_prints_the_value() -> None:
    """It prints the code's output and its value, and exits 0."""
    out = run_cli("run", "-c", "print('hi')\n40 + 2")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hi\n"
    assert "value: 42" in out.stderr


def test_run_json_prints_one_object() -> None:
    """It prints the RunResult as one JSON object with --json."""
    out = run_cli("run", "--json", "-c", "print('a')\n[1, 2]")
    assert out.returncode == 0
    data = json.loads(out.stdout)
    assert data["stdout"] == "a\n" and data["value"] == [1, 2] and data["ok"] is True


def test_run_file_and_stdin(tmp_path: Path) -> None:
    """It runs a file, or code from stdin with '-'."""
    script = tmp_path / "s.py"
    script.write_text("print(sum(range(5)))\n")
    assert run_cli("run", str(script)).stdout == "10\n"
    assert run_cli("run", "-", stdin="print('x')").stdout == "x\n"


def test_run_error_exits_non_zero_with_traceback() -> None:
    """It exits 1 and prints the traceback when the code raises."""
    out = run_cli("run", "-c", "1/0")
    assert out.returncode == 1
    assert "ZeroDivisionError" in out.stderr


def test_run_denial_exits_2_and_prints_a_block() -> None:
    """It exits 2 and prints the denials in a readable block."""
    out = run_cli("run", "--timeout", "1", "-c", "import time\ntime.sleep(30)")
    assert out.returncode == 2
    assert "denied (1):" in out.stderr and "[limits.timeout]" in out.stderr
    assert "to allow it" in out.stderr


def test_run_syntax_error() -> None:
    """It reports a syntax error with its position."""
    out = run_cli("run", "-c", "def (")
    assert out.returncode == 1
    assert "SyntaxError" in out.stderr


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    """It names a missing script or policy file."""
    out = run_cli("run", str(tmp_path / "none.py"))
    assert out.returncode == 66 and "cannot read" in out.stderr
    out = run_cli("run", "--policy", str(tmp_path / "none.toml"), "-c", "1")
    assert out.returncode == 78 and "none.toml" in out.stderr
    out = run_cli("run", "--json", str(tmp_path / "none.py"))
    error = json.loads(out.stdout)["error"]
    assert error["type"] == "InputFileError" and error["exit_status"] == 66


def test_a_missing_extends_file_is_named_with_the_file_and_line_that_extend_it(
    tmp_path: Path,
) -> None:
    """It names the policy file and the line of its `extends` when the file it extends is
    missing, not only the missing path."""
    policy = tmp_path / "tool.toml"
    policy.write_text('name = "tool"\nextends = "base.toml"\n')
    out = run_cli("policy", "check", str(policy))
    assert out.returncode == 78
    assert (
        f"{policy}:2: [extends] extends 'base.toml', which names {tmp_path / 'base.toml'}"
        in out.stderr
    )


def test_policy_check_and_explain(tmp_path: Path) -> None:
    """It validates and explains a policy, and reports a bad one with file and line."""
    good = tmp_path / "good.toml"
    good.write_text('name = "good"\n[imports]\nallow = ["json"]\n')
    out = run_cli("policy", "check", str(good))
    assert out.returncode == 0 and "ok: good" in out.stdout
    out = run_cli("policy", "explain", str(good))
    assert "json" in out.stdout and "network:" in out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n[limits]\nwal = 1\n')
    out = run_cli("policy", "check", str(bad))
    assert out.returncode == 78
    assert f"{bad}:3" in out.stderr and "limits.wal" in out.stderr


def test_policy_check_warns_about_a_policy_file_the_tool_may_write(tmp_path: Path) -> None:
    """It warns when the policy file (or one it extends) lies in a `files.write` directory."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "base.toml").write_text('name = "base"\n')
    policy = tools / "tool.toml"
    policy.write_text(f'extends = "base.toml"\nname = "tool"\n[files]\nwrite = ["{tools}"]\n')
    out = run_cli("policy", "check", str(policy))
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 2
    assert str(policy) in warned[0] and str(tools / "base.toml") in warned[1]
    safe = tmp_path / "safe.toml"
    safe.write_text(f'name = "safe"\n[files]\nwrite = ["{tools}"]\n')
    assert "warning" not in run_cli("policy", "check", str(safe)).stdout


def test_policy_list_shows_presets() -> None:
    """It lists the shipped policies."""
    out = run_cli("policy", "list")
    assert "pure-computation" in out.stdout and "data-analysis" in out.stdout


def test_no_command_prints_usage() -> None:
    """It prints usage and exits 64 without a command."""
    out = run_cli()
    assert out.returncode == 64 and "usage" in out.stderr


def test_a_file_keeps_its_name_and_a_syntax_error_points_at_its_line(tmp_path: Path) -> None:
    """It names the script in tracebacks and shows a caret under the bad line."""
    bad = tmp_path / "script.py"
    bad.write_text("x = 1\ny = (2,\nprint(x)\n")
    out = run_cli("run", str(bad))
    assert out.returncode == 1
    assert f'File "{bad}", line 2' in out.stderr and "<cell-" not in out.stderr
    assert "    y = (2,\n        ^" in out.stderr
    boom = tmp_path / "boom.py"
    boom.write_text("def f():\n    return 1/0\nf()\n")
    out = run_cli("run", str(boom))
    assert f'File "{boom}", line 2, in f' in out.stderr and "~^~" in out.stderr
    assert "guards" not in out.stderr and "site-packages" not in out.stderr


def test_a_library_internal_refusal_is_not_a_failure_of_the_cli() -> None:
    """It exits 0 for code whose only refusals a library handled itself."""
    code = "import matplotlib.font_manager as fm\nfm.findSystemFonts()\nprint('ok')"
    out = run_cli("run", "--policy", "data-analysis", "-c", code)
    assert out.returncode == 0, out.stderr
    assert "to allow it" not in out.stderr and "denied" not in out.stderr


def test_text_that_is_not_unicode_cannot_crash_the_cli() -> None:
    """It denies a lone surrogate (`print('\\ud800')`, a returned one, a dict key) the power
    to crash the CLI or make its JSON invalid: each arrives as U+FFFD, in plain and JSON output."""
    code = "print('a\\ud800b')\n{'\\udfff': ['\\ud800']}"
    plain = subprocess.run([*CLI, "run", "-c", code], capture_output=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.decode("utf-8") == "a\ufffdb\n"
    assert "\ufffd" in plain.stderr.decode("utf-8")  # the value line
    as_json = subprocess.run([*CLI, "run", "--json", "-c", code], capture_output=True, timeout=60)
    data = json.loads(as_json.stdout.decode("utf-8"))  # strict UTF-8, valid JSON
    assert data["stdout"] == "a\ufffdb\n" and data["value"] == {"\ufffd": ["\ufffd"]}


WRITES = (
    "import matplotlib.pyplot as plt\n"
    "plt.plot([1, 2]); plt.savefig('sales.png'); print('saved')\n"
    "open('report.csv', 'w').write('a,b\\n1,2\\n')\n"
    "open('we\\nird.txt', 'w').write('x')\n"
    "open('..evil', 'w').write('x')\n"
)


def test_run_writes_what_the_code_produced_to_the_output_directory(tmp_path: Path) -> None:
    """It writes the run's images and files to --out under safe names, lists them, names
    what it did not return and why, and never writes outside the directory."""
    out = tmp_path / "out"
    out.mkdir()
    done = run_cli("run", "-p", "data-analysis", "--out", str(out), "-c", WRITES)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["evil", "report.csv", "sales.png"]
    assert (out / "sales.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "report.csv").read_text() == "a,b\n1,2\n"
    assert f'wrote "{out}/sales.png" (image "sales.png")' in done.stderr
    assert 'not returned: file "we\\x0aird.txt": its name holds control characters' in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing beside it


def test_run_never_overwrites_without_force_and_never_through_a_link(tmp_path: Path) -> None:
    """It denies a run's output the power to replace an existing file (without --force) or
    to write through a link planted in the output directory (even with --force)."""
    (tmp_path / "report.csv").write_text("mine")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link.txt").symlink_to(victim)
    code = "open('report.csv', 'w').write('new')\nopen('link.txt', 'w').write('new')"
    done = run_cli("run", "-p", "data-analysis", "--out", str(tmp_path), "-c", code)
    assert (tmp_path / "report.csv").read_text() == "mine"
    assert "report.csv exists (use --force to replace it)" in done.stderr
    forced = run_cli(
        "run", "--json", "-p", "data-analysis", "--out", str(tmp_path), "--force", "-c", code
    )
    outputs = {o["name"]: o for o in json.loads(forced.stdout)["outputs"]}
    assert (tmp_path / "report.csv").read_text() == "new"
    assert victim.read_text() == "keep" and outputs["link.txt"]["path"] is None
    assert "symbolic links" in outputs["link.txt"]["not_returned"]


def test_run_in_places_files_in_scratch_before_the_run(tmp_path: Path) -> None:
    """`--in FILE` (repeatable) puts each file in the worker's scratch under its base name."""
    (tmp_path / "a.csv").write_text("x,y\n1,2\n")
    (tmp_path / "b.txt").write_text("hello")
    out = run_cli(
        "run",
        "--in",
        str(tmp_path / "a.csv"),
        "--in",
        str(tmp_path / "b.txt"),
        "-c",
        "print(open('a.csv').read().count(','), open('b.txt').read())",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "2 hello\n"


def test_run_in_refuses_a_missing_file_an_oversize_one_and_a_hidden_name(tmp_path: Path) -> None:
    """A missing `--in` file is an input error (66) before any worker starts; one over
    `limits.transfer_mb` and a hidden name are refusals (2) naming their rule."""
    out = run_cli("run", "--in", str(tmp_path / "absent.csv"), "-c", "1")
    assert out.returncode == 66 and "absent.csv" in out.stderr
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (1024 * 1024 + 1))
    policy = tmp_path / "p.toml"
    policy.write_text('name = "small-transfer"\n[limits]\ntransfer_mb = 1\n')
    out = run_cli("run", "--policy", str(policy), "--in", str(big), "-c", "1")
    assert out.returncode == 2, out.stderr
    assert "limits.transfer" in out.stderr
    secret = tmp_path / ".env"
    secret.write_text("TOKEN=1")
    out = run_cli("run", "--in", str(secret), "-c", "1")
    assert out.returncode == 2 and "files.hidden" in out.stderr
