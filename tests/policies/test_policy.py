"""The policy model: loading, validation errors that say where, fingerprint, merge, explain."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent_sandbox import Policy, PolicyError, PolicyNotFound
from agent_sandbox.policies import list_presets, load_policy, policy_from_toml, resolve_policy


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_loads_a_full_policy_from_toml(tmp_path: Path) -> None:
    """It loads every section from TOML."""
    path = write(
        tmp_path,
        """
name = "reader"
provider = "subprocess"
no_kernel_boundary = "accepted"
[files]
read = ["/data/**"]
write = ["$SCRATCH/out"]
hide = [".env"]
[[net.rules]]
host = "127.0.0.1"
ports = "8000-8010"
[imports]
allow = ["json"]
[env]
pass = ["LANG"]
set = { A = "1" }
[api]
allow = ["subprocess.run"]
[limits]
wall_seconds = 5
""",
    )
    policy = load_policy(path)
    assert policy.name == "reader"
    assert policy.provider == "subprocess" and policy.no_kernel_boundary == "accepted"
    assert policy.files.read == ("/data/**",)
    assert policy.net.rules[0].port_ranges() == [(8000, 8010)]
    assert policy.env.passthrough == ("LANG",)
    assert policy.env.set == {"A": "1"}
    assert policy.limits.wall_seconds == 5
    assert policy.source == str(path)


def test_unknown_key_names_file_key_and_line(tmp_path: Path) -> None:
    """It refuses an unknown key and names the file, the key and its line."""
    path = write(tmp_path, 'name = "x"\n\n[limits]\nwall_seconds = 3\nwal_seconds = 4\n')
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    err = info.value
    assert err.source == str(path)
    assert err.key == "limits.wal_seconds"
    assert err.line == 5
    assert "unknown key" in str(err) and f"{path}:5" in str(err)


def test_extends_given_to_the_constructor_names_the_loader() -> None:
    """`Policy(extends=...)` says the loader reads `extends` and names the call that does
    (it once answered "unknown key; did you mean `extends`?", naming the key it was given)."""
    from agent_sandbox.policies import policy_from_dict

    with pytest.raises(PolicyError) as info:
        Policy(name="x", extends="data-analysis")  # type: ignore[call-arg]
    assert info.value.key == "extends"
    assert "did you mean" not in str(info.value)
    assert "policy_from_dict" in str(info.value)
    # The call it names does what was asked.
    assert policy_from_dict({"name": "x", "extends": "data-analysis"}).name == "x"


def test_wrong_type_says_what_was_expected(tmp_path: Path) -> None:
    """It names the expected type for a wrong value."""
    path = write(tmp_path, 'name = "x"\n[limits]\nmemory_mb = "lots"\n')
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.key == "limits.memory_mb"
    assert info.value.line == 3
    assert "an integer" in str(info.value)


def test_malformed_toml_names_the_line(tmp_path: Path) -> None:
    """It reports a TOML syntax error with its line."""
    path = write(tmp_path, 'name = "x"\n[limits\n')
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.line == 2
    assert "not valid TOML" in str(info.value)


def test_missing_file_is_policy_not_found(tmp_path: Path) -> None:
    """It raises PolicyNotFound (also a FileNotFoundError) for a missing file."""
    with pytest.raises(PolicyNotFound) as info:
        load_policy(tmp_path / "nope.toml")
    assert isinstance(info.value, FileNotFoundError)
    assert "nope.toml" in str(info.value)


def test_unknown_preset_lists_the_shipped_ones() -> None:
    """It names the shipped policies when a name matches none."""
    with pytest.raises(PolicyNotFound) as info:
        resolve_policy("no-such-policy")
    for name in list_presets():
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("snippet", "key"),
    [
        ('[[net.rules]]\nhost = "10.0.0.0/33"\n', "net.rules.0.host"),
        ('[[net.rules]]\nhost = "a"\nports = "70000"\n', "net.rules.0.ports"),
        ('[files]\nread = ["relative/path"]\n', "files.read"),
        ('[api]\nallow = ["teleport"]\n', "api.allow"),
        ('provider = "docker"\n', "provider"),
        ('[imports]\nallow = ["bad name"]\n', "imports.allow"),
    ],
)
def test_invalid_values_are_refused_with_their_key(snippet: str, key: str) -> None:
    """It refuses invalid CIDRs, ports, relative paths, categories, providers and modules."""
    with pytest.raises(PolicyError) as info:
        policy_from_toml('name = "x"\n' + snippet)
    assert info.value.key == key


def test_permissive_policy_must_carry_danger_in_its_name() -> None:
    """It refuses a policy that allows every import unless its name says danger."""
    with pytest.raises(PolicyError, match="danger"):
        policy_from_toml('name = "x"\n[imports]\nallow = ["*"]\n')
    assert policy_from_toml('name = "danger-all"\n[imports]\nallow = ["*"]\n').is_permissive()


def test_policy_is_frozen() -> None:
    """It cannot be mutated once built."""
    policy = Policy(name="x")
    with pytest.raises(Exception):
        policy.name = "y"  # type: ignore[misc]


def test_fingerprint_is_stable_and_sensitive() -> None:
    """It gives the same hash for the same policy and a different one after a change."""
    a = policy_from_toml('name = "x"\n[limits]\nwall_seconds = 3\n')
    b = Policy(name="x", limits={"wall_seconds": 3})
    assert a.fingerprint() == b.fingerprint()
    assert a.merged({"limits": {"wall_seconds": 4}}).fingerprint() != a.fingerprint()


def test_merge_overrides_section_by_section() -> None:
    """It merges tables key by key and replaces lists."""
    base = resolve_policy("pure-computation")
    merged = base.merged({"limits": {"wall_seconds": 7}, "imports": {"allow": ["json"]}})
    assert merged.limits.wall_seconds == 7
    assert merged.limits.memory_mb == base.limits.memory_mb
    assert merged.imports.allow == ("json",)
    with pytest.raises(PolicyError):
        base.merged({"limits": {"bogus": 1}})


def test_extends_builds_on_a_preset(tmp_path: Path) -> None:
    """It lets a file extend a shipped policy."""
    path = write(tmp_path, 'name = "mine"\nextends = "data-analysis"\n[limits]\nwall_seconds = 9\n')
    policy = load_policy(path)
    assert "numpy" in policy.imports.allow
    assert policy.limits.wall_seconds == 9


@pytest.mark.parametrize("name", list_presets())
def test_shipped_policies_load_and_explain(name: str) -> None:
    """It ships policies that load, are not permissive, and explain themselves."""
    policy = resolve_policy(name)
    assert not policy.is_permissive()
    text = policy.explain()
    assert policy.name in text and "network:" in text and "limits:" in text


def test_shipped_policies_are_the_reviewed_two() -> None:
    """It ships a pure-computation and a data-analysis policy."""
    assert {"pure-computation", "data-analysis"} <= set(list_presets())
    analysis = resolve_policy("data-analysis")
    assert {"numpy", "pandas", "matplotlib"} <= set(analysis.imports.allow)
    assert not analysis.net.rules
    assert "$SCRATCH" in analysis.files.write


def test_directory_as_policy_file_is_an_error(tmp_path: Path) -> None:
    """It refuses a directory given as a policy file."""
    with pytest.raises(PolicyError, match="directory"):
        load_policy(tmp_path)


def test_non_utf8_policy_file_is_an_error(tmp_path: Path) -> None:
    """It refuses a file that is not UTF-8 text."""
    path = tmp_path / "bin.toml"
    path.write_bytes(b'name = "\xff"\n')
    with pytest.raises(PolicyError, match="UTF-8"):
        load_policy(path)
    assert os.path.exists(path)


def test_building_a_bad_policy_in_python_raises_policy_error() -> None:
    """It maps validation errors of `Policy(...)` to PolicyError naming the key."""
    with pytest.raises(PolicyError) as info:
        Policy(name="x", limits={"wall_seconds": -1})
    assert info.value.key == "limits.wall_seconds"
    assert "greater than" in str(info.value)
