"""The masks of hidden and denied names, and how Landlock alone narrows its grants."""

from __future__ import annotations

import os
from pathlib import Path

from agent_sandbox import Policy
from agent_sandbox.providers._landlock import _narrow
from agent_sandbox.providers._masks import Masks, find_masks, policy_files


class _Spec:
    def __init__(self, scratch: str) -> None:
        self.scratch = scratch


def test_find_masks_walks_granted_directories_for_hide_deny_and_policy_files(
    tmp_path: Path,
) -> None:
    """It finds hidden names at any depth, deny globs and plain denies, and the policy files,
    and never descends into a masked directory or follows a link."""
    data = tmp_path / "data"
    (data / "a" / "b").mkdir(parents=True)
    (data / "a" / "b" / ".env").write_text("x")
    (data / "keys").mkdir()
    (data / "keys" / "server.pem").write_text("x")
    (data / "q.csv").write_text("x")
    (data / "ok.txt").write_text("x")
    (data / ".ssh").mkdir()
    (data / "link").symlink_to("/etc")
    policy_file = data / "tool.toml"
    policy_file.write_text('name = "t"\n')
    policy = Policy(
        name="t",
        files={"read": [f"{data}/**"], "deny": [f"{data}/*.csv", f"{data}/ok.txt"]},
        source=str(policy_file),
    )
    masks = find_masks(policy, _Spec(str(tmp_path / "scratch")))
    assert dict(masks.paths) == {
        f"{data}/a/b/.env": "file",
        f"{data}/keys/server.pem": "file",
        f"{data}/q.csv": "file",
        f"{data}/ok.txt": "file",
        str(policy_file): "file",
    }
    assert ("link", "dir") not in masks.listings[str(data)]  # links are left out
    assert policy_files(policy) == (str(policy_file),)


def test_landlock_narrowing_leaves_no_rule_above_a_masked_path() -> None:
    """It grants the siblings of a masked name one by one and the folders above it for
    listing only, so no rule reaches the masked name."""
    rules = {"/d": "rw", "/usr/lib": "ro"}
    masks = Masks(
        paths={"/d/a/.env": "file"},
        listings={
            "/d": (("a", "dir"), ("b", "dir"), ("f.txt", "file")),
            "/d/a": ((".env", "file"), ("data.csv", "file")),
            "/": (("d", "dir"), ("usr", "dir")),
        },
    )
    _narrow(rules, masks, Policy(name="t"))
    assert rules == {
        "/d": "ls",
        "/d/a": "ls",
        "/d/a/data.csv": "rw",
        "/d/b": "rw",
        "/d/f.txt": "rw",
        "/usr/lib": "ro",
    }
    assert not any(
        a != "ls" and ("/d/a/.env" + "/").startswith(p.rstrip("/") + "/") for p, a in rules.items()
    )
    assert os.path.join("/d", "a") in rules
