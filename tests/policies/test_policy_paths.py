"""The `[files]` path language: globs, escapes that make a name literal, and every reader of
an entry (the file guard, the namespace view, Landlock) reading it the same way."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_sandbox import Policy, PolicyError
from agent_sandbox.guards._files import FileRules
from agent_sandbox.policies import policy_from_toml
from agent_sandbox.policies._paths import (
    check_entry,
    entry_regex,
    is_glob,
    literal,
    name_regex,
    risky_name,
    static_prefix,
    toml_quote,
    unescape,
)
from agent_sandbox.policies._toml import policy_to_toml
from agent_sandbox.providers._landlock import landlock_setup
from agent_sandbox.providers._view import policy_paths


def _covers(entry: str, path: str) -> bool:
    return entry_regex(entry).fullmatch(path) is not None


def test_globs_keep_their_meaning() -> None:
    """It keeps `**` crossing `/`, `*` and `?` within a component, and character classes."""
    assert _covers("/data/**", "/data/a/b/c.csv")
    assert _covers("/data/*.csv", "/data/a.csv") and not _covers("/data/*.csv", "/data/a/b.csv")
    assert _covers("/data/?.csv", "/data/a.csv") and not _covers("/data/?.csv", "/data/ab.csv")
    assert _covers("/data/[a-c].csv", "/data/b.csv") and not _covers(
        "/data/[a-c].csv", "/data/d.csv"
    )
    assert _covers("/data/[!a].csv", "/data/b.csv") and not _covers("/data/[!a].csv", "/data/a.csv")
    assert _covers("/data", "/data/anything/below")


@pytest.mark.parametrize(
    ("entry", "name", "sibling"),
    [
        ("/var/tmp/\\*\\*", "/var/tmp/**", "/var/tmp/secret"),
        ("/var/tmp/\\*", "/var/tmp/*", "/var/tmp/x"),
        ("/var/tmp/\\?", "/var/tmp/?", "/var/tmp/x"),
        ("/var/tmp/\\[a-z\\]", "/var/tmp/[a-z]", "/var/tmp/b"),
        ("/srv/\\{a,b\\}", "/srv/{a,b}", "/srv/a"),
        ("/srv/back\\\\slash", "/srv/back\\slash", "/srv/backslash"),
    ],
)
def test_an_escaped_name_matches_only_itself(entry: str, name: str, sibling: str) -> None:
    """It reads an escaped entry as one literal name: that path and what is below it."""
    assert not is_glob(entry)
    assert unescape(entry) == name and static_prefix(entry) == name
    assert literal(name) == entry
    assert _covers(entry, name) and _covers(entry, name + "/below")
    assert not _covers(entry, sibling)


@settings(max_examples=200, deadline=None)
@given(
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        max_size=30,
    )
)
def test_literal_of_any_name_matches_exactly_that_name(tail: str) -> None:
    """It writes any name so that it validates, is no glob and matches only itself."""
    name = "/srv/" + tail
    entry = literal(name)
    check_entry(entry)
    assert not is_glob(entry) and unescape(entry) == name
    assert _covers(entry, name)
    assert not _covers(entry, name + "x") or name.endswith("/")
    assert policy_from_toml(f"[files]\nread = [{toml_quote(entry)}]\n").files.read == (entry,)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("/srv/a\\b", "a backslash may only escape"),
        ("/srv/a\\", "lone backslash"),
        ("/srv/[abc", "not closed"),
        ("/srv/[z-a]", "not a valid pattern"),
    ],
)
def test_an_ambiguous_entry_is_refused(entry: str, message: str) -> None:
    """It refuses a backslash that escapes nothing, an unclosed class and a bad range."""
    with pytest.raises(ValueError, match=message):
        check_entry(entry)
    with pytest.raises(PolicyError, match=message):
        Policy(name="t", files={"read": [entry]})


def test_hidden_names_use_the_same_language() -> None:
    """It matches `files.hide` names with the same patterns and escapes."""
    assert name_regex("*.pem").fullmatch("a.pem") and not name_regex("*.pem").fullmatch("a.pe")
    assert name_regex("\\*.pem").fullmatch("*.pem")
    assert not name_regex("\\*.pem").fullmatch("a.pem")


def test_risky_name_names_pattern_and_invisible_characters() -> None:
    """It says why a name needs review, and nothing for a plain one."""
    assert risky_name("/srv/data/a.csv") == ""
    assert "pattern characters (*)" in risky_name("/var/tmp/**")
    assert "control or invisible" in risky_name("/srv/a\u202eb")
    assert "control or invisible" in risky_name("/srv/a\x1b[2Jb")


def test_the_file_guard_grants_an_escaped_name_literally(tmp_path: Path) -> None:
    """It lets the file guard read the literal name and nothing beside it."""
    (tmp_path / "*").mkdir()
    (tmp_path / "other").write_text("x")
    rules = FileRules({"read": [literal(str(tmp_path / "*"))]}, scratch="")
    assert rules.decide("read", str(tmp_path / "*" / "f")) is None
    refused = rules.decide("read", str(tmp_path / "other"))
    assert refused is not None
    hint = refused[1].hint
    granted = tomllib.loads(hint)["grant"][0]["files"]["read"]
    assert granted == [literal(str(tmp_path / "other"))]


def test_the_kernel_builders_grant_the_literal_name(tmp_path: Path) -> None:
    """It binds and grants the literal path, not the directory before a glob character."""
    target = tmp_path / "**"
    target.mkdir()
    policy = Policy(
        name="t",
        files={"read": [literal(str(target))], "deny": [literal(str(tmp_path / "[x]"))]},
    )
    spec = SimpleNamespace(scratch=str(tmp_path / "scratch"))
    read, _, deny = policy_paths(policy, spec)
    assert read == (str(target),) and deny == (str(tmp_path / "[x]"),)
    assert str(tmp_path) not in read
    fake = SimpleNamespace(
        python="/usr/bin/python3",
        sys_path=(),
        package_dirs={},
        boot_script="/nonexistent/boot.py",
        scratch=str(tmp_path / "scratch"),
    )
    granted = dict(landlock_setup(policy, fake)["paths"])  # type: ignore[arg-type]
    assert granted.get(str(target)) == "ro" and str(tmp_path) not in granted


def test_the_writer_keeps_escapes_readable() -> None:
    """It writes an escaped entry as a TOML literal string, which reads back unchanged."""
    policy = Policy(name="t", files={"read": ["/var/tmp/\\*\\*"]})
    text = policy_to_toml(policy)
    assert "'/var/tmp/\\*\\*'" in text
    assert policy_from_toml(text).files.read == ("/var/tmp/\\*\\*",)
