"""`auto`: the deepest working stack per policy, reported; explicit names never downgrade."""

from __future__ import annotations

import dataclasses
import subprocess
from typing import IO, Any, ClassVar

import pytest

from agent_sandbox import Policy, ProviderUnavailable, Sandbox
from agent_sandbox.providers import _bwrap as bwrap_module
from agent_sandbox.providers import get_provider, select_provider
from agent_sandbox.providers._auto import AUTO_CANDIDATES, AutoProvider
from agent_sandbox.providers._base import LaunchPlan, ProbeResult, Provider, WorkerSpec
from agent_sandbox.providers._firejail import FirejailProvider
from agent_sandbox.providers._landlock import probe_landlock
from agent_sandbox.providers._seccomp import probe_seccomp

SPEC = WorkerSpec(
    python="/py/bin/python",
    boot_script="/src/b.py",
    scratch="/tmp/s",
    control_dir="/tmp",
    listen_fd=3,
    boot_fd=4,
    sys_path=(),
    package_dirs={},
    env={},
    prefix="/py",
    base_prefix="/py",
)


def fake(
    name: str,
    *,
    strength: int,
    layers: tuple[str, ...] = (),
    available: bool = True,
    refuses: bool = False,
) -> Provider:
    """A provider double: a fixed probe, a plan with the given stack, a recorded launch."""

    class Fake(Provider):
        launched: ClassVar[list[str]] = []

        def probe(self) -> ProbeResult:
            return ProbeResult(name, available, "" if available else f"{name} is missing")

        def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
            if refuses:
                raise ProviderUnavailable(name, "cannot serve this policy")
            return LaunchPlan(
                provider=name, argv=(name,), env={}, pass_fds=(), cwd="/", stack=(name, *layers)
            )

        def launch(self, plan: LaunchPlan, log: IO[bytes]) -> subprocess.Popen[bytes]:
            self.launched.append(plan.provider)
            raise RuntimeError("launched " + plan.provider)

    Fake.name = name
    Fake.strength = strength
    Fake.answers = _answers_of(name)
    return Fake()


def _answers_of(name: str) -> Any:
    """What the provider called `name` answers; for another name, every section but `[net]`
    (so a `[net]` rule under it is refused, as under a provider that has not said)."""
    from agent_sandbox.providers import get_provider
    from agent_sandbox.providers._netcheck import standard_answers

    try:
        return type(get_provider(name)).answers
    except ProviderUnavailable:
        return {k: v for k, v in standard_answers(lambda policy: []).items() if k != "net"}


def test_picks_the_deepest_stack_that_works() -> None:
    """It prefers the stack with more layers, whatever the candidate order."""
    auto = AutoProvider((fake("a", strength=40), fake("b", strength=30, layers=("landlock",))))
    plan = auto.build(Policy(name="t"), SPEC)
    assert plan.provider == "b"
    assert plan.stack == ("b", "landlock")


def test_breaks_a_tie_by_strength() -> None:
    """It takes the stronger provider when two stacks are as deep."""
    auto = AutoProvider(
        (fake("weak", strength=10, layers=("x",)), fake("strong", strength=40, layers=("x",)))
    )
    assert auto.build(Policy(name="t"), SPEC).stack == ("strong", "x")


def test_skips_unavailable_and_refusing_candidates() -> None:
    """It ignores a candidate whose probe fails or that cannot serve the policy."""
    auto = AutoProvider(
        (
            fake("gone", strength=50, layers=("x", "y"), available=False),
            fake("nonet", strength=40, layers=("x", "y"), refuses=True),
            fake("ok", strength=10),
        )
    )
    assert auto.build(Policy(name="t"), SPEC).provider == "ok"
    assert auto.probe().details["unavailable"] == {"gone": "gone is missing"}


def test_no_candidate_is_an_error_naming_why() -> None:
    """It raises ProviderUnavailable with each candidate's reason when none can serve."""
    auto = AutoProvider((fake("nonet", strength=40, refuses=True),))
    with pytest.raises(ProviderUnavailable, match="nonet: cannot serve this policy"):
        auto.build(Policy(name="t"), SPEC)


def test_launches_with_the_provider_that_built_the_plan() -> None:
    """It hands the plan to the chosen provider's own launcher (bwrap's passes a memfd)."""
    chosen = fake("deep", strength=10, layers=("x",))
    auto = AutoProvider((fake("flat", strength=40), chosen))
    plan = auto.build(Policy(name="t"), SPEC)
    with pytest.raises(RuntimeError, match="launched deep"):
        auto.launch(plan, None)  # type: ignore[arg-type]


def test_never_chooses_firejail() -> None:
    """It leaves firejail out: only a policy that names it gets it."""
    assert FirejailProvider not in AUTO_CANDIDATES
    assert "firejail" not in [p.name for p in AutoProvider().candidates]


def test_an_explicit_provider_that_cannot_run_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """It denies a silent downgrade: a named provider that cannot run raises, naming why."""
    missing = ProbeResult("bwrap", False, "the `bwrap` executable (bubblewrap) is not on PATH")
    monkeypatch.setattr(bwrap_module, "_probe", lambda _exe: missing)
    with pytest.raises(ProviderUnavailable, match="bubblewrap"):
        select_provider("bwrap")
    with pytest.raises(ProviderUnavailable, match="bubblewrap"):
        Sandbox(Policy(name="t"), provider="bwrap", warm=0)


