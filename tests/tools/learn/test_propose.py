"""From learned records to a proposal: narrowing, exclusions, flags and idempotence.

These tests feed `Denial(..., learned=True)` records directly, the shape the guards emit in
learning mode, so they judge the proposal logic alone; `test_learn_run.py` drives real runs.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from agent_sandbox import Denial, Policy, RunResult
from agent_sandbox._tools.learn.findings import DIR_MIN_FILES
from agent_sandbox._tools.learn.propose import propose
from agent_sandbox._tools.learn.review import Proposal
from agent_sandbox.policies import policy_from_toml


def _files(root: Path, *names: str) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        (root / name).write_text("x")
        out.append(str(root / name))
    return out


def _status(proposal: Proposal, field: str, value: str) -> str | None:
    for f in proposal.findings:
        if f.field == field and (f.value == value or f.value.startswith(value + " ->")):
            return f.status
    return None


# -- narrowing --------------------------------------------------------------------------


def test_one_file_read_proposes_that_file_only(policy, learned, tmp_path, home) -> None:
    """It proposes the file a run read, not its directory (the seed turned /etc/hostname into /etc)."""
    (path,) = _files(tmp_path / "data", "one.csv")
    _files(tmp_path / "data", "other.csv")
    proposal = propose(policy, [learned("files.read", path)], home=str(home))
    assert proposal.proposed.files.read == (path,)


def test_several_files_in_one_directory_propose_the_directory(policy, learned, tmp_path, home):
    """It proposes a directory only when DIR_MIN_FILES files directly in it were used."""
    folder = tmp_path / "data" / "in"
    paths = _files(folder, *(f"{i}.csv" for i in range(DIR_MIN_FILES)))
    proposal = propose(policy, [learned("files.read", p) for p in paths], home=str(home))
    assert proposal.proposed.files.read == (str(folder),)
    fewer = propose(policy, [learned("files.read", p) for p in paths[:-1]], home=str(home))
    assert fewer.proposed.files.read == tuple(sorted(paths[:-1]))


def test_a_directory_is_proposed_at_the_narrowest_level(policy, learned, tmp_path, home) -> None:
    """It collapses files into their own directory, never into a grandparent."""
    a = _files(tmp_path / "d" / "a", "1", "2", "3")
    b = _files(tmp_path / "d" / "b", "1")
    proposal = propose(policy, [learned("files.read", p) for p in a + b], home=str(home))
    assert proposal.proposed.files.read == (str(tmp_path / "d" / "a"), b[0])


def test_system_configuration_stays_file_by_file(policy, learned, home) -> None:
    """It never collapses /etc files into /etc, and marks each /etc file RISKY."""
    names = ["/etc/hostname", "/etc/hosts", "/etc/os-release", "/etc/passwd"]
    proposal = propose(policy, [learned("files.read", n) for n in names], home=str(home))
    assert "/etc" not in proposal.proposed.files.read
    for name in names:
        real = os.path.realpath(name)  # /etc/os-release is a link into /usr/lib
        assert real in proposal.proposed.files.read
        if real.startswith("/etc/"):
            assert _status(proposal, "files.read", real) == "risky"


def test_top_level_directories_are_never_proposed(policy, learned, home) -> None:
    """It keeps files of a top-level directory individual (no `/opt`, `/srv`, `/usr`)."""
    names = [f"/srv/f{i}" for i in range(5)]
    proposal = propose(policy, [learned("files.read", n) for n in names], home=str(home))
    assert proposal.proposed.files.read == tuple(sorted(names))


def test_a_listed_directory_is_risky_and_never_a_system_one(policy, learned, tmp_path, home):
    """It proposes a listed data directory marked RISKY, and flags a listing of /etc or /."""
    folder = tmp_path / "data" / "in"
    inside = _files(folder, "a.csv")
    records = [
        learned("files.read", str(folder)),
        learned("files.read", inside[0]),
        learned("files.read", "/etc"),
        learned("files.read", "/usr"),
    ]
    proposal = propose(policy, records, home=str(home))
    assert proposal.proposed.files.read == (str(folder),)
    assert _status(proposal, "files.read", str(folder)) == "risky"
    assert _status(proposal, "files.read", "/etc") == "flagged"


def test_writes_imply_reads_and_are_proposed_as_writes(policy, learned, tmp_path, home) -> None:
    """It proposes a written file under files.write and does not repeat it under files.read."""
    (path,) = _files(tmp_path / "out", "result.csv")
    proposal = propose(
        policy, [learned("files.write", path), learned("files.read", path)], home=str(home)
    )
    assert proposal.proposed.files.write == (path,)
    assert proposal.proposed.files.read == (path,) or path not in proposal.proposed.files.read


def test_already_allowed_paths_are_not_proposed_again(learned, tmp_path, home) -> None:
    """It adds nothing for a path the current policy already grants."""
    folder = tmp_path / "data"
    (path,) = _files(folder, "a.csv")
    current = Policy(name="tool", files={"read": [str(folder)]})
    proposal = propose(current, [learned("files.read", path)], home=str(home))
    assert not proposal.changed


# -- never proposed ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/",
        "/proc/self/environ",
        "/proc/1/mem",
        "/sys/kernel/notes",
        "/dev/sda",
        "/run/docker.sock",
        "/etc/shadow",
        "/etc/sudoers",
        "/etc/ssh/ssh_host_ed25519_key",
    ],
)
def test_system_secrets_and_kernel_trees_are_flagged(policy, learned, home, target) -> None:
    """It never proposes the root, /proc, /sys, /dev, /run or secret system files."""
    proposal = propose(policy, [learned("files.read", target)], home=str(home))
    assert proposal.proposed.files.read == ()
    assert proposal.flagged


def test_harmless_devices_are_proposed(policy, learned, home) -> None:
    """It proposes /dev/null and /dev/urandom, which hold no host state."""
    proposal = propose(
        policy,
        [learned("files.write", "/dev/null"), learned("files.read", "/dev/urandom")],
        home=str(home),
    )
    assert proposal.proposed.files.write == ("/dev/null",)
    assert proposal.proposed.files.read == ("/dev/urandom",)


def test_the_home_directory_and_its_parents_are_never_proposed(policy, learned, home) -> None:
    """It never proposes the home directory or a parent of it, even when many files in it were read."""
    in_home = _files(home, "a", "b", "c")
    beside = _files(home.parent, "x", "y", "z")
    proposal = propose(policy, [learned("files.read", p) for p in in_home + beside], home=str(home))
    read = proposal.proposed.files.read
    assert str(home) not in read and str(home.parent) not in read
    for path in in_home:
        assert _status(proposal, "files.read", path) == "risky"
    flagged = propose(policy, [learned("files.read", str(home))], home=str(home))
    assert flagged.proposed.files.read == () and flagged.flagged


def test_credentials_locations_are_flagged(policy, learned, home) -> None:
    """It flags ~/.ssh, ~/.aws and names hidden by the policy, wherever they are."""
    records = [
        learned("files.read", str(home / ".ssh" / "id_rsa")),
        learned("files.read", str(home / ".aws" / "credentials")),
        learned("files.read", "/srv/app/.env"),
        learned("files.hidden", "/srv/app/server.pem"),
    ]
    proposal = propose(policy, records, home=str(home))
    assert proposal.proposed.files.read == ()
    assert len(proposal.flagged) == 4


def test_the_policy_file_and_its_proposal_are_never_proposed(policy, policy_file, learned, home):
    """It flags reads and writes of the policy file itself and of its proposal files."""
    records = [
        learned("files.read", str(policy_file)),
        learned("files.write", str(policy_file)),
        learned("files.write", str(policy_file.with_name("tool.proposed.toml"))),
    ]
    proposal = propose(policy, records, home=str(home))
    assert proposal.proposed.files == policy.files
    assert len(proposal.flagged) == 3


def test_worker_control_and_scratch_directories_are_never_proposed(policy, learned, home) -> None:
    """It flags paths in any worker's control or scratch directory (they vanish with the worker)."""
    import tempfile

    control = os.path.join(os.path.realpath(tempfile.gettempdir()), "agent-sandbox-abc123")
    records = [
        learned("files.read", f"{control}/worker.log"),
        learned("files.read", f"{control}/scratch/x/etc/passwd"),
    ]
    proposal = propose(policy, records, home=str(home))
    assert proposal.proposed.files.read == ()
    assert len(proposal.flagged) == 2


