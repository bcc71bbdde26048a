"""Where `worker serve` runs and which layer holds there (`_host/placement.py`), and what
`doctor` and `worker check` say about it: detection fed with simulated inputs (a fake `/`
tree and environment), since no gVisor or pod runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_sandbox._host import placement
from agent_sandbox._host.placement import (
    Place,
    choose_inpod,
    detect_place,
    effective_runtime,
    inpod_report,
    runtime_mismatch,
)
from agent_sandbox._tools.cli import main
from agent_sandbox.providers import AutoProvider

GVISOR_44 = "Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016\n"
GVISOR_419 = "Linux version 4.19.0-gvisor #1 SMP Sun Jan 10 15:06:54 PST 2016\n"
RUNC = "Linux version 6.1.0-28-amd64 (debian-kernel@lists.debian.org) #1 SMP Debian\n"


def _root(tmp_path: Path, version: str = RUNC, **files: str) -> str:
    (tmp_path / "proc" / "1").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "proc" / "version").write_text(version)
    (tmp_path / "proc" / "1" / "cgroup").write_text("0::/\n")
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    for name, text in files.items():
        path = tmp_path / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("version", [GVISOR_44, GVISOR_419])
def test_gvisor_is_detected_from_its_kernel_version(tmp_path: Path, version: str) -> None:
    place = detect_place(_root(tmp_path, version), {})
    assert place.runtime == "gvisor" and place.container == "container"
    assert any("gVisor's" in e for e in place.evidence)


def test_a_real_kernel_is_not_gvisor_whatever_the_hostname(tmp_path: Path) -> None:
    # The kubelet names no host `runsc`, but a container may: the name proves nothing.
    root = _root(tmp_path, RUNC, etc__hostname="runsc\n")
    assert detect_place(root, {}) == Place()


@pytest.mark.parametrize(
    ("files", "env", "container"),
    [
        ({}, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, "kubernetes"),
        ({"etc__hosts": "# Kubernetes-managed hosts file.\n"}, {}, "kubernetes"),
        ({"proc__1__cgroup": "1:cpu:/kubepods/besteffort/pod1/abc\n"}, {}, "kubernetes"),
        ({".dockerenv": ""}, {}, "docker"),
        ({"run__.containerenv": ""}, {}, "podman"),
        ({}, {"container": "lxc"}, "lxc"),
        ({}, {}, ""),
    ],
)
def test_containers_and_pods_are_detected(
    tmp_path: Path, files: dict[str, str], env: dict[str, str], container: str
) -> None:
    place = detect_place(_root(tmp_path, RUNC, **files), env)
    assert place.container == container and place.runtime == ""
    assert place.in_container is bool(container)


@pytest.mark.parametrize(
    ("requested", "runtime", "works", "expected"),
    [
        ("auto", "gvisor", True, ("auto", False)),  # a kernel provider works inside gVisor
        ("auto", "gvisor", False, ("subprocess", True)),  # none does: the runtime holds
        ("auto", "", False, ("auto", False)),  # no runtime, no provider: the bind refuses
        ("auto", "", True, ("auto", False)),
        ("subprocess", "kata", False, ("subprocess", True)),
        ("subprocess", "", True, ("subprocess", False)),  # refused unless the policy opts out
        ("landlock", "gvisor", False, ("landlock", False)),  # named: taken as named
    ],
)
def test_the_in_pod_provider_is_the_strongest_that_works(
    requested: str, runtime: str, works: bool, expected: tuple[str, bool]
) -> None:
    assert choose_inpod(requested, runtime, works) == expected


def test_a_declared_gvisor_the_kernel_contradicts_is_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(placement, "ROOT", _root(tmp_path, RUNC))
    runc = detect_place()
    assert "runtimeClassName did not apply" in runtime_mismatch("gvisor", runc)
    assert runtime_mismatch("kata", runc) == ""  # Kata cannot be checked from inside
    assert runtime_mismatch("gvisor", Place("container", "gvisor")) == ""
    assert effective_runtime("", Place("container", "gvisor")) == ("gvisor", "detected")
    assert effective_runtime("kata", runc) == ("kata", "declared")


@pytest.fixture
def gvisor_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated pod under gVisor: its kernel version, the kubelet's environment."""
    monkeypatch.setattr(placement, "ROOT", _root(tmp_path, GVISOR_44))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")


