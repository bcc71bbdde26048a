"""The host's chmod, chown and utime in scratch for the landlock provider, asked for by a
worker that may be compromised: nothing it sends changes a file outside scratch."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox._host.scratchmeta import metadata_handler, serve


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A scratch directory beside a file and a directory outside it, and links to both."""
    (tmp_path / "outside.txt").write_text("keep")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_text("keep")
    os.chmod(tmp_path / "outside.txt", 0o644)
    inside = tmp_path / "scratch"
    inside.mkdir()
    (inside / "a.txt").write_text("x")
    (inside / "sub").mkdir()
    os.symlink(tmp_path / "outside.txt", inside / "abs-link")
    os.symlink("../outside.txt", inside / "rel-link")
    os.symlink(tmp_path / "outside", inside / "dir-link")
    os.mkfifo(inside / "fifo")
    return inside


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_chmod_and_a_utime_in_scratch_are_made(scratch: Path) -> None:
    """It sets the permission bits and the times of a file and a directory in scratch."""
    assert serve(str(scratch), {"op": "chmod", "path": "a.txt", "mode": 0o600}) == {"ok": True}
    assert _mode(scratch / "a.txt") == 0o600
    request = {"op": "utime", "path": "sub/../a.txt", "ns": [1_000_000_000, 2_000_000_000]}
    assert serve(str(scratch), request) == {"ok": True}
    assert os.stat(scratch / "a.txt").st_mtime_ns == 2_000_000_000
    now = {"op": "utime", "path": "a.txt", "ns": None}
    assert serve(str(scratch), now) == {"ok": True}
    assert os.stat(scratch / "a.txt").st_mtime_ns > 2_000_000_000
    assert serve(str(scratch), {"op": "chmod", "path": "sub", "mode": 0o700}) == {"ok": True}
    assert _mode(scratch / "sub") == 0o700


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("../outside.txt", errno.EXDEV),
        ("sub/../../outside.txt", errno.EXDEV),
        ("abs-link", errno.ELOOP),
        ("rel-link", errno.ELOOP),
        ("dir-link/f", errno.ELOOP),
    ],
    ids=["dotdot", "dotdot-through-a-folder", "absolute-link", "relative-link", "linked-folder"],
)
def test_a_compromised_worker_cannot_chmod_outside_scratch(
    scratch: Path, path: str, code: int
) -> None:
    """It refuses, in the kernel (openat2 beneath scratch, no link followed), a path that
    leads out of scratch, and the file outside keeps its mode."""
    reply = serve(str(scratch), {"op": "chmod", "path": path, "mode": 0o777})
    assert reply["ok"] is False and reply["errno"] == code, reply
    assert _mode(scratch.parent / "outside.txt") == 0o644
    assert _mode(scratch.parent / "outside" / "f") != 0o777


def test_setuid_bits_special_files_and_a_new_owner_are_refused(scratch: Path) -> None:
    """It refuses a mode above 0o777, a FIFO, and a chown to another owner; a chown to the
    owner the file has is a no-op that succeeds."""
    reply = serve(str(scratch), {"op": "chmod", "path": "a.txt", "mode": 0o4755})
    assert reply["errno"] == errno.EPERM and "setuid" in reply["reason"]
    assert _mode(scratch / "a.txt") != 0o4755
    reply = serve(str(scratch), {"op": "chmod", "path": "fifo", "mode": 0o600})
    assert reply["errno"] == errno.EPERM and "regular file" in reply["reason"]
    st = os.stat(scratch / "a.txt")
    same = {"op": "chown", "path": "a.txt", "uid": st.st_uid, "gid": -1}
    assert serve(str(scratch), same) == {"ok": True}
    other = {"op": "chown", "path": "a.txt", "uid": st.st_uid + 1, "gid": -1}
    assert serve(str(scratch), other)["errno"] == errno.EPERM
    assert os.stat(scratch / "a.txt").st_uid == st.st_uid


@pytest.mark.parametrize(
    "request_",
    [
        {"op": "chmod", "path": "/etc/passwd", "mode": 0o777},
        {"op": "chmod", "path": "a.txt"},
        {"op": "chmod", "path": "a.txt", "mode": "0o777"},
        {"op": "unlink", "path": "a.txt"},
        {"op": "utime", "path": "a.txt", "ns": [1]},
        {"op": "utime", "path": "a\x00b", "ns": None},
        {"op": "chown", "path": "a.txt", "uid": 0},
    ],
    ids=["absolute", "no-mode", "text-mode", "other-op", "one-time", "nul", "no-gid"],
)
def test_a_malformed_request_is_refused_without_touching_anything(
    scratch: Path, request_: dict[str, Any]
) -> None:
    handle = metadata_handler(str(scratch))
    reply = handle({"id": 1, "request": json.dumps({"scratch_metadata": request_})}, 5.0)
    assert reply["ok"] is False and "error" in reply, reply
    assert _mode(scratch / "a.txt") != 0o777


def test_other_requests_go_to_the_host_tools(scratch: Path) -> None:
    """It hands a host-tool request to the tools' handler, and refuses it when none."""
    tool = {"id": 1, "request": json.dumps({"name": "search", "args": [], "kwargs": {}})}
    assert metadata_handler(str(scratch))(tool, 5.0)["rule"] == "tools"
    seen: list[Any] = []
    metadata_handler(str(scratch), lambda data, remaining: seen.append(data) or {"ok": True})(
        tool, 5.0
    )
    assert seen == [tool]


def test_a_folder_above_scratch_swapped_for_a_link_is_not_followed(scratch: Path) -> None:
    """It opens scratch itself through no link: a folder above it that the code could
    rename and replace by a link (under a write grant of /tmp) leads nowhere."""
    swapped = scratch.parent / "swapped"
    os.symlink(scratch.parent, swapped)
    reply = serve(str(swapped / "scratch"), {"op": "chmod", "path": "a.txt", "mode": 0o600})
    assert reply["ok"] is False and reply["errno"] == errno.EPERM, reply
    assert "cannot be opened" in reply["reason"]
    assert _mode(scratch / "a.txt") != 0o600
