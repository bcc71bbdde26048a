"""Writing a proposal beside the policy, the diff, and applying it as an explicit step.

Root ignores file permissions, so "not writable" is made here with things that stop root
too: the immutable attribute on the policy's directory (`chattr +i`, probed and skipped when
the file system refuses it), a directory under `/proc`, and a "directory" that is a file.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_sandbox import load_policy
from agent_sandbox._errors import LearningError
from agent_sandbox._tools.cli import main
from agent_sandbox._tools.learn.observe import Learner
from agent_sandbox._tools.learn.propose import propose
from agent_sandbox._tools.learn.review import apply_proposal, write_proposal
from agent_sandbox.policies import policy_from_toml


@pytest.fixture
def proposal(policy, learned, home):
    return propose(
        policy,
        [
            learned("imports", "csv"),
            learned("imports", "subprocess"),
            learned("files.read", "/etc/shadow"),
        ],
        home=str(home),
    )


@contextlib.contextmanager
def _immutable(folder: Path) -> Iterator[None]:
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("chattr is not installed")
    done = subprocess.run([chattr, "+i", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"the file system refuses the immutable attribute: {done.stderr!r}")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(folder)], check=True)


def test_the_proposal_is_written_beside_the_policy(proposal, policy_file) -> None:
    """It writes <name>.proposed.toml and <name>.proposed.diff next to the policy, which stays as is."""
    before = policy_file.read_bytes()
    files = write_proposal(proposal)
    assert files.toml == policy_file.with_name("tool.proposed.toml")
    assert files.diff == policy_file.with_name("tool.proposed.diff")
    assert policy_file.read_bytes() == before
    loaded = load_policy(files.toml)
    assert "csv" in loaded.imports.allow and "/etc/shadow" not in loaded.files.read
    diff = files.diff.read_text()
    assert "+ csv" in diff and "RISKY" in diff and "! [files.read] /etc/shadow" in diff


def test_a_symlinked_proposal_target_is_refused(proposal, policy_file, tmp_path) -> None:
    """It denies writing the proposal through a symlink planted at its name; the link's target is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    policy_file.with_name("tool.proposed.toml").symlink_to(victim)
    with pytest.raises(LearningError, match="symlink"):
        write_proposal(proposal)
    assert victim.read_text() == "keep me"


def test_a_symlinked_diff_target_is_refused(proposal, policy_file, tmp_path) -> None:
    """It denies writing the diff through a symlink too."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    policy_file.with_name("tool.proposed.diff").symlink_to(victim)
    with pytest.raises(LearningError, match="symlink"):
        write_proposal(proposal)
    assert victim.read_text() == "keep me"


def test_an_immutable_policy_directory_is_a_clear_error(proposal, policy_file) -> None:
    """It raises LearningError naming the path when the policy's directory cannot be written (even by root)."""
    with _immutable(policy_file.parent), pytest.raises(LearningError) as info:
        write_proposal(proposal)
    assert "tool.proposed.toml" in str(info.value) and "cannot write" in str(info.value)
    assert not policy_file.with_name("tool.proposed.toml").exists()


@pytest.mark.parametrize("where", ["/proc/1", "file"])
def test_an_unwritable_out_dir_is_a_clear_error(proposal, tmp_path, where) -> None:
    """It raises LearningError for a directory under /proc or a "directory" that is a file."""
    folder = Path(where)
    if where == "file":
        folder = tmp_path / "plain-file"
        folder.write_text("")
    with pytest.raises(LearningError, match="cannot write"):
        write_proposal(proposal, out_dir=folder)


def test_a_policy_edited_during_the_run_blocks_the_proposal(proposal, policy_file) -> None:
    """It refuses to write a proposal when the policy file changed since the run began."""
    from agent_sandbox._tools.learn.review import file_digest

    digest = file_digest(policy_file)
    policy_file.write_text(policy_file.read_text() + '\n[files]\nread = ["/"]\n')
    with pytest.raises(LearningError, match="changed"):
        write_proposal(proposal, expect_digest=digest)
    assert not policy_file.with_name("tool.proposed.toml").exists()


def test_a_policy_without_a_file_needs_an_out_dir(learned, tmp_path, home) -> None:
    """It asks for a directory when the policy was not loaded from a file."""
    from agent_sandbox import Policy

    proposal = propose(Policy(name="mem"), [learned("imports", "csv")], home=str(home))
    with pytest.raises(LearningError, match="out_dir"):
        write_proposal(proposal)
    files = write_proposal(proposal, out_dir=tmp_path)
    assert files.toml == tmp_path / "mem.proposed.toml"


# -- apply ------------------------------------------------------------------------------


