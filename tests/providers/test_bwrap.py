"""The bwrap provider: the exact argv, and effects of a real run where bubblewrap works.

The real runs use `BwrapProvider(stack=False)` so that the namespace layer alone is judged
(Landlock and seccomp, stacked by default, are judged in test_containment.py); one test
checks the default stack. Every test that starts a worker closes it.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, ProviderUnavailable
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers._base import WorkerSpec
from agent_sandbox.providers._bwrap import SECCOMP_FD_SLOT, BwrapPlan, BwrapProvider, bwrap_argv
from agent_sandbox.providers._view import HostLayout
from tests.providers.conftest import require_landlock_and_seccomp

HOST = HostLayout(
    symlinks={"/bin": "usr/bin", "/lib": "usr/lib", "/lib64": "usr/lib64", "/sbin": "usr/sbin"},
    kinds={"/data/in/secret.csv": "file"},
)
SPEC = WorkerSpec(
    python="/opt/venv/bin/python",
    boot_script="/src/agent_sandbox/_worker/boot.py",
    scratch="/tmp/as-1/scratch",
    control_dir="/tmp/as-1",
    listen_fd=3,
    boot_fd=4,
    sys_path=(
        "/py/lib/python3.11",
        "/py/lib/python3.11/lib-dynload",
        "/opt/venv/lib/python3.11/site-packages",
    ),
    package_dirs={
        "agent_sandbox": "/src/agent_sandbox",
        "agent_sandbox.guards": "/src/guards",
        "agent_sandbox.policies": "/src/policies",
        "agent_sandbox.providers": "/src/providers",
    },
    env={},
    prefix="/opt/venv",
    base_prefix="/py",
)
POLICY = Policy(
    name="t",
    files={
        "read": ["/data/in/*.csv", "/usr/share/dict"],
        "write": ["$SCRATCH/out", "/srv/out"],
        "deny": ["/data/in/secret.csv", "/srv/out/*.key"],
    },
)
WORKER = ["--", "/opt/venv/bin/python", "-I", "-S", "-B", "/src/agent_sandbox/_worker/boot.py", "4"]
PROLOGUE = [
    "bwrap",
    "--unshare-all",
    "--unshare-user",
    "--disable-userns",
    "--die-with-parent",
    "--new-session",
    "--cap-drop",
    "ALL",
    "--hostname",
    "sandbox",
]
MOUNTS = [
    "--ro-bind",
    "/usr",
    "/usr",
    "--symlink",
    "usr/bin",
    "/bin",
    "--symlink",
    "usr/lib",
    "/lib",
    "--symlink",
    "usr/lib64",
    "/lib64",
    "--symlink",
    "usr/sbin",
    "/sbin",
    "--dev",
    "/dev",
    "--proc",
    "/proc",
    "--size",
    "67108864",
    "--tmpfs",
    "/tmp",
    "--ro-bind",
    "/py",
    "/py",
    "--ro-bind",
    "/opt/venv",
    "/opt/venv",
    "--ro-bind",
    "/src/agent_sandbox",
    "/src/agent_sandbox",
    "--ro-bind",
    "/src/guards",
    "/src/guards",
    "--ro-bind",
    "/src/policies",
    "/src/policies",
    "--ro-bind",
    "/src/providers",
    "/src/providers",
    "--ro-bind-try",
    "/etc/ld.so.cache",
    "/etc/ld.so.cache",
    "--ro-bind-try",
    "/etc/localtime",
    "/etc/localtime",
    "--ro-bind-try",
    "/data/in",
    "/data/in",
    "--bind-try",
    "/srv/out",
    "/srv/out",
    "--perms",
    "0700",
    "--size",
    str(512 * 1024 * 1024),  # limits.scratch_mb
    "--tmpfs",
    "/tmp/as-1/scratch",
    "--ro-bind",
    "/dev/null",
    "/data/in/secret.csv",
    "--chdir",
    "/tmp/as-1/scratch",
]


# -- the pure builder ----------------------------------------------------------------------


def test_argv_is_exact_for_a_policy_with_paths() -> None:
    """It builds the whole argv: namespaces, then mounts shallow-first, then the worker."""
    assert bwrap_argv(POLICY, SPEC, HOST) == tuple(PROLOGUE + MOUNTS + WORKER)


def test_argv_carries_the_seccomp_slot_before_the_command() -> None:
    """It asks for `--seccomp FD` (filled in at launch) right before the worker's command."""
    argv = bwrap_argv(POLICY, SPEC, HOST, bwrap="/usr/bin/bwrap", seccomp=True)
    assert argv == ("/usr/bin/bwrap", *PROLOGUE[1:], *MOUNTS, "--seccomp", SECCOMP_FD_SLOT, *WORKER)


