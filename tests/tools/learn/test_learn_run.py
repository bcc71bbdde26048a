"""Learning runs end to end: real workers, real guards, then the learned policy enforced.

Each attack is judged by its effect on the next run (a canary that must not print, a marker
file that must not exist, a policy file that must not change), not by a message.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from agent_sandbox import Sandbox, load_policy
from agent_sandbox._errors import LearningError
from agent_sandbox._tools.learn.observe import learn_run
from agent_sandbox._tools.learn.review import apply_proposal, write_proposal
from agent_sandbox.providers import get_provider

pytestmark = pytest.mark.slow


def _kernel_provider() -> bool:
    names = get_provider("auto").probe().details.get("candidates", ())
    return any(get_provider(n).is_boundary for n in names)


needs_kernel = pytest.mark.skipif(not _kernel_provider(), reason="no kernel provider works here")

#: Each step is tried on its own so one refusal does not hide the next (the kernel provider
#: still refuses what the policy does not declare, and the guard records it first).
STEPS = textwrap.dedent(
    """
    import os
    def step(f):
        try:
            return f()
        except Exception as exc:
            return type(exc).__name__
    """
)


def _learn_and_apply(code: str, policy_file: Path, **kw):
    run = learn_run(code, policy_file, **kw)
    files = write_proposal(run.proposal, expect_digest=run.digest)
    apply_proposal(files.toml)
    return run, load_policy(policy_file)


@needs_kernel
def test_learned_policy_allows_exactly_what_the_run_did(policy_file, tmp_path, monkeypatch):
    """It learns a file, a module and a variable, then the applied policy allows them and refuses the rest."""
    monkeypatch.setenv("LEARN_TEST_REGION", "eu-west")
    monkeypatch.setenv("LEARN_TEST_OTHER", "other")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("alpha")
    (data / "b.csv").write_text("bravo")
    code = STEPS + textwrap.dedent(
        f"""
        import csv
        print(step(lambda: open({str(data / "a.csv")!r}).read()))
        print(step(lambda: os.environ["LEARN_TEST_REGION"]))
        """
    )
    run, learned = _learn_and_apply(code, policy_file)
    assert all(d.learned for d in run.result.denials)
    assert str(data / "a.csv") in learned.files.read
    assert "csv" in learned.imports.allow and "LEARN_TEST_REGION" in learned.env.passthrough

    with Sandbox(learned, provider="auto", warm=0) as sandbox:
        again = sandbox.run(code)
        assert again.ok, again.denials
        assert "alpha" in again.stdout and "eu-west" in again.stdout
        rest = sandbox.run(
            STEPS
            + textwrap.dedent(
                f"""
            print(step(lambda: open({str(data / "b.csv")!r}).read()))
            print(step(lambda: os.environ["LEARN_TEST_OTHER"]))
            try:
                import subprocess
            except ImportError:
                print("no subprocess")
            """
            )
        )
    assert "bravo" not in rest.stdout and "other\n" not in rest.stdout
    assert "no subprocess" in rest.stdout
    assert {d.rule for d in rest.denials} == {"files.read", "env", "imports"}


@needs_kernel
def test_relearning_the_same_code_gives_the_same_proposal(policy_file) -> None:
    """It writes a byte-identical proposal when the same code is learned twice."""
    code = STEPS + "import csv, statistics\nprint(step(lambda: open('/etc/hostname').read()))\n"
    first = learn_run(code, policy_file).proposal.to_toml()
    second = learn_run(code, policy_file).proposal.to_toml()
    assert first == second
    assert '"csv"' in first and '"/etc/hostname", # RISKY' in first


@needs_kernel
def test_blocks_widening_through_a_symlink_planted_in_scratch(policy_file) -> None:
    """It denies a learning run that plants `x -> /` in scratch the power to widen the next run."""
    code = STEPS + textwrap.dedent(
        """
        print(step(lambda: os.symlink("/", "x")))
        print(step(lambda: os.symlink("/etc", "etc-link")))
        print(step(lambda: open("x/etc/hostname").read()))
        print(step(lambda: os.listdir("etc-link")))
        """
    )
    _, learned = _learn_and_apply(code, policy_file)
    grants = set(learned.files.read) | set(learned.files.write)
    assert not grants & {"/", "/etc", "$SCRATCH/x", "$SCRATCH/etc-link"}
    assert all(g == os.path.realpath(g) for g in grants)  # real targets only, never a link
    canary = "root:x:0:0"
    with Sandbox(learned, provider="auto", warm=0) as sandbox:
        after = sandbox.run(
            STEPS
            + textwrap.dedent(
                """
            print(step(lambda: os.symlink("/", "x")))
            print(step(lambda: open("x/etc/passwd").read()))
            print(step(lambda: open("/etc/passwd").read()))
            """
            )
        )
    assert canary not in after.stdout
    assert any(d.rule == "files.read" for d in after.denials)


@needs_kernel
def test_a_read_through_a_link_planted_in_scratch_is_flagged_not_proposed(policy_file) -> None:
    """It flags a path reached through a link the run planted in scratch instead of proposing it."""
    code = STEPS + "print(step(lambda: os.symlink('/etc', 'e')))\n"
    code += "print(step(lambda: open('e/hostname').read()))\n"
    proposal = learn_run(code, policy_file).proposal
    assert "/etc/hostname" not in proposal.proposed.files.read


@needs_kernel
def test_blocks_pth_files_and_shadow_modules_from_preempting_the_next_run(
    policy_file, tmp_path
) -> None:
    """It denies `.pth` files and a shadowing `json.py` written while learning any effect on the next run."""
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "pth-ran"
    policy_file.write_text(policy_file.read_text() + f'\n[files]\nwrite = ["{out}"]\n')
    payload = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')"
    code = STEPS + textwrap.dedent(
        f"""
        for folder in (".", {str(out)!r}):
            print(step(lambda: open(folder + "/json.py", "w").write("print('SHADOWED')")))
            print(step(lambda: open(folder + "/evil.pth", "w").write({payload!r})))
            print(step(lambda: open(folder + "/sitecustomize.py", "w").write({payload!r})))
        print(step(lambda: open({str(tmp_path / "sitecustomize.py")!r}, "w").write("x")))
        """
    )
    run, learned = _learn_and_apply(code, policy_file)
    assert str(tmp_path / "sitecustomize.py") not in learned.files.write
    assert any("start-up" in f.reason for f in run.proposal.flagged)
    with Sandbox(learned, provider="auto", warm=0) as sandbox:
        after = sandbox.run("import json\nprint(json.__file__)")
    assert after.ok and "SHADOWED" not in after.stdout
    assert str(out) not in after.stdout and "/scratch" not in after.stdout
    assert not marker.exists()


@needs_kernel
def test_blocks_a_learning_run_from_editing_its_policy_under_a_kernel_provider(policy_file):
    """It denies the edit (the kernel holds) and flags the attempt in the proposal."""
    before = policy_file.read_bytes()
    code = (
        STEPS
        + f"print(step(lambda: open({str(policy_file)!r}, 'a').write('[files]\\nread=[\"/\"]')))\n"
    )
    run = learn_run(code, policy_file)
    assert policy_file.read_bytes() == before
    assert "/" not in run.proposal.proposed.files.read
    assert any(
        f.field == "files.write" and str(policy_file) in f.value for f in run.proposal.flagged
    )


def test_a_learning_run_cannot_edit_its_own_policy(policy_file) -> None:
    """It denies the edit even in learning mode (no kernel boundary): the file stays as it was."""
    _opt_out(policy_file)  # the test is about the guards: no kernel boundary, explicitly
    before = policy_file.read_bytes()
    code = STEPS + f"print(step(lambda: open({str(policy_file)!r}, 'a').write('# edited\\n')))\n"
    run = learn_run(code, policy_file, provider="subprocess")
    assert "FileAccessDenied" in run.result.stdout  # a PermissionError subclass
    assert policy_file.read_bytes() == before
    assert any(d.rule == "files.write" and not d.learned for d in run.result.denials)


def test_a_policy_edited_during_the_run_yields_no_proposal(policy_file) -> None:
    """It writes no proposal when the policy file changed while the run went on (an edit
    made behind the guards, here by the host itself, is detected afterwards)."""
    import threading

    def edit() -> None:
        time.sleep(0.5)
        with open(policy_file, "a") as fh:
            fh.write("# edited\n")

    _opt_out(policy_file)
    editor = threading.Thread(target=edit)
    editor.start()
    try:
        with pytest.raises(LearningError, match="changed"):
            learn_run("import time\ntime.sleep(2)", policy_file, provider="subprocess")
    finally:
        editor.join()
    assert not policy_file.with_name("tool.proposed.toml").exists()


@needs_kernel
def test_cli_learn_writes_the_proposal_beside_the_policy(policy_file, capsys) -> None:
    """It runs `agent-sandbox learn`, prints the envelope and the diff, and changes nothing else."""
    from agent_sandbox._tools.cli import main

    before = policy_file.read_bytes()
    code = main(["learn", "-c", "import csv\nprint('hi')", "--policy", str(policy_file)])
    out, err = capsys.readouterr()
    assert code == 0
    assert "learning envelope" in err and "ran under:" in err and "+ csv" in out
    assert policy_file.with_name("tool.proposed.toml").exists()
    assert policy_file.with_name("tool.proposed.diff").exists()
    assert policy_file.read_bytes() == before


def test_a_learned_port_is_reached_after_apply_and_others_stay_refused(policy_file) -> None:
    """It learns a loopback HTTP service from the egress proxy's refusal under a namespace
    provider (Landlock alone refuses connect rules: they would be port-only), then the applied
    policy reaches it through the proxy and no other port."""
    import http.server
    import socket
    import threading

    provider = next((n for n in ("bwrap", "unshare") if get_provider(n).probe().available), None)
    if provider is None:
        pytest.skip("no namespace provider is available here")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"hello"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spare = socket.socket()
    spare.bind(("127.0.0.1", 0))
    unused = spare.getsockname()[1]  # bound, never listening: a port nothing answers on
    # A declared loopback rule on another port gives the worker its egress proxy.
    policy_file.write_text(
        policy_file.read_text().replace('"json"]', '"json", "urllib"]')
        + f'\n[[net.rules]]\nhost = "127.0.0.1"\nports = "{unused}"\n'
    )
    send = STEPS + (
        "import urllib.request\n"
        "def send(port):\n"
        "    with urllib.request.urlopen(f'http://127.0.0.1:{port}/', timeout=5) as r:\n"
        "        return r.read().decode()\n"
        f"print(step(lambda: send({port})))\n"
    )
    try:
        run, learned = _learn_and_apply(send, policy_file, provider=provider)
        assert any(
            d.rule == "net.connect" and d.learned and d.target == f"127.0.0.1:{port}"
            for d in run.result.denials
        ), run.result.denials
        assert "hello" not in run.result.stdout  # while learning, the proxy still refused
        assert any(r.host == "127.0.0.1" and r.ports == str(port) for r in learned.net.rules)
        with Sandbox(learned, provider=provider, warm=0) as sandbox:
            ok = sandbox.run(send)
            other = sandbox.run(send.replace(f"send({port})", f"send({port + 1})"))
        assert ok.ok and "hello" in ok.stdout, ok
        assert "net.connect" in [d.rule for d in other.denials], other.denials
    finally:
        server.shutdown()
        server.server_close()
        spare.close()


def test_cli_learn_for_a_shipped_policy_needs_out(tmp_path, capsys) -> None:
    """It refuses to learn for a shipped policy without --out (before running anything), and writes there with it."""
    from agent_sandbox._tools.cli import main

    assert main(["learn", "-c", "import csv", "--policy", "pure-computation"]) == 1
    assert "--out" in capsys.readouterr().err
    code = main(
        ["learn", "-c", "import csv", "--policy", "pure-computation", "--out", str(tmp_path)]
    )
    assert code == 0
    assert (tmp_path / "pure-computation.proposed.toml").exists()


#: Names that read as patterns; none exists, and each is tried literally by the run.
GLOB_NAMES = ("/var/tmp/**", "/var/tmp/*", "/var/tmp/?", "/var/tmp/[a-z]")


@needs_kernel
def test_a_name_that_looks_like_a_glob_is_proposed_as_that_name_only(policy_file) -> None:
    """It proposes each glob-looking name the run tried as an escaped literal, RISKY with
    the reason; applied, the policy reads no other file in /var/tmp (issue 14)."""
    code = STEPS + "".join(f"print(step(lambda: open({n!r}).read()))\n" for n in GLOB_NAMES)
    run, learned = _learn_and_apply(code, policy_file)
    literals = {"/var/tmp/\\*\\*", "/var/tmp/\\*", "/var/tmp/\\?", "/var/tmp/\\[a-z\\]"}
    assert set(learned.files.read) == literals
    header = run.proposal.to_toml()
    for value in literals:
        finding = next(f for f in run.proposal.findings if f.value == value)
        assert finding.status == "risky" and "pattern characters" in finding.reason
        assert f"[files.read] {value}: " in header
    assert f"{len(literals)} RISKY" in header

    canaries = [Path("/var/tmp") / name for name in ("b", "x-canary-14.txt")]
    for canary in canaries:
        canary.write_text("secret-content-14\n")
    try:
        reads = "".join(
            f"print({str(c)!r}, step(lambda: open({str(c)!r}).read()))\n" for c in canaries
        )
        literal_reads = "".join(f"print(step(lambda: open({n!r}).read()))\n" for n in GLOB_NAMES)
        with Sandbox(learned, provider="auto", warm=0) as sandbox:
            result = sandbox.run(STEPS + reads + literal_reads)
    finally:
        for canary in canaries:
            canary.unlink()
    assert "secret-content-14" not in result.stdout
    assert sorted({d.target for d in result.denials}) == sorted(map(str, canaries))
    assert result.stdout.count("FileNotFoundError") == len(GLOB_NAMES)  # granted, absent


def _opt_out(policy_file: Path) -> None:
    """Add the explicit `no_kernel_boundary` opt-out to the policy file (a top-level key)."""
    text = policy_file.read_text()
    policy_file.write_text('no_kernel_boundary = "accepted"\n' + text)