def test_apply_adds_a_grant_and_refuses_a_symlink(proposal, policy_file, tmp_path) -> None:
    """It keeps the policy file byte for byte, appends the accepted additions as a [[grant]],
    leaves out what the review flagged, and refuses a target that is a symlink."""
    before = policy_file.read_text()
    files = write_proposal(proposal)
    written = apply_proposal(files.toml)
    assert written == policy_file
    applied = policy_file.read_text()
    assert applied.startswith(before)
    assert "[[grant]]" in applied[len(before) :]
    loaded = load_policy(policy_file)
    assert "csv" in loaded.imports.allow and "/etc/shadow" not in loaded.files.read
    again = apply_proposal(files.toml)  # nothing new: the file is left alone
    assert again == policy_file and policy_file.read_text() == applied
    link = tmp_path / "linked.toml"
    link.symlink_to(policy_file)
    with pytest.raises(LearningError, match="symlink"):
        apply_proposal(files.toml, link)


def test_apply_keeps_extends_and_comments_of_a_short_policy(learned, tmp_path) -> None:
    """A 5-line policy that extends a preset stays those 5 lines, plus the grant; what it
    inherited is still allowed after the apply (the grant adds, it does not replace)."""
    folder = tmp_path / "tools"
    folder.mkdir()
    target = folder / "analyst.toml"
    mine = (
        "# my analyst tool\n"
        'name = "analyst"\n'
        'extends = "data-analysis"  # the shipped preset\n'
        "[limits]\n"
        "wall_seconds = 60\n"
    )
    target.write_text(mine)
    proposal = propose(load_policy(target), [learned("imports", "tomllib")], home=str(tmp_path))
    files = write_proposal(proposal)
    apply_proposal(files.toml)
    applied = target.read_text()
    assert applied.startswith(mine)
    assert len(applied.splitlines()) < 12, applied
    loaded = load_policy(target)
    assert "tomllib" in loaded.imports.allow and "math" in loaded.imports.allow
    assert loaded.limits.wall_seconds == 60


def _cli(argv: list[str], stdin: str, monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_apply_asks_before_writing(proposal, policy_file, monkeypatch, capsys) -> None:
    """It writes nothing without a `y` (or `--yes`), shows the diff first, then applies on `y`."""
    files = write_proposal(proposal)
    before = policy_file.read_text()
    code, out, err = _cli(["policy", "apply", str(files.toml)], "\n", monkeypatch, capsys)
    assert code == 1 and "not applied" in err and "+ csv" in out
    assert policy_file.read_text() == before
    code, _, _ = _cli(["policy", "apply", str(files.toml)], "n\n", monkeypatch, capsys)
    assert code == 1 and policy_file.read_text() == before
    code, _, err = _cli(["policy", "apply", str(files.toml)], "y\n", monkeypatch, capsys)
    assert code == 0 and "applied" in err
    assert "csv" in policy_from_toml(policy_file.read_text()).imports.allow


def test_cli_apply_yes_and_an_immutable_target(proposal, policy_file, monkeypatch, capsys):
    """It applies with --yes without reading stdin, and reports an unwritable target as an error."""
    files = write_proposal(proposal)
    with _immutable(policy_file.parent):
        code, _, err = _cli(["policy", "apply", str(files.toml), "--yes"], "", monkeypatch, capsys)
        assert code == 1 and "cannot write" in err
    code, _, _ = _cli(["policy", "apply", str(files.toml), "--yes"], "", monkeypatch, capsys)
    assert code == 0 and "csv" in load_policy(policy_file).imports.allow


def test_cli_policy_diff_shows_additions_and_marks(proposal, policy_file, monkeypatch, capsys):
    """It prints the entries a proposal adds, with its RISKY marks."""
    files = write_proposal(proposal)
    code, out, _ = _cli(
        ["policy", "diff", str(policy_file), str(files.toml)], "", monkeypatch, capsys
    )
    assert code == 0
    assert "[imports.allow]" in out and "+ csv" in out
    assert "+ subprocess    # RISKY" in out


# -- the adapter hook -------------------------------------------------------------------


def test_learner_writes_one_proposal_per_tool(policy, policy_file, learned, tmp_path) -> None:
    """It collects results per tool across calls and writes one proposal for each."""
    from agent_sandbox import Policy, RunResult

    learner = Learner(out_dir=tmp_path / "out")
    (tmp_path / "out").mkdir()
    other = Policy(name="other")
    learner.record("analyst", policy, RunResult(denials=(learned("imports", "csv"),)))
    learner.record("analyst", policy, RunResult(denials=(learned("imports", "statistics"),)))
    learner.record("fetcher", other, RunResult(denials=(learned("env", "TZ"),)))
    written = learner.write()
    assert sorted(written) == ["analyst", "fetcher"]
    analyst = load_policy(written["analyst"].toml)
    assert analyst.imports.allow[-2:] == ("csv", "statistics")
    assert load_policy(written["fetcher"].toml).env.passthrough == ("TZ",)


def test_learner_refuses_a_policy_edited_during_the_conversation(policy, policy_file, learned):
    """It refuses to write when the tool's policy file changed after the first recorded call."""
    from agent_sandbox import RunResult

    learner = Learner()
    learner.record("analyst", policy, RunResult(denials=(learned("imports", "csv"),)))
    policy_file.write_text(policy_file.read_text().replace('"math"', '"math", "os"'))
    with pytest.raises(LearningError, match="changed"):
        learner.write()