def test_an_explicit_deny_is_never_overridden(learned, tmp_path, home) -> None:
    """It flags what the current policy denies explicitly instead of proposing it."""
    (path,) = _files(tmp_path / "data", "secret.csv")
    current = Policy(
        name="tool",
        files={"deny": [path]},
        imports={"deny": ["pickle"]},
        api={"deny": ["process-exec"]},
        net={"rules": [{"action": "deny", "host": "10.0.0.0/8"}]},
    )
    records = [
        learned("files.read", path),
        learned("imports", "pickle"),
        learned("api.process-exec", "subprocess.run"),
        learned("net.connect", "10.1.2.3:443"),
    ]
    proposal = propose(current, records, home=str(home))
    assert not proposal.changed
    assert len(proposal.flagged) == 4


# -- symlinks ---------------------------------------------------------------------------


def test_a_link_in_a_writable_directory_is_flagged_not_followed(learned, tmp_path, home) -> None:
    """It denies a widening through a link planted where the run could write (srt's `/tmp/x -> /`)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "link").symlink_to("/")
    current = Policy(name="tool", files={"write": [str(out)]})
    proposal = propose(
        current, [learned("files.read", str(out / "link" / "etc" / "hostname"))], home=str(home)
    )
    assert proposal.proposed.files.read == ()
    assert proposal.flagged and "symlink" in proposal.flagged[0].reason


def test_a_link_the_run_itself_wrote_is_flagged(policy, learned, tmp_path, home) -> None:
    """It flags a path reached through a link at a path the same run wrote."""
    spot = tmp_path / "spot"
    spot.mkdir()
    (spot / "x").symlink_to("/etc")
    records = [
        learned("files.write", str(spot / "x")),
        learned("files.read", str(spot / "x" / "hostname")),
    ]
    proposal = propose(policy, records, home=str(home))
    assert proposal.proposed.files.read == ()


def test_a_link_in_a_world_writable_directory_is_flagged(policy, learned, tmp_path, home) -> None:
    """It flags a link in a world-writable directory: anyone could have planted it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "x").symlink_to("/etc")
    proposal = propose(
        policy, [learned("files.read", str(shared / "x" / "hostname"))], home=str(home)
    )
    assert proposal.proposed.files.read == ()


