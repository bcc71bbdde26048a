"""The file guard, in-process: each route and each tricky path form, judged by its effect.

Root bypasses file permissions here, so every refusal below comes from the guard alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox._errors import FileAccessDenied, HiddenPathDenied

CANARY = "canary-files-5d1e"
MODULES = [
    "os", "io", "pathlib", "shutil", "glob", "tempfile", "gzip", "bz2", "lzma", "zipfile",
    "tarfile", "sqlite3", "codecs", "linecache", "fileinput", "_io",
]  # fmt: skip


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    public = tmp_path / "public"
    public.mkdir()
    (public / "data.txt").write_text("public data")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "canary.txt").write_text(CANARY)
    (public / ".env").write_text(f"TOKEN={CANARY}")
    (public / "server.pem").write_text(CANARY)
    out = tmp_path / "out"
    out.mkdir()
    return {"public": public, "secret": secret, "out": out, "root": tmp_path}


@pytest.fixture
def guard(armed: Callable[..., Any], tree: dict[str, Path]) -> Any:
    harness = armed(
        files={"read": [str(tree["public"])], "write": [str(tree["out"])]},
        imports={"allow": MODULES},
    )
    harness.run("import " + ", ".join(MODULES))
    return harness


def attempt(guard: Any, body: str) -> Any:
    """Run `body` (an expression) as user code; returns its value or the exception type name."""
    guard.run(
        f"try:\n    result = {body}\nexcept Exception as exc:\n    result = type(exc).__name__\n"
    )
    return guard.namespace["result"]


def test_allows_reading_a_granted_file(guard: Any, tree: dict[str, Path]) -> None:
    """It allows reading inside `files.read`."""
    assert attempt(guard, f"open({str(tree['public'] / 'data.txt')!r}).read()") == "public data"


@pytest.mark.parametrize(
    "body",
    [
        "open(SECRET).read()",
        "io.open(SECRET).read()",
        "io.FileIO(SECRET).read()",
        "__import__('_io').FileIO(SECRET).read()",
        "os.read(os.open(SECRET, os.O_RDONLY), 100)",
        "pathlib.Path(SECRET).read_text()",
        "pathlib.Path(SECRET).read_bytes()",
        "codecs.open(SECRET).read()",
        "linecache.getline(SECRET, 1)",
        "''.join(fileinput.input(SECRET))",
        "shutil.copyfile(SECRET, OUT + '/copy.txt') and open(OUT + '/copy.txt').read()",
        "os.listdir(SECRET_DIR)",
        "glob.glob(SECRET_DIR + '/*')",
        "[e.name for e in os.scandir(SECRET_DIR)]",
        "list(os.walk(SECRET_DIR))",
        "gzip.open(SECRET).read()",
        "zipfile.ZipFile(SECRET)",
        "tarfile.open(SECRET)",
        "sqlite3.connect(SECRET_DIR + '/db.sqlite').execute('select 1').fetchall()",
    ],
)
def test_blocks_reading_outside_the_policy(guard: Any, tree: dict[str, Path], body: str) -> None:
    """It denies every ordinary read route to a file outside `files.read`."""
    secret = str(tree["secret"] / "canary.txt")
    guard.namespace.update(SECRET=secret, SECRET_DIR=str(tree["secret"]), OUT=str(tree["out"]))
    guard.run("import " + ", ".join(MODULES))
    result = attempt(guard, body)
    assert CANARY not in repr(result)
    assert "canary.txt" not in repr(result)
    assert not (tree["out"] / "copy.txt").exists()
    assert not (tree["secret"] / "db.sqlite").exists()
    assert any(d.rule == "files.read" or d.rule == "files.write" for d in guard.denials())


@pytest.mark.parametrize(
    "body, created",
    [
        ("open(PUBLIC + '/new.txt', 'w').write('x')", "public/new.txt"),
        ("pathlib.Path(PUBLIC + '/new.txt').write_text('x')", "public/new.txt"),
        ("os.open(PUBLIC + '/new.txt', os.O_CREAT | os.O_WRONLY)", "public/new.txt"),
        ("os.mkdir(PUBLIC + '/newdir')", "public/newdir"),
        ("os.makedirs(PUBLIC + '/a/b')", "public/a"),
        ("shutil.copy(PUBLIC + '/data.txt', PUBLIC + '/new.txt')", "public/new.txt"),
        ("os.rename(PUBLIC + '/data.txt', OUT + '/moved.txt')", "out/moved.txt"),
        ("os.link(PUBLIC + '/data.txt', OUT + '/hard.txt')", "out/hard.txt"),
        ("os.symlink('/etc', PUBLIC + '/link')", "public/link"),
        ("tempfile.mkstemp(dir=PUBLIC)", "public/tmp"),
        ("gzip.open(PUBLIC + '/new.gz', 'wb').write(b'x')", "public/new.gz"),
        ("sqlite3.connect(PUBLIC + '/new.db').execute('create table t(x)')", "public/new.db"),
    ],
)
def test_blocks_writing_outside_the_policy(
    guard: Any, tree: dict[str, Path], body: str, created: str
) -> None:
    """It denies creating, moving, linking and writing outside `files.write`."""
    guard.namespace.update(PUBLIC=str(tree["public"]), OUT=str(tree["out"]))
    guard.run("import " + ", ".join(MODULES))
    attempt(guard, body)
    target = tree["root"] / created
    siblings = [p.name for p in tree["public"].iterdir()]
    assert not target.exists() and not any(n.startswith("tmp") for n in siblings)
    assert (tree["public"] / "data.txt").read_text() == "public data"
    assert any(d.rule == "files.write" for d in guard.denials())


def test_blocks_deleting_a_readable_file(guard: Any, tree: dict[str, Path]) -> None:
    """It denies deleting a file that is only readable."""
    attempt(guard, f"os.remove({str(tree['public'] / 'data.txt')!r})")
    attempt(guard, f"shutil.rmtree({str(tree['public'])!r})")
    assert (tree["public"] / "data.txt").exists()


def test_allows_writing_in_scratch_and_granted_dirs(guard: Any, tree: dict[str, Path]) -> None:
    """It allows the scratch directory (always) and `files.write`."""
    scratch = guard.scratch
    assert attempt(guard, f"open({scratch + '/a.txt'!r}, 'w').write('abc')") == 3
    assert attempt(guard, f"open({str(tree['out'] / 'b.txt')!r}, 'w').write('abc')") == 3
    assert attempt(guard, f"tempfile.mkstemp(dir={scratch!r})[1].startswith({scratch!r})") is True


def test_blocks_symlink_swap(guard: Any, tree: dict[str, Path]) -> None:
    """It denies a read through a link planted in scratch, decided on the resolved path."""
    link = os.path.join(guard.scratch, "link")
    guard.run(f"import os\nos.symlink({str(tree['secret'])!r}, {link!r})")
    result = attempt(guard, f"open({link + '/canary.txt'!r}).read()")
    assert result == "FileAccessDenied"
    denial = guard.denials()[-1]
    assert denial.target == str(tree["secret"] / "canary.txt")
    assert f"(requested as '{link}/canary.txt')" in denial.detail


def test_blocks_a_swap_after_an_allowed_decision(guard: Any, tree: dict[str, Path]) -> None:
    """It does not reuse an allowed decision once the link below it points elsewhere."""
    link = os.path.join(guard.scratch, "dir")
    guard.run(f"import os\nos.symlink({str(tree['public'])!r}, {link!r})")
    (tree["public"] / "canary.txt").write_text("fine")
    assert attempt(guard, f"open({link + '/canary.txt'!r}).read()") == "fine"
    guard.run(f"os.remove({link!r})\nos.symlink({str(tree['secret'])!r}, {link!r})")
    result = attempt(guard, f"open({link + '/canary.txt'!r}).read()")
    assert result == "FileAccessDenied"


def test_blocks_dotdot_escape(guard: Any, tree: dict[str, Path]) -> None:
    """It denies `..` that climbs from a granted directory to a secret one."""
    path = str(tree["public"]) + "/../secret/canary.txt"
    assert attempt(guard, f"open({path!r}).read()") == "FileAccessDenied"


def test_blocks_dir_fd_escape(guard: Any, tree: dict[str, Path]) -> None:
    """It resolves `dir_fd` before judging a relative path."""
    guard.run(f"import os\nfd = os.open({str(tree['public'])!r}, os.O_RDONLY)")
    result = attempt(guard, "os.read(os.open('../secret/canary.txt', os.O_RDONLY, dir_fd=fd), 99)")
    assert result == "FileAccessDenied"
    assert attempt(guard, "os.stat('data.txt', dir_fd=fd).st_size") == len("public data")


def test_relative_paths_follow_chdir(guard: Any, tree: dict[str, Path]) -> None:
    """It judges a relative path against the directory the code changed to."""
    guard.run(f"import os\nos.chdir({str(tree['public'])!r})")
    assert attempt(guard, "open('data.txt').read()") == "public data"
    assert attempt(guard, "open('../secret/canary.txt').read()") == "FileAccessDenied"


def test_relative_paths_follow_fchdir(guard: Any, tree: dict[str, Path]) -> None:
    """It follows `os.fchdir` too, so a relative write is judged where it really lands."""
    guard.run(
        f"import os\nos.chdir({guard.scratch!r})\nfd = os.open({str(tree['public'])!r}, os.O_RDONLY)"
    )
    guard.run("os.fchdir(fd)")
    assert attempt(guard, "open('planted.txt', 'w').write('x')") == "FileAccessDenied"
    assert not (tree["public"] / "planted.txt").exists()


def test_bytes_and_pathlike_paths_are_judged(guard: Any, tree: dict[str, Path]) -> None:
    """It judges bytes paths and PathLike objects like strings."""
    secret = str(tree["secret"] / "canary.txt")
    assert attempt(guard, f"open({secret.encode()!r}).read()") == "FileAccessDenied"
    assert attempt(guard, f"os.stat(pathlib.PurePath({secret!r}))") == "HiddenPathDenied"


def test_a_refused_stat_looks_like_a_missing_path(guard: Any, tree: dict[str, Path]) -> None:
    """It answers a stat-only probe outside the policy like a missing path (ENOENT)."""
    secret = str(tree["secret"] / "canary.txt")
    assert attempt(guard, f"pathlib.Path({secret!r}).exists()") is False
    assert attempt(guard, f"os.path.isfile({secret!r})") is False
    assert attempt(guard, f"os.stat({secret!r})") == "HiddenPathDenied"
    assert attempt(guard, f"open({secret!r})") == "FileAccessDenied"


def test_blocks_a_pathlike_that_changes_its_answer(guard: Any, tree: dict[str, Path]) -> None:
    """It converts a PathLike once, so the call gets the path that was judged."""
    guard.run(
        "class Shifty:\n"
        "    calls = 0\n"
        "    def __fspath__(self):\n"
        "        Shifty.calls += 1\n"
        f"        return {str(tree['public'] / 'data.txt')!r} if Shifty.calls == 1 "
        f"else {str(tree['secret'] / 'canary.txt')!r}\n"
    )
    result = attempt(guard, "open(Shifty()).read()")
    assert result == "public data"


def test_fileio_instance_checks_still_hold(guard: Any, tree: dict[str, Path]) -> None:
    """It keeps `isinstance(raw, io.FileIO)` true for files that `open()` made."""
    path = str(tree["public"] / "data.txt")
    assert attempt(guard, f"isinstance(open({path!r}, 'rb').raw, io.FileIO)") is True
    assert attempt(guard, f"io.FileIO({path!r}).read()") == b"public data"


def test_file_descriptors_pass(guard: Any, tree: dict[str, Path]) -> None:
    """It lets an already-judged descriptor be reused."""
    guard.run(f"import os\nfd = os.open({str(tree['public'] / 'data.txt')!r}, os.O_RDONLY)")
    assert attempt(guard, "open(fd).read()") == "public data"


def test_odd_paths_fail_cleanly(guard: Any, tree: dict[str, Path]) -> None:
    """It handles a huge path, a NUL byte and a symlink loop without crashing the guard."""
    assert attempt(guard, "open('/' + 'a' * 100000)") == "FileAccessDenied"
    assert attempt(guard, f"open({guard.scratch!r} + '/' + 'a' * 5000, 'w')") == "OSError"
    assert attempt(guard, "open('/tmp/x\\x00y')") == "ValueError"
    guard.run(
        f"os.symlink('b', {guard.scratch + '/a'!r})\nos.symlink('a', {guard.scratch + '/b'!r})"
    )
    assert attempt(guard, f"open({guard.scratch + '/a'!r})") == "OSError"


def test_hidden_names_look_absent(guard: Any, tree: dict[str, Path]) -> None:
    """It makes `.env` and `*.pem` look absent even inside a readable directory."""
    env = str(tree["public"] / ".env")
    assert attempt(guard, f"open({env!r}).read()") == "HiddenPathDenied"
    assert attempt(guard, f"os.path.exists({env!r})") is False
    assert attempt(guard, f"pathlib.Path({str(tree['public'] / 'server.pem')!r}).read_text()") == (
        "HiddenPathDenied"
    )
    assert issubclass(HiddenPathDenied, FileNotFoundError)
    assert "files.hidden" in {d.rule for d in guard.denials()}


def test_stat_of_a_parent_of_a_readable_root_is_allowed(guard: Any, tree: dict[str, Path]) -> None:
    """It allows `exists` on the parents of a readable root, not listing them."""
    assert attempt(guard, f"os.path.isdir({str(tree['root'])!r})") is True
    assert attempt(guard, f"os.listdir({str(tree['root'])!r})") == "FileAccessDenied"


def test_blocks_the_control_directory(guard: Any) -> None:
    """It denies the worker's control directory (socket, log) while scratch stays writable."""
    control = os.path.dirname(guard.scratch)
    assert attempt(guard, f"open({control + '/worker.log'!r}, 'w')") == "FileAccessDenied"
    assert attempt(guard, f"os.listdir({control!r})") == "FileAccessDenied"
    assert not os.path.exists(os.path.join(control, "worker.log"))


