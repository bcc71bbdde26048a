"""The parent's side of worker templates (see `_worker/template.py` for the worker side).

`WorkerTemplate.start(policy, provider)` launches one pre-imported template for a pool whose
provider starts its workers as plain children (`subprocess`, `landlock`); `spawn(plan, log)`
asks it to fork one worker for a launch plan the provider built as usual, and returns a
`TemplateChild`, which answers `pid`, `poll()` and `wait()` like a `subprocess.Popen`, from
the exit statuses the template reports. A template that cannot start or answer is an error
for the pool, which then starts workers directly; nothing about the sandbox changes.

Under `bwrap` (what `auto` picks here) and `unshare` the template lives INSIDE the sandbox:
bubblewrap (or the `unshare` launcher) starts it with the view a worker of the policy gets,
and each forked worker takes private namespaces of its own there (`_worker/template.py`).
The host keeps the template only when it can hold as a fresh worker would, and starts
workers from scratch otherwise:

* the plan stacks Landlock with its scopes (ABI 6 or later: each worker's own domain keeps
  its signals and ptrace from its siblings) and the seccomp filter;
* the scratch directory is under `/tmp` and the policy does not bind `/tmp` itself (each
  worker gets a fresh `/tmp` and scratch directory; the policy's paths under `/tmp` are
  copied onto it);
* per worker (`adapt`): the worker's view (its bubblewrap command line or launcher
  configuration), but for its scratch path and descriptor numbers, is the template's, and
  a bwrap worker's own set-up gains what bubblewrap gives a fresh one: no-new-privileges,
  the capability drop and the seccomp filter (an `unshare` worker applies all three itself
  anyway).

A forked worker's init (PID 1 of its own PID namespace) is known to the host by the
credentials of a socket message (`SO_PASSCRED`: the kernel writes them and translates the
pid into the host's PID namespace); the host places the init and the worker in the
worker's cgroups while the worker boots, as for a fresh start (the worker forks nothing
before its handshake, and the host checks the whole tree after it).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from agent_sandbox._errors import WorkerStartError
from agent_sandbox._host import hostfile, lifecycle
from agent_sandbox._host.guardian import remove_tree
from agent_sandbox._host.launch import (
    BOOT_SCRIPT,
    import_roots,
    package_dirs,
    worker_env,
    worker_python,
)
from agent_sandbox.policies import Policy
from agent_sandbox.providers import LaunchPlan, Provider, WorkerSpec

__all__ = [
    "NAMESPACE_TEMPLATE_PROVIDERS",
    "PLAIN_TEMPLATE_PROVIDERS",
    "TEMPLATE_PROVIDERS",
    "TemplateChild",
    "WorkerTemplate",
]

#: Providers whose launch plan starts the worker itself as a plain child, with everything
#: that differs between workers in the plan's boot configuration and environment.
PLAIN_TEMPLATE_PROVIDERS = frozenset({"subprocess", "landlock"})
#: Providers whose template lives inside their namespace sandbox (see the docstring).
NAMESPACE_TEMPLATE_PROVIDERS = frozenset({"bwrap", "unshare"})
TEMPLATE_PROVIDERS = PLAIN_TEMPLATE_PROVIDERS | NAMESPACE_TEMPLATE_PROVIDERS
_SCRATCH_MARK = "@scratch"


class TemplateChild:
    """A worker forked by a template, seen like a `subprocess.Popen`."""

    def __init__(self, pid: int, template: WorkerTemplate, *, init: bool = False) -> None:
        self.pid = pid  # on the host (a namespace template's pids differ inside)
        #: `pid` is the worker's init, with the worker its only child (a namespace template).
        self.init = init
        self.returncode: int | None = None
        self._template = template
        self._done = threading.Event()

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._done.set()

    def poll(self) -> int | None:
        if self.returncode is None and not self._template.alive():
            self._gone_without_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if not self._template.alive():
                self._gone_without_status()
                if self.returncode is not None:
                    break
            remaining = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if remaining <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
            self._done.wait(remaining)
        return self.returncode

    def _gone_without_status(self) -> None:
        # The template died before reporting: its children die with it (parent-death
        # signal), so the worker has ended once its process is gone or a zombie.
        if _process_ended(self.pid):
            self._exited(-signal.SIGKILL)


def _process_ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return True
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


class WorkerTemplate:
    """One template process for one (policy, provider) pair; `close()` ends it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.folder = ""
        self._children: dict[int, TemplateChild] = {}
        self._pending: dict[int, threading.Event] = {}
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        self._buffer = b""
        #: "plain" or "namespace" (see the module docstring).
        self.kind = "plain"
        self._view: tuple[str, ...] = ()
        self._scratch_bytes = 0
        self._tmpfs_bytes = 0
        self._template_scratch = ""
        self._provider = ""
        self._loopback = True

    @classmethod
    def start(
        cls,
        policy: Policy,
        provider: Provider,
        *,
        timeout: float = 15.0,
        started: Callable[[WorkerTemplate], None] | None = None,
    ) -> WorkerTemplate:
        """Launch the template with the provider's environment for this policy.

        `started` is given the template before it launches: its `close()` from another
        thread cancels the start (which then raises WorkerStartError).
        """
        from agent_sandbox.providers._base import base_env

        if provider.name in NAMESPACE_TEMPLATE_PROVIDERS:
            return cls._start_namespace(policy, provider, timeout, started)
        if provider.name not in PLAIN_TEMPLATE_PROVIDERS:
            raise WorkerStartError(f"provider {provider.name!r} does not use worker templates")
        self = cls()
        if started is not None:
            started(self)
        lifecycle.ensure_guardian()
        self.folder = tempfile.mkdtemp(prefix=lifecycle.control_dir_prefix() + "template-")
        spec = WorkerSpec(
            python=worker_python(),
            boot_script=BOOT_SCRIPT,
            scratch=self.folder,
            control_dir=self.folder,
            listen_fd=-1,
            boot_fd=-1,
            sys_path=import_roots(),
            package_dirs=package_dirs(),
            env=worker_env(policy, os.environ),
            prefix=sys.prefix,
            base_prefix=sys.base_prefix,
        )
        parent, child = socket.socketpair()
        child_fd = child.fileno()
        boot_r, boot_w = os.pipe()
        try:
            log = os.fdopen(hostfile.create_new(self.folder, "template.log"), "wb")
            argv = (spec.python, "-I", "-S", "-B", spec.boot_script, str(boot_r))
            self.proc = subprocess.Popen(
                argv,
                env={**base_env(spec), **lifecycle.owner_env()},
                cwd=self.folder,
                pass_fds=(child.fileno(), boot_r),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
        finally:
            child.close()
            os.close(boot_r)
        boot = {
            "template_fd": child_fd,
            "sys_path": list(spec.sys_path),
            "package_dirs": dict(spec.package_dirs),
        }
        self._boot(boot_w, boot, parent, timeout)
        return self

    @classmethod
    def _start_namespace(
        cls,
        policy: Policy,
        provider: Provider,
        timeout: float,
        started: Callable[[WorkerTemplate], None] | None = None,
    ) -> WorkerTemplate:
        """Launch the template inside the provider's sandbox (see the module docstring)."""
        from agent_sandbox.providers._bwrap import BwrapPlan, template_argv
        from agent_sandbox.providers._landlock import probe_landlock
        from agent_sandbox.providers._view import (
            TMPFS_BYTES,
            host_layout_for,
            mounts_for,
            network_mode,
            scratch_bytes,
        )

        self = cls()
        self.kind = "namespace"
        if started is not None:
            started(self)
        lifecycle.ensure_guardian()
        self.folder = tempfile.mkdtemp(prefix=lifecycle.control_dir_prefix() + "template-")
        scratch = os.path.join(self.folder, "scratch")
        os.mkdir(scratch, 0o700)
        parent, child = socket.socketpair()
        boot_r, boot_w = os.pipe()
        try:
            spec = WorkerSpec(
                python=worker_python(),
                boot_script=BOOT_SCRIPT,
                scratch=scratch,
                control_dir=self.folder,
                listen_fd=child.fileno(),
                boot_fd=boot_r,
                sys_path=import_roots(),
                package_dirs=package_dirs(),
                env=worker_env(policy, os.environ),
                prefix=sys.prefix,
                base_prefix=sys.base_prefix,
            )
            plan = provider.build(policy, spec)
            if plan.provider == "bwrap" and not isinstance(plan, BwrapPlan):
                raise WorkerStartError("the provider's plan is not a bubblewrap plan")
            if "landlock" not in plan.stack or "seccomp" not in plan.stack:
                raise WorkerStartError(
                    "a template inside the sandbox needs Landlock and seccomp stacked "
                    f"(this plan has {'+'.join(plan.stack)}); workers start from scratch"
                )
            if int(probe_landlock().details.get("abi", 0)) < 6:
                raise WorkerStartError(
                    "a template inside the sandbox needs Landlock ABI 6 (scoped signals); "
                    "workers start from scratch"
                )
            mounts = mounts_for(policy, spec, host_layout_for(policy, spec))
            over_tmp = [m.dst for m in mounts if m.dst == "/tmp" and m.kind != "tmpfs"]
            if not spec.scratch.startswith("/tmp/") or over_tmp:
                raise WorkerStartError(
                    "a template inside the sandbox needs the scratch directory under a "
                    "private /tmp (here the scratch directory is "
                    f"{spec.scratch}{' and the policy binds /tmp itself' if over_tmp else ''}); "
                    "workers start from scratch"
                )
            self._provider = plan.provider
            self._view = _view_key(plan, spec.scratch)
            self._scratch_bytes = scratch_bytes(policy)
            self._tmpfs_bytes = TMPFS_BYTES
            self._template_scratch = spec.scratch
            # `lo` as the provider leaves it for a fresh worker (bwrap: always up).
            self._loopback = plan.provider == "bwrap" or network_mode(policy) == "proxy"
            if plan.provider == "bwrap":
                argv = template_argv(plan.argv)
            else:
                from agent_sandbox.providers import _unshare

                argv = _unshare.template_argv(plan.argv)
            log = os.fdopen(hostfile.create_new(self.folder, "template.log"), "wb")
            # In the lasting launch thread: the launcher dies with the thread that forked it
            # (its parent-death signal follows the thread), which must outlive the pool.
            fds = (child.fileno(), boot_r)
            env = {**plan.env, **lifecycle.owner_env()}

            def popen() -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    argv,
                    env=env,
                    cwd=self.folder,
                    pass_fds=fds,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

            self.proc = lifecycle.launch(popen)
            log.close()
        except BaseException:
            parent.close()
            os.close(boot_w)
            self.close()
            raise
        finally:
            child.close()
            os.close(boot_r)
        boot = {
            "template_fd": spec.listen_fd,
            "namespace": True,
            "sys_path": list(spec.sys_path),
            "package_dirs": dict(spec.package_dirs),
        }
        self._boot(boot_w, boot, parent, timeout)
        return self

    def _boot(
        self, boot_w: int, boot: dict[str, object], parent: socket.socket, timeout: float
    ) -> None:
        """Hand the template its boot message down the pipe, then wait for its `ready`."""
        with os.fdopen(boot_w, "wb") as fh:
            fh.write(json.dumps(boot).encode())
        self._await_ready(parent, timeout)

    def _await_ready(self, parent: socket.socket, timeout: float) -> None:
        """Wait for the template's `ready`, then read its messages in a thread."""
        self.sock = parent
        if self._closed:  # cancelled (closed from another thread) while it launched
            self.close()
            raise WorkerStartError("the worker template's start was cancelled")
        parent.settimeout(timeout)
        try:
            line = self._read_line()
        except (OSError, ValueError) as exc:
            self.close()
            raise WorkerStartError(f"the worker template did not start ({exc})") from None
        if "ready" not in line:
            self.close()
            raise WorkerStartError(f"the worker template answered {line!r}")
        parent.settimeout(None)
        threading.Thread(target=self._read_loop, name="agent-sandbox-template", daemon=True).start()

    # -- messages ------------------------------------------------------------------------

    def _read_line(self) -> dict[str, Any]:
        assert self.sock is not None
        while b"\n" not in self._buffer:
            data = self.sock.recv(65536)
            if not data:
                raise ValueError("the template closed its socket")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("the template sent something that is not an object")
        return message

    def _read_loop(self) -> None:
        while not self._closed:
            try:
                message = self._read_line()
            except (OSError, ValueError):
                break
            if "exit" in message:
                pid, code = int(message["exit"]), int(message["returncode"])
                with self._lock:
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._exits[pid] = code
                if child is not None:
                    child._exited(code)
            elif "req" in message:
                req = int(message["req"])
                with self._lock:
                    self._replies[req] = message
                    event = self._pending.get(req)
                if event is not None:
                    event.set()
        self._closed = True
        with self._lock:
            events = list(self._pending.values())
        for event in events:
            event.set()

    def alive(self) -> bool:
        return not self._closed and self.proc is not None and self.proc.poll() is None

    # -- spawning ------------------------------------------------------------------------

    def adapt(self, plan: LaunchPlan) -> LaunchPlan:
        """The plan a worker forked from this template runs (the same plan for a plain one).

        For a namespace template: refuses (WorkerStartError, then the pool starts the worker
        from scratch) a plan whose view is not the template's, and adds to the worker's own
        set-up what bubblewrap gives a fresh worker (see the module docstring).
        """
        if self.kind != "namespace":
            # A plain template's worker is its own forked child: no keeper above it (the
            # template is the subreaper of what it detaches and ends it when the host is gone).
            return dataclasses.replace(plan, worker_depth=0, keeper=False)
        from agent_sandbox.providers._bwrap import BwrapPlan

        if plan.provider != self._provider or _view_key(plan, plan.cwd) != self._view:
            raise WorkerStartError(
                "the worker's view differs from its template's (the host's files changed "
                "since the template started); it starts from scratch"
            )
        if plan.provider != "bwrap":
            return plan  # (the `unshare` worker applies all of its set-up itself anyway)
        if not isinstance(plan, BwrapPlan) or not plan.seccomp_bpf:
            raise WorkerStartError("the worker's plan has no seccomp filter for a forked worker")
        setup = plan.worker_setup.replace(
            no_new_privs=True,
            drop_caps=True,
            seccomp={"bpf": base64.b64encode(plan.seccomp_bpf).decode()},
        )
        return dataclasses.replace(plan, worker_setup=setup)

    def spawn(self, plan: LaunchPlan, log: IO[bytes], *, timeout: float = 10.0) -> TemplateChild:
        """Fork one worker for `plan` (its boot pipe and listening socket are in pass_fds).

        From a namespace template, the child's `pid` is the worker's init (on the host), and
        `init` is set: the caller places the init and the worker in the worker's cgroups.
        """
        if not self.alive() or self.sock is None:
            raise WorkerStartError("the worker template is not running")
        if len(plan.pass_fds) < 2:
            raise WorkerStartError("the plan has no listening socket and boot pipe")
        req = next(self._ids)
        event = threading.Event()
        with self._lock:
            self._pending[req] = event
        request: dict[str, Any] = {
            "req": req,
            "cwd": plan.cwd,
            "env": dict(plan.env),
            "plan_fds": list(plan.pass_fds),
        }
        fds = [log.fileno()]
        cred: socket.socket | None = None
        cred_child: socket.socket | None = None
        if self.kind == "namespace":
            request["ns"] = {
                "scratch": plan.cwd,
                "scratch_bytes": self._scratch_bytes,
                "tmpfs_bytes": self._tmpfs_bytes,
                "template_scratch": self._template_scratch,
                "loopback": self._loopback,
            }
            cred, cred_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            cred.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            fds.append(cred_child.fileno())
        fds += list(plan.pass_fds)
        message = json.dumps(request).encode()
        host_pid = 0
        try:
            with self._send_lock:
                socket.send_fds(self.sock, [message + b"\n"], fds)
            if cred is not None and cred_child is not None:
                cred_child.close()
                host_pid = _sender_pid(cred, timeout)  # the kernel's word, not the child's
            if not event.wait(timeout) or req not in self._replies:
                raise WorkerStartError("the worker template did not fork a worker in time")
        except OSError as exc:
            raise WorkerStartError(
                f"the worker template could not start a worker ({exc})"
            ) from None
        finally:
            if cred_child is not None:
                cred_child.close()
            if cred is not None:
                cred.close()
            with self._lock:
                self._pending.pop(req, None)
                reply = self._replies.pop(req, {})
        if "spawned" not in reply:
            raise WorkerStartError(f"the worker template refused: {reply.get('error', reply)}")
        pid = int(reply["spawned"])  # in the template's PID namespace
        child = TemplateChild(host_pid or pid, self, init=bool(host_pid))
        with self._lock:
            early = self._exits.pop(pid, None)
            if early is None:
                self._children[pid] = child
        if early is not None:
            child._exited(early)
        return child

    def close(self) -> None:
        """End the template (its workers die with it) and remove its folder."""
        self._closed = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a start waiting for `ready`
            with contextlib.suppress(OSError):
                self.sock.close()
        if self.proc is not None and self.proc.poll() is None:
            # A namespace template's processes (the launcher's init, the template, its
            # workers) die with the launcher, but after it: wait until each is gone.
            tree: list[int] = []
            if self.kind == "namespace":
                from agent_sandbox._host.limits import _descendants

                tree = [pid for pid, _level in _descendants(self.proc.pid)]
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in tree:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            deadline = time.monotonic() + 5.0
            for pid in tree:
                while not _process_ended(pid) and time.monotonic() < deadline:
                    time.sleep(0.005)
        if self.folder:
            remove_tree(self.folder)


def _sender_pid(sock: socket.socket, timeout: float) -> int:
    """The pid (in this process's PID namespace) of the process that sent the next message
    on `sock` (`SO_PASSCRED` set): the kernel writes it, the sender cannot choose it."""
    sock.settimeout(timeout)
    _data, ancillary, _flags, _addr = sock.recvmsg(16, socket.CMSG_SPACE(12))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
            pid = int(struct.unpack("iII", payload[:12])[0])
            if pid > 0:
                return pid
    raise WorkerStartError("the forked worker sent no credentials")


def _view_key(plan: LaunchPlan, scratch: str) -> tuple[str, ...]:
    """A plan's view and namespaces, the same for every worker of a policy: for bubblewrap
    the options before `--` without the seccomp descriptor, for the `unshare` launcher its
    mounts, sizes, network and host name; the scratch path marked."""
    argv = plan.argv
    if plan.provider == "unshare":
        from agent_sandbox.providers._unshare import view_words

        return view_words(argv, scratch, _SCRATCH_MARK)
    head = list(argv[: argv.index("--")]) if "--" in argv else list(argv)
    if "--seccomp" in head:
        at = head.index("--seccomp")
        del head[at : at + 2]
    return tuple(_SCRATCH_MARK if a == scratch else a for a in head)
