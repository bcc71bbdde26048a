"""The start of a worker, seen from the parent: from nothing to a handshaken, placed worker.

In order (`start_worker`):

1. Create a private 0700 control directory holding the listening socket and the scratch
   directory (the worker's working directory); the worker log is a bounded memfd
   (`bounded_log`).
2. Listen on a Unix socket there; the worker inherits the listening descriptor, so it needs
   no path to the socket, and the parent connects by path.
3. Let the provider build the launch plan (pure) and launch it (thin) in a new session.
4. Write the boot configuration (policy, token, import roots) into an inherited pipe.
5. Handshake (`GET /hello`): the worker must answer in time and run the same interpreter
   version and base prefix as the parent (this catches a silently swapped libpython).
6. Open the host's own sources of evidence about the worker's calls (its guard counter,
   its kernel log, its egress route: `agent_sandbox._host.evidence`).

The process it starts is a `agent_sandbox._host.process.WorkerProcess`; the inputs of a
start are in `agent_sandbox._host.launch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent_sandbox._denial import new_token
from agent_sandbox._errors import TransportError, WorkerStartError, describe_exit
from agent_sandbox._host import lifecycle
from agent_sandbox._host.evidence import (
    EgressEvidence,
    GuardEvidence,
    KernelLogEvidence,
    LimitEvidence,
)
from agent_sandbox._host.intake import guard_block
from agent_sandbox._host.intake.events import HostBounds
from agent_sandbox._host.intake.transport import WorkerClient
from agent_sandbox._host.launch import (
    BOOT_SCRIPT,
    bounded_log,
    import_roots,
    package_dirs,
    worker_env,
    worker_python,
)
from agent_sandbox._host.limit_report import GuestLimits
from agent_sandbox._host.limits import start_cgroups
from agent_sandbox._host.setup_checks import verify_checks
from agent_sandbox._wire import BootConfig, HelloError
from agent_sandbox.policies import Policy
from agent_sandbox.providers import Provider, WorkerSpec

if TYPE_CHECKING:
    from agent_sandbox._host.process import WorkerProcess
    from agent_sandbox._host.templates import WorkerTemplate

__all__ = ["pin_socket", "start_worker", "watch_guards"]

_logger = logging.getLogger("agent_sandbox")
_unwatched_warned = False


def start_worker(
    cls: type[WorkerProcess],
    policy: Policy,
    provider: Provider,
    *,
    start_timeout: float = 15.0,
    template: WorkerTemplate | None = None,
) -> WorkerProcess:
    """Start a worker for `policy` under `provider` and wait for its handshake.

    With a `template` (see `_host/templates.py`) the worker is forked from a pre-imported
    template instead of started from scratch; the plan, the boot configuration, the
    limits and every restriction are the same.
    """
    worker = cls()
    worker.policy = policy
    provider.prepare(policy)  # a first use's one-time build: outside the start timeout
    t0 = time.monotonic()
    lifecycle.ensure_guardian()
    worker.control_dir = tempfile.mkdtemp(prefix=lifecycle.control_dir_prefix())
    os.chmod(worker.control_dir, 0o700)
    worker.scratch = os.path.join(worker.control_dir, "scratch")
    os.mkdir(worker.scratch, 0o700)
    sock_path = os.path.join(worker.control_dir, "ctl.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    boot_r, boot_w = os.pipe()
    # The worker's life line (`WorkerSpec.life_fd`): the write end stays here, close-on-
    # exec and passed to nothing, until the worker is reaped; a worker forked from a
    # template dies with the template instead.
    life_r, life_w = os.pipe() if template is None else (-1, -1)
    # The channel that brings the worker's egress-proxy listener to the host (used only
    # when the plan has an egress proxy; see _host/egress/proxy.py).
    egress_host, egress_worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker._egress_channel = egress_host  # closed by _cleanup_dirs on any failure
    try:
        listener.bind(sock_path)
        listener.listen(8)
        listener.set_inheritable(True)
        os.set_inheritable(boot_r, True)
        if life_r >= 0:
            os.set_inheritable(life_r, True)
        egress_worker.set_inheritable(True)
        spec = WorkerSpec(
            python=worker_python(),
            boot_script=BOOT_SCRIPT,
            scratch=worker.scratch,
            control_dir=worker.control_dir,
            listen_fd=listener.fileno(),
            boot_fd=boot_r,
            sys_path=import_roots(),
            package_dirs=package_dirs(),
            env=worker_env(policy, os.environ),
            prefix=sys.prefix,
            base_prefix=sys.base_prefix,
            egress_fd=egress_worker.fileno(),
            life_fd=life_r,
        )
        worker.plan = provider.build(policy, spec)
        if template is not None:
            worker.plan = template.adapt(worker.plan)  # a namespace template's worker
        if "landlock" in worker.plan.worker_setup:
            # Subscribed to the kernel's Landlock records before the worker can meet its
            # first denial, where the audit is on and readable (_host/denial_log.py).
            from agent_sandbox._host.denial_log import subscribe

            subscribe()
        depth = worker.plan.worker_depth
        # A namespace template's worker has its init and relay inside its groups (they
        # count in pids.max, like a launcher that joins the groups itself).
        inside = template is not None and template.kind == "namespace"
        worker.cgroups = start_cgroups(
            worker.id,
            policy,
            None if inside else depth,
            launcher_tasks=worker.plan.launcher_tasks,
            launcher_mb=worker.plan.launcher_mb,
        )
        log = bounded_log()
        worker._log = log
        if template is not None:
            worker.proc = template.spawn(worker.plan, log)
        else:
            plan = worker.plan
            if worker.cgroups is not None and depth is None:
                # A launcher of no fixed shape joins the groups itself before it runs.
                plan = dataclasses.replace(plan, argv=worker.cgroups.joining_argv(plan.argv))
            plan = dataclasses.replace(plan, env={**plan.env, **lifecycle.owner_env()})
            worker.proc = lifecycle.launch(provider.launch, plan, log)
    except BaseException:
        listener.close()
        os.close(boot_r)
        os.close(boot_w)
        egress_worker.close()
        if life_w >= 0:
            os.close(life_w)
        worker._cleanup_dirs()
        raise
    finally:
        listener.close()
        egress_worker.close()
        with contextlib.suppress(OSError):
            os.close(boot_r)
        if life_r >= 0:
            os.close(life_r)
    if life_w >= 0 and life_r in worker.plan.pass_fds:
        worker._life = life_w
    elif life_w >= 0:
        os.close(life_w)  # the provider has no use for it (a parent-death signal reaches)
    try:
        setup = worker.plan.worker_setup
        if "egress" in setup:  # its route's refusal token, its own (`_denial.new_token`)
            worker.egress_token = new_token()
            setup = setup.replace(egress={**setup["egress"], "token": worker.egress_token})
        boot = BootConfig(
            token=worker.token,
            worker_id=worker.id,
            listen_fd=spec.listen_fd,
            policy=policy.to_wire(pin="egress" not in worker.plan.worker_setup),
            sys_path=list(spec.sys_path),
            package_dirs=dict(spec.package_dirs),
            scratch=worker.scratch,
            worker_setup=setup,
            host_env_names=sorted(os.environ),
            # Started from scratch in the launch thread: it dies with that thread.
            die_with_parent=template is None,
            # No pid namespace to die with: a keeper ends what the worker detached.
            keeper=template is None and worker.plan.keeper,
            # The worker's end of the life line: the same number in it (pass_fds).
            life_fd=life_r if worker._life is not None else None,
        )
        try:
            _write_all(boot_w, json.dumps(boot.to_dict()).encode())
        except OSError as exc:
            raise start_failed(worker, f"could not send the boot configuration ({exc})") from None
        finally:
            os.close(boot_w)
        cgroups, proc = worker.cgroups, worker.proc
        # A namespace template's worker: `proc` is its init, the worker its only child.
        init = bool(getattr(proc, "init", False))
        if init:
            depth = 0
        if cgroups is not None and depth is not None:
            # While the worker boots (it has its configuration already). It runs no user code
            # and forks nothing before its handshake, so joining now covers all it will start.
            if depth == 0:
                place_in_cgroups(worker, lambda: cgroups.attach(proc.pid))
            else:
                alive = lambda: proc.poll() is None  # noqa: E731
                place_in_cgroups(
                    worker, lambda: cgroups.attach_at_depth(proc.pid, depth, start_timeout, alive)
                )
        # Loaded here, while the worker boots (on a fresh host's idle core), rather than
        # with this module: the restricted unpickler's tables (about 5 ms of imports).
        from agent_sandbox._host.intake.unpickle import Decoder

        worker.decoder = Decoder.from_policy(policy)
        worker.bounds = HostBounds.from_policy(policy)
        if worker.plan.socket_path:
            # The worker binds its own socket (gVisor): wait for it, then pin it.
            sock_path = pin_socket(worker, worker.plan.socket_path, t0 + start_timeout)
        worker.client = WorkerClient(
            sock_path, worker.token, worker.bounds.max_event_bytes(), worker.bounds.kind_caps()
        )
        if "egress" in worker.plan.worker_setup:
            # The proxy's thread starts while the worker boots: a thread's start waits
            # until the new thread runs, several milliseconds on a loaded machine, which
            # the worker's own boot hides here (before the launch it added them to every
            # start with the proxy: benchmarks/bench_egress.py). Loaded for plans with
            # an egress proxy only (it brings asyncio).
            from agent_sandbox._host.egress.handoff import EgressError
            from agent_sandbox._host.egress.proxy import egress_proxy

            try:
                egress_proxy().start()
            except EgressError as exc:
                raise start_failed(worker, f"the egress proxy could not start: {exc}") from None
        try:
            remaining = start_timeout - (time.monotonic() - t0)
            worker.hello = worker.client.hello(max(0.05, remaining))
        except HelloError as exc:
            # An answer, but not a handshake this host reads (`_wire.Hello`).
            raise start_failed(worker, f"its handshake was refused: {exc}") from None
        except (TimeoutError, TransportError) as exc:
            status = worker.proc.poll()
            tail = worker.log_tail()
            worker.kill()
            reason = (
                f"it exited early ({describe_exit(status)})"
                if status is not None
                else f"no handshake within {start_timeout:g} s ({exc})"
            )
            raise WorkerStartError(reason, log_tail=tail) from None
        verify_hello(worker)
        if worker.plan.provider == "gvisor" and getattr(worker.plan, "pins", None):
            # The granted paths as runsc's gofer mounted them, before any call.
            from agent_sandbox.providers.gvisor.pins import check_pins_in_gofer

            check_pins_in_gofer(worker.plan, proc.pid)  # type: ignore[arg-type]
        hold_scratch(worker)
        watch_guards(worker)
        watch_kernel_log(worker)
        if "egress" in worker.plan.worker_setup:
            attach_egress(worker, egress_host, start_timeout - (time.monotonic() - t0))
        worker._egress_channel = None
        egress_host.close()
        if cgroups is not None and depth:
            # Whatever the first pass missed at the worker's depth or below (normally
            # nothing: one read per group); the launcher's own processes stay outside.
            place_in_cgroups(worker, lambda: cgroups.attach_tree(proc.pid, min_depth=depth))
        elif cgroups is not None and init:
            # The worker itself, forked by its init maybe before the init was placed.
            place_in_cgroups(worker, lambda: cgroups.attach_tree(proc.pid))
    except BaseException:
        # An interrupted or failed start (Ctrl-C, a start error): nothing of it stays.
        worker.kill()
        raise
    if worker.plan.limit_reports:
        worker.guest_limits = GuestLimits(
            worker.plan.limit_reports, worker.proc.pid, source=worker.plan.provider
        )
    # The limit report, with what this start set up (the warm-up call below consults it).
    worker.evidence.register(
        LimitEvidence(
            worker.cgroups,
            scratch=worker.scratch,
            guest=worker.guest_limits,
            scratch_in_memory=worker.scratch_in_memory,
        )
    )
    if worker.plan.warm_up:
        warm_up(worker, start_timeout - (time.monotonic() - t0))
    worker.started_at = time.monotonic()
    _logger.debug(
        "worker %s started under %s in %.0f ms",
        worker.id,
        "+".join(worker.plan.stack),
        (worker.started_at - t0) * 1000,
    )
    return worker


def pin_socket(worker: WorkerProcess, path: str, deadline: float) -> str:
    """Wait until the worker's own socket exists at `path` (in the directory the sandbox
    shares with the host), then open it with O_PATH | O_NOFOLLOW and return the
    `/proc/self/fd` name the client connects through: a link the worker planted there
    is refused, and a later swap of the name does not redirect the host."""
    assert worker.proc is not None
    delay = 0.001
    fd = -1
    while True:
        if fd < 0:
            try:
                fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise start_failed(
                    worker, f"the worker's socket cannot be opened ({exc})"
                ) from None
        if fd >= 0:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
                raise start_failed(worker, "the worker's socket path is not a socket")
            if _accepts(f"/proc/self/fd/{fd}"):  # bound, and listening (not only bound)
                break
        status = worker.proc.poll()
        if status is not None:
            tail = worker.log_tail()
            worker.kill()
            raise WorkerStartError(
                f"it exited early ({describe_exit(status)})", log_tail=tail
            ) from None
        if time.monotonic() >= deadline:
            if fd >= 0:
                os.close(fd)
            raise start_failed(worker, "no socket from the worker within its start timeout")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    worker._socket_pin = fd
    return f"/proc/self/fd/{fd}"


def start_failed(worker: WorkerProcess, reason: str) -> WorkerStartError:
    """A start that cannot be kept: take the worker's log tail, kill it, and return the
    error to raise, naming `reason`."""
    tail = worker.log_tail()
    worker.kill()
    return WorkerStartError(reason, log_tail=tail)


def warm_up(worker: WorkerProcess, timeout: float) -> None:
    """One constant call before the worker is handed out (`LaunchPlan.warm_up`)."""
    result = worker.run("None", timeout=max(timeout, 5.0), filename="<warm-up>")
    if result.error is not None or worker.dead:
        raise start_failed(worker, f"the worker's warm-up call failed ({result.error})")


def attach_egress(worker: WorkerProcess, channel: socket.socket, timeout: float) -> None:
    """Take the worker's proxy listener (sent before its handshake) onto the host's
    egress proxy; a worker whose proxy cannot serve is never kept."""
    assert worker.policy is not None
    from agent_sandbox._host.egress.handoff import (
        EgressError,
        loopback_forwards,
        receive_listeners,
    )
    from agent_sandbox._host.egress.proxy import egress_proxy

    try:
        listener, forwards = receive_listeners(channel, timeout, loopback_forwards(worker.policy))
        worker.egress = egress_proxy().attach(
            worker.policy, listener, forwards=forwards, token=worker.egress_token
        )
        worker.evidence.register(EgressEvidence(worker.egress))
    except EgressError as exc:
        raise start_failed(worker, f"the egress proxy could not start: {exc}") from None


def place_in_cgroups(worker: WorkerProcess, place: Callable[[], object]) -> None:
    """Run one placement step; a worker alive but outside its groups is never kept."""
    assert worker.proc is not None
    try:
        place()
    except OSError as exc:
        if worker.proc.poll() is None:
            raise start_failed(
                worker, f"could not place the worker in its cgroups ({exc})"
            ) from None


def verify_hello(worker: WorkerProcess) -> None:
    hello = worker.hello
    assert hello is not None
    version = hello.version
    if version != tuple(sys.version_info[:3]):
        raise start_failed(
            worker,
            f"the worker runs Python {'.'.join(map(str, version))}, the parent "
            f"{'.'.join(map(str, sys.version_info[:3]))} (a swapped libpython?)",
        )
    if os.path.realpath(hello.base_prefix) != os.path.realpath(
        sys.base_prefix
    ) and not plan_hides_prefix(worker):
        raise start_failed(
            worker,
            f"the worker's interpreter prefix {hello.base_prefix!r} is not "
            f"the parent's {sys.base_prefix!r}",
        )

    problems = verify_checks(
        worker.plan.worker_setup.to_dict() if worker.plan else {}, hello.checks.to_dict()
    )
    if problems:
        raise start_failed(
            worker, "the worker's kernel restrictions do not match its plan: " + "; ".join(problems)
        )


def watch_guards(worker: WorkerProcess) -> None:
    """Open the host's reader of the arming counter the handshake reported."""
    global _unwatched_warned
    assert worker.proc is not None and worker.hello is not None
    worker.guard_watch = guard_block.GuardWatch.open(worker.proc.pid, worker.hello)
    if worker.guard_watch is not None:
        worker.evidence.register(GuardEvidence(worker.guard_watch))
    # A worker behind its own kernel (a VM, gVisor's Sentry) has no host process whose
    # memory the host could read: expected there, not worth a warning.
    expected = worker.plan is not None and worker.plan.interrupt_launcher
    if worker.guard_watch is None and not expected and not _unwatched_warned:
        _unwatched_warned = True
        guards = worker.hello.checks.guards
        reported = isinstance(guards, dict) and isinstance(guards.get("block"), dict)
        why = (
            "this process may not read the worker's memory"
            if reported
            else "the worker reported none: the guards' C extension `_fastimport` is "
            "not built for its interpreter"
        )
        _logger.warning(
            "agent_sandbox: the host cannot read the worker's guard counter (%s); only "
            "the worker's own tamper check remains",
            why,
        )