def test_blocks_rewriting_the_policy_file(armed: Callable[..., Any], tmp_path: Path) -> None:
    """It denies writing the policy file even inside a writable directory."""
    from agent_sandbox.policies import load_policy

    policy_file = tmp_path / "tool.toml"
    text = f'name = "tool"\n[files]\nwrite = ["{tmp_path}"]\n[imports]\nallow = ["os"]\n'
    policy_file.write_text(text)
    guard = armed(policy=load_policy(policy_file))
    assert attempt(guard, f"open({str(policy_file)!r}, 'w').write('x')") == "FileAccessDenied"
    assert attempt(guard, f"open({str(tmp_path / 'other.txt')!r}, 'w').write('x')") == 1
    assert policy_file.read_text() == text


def test_deny_beats_write_and_scratch_placeholder(
    armed: Callable[..., Any], tmp_path: Path
) -> None:
    """It lets `files.deny` beat a write grant, and expands `$SCRATCH`."""
    guard = armed(files={"deny": ["$SCRATCH/locked"]}, imports={"allow": ["os"]})
    locked = guard.scratch + "/locked"
    assert attempt(guard, f"open({locked!r}, 'w')") == "FileAccessDenied"
    assert guard.denials()[-1].hint == f"remove {guard.scratch + '/locked'!r} from [files] deny"
    assert attempt(guard, f"open({guard.scratch + '/free'!r}, 'w').close()") is None
    assert not os.path.exists(locked)


