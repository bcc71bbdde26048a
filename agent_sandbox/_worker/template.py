"""The worker template: a pre-imported process that forks ready-to-configure workers.

Most of a worker's start-up is importing its own code (h11, the guards, the code layer).
A pool for a provider that starts its worker as a plain child (`subprocess`, `landlock`)
keeps one template per policy: it imports all of that once, runs no user code, holds no
secret, arms nothing, and on request forks a child that becomes a worker. In order:

1. The template imports the worker's modules, runs their per-call code on data of its own
   (`server.exercise`), applies the guards' patches, which depend on no policy and stay
   disarmed (`guards._install.preinstall`), and says `ready` on its control socket.
2. For each request (JSON plus three descriptors: the listening socket, the boot pipe and
   the log) it forks. The child closes the control socket, starts a new session, points
   stdout and stderr at the log, changes to its scratch directory, takes the environment it
   was sent, reads its boot configuration and runs exactly what a freshly started worker
   runs (`serve`): rlimits, kernel restrictions (Landlock applies to the single-threaded
   child), guards, then serving.
3. The template reports `spawned` with the child's pid, and each child's exit status when
   it reaps it, so the parent sees signals and exit codes as from a direct child.

What it does not change: every worker still applies its own limits and restrictions, and
configures, seals and arms the guards for its own policy; the template saves the imports and
the patching (whose pages every worker would otherwise write again).

Per-process secrets: `random` reseeds itself after a fork, and the child replaces the
`multiprocessing` authentication key when that module is loaded. Two things cannot be
renewed in a forked process, and are a documented limit: the string hash secret (every
string and dict made during the imports carries hashes under it, so changing it would break
them) and the address-space layout (ASLR is applied at exec). Workers forked from one
template share both. A template belongs to one pool, and a pool to one `Sandbox` unless the
user asks to share (`Sandbox(share_workers=True)`), so workers of different sandboxes never
share them; a worker that knows the secret can only use it against its own siblings, which
run the same sandbox's code under the same policy.

A template inside a namespace sandbox (`bwrap`, `unshare`; `_host/templates.py` says when)
gives each worker namespaces of its own: `_worker/nstemplate.py`.

Standard library only until the worker's modules are imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
from collections.abc import Callable
from typing import Any

from agent_sandbox._worker import nstemplate
from agent_sandbox._worker.reaper import end_children

__all__ = ["run_template"]

_MAX_MESSAGE = 1 << 20
#: The log, the credential socket (namespace templates), and the plan's descriptors.
_MAX_FDS = 8


def _warm_up() -> Any:
    import ctypes
    import fcntl  # noqa: F401  (a forked worker's `lo`, in a namespace template)
    import struct  # noqa: F401

    import agent_sandbox._landlock_sys
    import agent_sandbox._worker._inworker
    import agent_sandbox._worker.objects
    import agent_sandbox._worker.server
    import agent_sandbox._worker.setup
    import agent_sandbox.guards._code_budget
    import agent_sandbox.guards._code_check
    import agent_sandbox.guards._install

    # Made once here rather than in each worker's memory (issue 19: memory per session).
    agent_sandbox._landlock_sys.warm_up()
    agent_sandbox._worker._inworker.warm_up()
    agent_sandbox._worker.server.exercise()
    # Last: the guards' patches (disarmed until a worker configures and arms them).
    agent_sandbox.guards._install.preinstall()
    return ctypes.CDLL(None, use_errno=True)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


_PR_SET_PDEATHSIG = 1


def _become_worker(
    request: dict[str, Any],
    fds: list[int],
    control: socket.socket,
    selector: selectors.BaseSelector,
    wakeup: tuple[int, int],
    libc: Any,
    read_boot: Callable[[int], dict[str, Any]],
    *,
    entered: bool = False,
) -> None:
    """In the forked child: set up like a fresh worker process, then serve (never returns).

    `entered`: this is W, and P's part of step 1 in `_worker/nstemplate.py` is done: the C
    fork did it, and closed the log and credential descriptors in P before W was forked."""
    try:
        if not entered:
            # Dies with the template, which exits when the parent's end of its socket closes.
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()  # the template's descriptors are nothing the worker may keep
        for fd in wakeup:
            os.close(fd)
        control.close()
        ns = request.get("ns")
        log_fd, rest = fds[0], fds[1:]
        cred_fd = rest.pop(0) if ns else -1
        # The plan's descriptors (listening socket, boot pipe, egress channel...), by the
        # numbers the host's plan gave them.
        by_host = dict(zip((int(n) for n in request["plan_fds"]), rest, strict=True))
        listen_fd, boot_fd = rest[0], rest[1]
        if entered:
            nstemplate.build_view(request["ns"], libc)
        else:
            os.setsid()
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(log_fd)
            if ns:
                nstemplate.enter_namespaces(ns, cred_fd, libc)  # returns in W only
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, value in request["env"].items():
            os.putenv(name, value)
        _renew_secrets()
        from agent_sandbox._worker.server import serve

        boot = read_boot(boot_fd)
        boot["listen_fd"] = listen_fd
        egress = (boot.get("worker_setup") or {}).get("egress")
        if egress and int(egress.get("fd", -1)) in by_host:
            egress["fd"] = by_host[int(egress["fd"])]
        serve(boot)
    except BaseException as exc:
        try:
            os.write(2, f"agent-sandbox worker set-up failed: {exc!r}\n".encode())
        finally:
            os._exit(70)
    os._exit(0)


def _renew_secrets() -> None:
    """Per-process secrets the child must not share with its siblings (see the docstring)."""
    import sys

    mp = sys.modules.get("multiprocessing.process")
    if mp is not None:
        mp.current_process().authkey = os.urandom(32)  # type: ignore[attr-defined]


def _reap(control: socket.socket, spawned: set[int]) -> None:
    """Reap every ended child; report those this template forked (an orphan a worker left,
    reparented here as to a subreaper, is reaped silently: its pid means nothing to the
    host, and may be a later worker's)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in spawned:
            continue
        spawned.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _send(control, {"exit": pid, "returncode": code})


_PR_SET_CHILD_SUBREAPER = 36


def run_template(
    control_fd: int, read_boot: Callable[[int], dict[str, Any]], *, namespace: bool = False
) -> None:
    """Serve fork requests on the control socket until it closes (then exit).

    `read_boot` is the boot script's reader of a boot configuration: the boot script runs
    by path, so it hands its reader over instead of being imported a second time.
    `namespace`: the template runs inside a namespace sandbox (see the module docstring).
    """
    control = socket.socket(fileno=control_fd)
    libc = _warm_up()
    if namespace:
        nstemplate.prepare(libc)
    else:
        # A plain template (no pid namespace to end its workers' descendants): what a
        # worker starts and detaches (a setsid double fork) is reparented here, and ended
        # with everything else when the host is gone.
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    spawned: set[int] = set()
    import gc

    gc.collect()
    gc.freeze()
    # A child's exit wakes the loop through this pipe (no polling while idle).
    wakeup = os.pipe()
    os.set_blocking(wakeup[0], False)
    os.set_blocking(wakeup[1], False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wakeup[1])
    _send(control, {"ready": os.getpid()})
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(wakeup[0], selectors.EVENT_READ, "child")
    buffer = b""
    while True:
        events = selector.select()
        _reap(control, spawned)
        if not any(key.data == "control" for key, _ in events):
            with contextlib.suppress(BlockingIOError):
                os.read(wakeup[0], 4096)
            continue
        data, fds_list, _flags, _addr = socket.recv_fds(control, 65536, _MAX_FDS)
        if not data:
            # The parent is gone: its workers die with this process (their parent-death
            # signal); what they detached is ended here first.
            if not namespace:
                end_children(5.0)
            os._exit(0)
        fds = list(fds_list)
        buffer += data
        if len(buffer) > _MAX_MESSAGE:
            os._exit(71)
        if b"\n" not in buffer:
            for fd in fds:
                os.close(fd)
            continue
        line, _, buffer = buffer.partition(b"\n")
        request = json.loads(line)
        expected = 1 + bool(request.get("ns")) + len(request.get("plan_fds") or ())
        if len(fds) != expected or len(request.get("plan_fds") or ()) < 2:
            for fd in fds:
                os.close(fd)
            _send(control, {"error": "unexpected descriptors", "req": request.get("req")})
            continue
        try:
            if request.get("ns"):
                role, pid = nstemplate.fork(libc, fds[0], fds[1])
            else:
                pid = os.fork()
                role = "template" if pid else "child"
        except (OSError, nstemplate.NamespaceSetupFailed) as exc:
            for fd in fds:
                os.close(fd)
            _send(control, {"error": f"could not fork a worker ({exc})", "req": request.get("req")})
            continue
        if role == "worker":
            _become_worker(request, fds, control, selector, wakeup, libc, read_boot, entered=True)
        elif role == "init":
            nstemplate.init_loop(pid)
        elif role == "child":
            _become_worker(request, fds, control, selector, wakeup, libc, read_boot)
        for fd in fds:
            os.close(fd)
        spawned.add(pid)
        _send(control, {"spawned": pid, "req": request.get("req")})
