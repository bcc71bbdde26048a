"""The firejail provider: the exact hardened argv, and real runs where firejail works.

The namespace effects (capabilities, processes, network, files, death with the parent) are
judged in test_namespaces.py. Here: the argv, for a virtualenv under /tmp too (firejail's
private /tmp hides it unless whitelisted), and a real worker whose virtualenv lives in /tmp.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from agent_sandbox import Policy, ProviderUnavailable
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers._base import LaunchPlan, WorkerSpec
from agent_sandbox.providers._firejail import FirejailProvider, firejail_argv
from agent_sandbox.providers._view import HostLayout

HOST = HostLayout(
    symlinks={"/bin": "usr/bin"},
    top=("/bin", "/boot", "/etc", "/home", "/root", "/run", "/tmp", "/usr", "/var"),
    run=("/run/dbus", "/run/firejail", "/run/postgresql"),
)
SPEC = WorkerSpec(
    python="/tmp/venv-x/bin/python",
    boot_script="/src/agent_sandbox/_worker/boot.py",
    scratch="/tmp/as-1/scratch",
    control_dir="/tmp/as-1",
    listen_fd=3,
    boot_fd=4,
    sys_path=(
        "/py/lib/python3.11",
        "/py/lib/python3.11/lib-dynload",
        "/tmp/venv-x/lib/python3.11/site-packages",
    ),
    package_dirs={
        "agent_sandbox": "/src/agent_sandbox",
        "agent_sandbox.guards": "/src/guards",
        "agent_sandbox.policies": "/src/policies",
        "agent_sandbox.providers": "/src/providers",
    },
    env={},
    prefix="/tmp/venv-x",
    base_prefix="/py",
)
POLICY = Policy(
    name="t",
    files={"read": ["/data/in/*.csv", "/etc/ssl/certs"], "deny": ["/data/in/secret.csv"]},
)


def test_argv_is_exact_for_a_venv_under_tmp() -> None:
    """It spells out every protection and whitelists the /tmp virtualenv read-only."""
    ro = [
        "/py",
        "/src/agent_sandbox",
        "/src/guards",
        "/src/policies",
        "/src/providers",
        "/tmp/venv-x",
        "/data/in",
    ]
    expected = [
        "setpriv",
        "--pdeathsig",
        "KILL",
        "--",
        "firejail",
        "--noprofile",
        "--quiet",
        "--caps.drop=all",
        "--nonewprivs",
        "--seccomp",
        "--net=none",
        "--private-dev",
        "--private-tmp",
        "--private-etc=ld.so.cache,localtime,ssl",
        "--read-only=/",
        "--blacklist=/boot",
        "--blacklist=/home",
        "--blacklist=/root",
        "--blacklist=/var",
        "--blacklist=/run/dbus",
        "--blacklist=/run/postgresql",
    ]
    for path in ro:
        expected += [f"--whitelist={path}", f"--read-only={path}"]
    expected += [
        "--whitelist=/tmp/as-1/scratch",
        "--read-write=/tmp/as-1/scratch",
        "--blacklist=/data/in/secret.csv",
        "--keep-fd=3,4",
        "--deterministic-exit-code",
        "--deterministic-shutdown",
        "--",
        "/tmp/venv-x/bin/python",
        "-I",
        "-S",
        "-B",
        "/src/agent_sandbox/_worker/boot.py",
        "4",
    ]
    assert firejail_argv(POLICY, SPEC, HOST) == tuple(expected)
    # The worker's life line (the agent's pipe) is kept with the transport's descriptors.
    with_life = dataclasses.replace(SPEC, life_fd=7)
    expected[expected.index("--keep-fd=3,4")] = "--keep-fd=3,4,7"
    assert firejail_argv(POLICY, with_life, HOST) == tuple(expected)


def test_argv_never_relies_on_a_profile() -> None:
    """It denies firejail's default profile a say: `--noprofile`, nothing from a profile."""
    argv = firejail_argv(POLICY, SPEC, HOST)
    assert "--noprofile" in argv
    assert not any(a.startswith(("--profile", "--include")) for a in argv)


def test_refuses_a_policy_that_allows_a_remote_host() -> None:
    """It refuses, naming the rule, a policy that needs more than `--net=none`."""
    policy = Policy(name="t", net={"rules": [{"host": "10.1.2.3", "ports": 80}]})
    with pytest.raises(
        ProviderUnavailable,
        match=r'host = "10\.1\.2\.3" ports = "80": firejail runs the worker with --net=none.*enforced by: bwrap or unshare',
    ):
        FirejailProvider().build(policy, SPEC)


