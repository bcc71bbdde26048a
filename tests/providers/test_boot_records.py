"""The typed records that cross from host to worker before it serves (`_wire.py`).

Every provider's plan carries a `WorkerSetup` record, never a hand-written dict; each of the
record's fields is set by the plans that need it and by no other (the table below says
which: a field no plan sets is a dead key, a field a plan sets that the table does not list
is a new contract to review); the wire form of each plan's record is what the worker reads
back, and the worker refuses a boot configuration with a key it does not know or one it
lacks, naming them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._errors import ProviderUnavailable
from agent_sandbox._wire import (
    BootConfig,
    BootError,
    EgressRelay,
    EgressSetup,
    GrantPins,
    LandlockRuleset,
    LimitReport,
    ScratchTmpfs,
    SeccompProgram,
    WorkerSetup,
)
from agent_sandbox.providers import _landlock, _seccomp
from agent_sandbox.providers._base import LaunchPlan, ProbeResult, WorkerSpec
from agent_sandbox.providers._registry import all_providers
from tests.providers.conftest import accepted_for

SPEC = WorkerSpec(
    python="/opt/venv/bin/python",
    boot_script="/src/agent_sandbox/_worker/boot.py",
    scratch="/tmp/as-1/scratch",
    control_dir="/tmp/as-1",
    listen_fd=3,
    boot_fd=4,
    sys_path=("/py/lib/python3.11", "/py/lib/python3.11/lib-dynload"),
    package_dirs={"agent_sandbox": "/src/agent_sandbox", "agent_sandbox.guards": "/src/guards"},
    env={},
    prefix="/opt/venv",
    base_prefix="/py",
    egress_fd=7,
)
DEFAULT = Policy(name="t")
#: A policy with a remote host: the plans that carry the egress proxy say so.
NET = Policy(name="t", net={"rules": [{"host": "api.example.com", "ports": 443}]})

#: Which `WorkerSetup` fields each provider's plan sets, for the default policy and for one
#: with a `[net]` rule, with Landlock and seccomp working here. A field left out is None on
#: purpose: the worker skips that step (its meaning is in `WorkerSetup`'s docstring).
KERNEL = {"no_new_privs", "drop_caps"}
IN_WORKER = {"landlock", "seccomp", "seccomp_exec"}
#: None: the provider refuses the `[net]` policy (`_netcheck`), so there is no plan.
EXPECTED: dict[str, tuple[set[str], set[str] | None]] = {
    "subprocess": (set(), set()),
    "landlock": (KERNEL | IN_WORKER | {"scratch_tmpfs"}, None),
    # bwrap loads the seccomp program itself; the worker applies the exec program after.
    "bwrap": ({"landlock", "seccomp_exec"}, {"landlock", "seccomp_exec", "egress"}),
    "unshare": (KERNEL | IN_WORKER, KERNEL | IN_WORKER | {"egress"}),
    "firejail": (KERNEL | IN_WORKER, None),
    "gvisor": (
        KERNEL | {"listen_path", "limit_report", "seccomp", "seccomp_exec"},
        KERNEL
        | {"listen_path", "limit_report", "seccomp", "seccomp_exec", "egress", "egress_relay"},
    ),
    "qemu": ({"seccomp", "seccomp_exec"}, {"seccomp", "seccomp_exec", "egress"}),
}
#: The providers whose worker checks, after its view is built, that each granted path is the
#: one the host walked (a `pins` field of its own; Landlock's are in its ruleset, gVisor's
#: are checked by the host).
PINNING = {"bwrap", "unshare", "firejail"}


@pytest.fixture
def working_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Landlock, seccomp and runsc as a machine where they all work would answer (the
    plans are pure; nothing here starts a worker)."""
    from agent_sandbox.providers.gvisor.provider import GvisorProvider

    monkeypatch.setattr(_landlock, "probe_landlock", lambda: ProbeResult("landlock", True))
    monkeypatch.setattr(_seccomp, "probe_seccomp", lambda: (True, ""))
    monkeypatch.setattr(GvisorProvider, "probe", lambda self: ProbeResult("gvisor", True))