def watch_kernel_log(worker: WorkerProcess) -> None:
    """Read the worker's Landlock denials from the kernel's audit log where it is on
    and readable (nothing is switched on here: see `_host/denial_log.py`)."""
    assert worker.policy is not None
    assert worker.hello is not None
    landlock = worker.hello.checks.landlock
    if worker.plan is None or "landlock" not in worker.plan.worker_setup:
        return
    if not isinstance(landlock, dict):
        return
    abi = landlock.get("abi")
    if not isinstance(abi, int) or abi < 7:
        return
    from agent_sandbox._host.denial_log import watch_worker

    worker.kernel_log = watch_worker(worker.worker_pid(), worker.policy.name, abi)
    if worker.kernel_log is not None:
        worker.evidence.register(KernelLogEvidence(worker.kernel_log))


def plan_hides_prefix(worker: WorkerProcess) -> bool:
    return False  # (no provider's plan runs the worker under another prefix)


def hold_scratch(worker: WorkerProcess) -> None:
    """Keep a descriptor on the worker's scratch if it is a tmpfs and a memory cgroup
    bounds the worker: its files are then memory, and an OOM kill they caused is named
    as theirs (`scratch_in_memory`). The descriptor keeps the tmpfs until the worker is
    ended, however it died; checked to be the tmpfs its mount table names."""
    cgroups = worker.cgroups
    if cgroups is None or not any(k.startswith("memory") for k in cgroups.dirs):
        return
    assert worker.plan is not None
    inside = worker.scratch
    pid = worker.worker_pid()
    if pid is None:
        return
    try:
        with open(f"/proc/{pid}/mountinfo") as fh:
            mountinfo = fh.read()
    except OSError:
        return
    device = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) >= 5 and rest and fields[4] == inside:
            device = fields[2] if rest[0] == "tmpfs" else None  # the last mount wins
    if device is None:
        return
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(f"/proc/{pid}/root{inside}", flags)
    except OSError:
        return
    st = os.fstat(fd)
    if f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}" != device:
        os.close(fd)
        return
    worker._scratch_fd = fd


def _accepts(path: str) -> bool:
    """Whether the Unix socket at `path` takes a connection (closed at once)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                time.sleep(0.001)
                continue
            raise
        view = view[n:]