def test_a_trusted_link_is_judged_on_its_real_target(policy, learned, tmp_path, home) -> None:
    """It resolves a link the run could not have planted and proposes (or flags) the real target."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = _files(tmp_path / "real", "data.csv")[0]
    (ro / "alias.csv").symlink_to(real)
    (ro / "proc").symlink_to("/proc")
    proposal = propose(
        policy,
        [
            learned("files.read", str(ro / "alias.csv")),
            learned("files.read", str(ro / "proc" / "1" / "environ")),
        ],
        home=str(home),
    )
    assert proposal.proposed.files.read == (real,)
    assert len(proposal.flagged) == 1


@pytest.mark.parametrize(
    "requested", ["x/etc/hostname", "/tmp/agent-sandbox-abc/scratch/x/etc/hostname"]
)
def test_a_path_requested_through_scratch_is_flagged(policy, learned, home, requested) -> None:
    """It flags a resolved path whose record says the code asked for it through scratch."""
    record = learned(
        "files.read",
        "/etc/hostname",
        detail=f"the path is outside [files] read (requested as '{requested}')",
    )
    proposal = propose(policy, [record], home=str(home))
    assert proposal.proposed.files.read == ()
    assert "link the run could plant" in proposal.flagged[0].reason


def test_a_path_requested_through_a_declared_write_dir_is_flagged(learned, tmp_path, home):
    """It flags a path the code reached through a directory the policy lets it write."""
    current = Policy(name="tool", files={"write": [str(tmp_path / "out")]})
    record = learned(
        "files.read",
        "/etc/hostname",
        detail=f"outside (requested as '{tmp_path}/out/lnk/hostname')",
    )
    assert propose(current, [record], home=str(home)).proposed.files.read == ()


# -- start-up files and imports ---------------------------------------------------------


@pytest.mark.parametrize("name", ["evil.pth", "sitecustomize.py", "usercustomize.py"])
def test_startup_files_are_never_proposed_for_writing(policy, learned, tmp_path, home, name):
    """It flags writes of files an interpreter runs at start-up, wherever they are."""
    proposal = propose(
        policy, [learned("files.write", str(tmp_path / "out" / name))], home=str(home)
    )
    assert proposal.proposed.files.write == ()


def test_writes_into_import_roots_are_never_proposed(policy, learned, home) -> None:
    """It flags a write into the standard library or site-packages (it would pre-empt imports)."""
    import json
    import sysconfig

    targets = [
        os.path.join(os.path.dirname(os.path.dirname(json.__file__)), "json2.py"),
        os.path.join(sysconfig.get_paths()["purelib"], "json.py"),
    ]
    proposal = propose(policy, [learned("files.write", t) for t in targets], home=str(home))
    assert proposal.proposed.files.write == ()
    assert len(proposal.flagged) == 2


def test_risky_modules_are_proposed_with_a_mark(policy, learned, home) -> None:
    """It marks ctypes, subprocess, pickle, importlib and (without network) socket RISKY."""
    records = [
        learned("imports", m)
        for m in ("ctypes", "subprocess", "pickle", "importlib.util", "socket", "csv")
    ]
    proposal = propose(policy, records, home=str(home))
    for module in ("ctypes", "subprocess", "pickle", "importlib.util", "socket"):
        assert _status(proposal, "imports.allow", module) == "risky", module
    assert _status(proposal, "imports.allow", "csv") == "proposed"
    parse = propose(policy, [learned("imports", "urllib.parse")], home=str(home))
    assert _status(parse, "imports.allow", "urllib.parse") == "proposed"
    http = propose(
        policy, [learned("imports", "http"), learned("imports", "http.client")], home=str(home)
    )
    assert _status(http, "imports.allow", "http") == "risky"
    assert "# RISKY:" in proposal.to_toml()


def test_a_parent_module_covers_its_submodules(policy, learned, home) -> None:
    """It proposes `xml` once when `xml` and `xml.etree` were both imported."""
    proposal = propose(
        policy, [learned("imports", "xml.etree"), learned("imports", "xml")], home=str(home)
    )
    assert proposal.proposed.imports.allow == ("math", "json", "xml")


def test_native_and_dynamic_code_calls_are_never_proposed(policy, learned, home) -> None:
    """It flags native-code and dynamic-code calls and marks other sensitive calls RISKY."""
    records = [
        learned("api.native-code", "ctypes.CDLL"),
        learned("api.dynamic-code", "builtins.eval"),
        learned("api.process-exec", "subprocess.run"),
    ]
    proposal = propose(policy, records, home=str(home))
    assert proposal.proposed.api.allow == ("subprocess.run",)
    assert _status(proposal, "api.allow", "subprocess.run") == "risky"
    assert not proposal.proposed.is_permissive()


# -- environment and network ------------------------------------------------------------


def test_env_names_secrets_and_loader_variables(policy, learned, home) -> None:
    """It proposes plain names, marks secret-looking ones RISKY, never passes loader variables."""
    records = [learned("env", n) for n in ("TZ", "OPENAI_API_KEY", "LD_PRELOAD", "PYTHONPATH")]
    proposal = propose(policy, records, home=str(home))
    assert proposal.proposed.env.passthrough == ("LANG", "OPENAI_API_KEY", "TZ")
    assert _status(proposal, "env.pass", "OPENAI_API_KEY") == "risky"
    assert _status(proposal, "env.pass", "LD_PRELOAD") == "flagged"


def test_net_rules_name_host_and_ports(policy, learned, home) -> None:
    """It proposes one rule per host and direction with the ports used, and flags metadata hosts."""
    records = [
        learned("net.connect", "203.0.113.5:443"),
        learned("net.connect", "203.0.113.5:80"),
        learned("net.connect", "127.0.0.1:8080"),
        learned("net.bind", "127.0.0.1:9000"),
        learned("net.connect", "169.254.169.254:80"),
        learned("net.resolve", "api.example.com:443"),
    ]
    proposal = propose(policy, records, home=str(home))
    rules = {(r.direction, r.host, r.ports) for r in proposal.proposed.net.rules}
    assert rules == {
        ("connect", "203.0.113.5", "80,443"),
        ("connect", "127.0.0.1", "8080"),
        ("bind", "127.0.0.1", "9000"),
        ("connect", "api.example.com", "443"),
    }
    assert any("metadata" in f.reason for f in proposal.flagged)


def test_guard_style_targets_ipv6_and_lookups(policy, learned, home) -> None:
    """It reads `::1:8080` as host and port, and gives a looked-up name the ports the run used."""
    records = [
        learned("net.connect", "::1:8080"),
        learned("net.connect", "93.184.216.34:443", action="connect"),
        learned("net.resolve", "api.example.com", action="resolve"),
        learned("net.connect", "unix:@'bus'"),
    ]
    proposal = propose(policy, records, home=str(home))
    rules = {(r.host, r.ports) for r in proposal.proposed.net.rules}
    assert rules == {("::1", "8080"), ("93.184.216.34", "443"), ("api.example.com", "443")}
    assert _status(proposal, "net.rules", "connect tcp api.example.com:443") == "risky"
    assert any("unix" in f.value for f in proposal.flagged)


# -- what does not count ----------------------------------------------------------------


def test_only_learning_records_count(policy, learned, home) -> None:
    """It ignores enforced refusals (not observed), limits and the code layer."""
    records = [
        Denial("files.read", "read", "/srv/x"),
        learned("limits.timeout", "30s"),
        learned("code.syntax", "line 1"),
    ]
    proposal = propose(policy, records, home=str(home))
    assert not proposal.changed
    assert len(proposal.flagged) == 3


def test_a_tampered_guard_is_flagged_loudly(policy, learned, home) -> None:
    """It flags a run that disarmed a guard: its records cannot be trusted to be complete."""
    records = [Denial("guard.tampered", "disarm", "files"), learned("imports", "csv")]
    proposal = propose(policy, records, home=str(home))
    assert any(f.rule == "guard.tampered" for f in proposal.flagged)
    assert "guard" in proposal.to_toml()


# -- idempotence and shape --------------------------------------------------------------


def _mixed_records(learned, tmp_path: Path) -> list[Denial]:
    paths = _files(tmp_path / "mixed", "a", "b", "c", "d")
    return [
        *(learned("files.read", p) for p in paths),
        learned("files.write", str(tmp_path / "mixed" / "out.txt")),
        learned("files.read", "/etc/shadow"),
        learned("imports", "subprocess"),
        learned("imports", "csv"),
        learned("env", "TZ"),
        learned("net.connect", "203.0.113.5:443"),
        learned("api.process-exec", "subprocess.run"),
    ]


def test_relearning_the_same_run_gives_the_same_proposal(policy, learned, tmp_path, home) -> None:
    """It gives byte-identical proposals for the same records in any order, and repeats."""
    records = _mixed_records(learned, tmp_path)
    first = propose(policy, records, home=str(home))
    shuffled = list(records) * 2
    random.Random(7).shuffle(shuffled)
    second = propose(policy, shuffled, home=str(home))
    assert first.to_toml() == second.to_toml()
    assert first.diff() == second.diff()


def test_learning_again_from_the_proposal_changes_nothing(policy, learned, tmp_path, home) -> None:
    """It reaches a fixed point: the proposal already covers the run that produced it."""
    records = _mixed_records(learned, tmp_path)
    proposal = propose(policy, records, home=str(home))
    applied = policy_from_toml(proposal.to_toml())
    again = propose(applied, records, home=str(home))
    assert not again.changed


def test_the_proposal_is_valid_toml_in_enforce_mode(learned, tmp_path, home) -> None:
    """It writes a proposal that loads as a policy in enforce mode, with every flag as a comment."""
    current = Policy(name="tool", mode="learn")
    proposal = propose(current, _mixed_records(learned, tmp_path), home=str(home))
    text = proposal.to_toml()
    loaded = policy_from_toml(text)
    assert loaded.mode == "enforce"
    assert "FLAGGED" in text and "/etc/shadow" in text
    assert "/etc/shadow" not in loaded.files.read


def test_run_results_are_accepted_as_records(policy, learned, home) -> None:
    """It takes whole RunResults as well as Denials."""
    result = RunResult(denials=(learned("imports", "csv"),))
    assert propose(policy, [result], home=str(home)).proposed.imports.allow[-1] == "csv"


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("/var/tmp/**", "/var/tmp/\\*\\*"),
        ("/var/tmp/*", "/var/tmp/\\*"),
        ("/var/tmp/?", "/var/tmp/\\?"),
        ("/var/tmp/[a-z]", "/var/tmp/\\[a-z\\]"),
        ("/srv/{a,b}/x\\y", "/srv/\\{a,b\\}/x\\\\y"),
    ],
)
def test_a_glob_looking_name_is_proposed_escaped_and_risky(
    policy, learned, home, name, entry
) -> None:
    """It proposes the name as a literal entry (matching only itself), marked RISKY."""
    proposal = propose(policy, [learned("files.read", name)], home=str(home))
    assert proposal.proposed.files.read == (entry,)
    finding = next(f for f in proposal.findings if f.field == "files.read")
    assert finding.status == "risky" and "pattern characters" in finding.reason
    text = proposal.to_toml()
    assert policy_from_toml(text).files.read == (entry,)
    assert f"    '{entry}', # RISKY: " in text  # a TOML literal string: escapes as written


def test_a_name_with_control_characters_is_risky_and_shown_escaped(policy, learned, home):
    """It proposes a name holding a newline or a bidirectional override, RISKY, and every
    line of the proposal and its diff shows those characters as escapes."""
    name = "/srv/data/a\nb\u202ec.txt"
    proposal = propose(policy, [learned("files.read", name)], home=str(home))
    assert proposal.proposed.files.read == (name,)
    finding = next(f for f in proposal.findings if f.field == "files.read")
    assert finding.status == "risky" and "control or invisible" in finding.reason
    text, diff = proposal.to_toml(), proposal.diff()
    assert policy_from_toml(text).files.read == (name,)
    for shown in (text, diff):
        assert "\u202e" not in shown and "a\nb" not in shown
        assert "\\u202E" in shown


@pytest.mark.parametrize("host", ["0.0.0.0/0", "*", "*.example.com", "any", "a\nb.example"])
def test_a_host_that_is_not_one_host_is_flagged(policy, learned, home, host) -> None:
    """It never proposes a rule for a host that would mean more than the one host used."""
    proposal = propose(policy, [learned("net.connect", f"{host}:443")], home=str(home))
    assert proposal.proposed.net.rules == ()
    assert [f.status for f in proposal.findings if f.field == "net.rules"] == ["flagged"]


def test_a_lan_service_is_flagged_with_the_loopback_forward_not_proposed(learned, home) -> None:
    """It never proposes a rule the namespace providers refuse: a connection to a LAN
    address is flagged with the loopback forward that every client reaches."""
    proposal = propose(
        Policy(name="tool"), [learned("net.connect", "192.168.1.20:5432")], home=str(home)
    )
    assert not proposal.changed
    (finding,) = proposal.flagged
    assert "a LAN address" in finding.reason and "127.0.0.1" in finding.reason
