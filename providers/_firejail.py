"""The `firejail` provider: the worker under firejail 0.9.72 with an explicit, hardened argv.

Firejail's defaults do not fit: its default profile for root (`server.profile`) hides
root's home, where the interpreter may live, and `--noprofile` alone is no sandbox at all
(full capabilities, no seccomp, the whole file system). So this provider never uses a
profile and spells out every option.

What it enforces, for native code too:

* new PID, mount and network namespaces (`--net=none`: only a loopback interface), and
  death with the parent (`setpriv --pdeathsig KILL` in front of firejail, which has no such
  option: without it the sandbox outlives a killed parent), and with the agent however it
  died (the worker's life line: the kernel SIGKILLs the worker when the agent's end of a
  pipe closes, and `--deterministic-shutdown` ends the rest of the sandbox);
* no capabilities (`--caps.drop=all`), no-new-privileges, firejail's default seccomp
  filter (`--seccomp`);
* the whole file system read-only (`--read-only=/`), a private `/dev`, `/tmp` and `/etc`
  (holding only `ld.so.cache` and `localtime`), every other top-level entry of `/` that the
  worker does not need blacklisted; inside the top-level directories it does need (the
  interpreter's, the virtualenv's, the project's), only the whitelisted paths exist;
* writable: only the scratch directory and the policy's write paths (`--read-write`);
* the policy's denied paths blacklisted;
* Landlock and the seccomp filter of `providers._seccomp` applied by the worker itself,
  when available (see `LaunchPlan.stack`).

What it does not enforce: firejail is a setuid-root program with a history of local
privilege escalations, and it starts about twice as slowly as bwrap; it is never chosen by
`auto`, only when a policy names it. The worker runs as uid 0 without capabilities, so
visible root-owned files are readable as owner. Non-root users need an entry in
`/etc/firejail/firejail.users`. Firejail closes inherited descriptors unless told; the
transport's two are kept with `--keep-fd`.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any, ClassVar

from agent_sandbox.providers._base import (
    Answer,
    LaunchPlan,
    ProbeResult,
    Provider,
    WorkerSetup,
    WorkerSpec,
    base_env,
    worker_argv,
)
from agent_sandbox.providers._grants import grant_pins
from agent_sandbox.providers._netcheck import firejail_net, refuse_unenforceable, standard_answers
from agent_sandbox.providers._view import (
    HostLayout,
    bound_paths,
    host_layout_for,
    policy_paths,
)

__all__ = ["FirejailProvider", "firejail_argv"]

#: Top-level entries that stay (read-only or private). NOTE: `/run` is allowed because
#: firejail keeps its state in /run/firejail and fails when /run is blacklisted; every other
#: entry of /run is blacklisted (host sockets such as D-Bus or a database live there).
_SYSTEM_TOP = frozenset(
    {
        "/usr",
        "/bin",
        "/sbin",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/etc",
        "/dev",
        "/proc",
        "/tmp",
        "/run",
    }
)
#: The only host files kept in the private /etc. NOTE: allowed because ld.so and `time`
#: read them; neither holds secrets.
_ETC_KEEP = ("ld.so.cache", "localtime")


def _top(path: str) -> str:
    return "/" + path.strip("/").split("/")[0]


def firejail_argv(
    policy: Any,
    spec: WorkerSpec,
    host: HostLayout,
    *,
    firejail: str = "firejail",
    setpriv: str = "setpriv",
) -> tuple[str, ...]:
    """The whole firejail command line for one worker (pure; tests compare it exactly).

    0. `setpriv --pdeathsig KILL`: firejail has no die-with-parent of its own, and its
       sandbox outlives a killed parent; killing firejail takes the sandbox down with it.
       Run by a normal user, the exec of the set-user-ID firejail clears that signal, and
       it was not seen to end the sandbox reliably as root either: the worker's life line
       (`WorkerSpec.life_fd`, kept with the transport's descriptors) ends the worker when
       the agent is gone, and `--deterministic-shutdown` the rest of the sandbox; the
       guardian and the sweep also find firejail by its command line (`_host/guardian.py`);
    1. no profile, then every protection spelled out (caps, nonewprivs, seccomp, network);
    2. private `/dev`, `/tmp`, `/etc`; everything read-only;
    3. top-level entries the worker does not need, and /run's entries: blacklisted;
    4. whitelisted and read-only: the interpreter closure and the policy's read paths outside
       `/usr` and `/etc`; whitelisted and writable: scratch and the policy's write paths;
    5. the policy's denied paths blacklisted; the transport descriptors kept;
    6. `--` and the worker's own command line.
    """
    ro_needed, ro_policy, writable = bound_paths(policy, spec)
    deny = policy_paths(policy, spec)[2]
    etc = sorted({*_ETC_KEEP, *(p.split("/")[2] for p in ro_policy if _top(p) == "/etc")})
    visible = [p for p in [*ro_needed, *ro_policy] if _top(p) not in ("/usr", "/etc")]
    needed_top = _SYSTEM_TOP | {_top(p) for p in [*visible, *writable]}
    argv = [
        setpriv,
        "--pdeathsig",
        "KILL",
        "--",
        firejail,
        "--noprofile",
        "--quiet",
        "--caps.drop=all",
        "--nonewprivs",
        "--seccomp",
        "--net=none",
        "--private-dev",
        "--private-tmp",
        f"--private-etc={','.join(etc)}",
        "--read-only=/",
    ]
    argv += [f"--blacklist={p}" for p in host.top if p not in needed_top]
    argv += [f"--blacklist={p}" for p in host.run if p != "/run/firejail"]
    for path in visible:
        # NOTE: `--read-only=/` does not cover a path whitelisted under a private /tmp.
        argv += [f"--whitelist={path}", f"--read-only={path}"]
    for path in writable:
        argv += [f"--whitelist={path}", f"--read-write={path}"]
    argv += [f"--blacklist={p}" for p in dict.fromkeys([*deny, *sorted(host.masked)])]
    kept = [spec.listen_fd, spec.boot_fd, *([spec.life_fd] if spec.life_fd >= 0 else [])]
    argv += [
        f"--keep-fd={','.join(map(str, kept))}",
        "--deterministic-exit-code",
        # The worker's end ends everything it started in the sandbox (a setsid double
        # fork included), not only the worker.
        "--deterministic-shutdown",
        "--",
        *worker_argv(spec),
    ]
    return tuple(argv)


@functools.cache
def _probe(firejail: str) -> ProbeResult:
    """Run a minimal hardened sandbox once (cached) and report why it fails, if it does."""
    path = shutil.which(firejail)
    if path is None:
        return ProbeResult("firejail", False, "the `firejail` executable is not on PATH")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ProbeResult(
            "firejail", False, "`setpriv` (util-linux) is needed to end firejail with its parent"
        )
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
        version = first.rpartition(" ")[2]
        trial = subprocess.run(
            [
                path,
                "--noprofile",
                "--quiet",
                "--caps.drop=all",
                "--nonewprivs",
                "--seccomp",
                "--net=none",
                "--private-dev",
                "--private-tmp",
                "--read-only=/",
                "--",
                "/bin/sh",
                "-c",
                "exit 0",
            ],
            capture_output=True,
            text=True,
            timeout=15,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ProbeResult("firejail", False, f"running {path} failed: {exc}")
    if trial.returncode != 0:
        err = trial.stderr.strip().splitlines()
        return ProbeResult(
            "firejail",
            False,
            f"firejail refused to run ({err[-1] if err else trial.returncode}); a non-root "
            "user needs an entry in /etc/firejail/firejail.users",
            version=version,
        )
    return ProbeResult("firejail", True, version=version, details={"path": path, "boundary": True})


class FirejailProvider(Provider):
    """Start the worker under firejail with the hardened argv (only when named)."""

    #: What it holds of each section of the policy (`_netcheck.py`).
    answers: ClassVar[Mapping[str, Answer]] = standard_answers(firejail_net)

    name: ClassVar[str] = "firejail"
    strength: ClassVar[int] = 25
    is_boundary: ClassVar[bool] = True

    def __init__(self, *, firejail: str = "firejail", stack: bool = True) -> None:
        self.firejail = firejail
        self.stack = stack

    def probe(self) -> ProbeResult:
        return _probe(self.firejail)

    def build(self, policy: Any, spec: WorkerSpec) -> LaunchPlan:
        refuse_unenforceable(self, policy)  # --net=none: its own loopback only
        details = self.probe().details
        exe = str(details.get("path", self.firejail))
        setpriv = str(details.get("setpriv", "setpriv"))
        pins = grant_pins(policy, spec)  # refuses a grant that runs through a link
        host = host_layout_for(policy, spec)
        setup: dict[str, Any] = {"no_new_privs": True, "drop_caps": True}
        layers: tuple[str, ...] = ()
        if self.stack:
            from agent_sandbox.providers._unshare import stack_in_worker

            more, layers = stack_in_worker(policy, spec, host, pins)
            setup.update(more)
        if pins:
            setup["pins"] = pins
        return LaunchPlan(
            provider=self.name,
            argv=firejail_argv(policy, spec, host, firejail=exe, setpriv=setpriv),
            env=base_env(spec),
            pass_fds=(
                spec.listen_fd,
                spec.boot_fd,
                *([spec.life_fd] if spec.life_fd >= 0 else []),
            ),
            cwd=spec.scratch,
            worker_setup=WorkerSetup(**setup),
            stack=(self.name, *layers),
            worker_depth=None,  # firejail forks short-lived helpers of its own
        )
