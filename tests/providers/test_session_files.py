"""The session files API (put, get, list, remove) under every local provider, and its refusals.

The host never opens the worker's scratch: each operation is a request the worker serves
between calls (`agent_sandbox._worker.files`), so the same tests hold where scratch is a host
directory (`subprocess`, `firejail`), a tmpfs in the worker's mount namespace (`bwrap`,
`unshare`, `landlock` as root) or the QEMU guest's own file system. The hostile cases plant
links with ctypes (the Python guards switched off by the hostile policy), so what stops them
is the API's own `O_NOFOLLOW`/`O_EXCL` discipline, not a guard.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import FileTransferRefused, Policy, Sandbox
from agent_sandbox._host import files as host_files
from tests.conftest import GrowOnRead
from tests.providers.conftest import (
    KERNEL_PROVIDERS,
    QEMU_MEMORY_MB,
    accepted_for,
    skip_unless_available,
)

pytestmark = pytest.mark.filterwarnings("ignore:policy .danger-files-test. grants:UserWarning")


@pytest.fixture(params=(*KERNEL_PROVIDERS, "subprocess", "qemu"))
def provider(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name = str(request.param)
    if name == "qemu":
        monkeypatch.setenv("XDG_CACHE_HOME", request.getfixturevalue("qemu_cache"))
    if name != "subprocess":
        skip_unless_available(name)
    return name


def _policy(provider: str, **limits: Any) -> Policy:
    data: dict[str, Any] = {
        "name": "danger-files-test",
        "imports": {"allow": ["*"]},
        "api": {"allow": ["native-code", "process-control"]},
        "limits": {"wall_seconds": 20, **limits},
    }
    data.update(accepted_for(provider))
    if provider == "qemu":
        data["limits"]["memory_mb"] = QEMU_MEMORY_MB
    return Policy(**data)


def _refusal(excinfo: pytest.ExceptionInfo[FileTransferRefused]) -> str:
    return excinfo.value.denial.rule


#: Plants a link with libc (no Python guard sees it).
_PLANT = """
import ctypes
_libc = ctypes.CDLL(None, use_errno=True)
print(_libc.symlink({target!r}.encode(), {name!r}.encode()))
"""


def test_put_run_get_list_remove_round_trip(provider: str) -> None:
    """Bytes put under a name are the file the code reads; a file the code writes comes back."""
    with Sandbox(_policy(provider), provider=provider, warm=0) as sb:
        session = sb.session("files")
        info = session.put_file("in.csv", b"a,b\n1,2\n")
        assert (info.name, info.size) == ("in.csv", 8)
        result = session.run(
            "data = open('in.csv').read()\nopen('out.txt', 'w').write(data.upper())\ndata"
        )
        assert result.ok, result.error
        assert result.value == "a,b\n1,2\n"
        # The upload is not reported as a file the code produced; the code's file is.
        assert [f["name"] for f in result.files] == ["out.txt"]
        names = {f.name: f for f in session.list_files()}
        assert set(names) == {"in.csv", "out.txt"} and names["out.txt"].kind == "file"
        assert session.get_file("out.txt") == b"A,B\n1,2\n"
        session.remove_file("out.txt")
        assert [f.name for f in session.list_files()] == ["in.csv"]
        assert session.run("import os; os.path.exists('out.txt')").value is False


def test_put_from_a_host_file_and_refuses_an_existing_name(provider: str, tmp_path: Path) -> None:
    source = tmp_path / "data.bin"
    source.write_bytes(bytes(range(256)) * 100)
    with Sandbox(_policy(provider), provider=provider, warm=0) as sb:
        session = sb.session()
        session.put_file("data.bin", source=source)
        assert session.run("len(open('data.bin','rb').read())").value == 25600
        with pytest.raises(FileTransferRefused) as excinfo:
            session.put_file("data.bin", b"other")
        assert _refusal(excinfo) == "files.transfer"
        assert "overwrite=True" in str(excinfo.value)
        session.put_file("data.bin", b"other", overwrite=True)
        assert session.get_file("data.bin") == b"other"


@pytest.mark.parametrize(
    "name",
    ["../escape", "..", ".", "/etc/passwd", "a/b", "nul\x00name", "", "line\nbreak", "x" * 256],
)
def test_refuses_names_outside_scratch(name: str, tmp_path: Path) -> None:
    """It denies a name that is not one plain component of scratch, before asking the worker."""
    with Sandbox(_policy("subprocess"), provider="subprocess", warm=0) as sb:
        session = sb.session()
        for op in (
            lambda: session.put_file(name, b"x"),
            lambda: session.get_file(name),
            lambda: session.remove_file(name),
        ):
            with pytest.raises(FileTransferRefused) as excinfo:
                op()
            assert _refusal(excinfo) == "files.transfer"
            assert excinfo.value.denial.policy == "danger-files-test"
        assert session.list_files() == []
        # Nothing next to or above scratch either.
        worker = session.worker
        assert worker is not None
        assert sorted(os.listdir(worker.control_dir)) == ["ctl.sock", "scratch"]
        assert not Path(os.path.dirname(worker.control_dir), "escape").exists()


def test_refuses_a_hidden_name() -> None:
    """It denies `.env` (a `files.hide` pattern): the code could not see it."""
    with Sandbox(_policy("subprocess"), provider="subprocess", warm=0) as sb:
        with pytest.raises(FileTransferRefused) as excinfo:
            sb.session().put_file(".env", b"SECRET=1")
        assert _refusal(excinfo) == "files.hidden"


def test_refuses_an_oversize_upload_and_download(provider: str) -> None:
    """It denies a file larger than `limits.transfer_mb`, in and out; nothing is written."""
    with Sandbox(_policy(provider, transfer_mb=1), provider=provider, warm=0) as sb:
        session = sb.session()
        with pytest.raises(FileTransferRefused) as excinfo:
            session.put_file("big.bin", b"\0" * (1024 * 1024 + 1))
        assert _refusal(excinfo) == "limits.transfer"
        assert "transfer_mb = 2" in str(excinfo.value)  # the hint
        assert session.list_files() == []
        made = session.run("open('made.bin','wb').write(b'x' * (1024 * 1024 + 5))")
        assert made.ok, made.error
        with pytest.raises(FileTransferRefused) as excinfo:
            session.get_file("made.bin")
        assert _refusal(excinfo) == "limits.transfer"


def test_honours_the_scratch_quota() -> None:
    """It denies an upload that does not fit in what is left of `limits.scratch_mb`."""
    policy = _policy("subprocess", scratch_mb=1)
    with Sandbox(policy, provider="subprocess", warm=0) as sb:
        session = sb.session()
        session.put_file("a.bin", b"\1" * 700_000)
        with pytest.raises(FileTransferRefused) as excinfo:
            session.put_file("b.bin", b"\2" * 700_000)
        assert _refusal(excinfo) == "limits.scratch"
        assert [f.name for f in session.list_files()] == ["a.bin"]


def test_refuses_a_host_file_that_changes_while_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grow_on_read: GrowOnRead
) -> None:
    """It denies a host file that grows while it is read (a writer between two reads)."""
    source = tmp_path / "growing.csv"
    source.write_bytes(b"x" * 1000)
    grow_on_read.arm(source)
    with Sandbox(_policy("subprocess"), provider="subprocess", warm=0) as sb:
        session = sb.session()
        with pytest.raises(FileTransferRefused) as excinfo:
            session.put_file("growing.csv", source=source)
        monkeypatch.undo()
        assert grow_on_read.grew, "the writer never ran"
        assert _refusal(excinfo) == "files.transfer"
        assert "changed while it was read" in str(excinfo.value)
        assert session.list_files() == []


def test_refuses_a_scratch_file_that_changes_while_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """It denies a download whose file changes between two chunks (the code's thread, played
    here by a write into the host-side scratch between the first and second chunk)."""
    with Sandbox(_policy("subprocess"), provider="subprocess", warm=0) as sb:
        session = sb.session()
        size = host_files.CHUNK + 10
        assert session.run(f"open('log.txt','wb').write(b'a' * {size})").ok
        worker = session.worker
        assert worker is not None
        real = worker.file_request
        chunks: list[int] = []

        def request(payload: dict[str, Any], timeout: float) -> Any:
            reply = real(payload, timeout)
            if payload.get("op") == "get":
                chunks.append(payload["offset"])
                if len(chunks) == 1:
                    with open(os.path.join(worker.scratch, "log.txt"), "ab") as fh:
                        fh.write(b"appended")
            return reply

        monkeypatch.setattr(worker, "file_request", request)
        with pytest.raises(FileTransferRefused) as excinfo:
            session.get_file("log.txt")
        assert len(chunks) == 2, "the change between chunks never happened"
        assert _refusal(excinfo) == "files.transfer"
        assert "changed while it was read" in str(excinfo.value)


def test_denies_following_a_planted_symlink(provider: str, tmp_path: Path) -> None:
    """It denies reading or writing through a link the code planted in scratch: a get is
    refused, a put under the name is refused, an overwrite replaces the link itself, and a
    remove removes the link; the file the link names is never read or changed."""
    outside = tmp_path / "outside.txt"
    outside.write_text("host secret\n")
    outside.chmod(0o666)
    target = str(outside) if provider not in ("qemu",) else "/etc/hostname"
    with Sandbox(_policy(provider), provider=provider, warm=0) as sb:
        session = sb.session()
        planted = session.run(_PLANT.format(target=target, name="evil"))
        assert planted.ok and planted.stdout.strip() == "0", planted
        kinds = {f.name: f.kind for f in session.list_files()}
        assert kinds == {"evil": "link"}  # the attack's link is there
        with pytest.raises(FileTransferRefused) as excinfo:
            session.get_file("evil")
        assert _refusal(excinfo) == "files.transfer"
        assert "symbolic link" in str(excinfo.value)
        with pytest.raises(FileTransferRefused) as excinfo:
            session.put_file("evil", b"pwned")
        assert _refusal(excinfo) == "files.transfer"
        session.put_file("evil", b"pwned", overwrite=True)
        assert {f.name: f.kind for f in session.list_files()} == {"evil": "file"}
        assert session.get_file("evil") == b"pwned"
        assert outside.read_text() == "host secret\n"
        planted = session.run(_PLANT.format(target=target, name="evil2"))
        assert planted.stdout.strip() == "0"
        session.remove_file("evil2")
        assert "evil2" not in {f.name for f in session.list_files()}
        assert outside.read_text() == "host secret\n"


def test_refuses_a_directory_and_a_missing_name() -> None:
    with Sandbox(_policy("subprocess"), provider="subprocess", warm=0) as sb:
        session = sb.session()
        assert session.run("import os; os.mkdir('d')").ok
        for op in (lambda: session.get_file("d"), lambda: session.remove_file("d")):
            with pytest.raises(FileTransferRefused) as excinfo:
                op()
            assert _refusal(excinfo) == "files.transfer"
        with pytest.raises(FileTransferRefused) as excinfo:
            session.get_file("absent.txt")
        assert "no such file" in str(excinfo.value)


def test_async_twins() -> None:
    async def main() -> tuple[bytes, list[str]]:
        with Sandbox(_policy("subprocess"), provider="subprocess", warm=0) as sb:
            session = sb.session()
            await session.aput_file("x.txt", b"hello")
            result = await session.arun("open('x.txt').read() + '!'")
            assert result.value == "hello!"
            names = [f.name for f in await session.alist_files()]
            data = await session.aget_file("x.txt")
            await session.aremove_file("x.txt")
            assert await session.alist_files() == []
            return data, names

    data, names = asyncio.run(main())
    assert data == b"hello" and names == ["x.txt"]