def test_argv_never_uses_options_missing_from_bubblewrap_0_8() -> None:
    """It uses no option added after bubblewrap 0.8.0 (`--argv0`, the overlay family)."""
    argv = bwrap_argv(POLICY, SPEC, HOST, seccomp=True)
    for option in ("--argv0", "--overlay", "--tmp-overlay", "--ro-overlay", "--overlay-src"):
        assert option not in argv


def test_every_tmpfs_has_a_size() -> None:
    """It never mounts a tmpfs without `--size` (which would get half of the RAM)."""
    argv = bwrap_argv(POLICY, SPEC, HOST)
    for i, arg in enumerate(argv):
        if arg == "--tmpfs":
            assert argv[i - 2] == "--size"


def test_a_policy_with_a_remote_host_gets_the_egress_proxy() -> None:
    """It serves a remote host through the host's egress proxy: the listener channel is
    passed, the proxy variables are set, Landlock lets the worker reach the proxy port."""
    policy = Policy(name="t", net={"rules": [{"host": "api.example.com", "ports": 443}]})
    spec = dataclasses.replace(SPEC, egress_fd=7)
    plan = BwrapProvider().build(policy, spec)
    assert plan.worker_setup["egress"] == {
        "fd": 7,
        "host": "127.0.0.1",
        "port": 3128,
        "forwards": [],
    }
    assert 7 in plan.pass_fds
    assert plan.env["HTTPS_PROXY"] == plan.env["http_proxy"] == "http://127.0.0.1:3128"
    assert plan.env["NO_PROXY"] == ""
    assert plan.stack[0] == "bwrap" and plan.stack[-1] == "egress-proxy"
    if "landlock" in plan.worker_setup:
        assert plan.worker_setup["landlock"]["tcp_connect"] == [443, 3128]
    assert "egress" not in BwrapProvider().build(Policy(name="t"), spec).worker_setup


def test_refuses_a_udp_rule_naming_it() -> None:
    """It refuses, naming the rule, a UDP rule the proxy cannot carry (no silent cut)."""
    policy = Policy(
        name="t", net={"rules": [{"host": "10.0.0.0/8", "ports": 53, "protocol": "udp"}]}
    )
    with pytest.raises(
        ProviderUnavailable, match=r'host = "10\.0\.0\.0/8" ports = "53" protocol = "udp": UDP'
    ):
        BwrapProvider().build(policy, dataclasses.replace(SPEC, egress_fd=7))


def test_a_missing_bwrap_is_an_error_naming_it() -> None:
    """It raises ProviderUnavailable naming bubblewrap when the executable is absent."""
    with pytest.raises(ProviderUnavailable, match="bwrap"):
        BwrapProvider(bwrap="/nonexistent/bwrap-" + secrets.token_hex(4)).require()


# -- real runs (the namespace effects are in test_namespaces.py) ---------------------


def _require() -> None:
    probe = BwrapProvider().probe()
    if not probe.available:
        pytest.skip(f"bwrap unavailable here: {probe.reason}")


def _danger_policy(**files: Any) -> Policy:
    return Policy(
        name="danger-bwrap-test",
        imports={"allow": ["*"]},
        api={"allow": ["native-code", "process-control", "introspection"]},
        code={"enabled": False},
        files=files,
        limits={"wall_seconds": 20},
    )


def test_default_stack_adds_landlock_and_seccomp(tmp_path: Path) -> None:
    """It stacks Landlock and the seccomp program (by descriptor) where both work here."""
    _require()
    require_landlock_and_seccomp()
    w = WorkerProcess.start(Policy(name="t"), BwrapProvider())
    try:
        assert isinstance(w.plan, BwrapPlan)
        checks = w.hello.get("checks", {})
        assert w.plan.stack == ("bwrap", "landlock", "seccomp")
        assert checks["seccomp"] == 2
        assert SECCOMP_FD_SLOT in w.plan.argv
        assert checks["landlock"]["enforced"] is True
        result = w.run("2 + 3")
        assert result.value == 5
    finally:
        w.close()