def _plans(granted: Path) -> dict[str, tuple[LaunchPlan, LaunchPlan | None, LaunchPlan]]:
    """Each provider's plans for the default policy, the `[net]` one (None: refused) and
    one granting an existing folder (`granted`) to read."""
    plans = {}
    for provider in all_providers():
        if provider.name == "auto":
            continue
        # The words each provider needs said to take a policy (landlock: visible names).
        words = accepted_for(provider.name)
        grant = Policy(name="t", files={"read": [str(granted)]}, **words)
        default = provider.build(DEFAULT.model_copy(update=words), SPEC)
        try:
            net: LaunchPlan | None = provider.build(NET.model_copy(update=words), SPEC)
        except ProviderUnavailable:
            net = None
        plans[provider.name] = (default, net, provider.build(grant, SPEC))
    return plans


def test_every_provider_plan_sets_the_setup_fields_its_table_lists(
    working_kernel: None, tmp_path: Path
) -> None:
    """Every registered provider is in the table, each plan carries a `WorkerSetup` record,
    and the fields it sets are exactly those the table lists for it."""
    plans = _plans(tmp_path)
    assert sorted(plans) == sorted(EXPECTED)
    for name, (default, net, grant) in plans.items():
        pins = {"pins"} if name in PINNING else set()
        wanted = (*EXPECTED[name], EXPECTED[name][0] | pins)
        for plan, want in zip((default, net, grant), wanted, strict=True):
            if want is None or plan is None:
                assert plan is want, f"{name}: refused {want is None}, planned {plan is not None}"
                continue
            assert isinstance(plan.worker_setup, WorkerSetup), name
            assert set(plan.worker_setup) == want, name


def test_every_setup_field_is_set_by_some_provider_plan(
    working_kernel: None, tmp_path: Path
) -> None:
    """No field of the record is dead: each one is set by at least one provider's plan."""
    used: set[str] = set()
    for plans in _plans(tmp_path).values():
        for plan in plans:
            used |= set(plan.worker_setup) if plan else set()
    assert used == set(WorkerSetup.__slots__)


def test_every_plan_setup_round_trips_through_the_worker_reading(
    working_kernel: None, tmp_path: Path
) -> None:
    """The JSON the host writes is what the worker reads back, field for field."""
    for plans in _plans(tmp_path).values():
        for plan in filter(None, plans):
            wire = json.loads(json.dumps(plan.worker_setup.to_dict()))
            assert WorkerSetup.from_dict(wire) == plan.worker_setup


def _boot(**changes: Any) -> BootConfig:
    fields: dict[str, Any] = {
        "token": "t0k",
        "worker_id": "w-1",
        "listen_fd": 3,
        "policy": {"name": "t"},
        "sys_path": ["/py/lib/python3.11"],
        "package_dirs": {"agent_sandbox": "/src/agent_sandbox"},
        "scratch": "/tmp/as-1/scratch",
        "worker_setup": WorkerSetup(no_new_privs=True, drop_caps=True),
        "host_env_names": ["HOME", "PATH"],
        "die_with_parent": True,
        "keeper": False,
    }
    fields.update(changes)
    return BootConfig(**fields)


def test_the_boot_configuration_crosses_as_the_same_json_object() -> None:
    """Its wire form has the keys the worker reads, `worker_setup` as a plain object."""
    boot = _boot()
    wire = json.loads(json.dumps(boot.to_dict()))
    assert sorted(wire) == sorted(BootConfig.__slots__)
    assert wire["worker_setup"] == {"no_new_privs": True, "drop_caps": True}
    assert BootConfig.from_dict(wire) == boot


def test_a_boot_configuration_with_an_unknown_or_a_missing_key_is_refused_naming_it() -> None:
    wire = _boot().to_dict()
    del wire["token"]
    wire["tokn"] = "t0k"
    with pytest.raises(BootError, match=r"missing token; unknown tokn"):
        BootConfig.from_dict(wire)
    wire = _boot().to_dict()
    wire["worker_setup"]["seccmp"] = {}
    with pytest.raises(BootError, match=r"worker_setup has keys .*: seccmp"):
        BootConfig.from_dict(wire)
    with pytest.raises(BootError, match=r"must be a JSON object"):
        BootConfig.from_dict([])