@pytest.fixture
def nothing_works_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel provider starts (gVisor with user namespaces refused, no Landlock)."""
    monkeypatch.setattr(placement, "_auto_works", lambda: (False, "simulated: none works"))


@pytest.mark.usefixtures("gvisor_pod", "nothing_works_inside")
def test_doctor_in_a_gvisor_pod_says_the_runtime_is_the_boundary_and_secrets_are_exposed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["doctor"]) == 0  # gVisor is a boundary, though no provider works inside
    out = capsys.readouterr().out
    assert "in a Kubernetes pod: what `agent-sandbox worker serve` would run here" in out
    assert "runtime: gvisor (detected; it is a boundary)" in out
    assert "in-pod provider (auto): subprocess" in out
    assert "boundary: gvisor+subprocess" in out
    assert "READABLE by the code" in out


@pytest.mark.usefixtures("gvisor_pod")
def test_doctor_in_a_gvisor_pod_where_a_kernel_provider_works_names_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if not AutoProvider().probe().available:
        pytest.skip("no kernel provider works here")
    main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    in_pod = report["in_pod"]
    assert report["placement"]["runtime"] == "gvisor"
    assert in_pod["runtime"] == "gvisor" and in_pod["runtime_source"] == "detected"
    assert in_pod["provider"] in ("bwrap", "unshare", "landlock")
    assert in_pod["stack"][:2] == ["gvisor", in_pod["provider"]]
    assert in_pod["boundary"].startswith("gvisor+" + in_pod["provider"])
    assert in_pod["secrets_masked"] is True


def test_doctor_on_a_plain_host_has_no_pod_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(placement, "ROOT", _root(tmp_path, RUNC))
    for name in ("KUBERNETES_SERVICE_HOST", "container"):
        monkeypatch.delenv(name, raising=False)
    main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert "in_pod" not in report and report["placement"]["container"] == ""


@pytest.mark.usefixtures("gvisor_pod", "nothing_works_inside")
def test_worker_check_says_the_same_as_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "check"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == inpod_report("auto", "").lines()
    assert "boundary: gvisor+subprocess" in out


def test_worker_check_fails_on_a_declared_gvisor_the_kernel_contradicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(placement, "ROOT", _root(tmp_path, RUNC))
    assert main(["worker", "check", "--runtime-boundary", "gvisor"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_worker_check_without_any_boundary_says_the_bind_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(placement, "ROOT", _root(tmp_path, RUNC))
    assert main(["worker", "check", "--provider", "subprocess"]) == 1
    assert "refused" in capsys.readouterr().out


def test_worker_check_under_landlock_says_only_policies_accepting_visible_names_bind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`worker check --provider landlock` reports Landlock's stack for a policy that says
    `visible_names = "accepted"`, and says in words that names are visible and no other
    policy binds (never a default policy accepted on its behalf)."""
    from agent_sandbox.providers import get_provider

    if not get_provider("landlock").probe().available:
        pytest.skip("landlock unavailable here")
    monkeypatch.setattr(placement, "ROOT", _root(tmp_path, RUNC))
    report = inpod_report("landlock", "")
    assert report.error == "" and report.provider == "landlock", report
    assert report.names_visible is True
    text = "\n".join(report.lines())
    assert "names outside the grants: VISIBLE" in text
    assert 'only a policy that says visible_names = "accepted" binds here' in text
    if AutoProvider().probe().available:
        assert inpod_report("auto", "").names_visible is False
