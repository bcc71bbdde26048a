"""The learning envelope: learn mode, inside a kernel provider, never wider than the policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_sandbox import Policy, PolicyError, ProviderUnavailable
from agent_sandbox._tools.learn.observe import envelope_report, learning_envelope
from agent_sandbox.providers import get_provider


def _kernel_provider_available() -> bool:
    names = get_provider("auto").probe().details.get("candidates", ())
    return any(get_provider(n).is_boundary for n in names)


needs_kernel = pytest.mark.skipif(
    not _kernel_provider_available(), reason="no kernel provider works on this machine"
)

POLICY = Policy(
    name="tool",
    files={"read": ["/data/in"], "write": ["$SCRATCH", "/data/out"]},
    net={"rules": [{"host": "127.0.0.1", "ports": "8080"}]},
    imports={"allow": ["json"]},
    env={"pass": ["LANG", "OPENAI_API_KEY", "LD_PRELOAD", "*", "DB_PASSWORD"]},
)
#: The same policy with the explicit opt-out, for the tests that learn under `subprocess`.
OPTED_OUT = POLICY.model_copy(update={"no_kernel_boundary": "accepted"})


@needs_kernel
def test_learning_runs_in_a_kernel_provider_when_one_is_available() -> None:
    """It learns under `auto` and reports the kernel candidates."""
    envelope = learning_envelope(POLICY)
    assert envelope.mode == "learn"
    assert envelope.provider == "auto"
    assert "kernel boundary" in envelope_report(POLICY, envelope)[0]


def test_a_named_kernel_provider_is_kept() -> None:
    """It keeps the provider a policy names (landlock here) instead of choosing another."""
    if not get_provider("landlock").probe().available:
        pytest.skip("landlock is not available here")
    named = POLICY.model_copy(update={"provider": "landlock", "visible_names": "accepted"})
    envelope = learning_envelope(named)
    assert envelope.provider == "landlock" and envelope.visible_names == "accepted"
    with pytest.raises(PolicyError, match='visible_names = "accepted"'):
        learning_envelope(POLICY, provider="landlock")  # the key is the policy's, never added
    assert envelope_report(POLICY, envelope)[0] == "provider: landlock (kernel boundary)"


def test_an_unavailable_requested_provider_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It raises ProviderUnavailable for a named provider that cannot run, never a downgrade."""
    # qemu: no guest image here, and no kernel package to build one on first use
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("AGENT_SANDBOX_QEMU_KERNEL_DEB", str(tmp_path / "no-kernel.deb"))
    with pytest.raises(ProviderUnavailable):
        learning_envelope(POLICY, provider="qemu")


def test_an_explicit_subprocess_provider_is_reported_as_unbounded() -> None:
    """It honours an explicit `subprocess` (with the policy's opt-out) and says there is no
    kernel boundary; without the opt-out it refuses."""
    with pytest.raises(PolicyError, match="no_kernel_boundary"):
        learning_envelope(POLICY, provider="subprocess")
    envelope = learning_envelope(OPTED_OUT, provider="subprocess")
    assert envelope.provider == "subprocess"
    assert "NO kernel boundary" in envelope_report(POLICY, envelope)[0]


def test_the_envelope_never_widens_the_policy() -> None:
    """It keeps files, network and imports as declared and only narrows the environment."""
    envelope = learning_envelope(OPTED_OUT, provider="subprocess")
    assert envelope.files.read == POLICY.files.read
    assert envelope.files.write == POLICY.files.write
    assert envelope.net == POLICY.net
    assert envelope.imports == POLICY.imports
    assert envelope.api == POLICY.api
    assert set(envelope.env.passthrough) <= set(POLICY.env.passthrough)


def test_secrets_and_loader_variables_are_withheld_while_learning() -> None:
    """It drops secret-looking names, loader variables and a bare `*` from env.pass, and says so."""
    envelope = learning_envelope(OPTED_OUT, provider="subprocess")
    assert envelope.env.passthrough == ("LANG",)
    report = "\n".join(envelope_report(POLICY, envelope))
    assert "withheld while learning" in report and "OPENAI_API_KEY" in report


def test_the_policy_file_is_denied_inside_the_envelope(policy, policy_file) -> None:
    """It adds the policy file and its proposal files to files.deny for the learning run."""
    opted_out = policy.model_copy(update={"no_kernel_boundary": "accepted"})
    envelope = learning_envelope(opted_out, provider="subprocess")
    assert str(policy_file) in envelope.files.deny
    assert str(policy_file.with_name("tool.proposed.toml")) in envelope.files.deny
