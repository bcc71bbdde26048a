"""The refusal trail (`_worker/audit.Tally`, and the host's own bound in the builder): the
important refusals survive any flood, and the folds say how many they hold."""

from __future__ import annotations

from agent_sandbox._denial import Denial, is_sensitive
from agent_sandbox._host.intake.builder import MAX_DENIALS, MAX_SENSITIVE, ResultBuilder
from agent_sandbox._worker.audit import MAX_KEYS, PER_RULE, Tally


def _read(target: str, **kw: object) -> Denial:
    return Denial(rule="files.read", action="read", target=target, policy="p", **kw)  # type: ignore[arg-type]


def test_a_flood_of_junk_cannot_fold_away_etc_shadow() -> None:
    """It denies 10,000 junk refusals the power to hide a later read of /etc/shadow."""
    tally = Tally()
    for i in range(10_000):
        tally.add(_read(f"/data/junk-{i}"))
    tally.add(_read("/etc/shadow"))
    tally.add(_read("/data/junk-last"))
    out = {d.target: d for d in tally.denials()}
    assert out["/etc/shadow"].count == 1
    fold = out["(other targets)"]
    assert fold.count == 10_001 - PER_RULE  # the trace says how many were folded
    assert fold.last is not None and fold.last.target == "/data/junk-last"
    assert f"past the first {PER_RULE} distinct targets" in fold.detail
    assert len(out) == PER_RULE + 2


def test_one_noisy_rule_leaves_room_for_the_others() -> None:
    """It keeps the first refusals of every rule, however many another rule had."""
    tally = Tally()
    for i in range(5000):
        tally.add(_read(f"/x/{i}"))
    for i in range(3):
        tally.add(Denial(rule="imports", action="import", target=f"mod{i}", policy="p"))
    targets = {d.target for d in tally.denials()}
    assert {"mod0", "mod1", "mod2"} <= targets


def test_sensitive_refusals_have_a_bounded_reserve_and_a_fold_of_their_own() -> None:
    """It keeps sensitive refusals apart: their own reserve, then their own fold."""
    tally = Tally(max_keys=MAX_KEYS, per_rule=PER_RULE, max_sensitive=4)
    for i in range(10):
        tally.add(_read(f"/home/u/.ssh/id_rsa{i}"))
    for i in range(100):
        tally.add(_read(f"/junk/{i}"))
    out = {d.target: d for d in tally.denials()}
    assert out["(other sensitive targets)"].count == 6
    last = out["(other sensitive targets)"].last
    assert last is not None and last.target == "/home/u/.ssh/id_rsa9"
    assert out["(other targets)"].last.target == "/junk/99"  # type: ignore[union-attr]
    assert sum(1 for t in out if t.startswith("/home/u/.ssh/")) == 4


def test_what_counts_as_sensitive() -> None:
    for rule, target in [
        ("files.read", "/etc/shadow"),
        ("files.read", "/root/.aws/credentials"),
        ("files.read", "/proc/1/environ"),
        ("env", "GITHUB_TOKEN"),
        ("net.connect", "203.0.113.5:443"),
        ("api.process-exec", "/bin/sh"),
    ]:
        assert is_sensitive(rule, target), (rule, target)
    assert not is_sensitive("files.read", "/data/sales/q1.csv")
    assert not is_sensitive("imports", "numpy")


def test_the_host_keeps_sensitive_refusals_past_its_own_bound() -> None:
    """It denies a worker that sends more distinct refusals than the host keeps the power to
    fold a sensitive one into the ordinary fold."""
    b = ResultBuilder(policy="p", call=1)
    for i in range(MAX_DENIALS + 50):
        b.add_denial(_read(f"/junk/{i}"))
    b.add_denial(_read("/etc/shadow"))
    targets = [d.target for d in b.denials]
    assert "/etc/shadow" in targets and "(other targets)" in targets
    (fold,) = [d for d in b.denials if d.target == "(other targets)"]
    assert fold.count == 50
    assert MAX_SENSITIVE > 0
