"""The parent's side of worker templates (see `_worker/template.py` for the worker side).

`WorkerTemplate.start(policy, provider)` launches one pre-imported template for a pool whose
provider starts its workers as plain children (`subprocess`, `landlock`); `spawn(plan, log)`
asks it to fork one worker for a launch plan the provider built as usual, and returns a
`TemplateChild`, which answers `pid`, `poll()` and `wait()` like a `subprocess.Popen`, from
the exit statuses the template reports. A template that cannot start or answer is an error
for the pool, which then starts workers directly; nothing about the sandbox changes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from agent_sandbox._errors import WorkerStartError
from agent_sandbox._host import lifecycle
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

__all__ = ["TEMPLATE_PROVIDERS", "TemplateChild", "WorkerTemplate"]

#: Providers whose launch plan starts the worker itself as a plain child, with everything
#: that differs between workers in the plan's boot configuration and environment.
TEMPLATE_PROVIDERS = frozenset({"subprocess", "landlock"})


class TemplateChild:
    """A worker forked by a template, seen like a `subprocess.Popen`."""

    def __init__(self, pid: int, template: WorkerTemplate) -> None:
        self.pid = pid
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

    @classmethod
    def start(cls, policy: Policy, provider: Provider, *, timeout: float = 15.0) -> WorkerTemplate:
        """Launch the template with the provider's environment for this policy."""
        from agent_sandbox.providers._base import base_env

        if provider.name not in TEMPLATE_PROVIDERS:
            raise WorkerStartError(f"provider {provider.name!r} does not use worker templates")
        self = cls()
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
            log = open(os.path.join(self.folder, "template.log"), "wb")  # noqa: SIM115
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
        with os.fdopen(boot_w, "wb") as fh:
            fh.write(json.dumps(boot).encode())
        self.sock = parent
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
        return self

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

    def spawn(self, plan: LaunchPlan, log: IO[bytes], *, timeout: float = 10.0) -> TemplateChild:
        """Fork one worker for `plan` (its boot pipe and listening socket are in pass_fds)."""
        if not self.alive() or self.sock is None:
            raise WorkerStartError("the worker template is not running")
        listen_fd, boot_fd = plan.pass_fds
        req = next(self._ids)
        event = threading.Event()
        with self._lock:
            self._pending[req] = event
        message = json.dumps({"req": req, "cwd": plan.cwd, "env": dict(plan.env)}).encode()
        try:
            with self._send_lock:
                socket.send_fds(self.sock, [message + b"\n"], [listen_fd, boot_fd, log.fileno()])
            if not event.wait(timeout) or req not in self._replies:
                raise WorkerStartError("the worker template did not fork a worker in time")
        finally:
            with self._lock:
                self._pending.pop(req, None)
                reply = self._replies.pop(req, {})
        if "spawned" not in reply:
            raise WorkerStartError(f"the worker template refused: {reply.get('error', reply)}")
        pid = int(reply["spawned"])
        child = TemplateChild(pid, self)
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
                self.sock.close()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        if self.folder:
            remove_tree(self.folder)