def test_the_records_are_immutable() -> None:
    setup = WorkerSetup(no_new_privs=True)
    with pytest.raises(AttributeError, match="immutable"):
        setup.no_new_privs = False  # type: ignore[misc]
    boot = _boot()
    with pytest.raises(AttributeError, match="immutable"):
        boot.token = "other"  # type: ignore[misc]
    changed = setup.replace(drop_caps=True, no_new_privs=None)
    assert dict(changed) == {"drop_caps": True} and dict(setup) == {"no_new_privs": True}
    assert dataclasses.is_dataclass(setup) is False  # (the worker's start imports no dataclasses)


# -- the nested fragments ------------------------------------------------------------------

#: The record of each fragment field of `WorkerSetup`.
FRAGMENTS = {
    "landlock": LandlockRuleset,
    "seccomp": SeccompProgram,
    "seccomp_exec": SeccompProgram,
    "scratch_tmpfs": ScratchTmpfs,
    "pins": GrantPins,
    "egress": EgressSetup,
    "egress_relay": EgressRelay,
    "limit_report": LimitReport,
}


def test_every_fragment_of_every_plan_is_its_typed_record(
    working_kernel: None, tmp_path: Path
) -> None:
    """Each fragment a plan sets is its immutable record (never a dict), holds every field
    its record requires, and the fields the plans set cover each record's fields (none is
    dead); the worker reads the whole boot configuration back field for field."""
    used: dict[type, set[str]] = {}
    for name, plans in _plans(tmp_path).items():
        for plan in filter(None, plans):
            setup = plan.worker_setup
            for field, record in FRAGMENTS.items():
                value = getattr(setup, field)
                if value is None:
                    continue
                assert type(value) is record, (name, field, type(value))
                with pytest.raises(AttributeError, match="immutable"):
                    value.entries = {}  # type: ignore[union-attr]
                if record is not GrantPins:
                    assert set(record._REQUIRED) <= set(value), (name, field)
                    used.setdefault(record, set()).update(value)
            wire = json.loads(json.dumps(_boot(worker_setup=setup).to_dict()))
            assert BootConfig.from_dict(wire).worker_setup == setup, name
    for record in set(FRAGMENTS.values()) - {GrantPins}:
        want = set(record.__slots__)
        if os.geteuid() == 0:
            want -= {"user_ns"}  # (a tmpfs in a user namespace of its own: non-root only)
        if record is EgressSetup:
            want -= {"token"}  # the host's, set at each start (`_host/startup.py`), no plan's
        assert used.get(record) == want, record.__name__


@pytest.mark.parametrize(
    ("field", "fragment", "words"),
    [
        ("seccomp", {"bpf": "AAAA", "rulez": 1}, r"seccomp program has unknown rulez"),
        ("seccomp_exec", {"rules": 2}, r"seccomp program has missing bpf"),
        ("scratch_tmpfs", {"path": "/s", "bytes": "512"}, r"bytes must be an integer, not str"),
        ("landlock", {"min_abi": 1, "paths": {}}, r"paths must be a JSON array, not dict"),
        ("egress", {"fd": 3, "host": "127.0.0.1"}, r"egress has missing port"),
        ("egress_relay", [], r"egress_relay must be a JSON object, not list"),
        ("limit_report", {"path": "/r", "processes": True}, r"must be an integer, not bool"),
        ("pins", {"/etc": [1]}, r"pins map a path to \[st_dev, st_ino\] or null"),
        ("no_new_privs", 1, r"no_new_privs must be true or false"),
    ],
)
def test_a_malformed_fragment_is_refused_where_built_and_where_read(
    field: str, fragment: Any, words: str
) -> None:
    """A provider building a wrong fragment fails where it builds it; a boot configuration
    carrying one is refused by the worker's reading; both name what is wrong."""
    with pytest.raises(BootError, match=words):
        WorkerSetup(**{field: fragment})
    wire = _boot().to_dict()
    wire["worker_setup"] = {field: fragment}
    with pytest.raises(BootError, match=words):
        BootConfig.from_dict(wire)