def test_a_missing_firejail_is_an_error_naming_it() -> None:
    """It raises ProviderUnavailable naming firejail when the executable is absent."""
    with pytest.raises(ProviderUnavailable, match="firejail"):
        FirejailProvider(firejail="/nonexistent/firejail").require()


# -- real runs -----------------------------------------------------------------------------


def _require() -> None:
    probe = FirejailProvider().probe()
    if not probe.available:
        pytest.skip(f"firejail unavailable here: {probe.reason}")


def test_default_stack_runs_with_the_project_venv() -> None:
    """It runs a worker from the project's virtualenv, stacking Landlock and seccomp."""
    _require()
    w = WorkerProcess.start(Policy(name="t"), FirejailProvider())
    try:
        assert w.plan is not None and w.plan.stack[0] == "firejail"
        checks = w.hello["checks"]
        assert checks["cap_eff"] == "0" * 16 and checks["no_new_privs"] == 1
        assert w.run("2 + 3").value == 5
    finally:
        w.close()


class _NoDeathSignal(FirejailProvider):
    """firejail as a normal user meets it: the exec of the set-user-ID firejail clears the
    parent-death signal `setpriv` set, so here there is none at all."""

    def build(self, policy: Policy, spec: WorkerSpec) -> LaunchPlan:
        plan = super().build(policy, spec)
        assert plan.argv[1:4] == ("--pdeathsig", "KILL", "--"), plan.argv[:4]
        return dataclasses.replace(plan, argv=plan.argv[4:])


def test_a_worker_no_death_signal_reaches_ends_when_the_agents_life_line_closes() -> None:
    """It ends the firejail sandbox, worker and all, when the agent's end of the worker's
    life line closes (what the agent's death does, however it died), with no parent-death
    signal and nothing sent by the host: the kernel SIGKILLs the worker (its code blocks every
    signal and never returns), and firejail's --deterministic-shutdown ends the rest."""
    _require()
    w = WorkerProcess.start(
        Policy(name="t", imports={"allow": ["signal", "time"]}), _NoDeathSignal()
    )
    try:
        assert w.plan is not None and w.plan.argv[0].endswith("firejail")
        assert w.run("2 + 3").value == 5
        assert w._life is not None and w.proc is not None
        looping = threading.Event()
        call = threading.Thread(
            target=w.run,
            args=(_NEVER_YIELDS,),
            kwargs={"timeout": 600, "on_event": lambda *e: "looping" in repr(e) and looping.set()},
            daemon=True,
        )
        call.start()
        assert looping.wait(60), "the call did not start"
        assert w.proc.poll() is None
        os.close(w._life)  # the agent's end: nothing else is sent to the worker
        w._life = None
        assert w.proc.wait(timeout=60) is not None
        call.join(60)
        assert not call.is_alive()
    finally:
        w.close()


# A sleep, not a Python loop: the code layer's iteration budget would end a loop within a
# second on a fast interpreter, and the call must still be running when the line closes.
_NEVER_YIELDS = (
    "import signal, time\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\n"
    "print('looping', flush=True)\n"
    "time.sleep(3600)\n"
)


def test_runs_a_worker_whose_venv_lives_under_tmp(tmp_path: Path) -> None:
    """It runs a worker whose interpreter is a virtualenv in /tmp (hidden by --private-tmp)."""
    _require()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    project_site = Path(sys.prefix) / site.relative_to(venv)
    # The worker imports h11 and wrapt from its own environment: copy them (no network).
    for name in ("h11", "wrapt"):
        shutil.copytree(project_site / name, site / name)
    # The parent imports the rest from the project (a path line, then the editable finder).
    editable = next(project_site.glob("__editable__*.pth"), None)
    lines = [str(project_site)] + ([editable.read_text().strip()] if editable else [])
    (site / "zz_project.pth").write_text("\n".join(lines) + "\n")
    script = textwrap.dedent("""
        import sys
        from agent_sandbox import Policy
        from agent_sandbox._host.process import WorkerProcess
        from agent_sandbox.providers._firejail import FirejailProvider
        policy = Policy(name="t", imports={"allow": ["sys", "h11"]})
        w = WorkerProcess.start(policy, FirejailProvider(stack=False))
        try:
            assert "--whitelist=" + sys.prefix in w.plan.argv, w.plan.argv
            r = w.run("import sys, h11; print(sys.executable); print(h11.__file__)")
            print(r.stdout, r.error)
        finally:
            w.close()
    """)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
        env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert lines[0] == str(venv / "bin" / "python"), out.stdout
    assert lines[1].startswith(str(site)), out.stdout