def test_auto_here_picks_bwrap_with_landlock_and_seccomp() -> None:
    """It stacks Landlock and seccomp inside bwrap on a machine that has all three."""
    if not (
        bwrap_module.BwrapProvider().probe().available
        and probe_landlock().available
        and probe_seccomp()[0]
    ):
        pytest.skip("this machine lacks bwrap, Landlock or seccomp")
    plan = get_provider("auto").build(Policy(name="t"), SPEC)
    assert plan.stack == ("bwrap", "landlock", "seccomp")


def test_auto_gives_a_networked_policy_to_a_namespace_provider_with_the_proxy() -> None:
    """It is never weaker with network rules than without: the same namespace provider,
    plus the egress proxy, never Landlock's port rules alone."""
    if not bwrap_module.BwrapProvider().probe().available:
        pytest.skip("bwrap unavailable here")
    spec = dataclasses.replace(SPEC, egress_fd=9)
    policy = Policy(name="t", net={"rules": [{"host": "api.example.com", "ports": 443}]})
    plain = get_provider("auto").build(Policy(name="t"), spec)
    plan = get_provider("auto").build(policy, spec)
    assert plan.provider == plain.provider == "bwrap"
    assert plan.stack == (*plain.stack, "egress-proxy")
    assert "egress" in plan.worker_setup


def test_auto_refuses_a_networked_policy_when_only_port_rules_are_left() -> None:
    """It raises, naming what is missing, rather than hand network rules to Landlock alone."""
    auto = AutoProvider((fake("landlock", strength=20, layers=("landlock", "seccomp")),))
    rules = [{"host": "api.example.com", "ports": 443}]
    policy = Policy(name="t", net={"rules": rules}, visible_names="accepted")
    with pytest.raises(
        ProviderUnavailable,
        match=r"namespace provider.*landlock: it cannot enforce this \[net\] rule.*\[net\] rules\[0\] host = \"api\.example\.com\" ports = \"443\": Landlock filters TCP by port only.*enforced by: bwrap or unshare",
    ):
        auto.build(policy, SPEC)
    assert auto.build(Policy(name="t", visible_names="accepted"), SPEC).provider == "landlock"


def test_auto_never_takes_landlock_alone_for_a_policy_that_does_not_accept_visible_names() -> None:
    """It refuses, naming the key and the providers that hide names, where Landlock alone is
    all that works (a machine without user namespaces: no bwrap, no unshare), and takes it
    for the same policy with `visible_names = "accepted"`; with bwrap working, Landlock
    stays its second layer for a policy without the key."""
    from agent_sandbox.providers._landlock import LandlockProvider

    if not LandlockProvider().probe().available:
        pytest.skip("landlock unavailable here")
    no_userns = AutoProvider(
        (
            fake("bwrap", strength=40, available=False),
            fake("unshare", strength=30, available=False),
            LandlockProvider(),
        ),
        stronger=(),
    )
    with pytest.raises(ProviderUnavailable) as info:
        no_userns.build(Policy(name="t"), SPEC)
    text = str(info.value)
    assert "landlock: " in text and "Landlock cannot hide that a file exists" in text, text
    assert 'visible_names = "accepted"' in text and '"bwrap" or "unshare"' in text, text
    plan = no_userns.build(Policy(name="t", visible_names="accepted"), SPEC)
    assert plan.stack == ("landlock", "seccomp")
    if bwrap_module.BwrapProvider().probe().available:
        plan = AutoProvider(stronger=()).build(Policy(name="t"), SPEC)
        assert plan.stack[:2] == ("bwrap", "landlock"), plan.stack


def test_a_sandbox_on_auto_reports_the_provider_that_ran() -> None:
    """It runs a call on `auto` and the result names the provider actually used."""
    with Sandbox(Policy(name="t"), provider="auto", warm=0) as sb:
        result = sb.run("2 + 3")
    assert result.value == 5
    assert result.provider in {cls.name for cls in AUTO_CANDIDATES}


def test_a_candidate_that_cannot_beat_the_best_plan_is_not_built() -> None:
    """It builds no plan of a weaker candidate whose deepest stack cannot beat the stack it
    has already (for a policy without network rules), and still builds one that could."""
    built: list[str] = []

    def counted(name: str, strength: int, layers: tuple[str, ...], deepest: int) -> Provider:
        provider = fake(name, strength=strength, layers=layers)
        real = provider.build

        def build(policy: Any, spec: WorkerSpec) -> LaunchPlan:
            built.append(name)
            return real(policy, spec)

        provider.build = build  # type: ignore[method-assign]
        type(provider).deepest_stack = deepest
        return provider

    auto = AutoProvider(
        (
            counted("weak", 10, ("x",), 2),
            counted("strong", 40, ("x", "y"), 3),
            counted("deeper", 30, (), 4),
        )
    )
    assert auto.build(Policy(name="t"), SPEC).stack == ("strong", "x", "y")
    assert built == ["strong", "deeper"]


def test_no_plan_here_lists_more_than_its_providers_deepest_stack() -> None:
    """Each provider's `deepest_stack` holds for the plans it builds on this machine."""
    from agent_sandbox.providers import get_provider

    for name in ("bwrap", "unshare", "landlock"):
        provider = get_provider(name)
        if not provider.probe().available:
            continue
        assert provider.deepest_stack is not None
        plan = provider.build(Policy(name="t", visible_names="accepted"), SPEC)
        assert len(plan.stack) <= provider.deepest_stack, (name, plan.stack)