def test_denial_text_names_rule_target_policy_and_the_line(
    guard: Any, tree: dict[str, Path]
) -> None:
    """It raises a PermissionError whose text names the rule, target, policy and fix."""
    secret = str(tree["secret"] / "canary.txt")
    with pytest.raises(PermissionError) as info:
        guard.run(f"open({secret!r})")
    exc = info.value
    assert isinstance(exc, FileAccessDenied)
    text = str(exc)
    assert "[files.read]" in text and secret in text and '"guard-test"' in text
    assert f'[[grant]]\n    files.read = ["{secret}"]' in text


def test_learning_mode_records_and_proceeds(
    armed: Callable[..., Any], tree: dict[str, Path]
) -> None:
    """It lets the read happen in learning mode and records it as learned."""
    guard = armed(mode="learn", imports={"allow": ["os"]})
    secret = str(tree["secret"] / "canary.txt")
    assert attempt(guard, f"open({secret!r}).read()") == CANARY
    learned = [d for d in guard.denials() if d.target == secret]
    assert learned and all(d.learned for d in learned)


def test_disarmed_code_is_not_judged(guard: Any, tree: dict[str, Path]) -> None:
    """It does not judge code running outside `arming()` (the worker between calls)."""
    assert (tree["secret"] / "canary.txt").read_text() == CANARY


def test_a_removed_working_directory_does_not_break_the_guard(guard: Any) -> None:
    """It keeps judging (and can be uninstalled) after the code removed the directory it
    changed to: a relative path is judged where it would be."""
    gone = os.path.join(guard.scratch, "gone")
    guard.run(f"import os\nos.mkdir({gone!r})\nos.chdir({gone!r})\nos.rmdir({gone!r})")
    assert attempt(guard, "open('x.txt').read()") in ("FileNotFoundError", "FileAccessDenied")
    guard.guards.uninstall()
