"""Installing the guards in a worker, arming them around each call, and checking them after.

The order, at worker start (hook 5b of `_worker.setup.prepare`):

1. Configure every guard from the boot configuration (the wire policy, the scratch
   directory, the host's variable names, the import roots whose code is not user code).
2. Point temporary files at the scratch directory (`TMPDIR`, `MPLCONFIGDIR`), so libraries
   do not knock on `/tmp` first.
3. Patch: files, sockets, environment, sensitive calls, thread start, then the import finder
   and its audit hook (last, so it sits ahead of wrapt's post-import finder).
4. Build the user namespace's own `__builtins__` (with the judging `__import__`).

Steps 3 and 4 depend on no policy: a worker template does them once before it forks
(`preinstall`), and its workers start at step 1 with them done.

Per call, `arming()` puts that `__builtins__` back into the namespace and sets the armed
flag; threads started while armed stay armed. After the call, `tamper_check()` returns the
reasons the guards are no longer intact: a wrapper replaced or removed, the import finder
displaced and not restorable, the flag cleared during the call, the namespace's
`__builtins__` swapped. Each reason becomes a `guard.tampered` denial and the worker is
discarded.

The flag itself lives in C and every write of it is counted where the host reads it
(`_state.py`), so a flag cleared and set back within one call, or a replaced
`tamper_check`, is caught by the host, not by this module.

What it does NOT do: anything about what is done through the originals; see the escape
matrix in docs/guards.md.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
from types import ModuleType

from agent_sandbox.guards import _calls, _env, _files, _imports, _net, _patch, _state
from agent_sandbox.guards._state import block_info, state
from agent_sandbox.guards._state import configure as configure_state

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["Guards", "install_guards"]


def _c_tampered() -> int:
    """The C block's tamper bits as this process sees them (0 without the extension)."""
    return _state.tampered_bits()


def _thread_start_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Mark a thread started by user code (or by one of its threads) as armed for its life.

    Wraps every primitive that starts a thread: `_thread.start_new_thread` and its alias
    `start_new`, `threading._start_new_thread` (3.11, 3.12), and 3.13's
    `_thread.start_joinable_thread` (whose `function` may be passed by keyword) with its
    copy `threading._start_joinable_thread`, which `Thread.start` calls.
    """
    if not (state.armed or (state.user_threads and _thread.get_ident() in state.user_threads)):
        return wrapped(*args, **kwargs)
    if args:
        function: Any = args[0]
        rest, named = args[1:], kwargs
    elif "function" in kwargs:
        named = dict(kwargs)
        function = named.pop("function")
        rest = ()
    else:
        return wrapped(*args, **kwargs)  # the primitive's own TypeError

    def armed_thread(*a: Any, **k: Any) -> Any:
        ident = _thread.get_ident()
        state.user_threads.add(ident)
        try:
            return function(*a, **k)
        finally:
            state.user_threads.discard(ident)

    return wrapped(armed_thread, *rest, **named)


#: Every attribute through which a thread is started: (module, name). A name missing on
#: this Python (`start_joinable_thread` before 3.13, `threading._start_new_thread` from
#: 3.13) is skipped; `_thread.start_new` is an alias that user code can call directly.
THREAD_STARTS: tuple[tuple[ModuleType, str], ...] = (
    (_thread, "start_new_thread"),
    (_thread, "start_new"),
    (_thread, "start_joinable_thread"),
    (threading, "_start_new_thread"),
    (threading, "_start_joinable_thread"),
)


class _Arming:
    """The context manager the runner enters around one call."""

    __slots__ = ("guards",)

    def __init__(self, guards: Guards) -> None:
        self.guards = guards

    def __enter__(self) -> None:
        self.guards.enter()

    def __exit__(self, *exc: Any) -> None:
        self.guards.exit()


class Guards:
    """The installed guards of one process (a worker, or a test)."""

    def __init__(self, namespace: dict[str, Any] | None, user_builtins: ModuleType) -> None:
        self.namespace = namespace
        self.user_builtins = user_builtins
        self.installed = True
        self.reasons: list[str] = []
        self.calls = 0
        self.env_set: list[str] = []

    def arming(self) -> _Arming:
        """The context manager that arms the guards for one call."""
        return _Arming(self)

    def enter(self) -> None:
        self._prepare_call()
        state.armed = True

    def exit(self) -> None:
        if not state.armed:
            self.reasons.append("the guards were disarmed during the call")
        state.armed = False

    def _prepare_call(self) -> None:
        if not self.installed:
            raise RuntimeError("the guards were uninstalled; this worker cannot run user code")
        if self.namespace is not None:
            self.namespace["__builtins__"] = self.user_builtins
        resolver = _files._resolver
        if resolver is not None:
            resolver.cwd = _files._current_dir(resolver.cwd)
        self.calls += 1

    def run_armed(self, fn: Any, *args: Any) -> Any:
        """Call `fn(*args)` armed: what the worker's runner does for each call.

        With the C state the arming and the disarming are made by `state.run_armed`, in a
        C frame that code running inside `fn` cannot skip, so a flag it cleared shows in the
        host's count as a third write.
        """
        self._prepare_call()
        run = getattr(state, "run_armed", None)
        if run is None:  # the Python stand-in (extension not built)
            state.armed = True
            try:
                return fn(*args)
            finally:
                self.exit()
        before = _c_tampered()
        try:
            return run(fn, *args)
        finally:
            if _c_tampered() & ~before & 2:
                self.reasons.append("the guards were disarmed during the call")

    def prime(self) -> None:
        """Do the tamper check's one-time work now (grouping the patches by owner), so that
        the first call does not pay it; reports and records nothing."""
        _patch.broken()

    def tamper_check(self) -> list[str]:
        """Why the guards are no longer intact (empty when they are)."""
        reasons = list(self.reasons)
        self.reasons.clear()
        if not self.installed:
            reasons.append("the guards were uninstalled")
            return reasons
        reasons.extend(
            f"the wrapper of {label} was replaced or removed" for label in _patch.broken()
        )
        reasons.extend(_imports.problems())
        if self.user_builtins.__dict__.get("__import__") is not _imports.user_import:
            reasons.append("__import__ of the user namespace's builtins was replaced")
        if (
            self.namespace is not None
            and self.namespace.get("__builtins__") is not self.user_builtins
        ):
            reasons.append("the user namespace's __builtins__ was replaced or deleted")
        return reasons

    def uninstall(self) -> None:
        """Restore every original (tests use this; a worker never does)."""
        state.armed = False
        state.user_threads.clear()
        _imports.uninstall()
        _patch.uninstall()
        _files.configure(_files.FileRules({}, scratch=""))
        for key in self.env_set:
            os.environ.pop(key, None)
        self.installed = False


def _patch_everything() -> ModuleType:
    """Steps 3 and 4 of the module docstring: every patch, then the user builtins' copy.
    Neither depends on the policy: the wrappers judge by the rules step 1 configures."""
    _files.install()
    _net.install()
    _env.install()
    _calls.install()
    for owner, name in THREAD_STARTS:
        if getattr(owner, name, None) is not None:
            _patch.wrap(owner, name, _thread_start_wrapper)
    _imports.install()
    return _imports.make_user_builtins()


#: The user builtins `preinstall` made (None: this process patches at `install_guards`).
_preinstalled: ModuleType | None = None


def preinstall() -> None:
    """In a worker template, before it forks any worker: steps 3 and 4 (every patch, the
    import finder and audit hook, the user builtins' copy) and the tamper check's grouping,
    which depend on no policy. Nothing is armed or configured: every wrapper passes its
    call through while the flag is down, as in a fresh worker before its first call. Each
    forked worker then configures the rules for its own policy (steps 1 and 2) in
    `install_guards`, seals them, and arms them per call exactly as a fresh worker does;
    the pages of this work stay shared with the template instead of being written again
    by every worker (issue 19: memory per session, about 1.2 MB)."""
    global _preinstalled
    if _preinstalled is not None:
        return
    _preinstalled = _patch_everything()
    _patch.broken()  # the grouping `Guards.prime` would do in each worker


def install_guards(boot: dict[str, Any], namespace: dict[str, Any] | None = None) -> Guards:
    """Install every guard for the boot configuration `boot`; see the module docstring."""
    policy: dict[str, Any] = boot.get("policy") or {}
    name = str(policy.get("name", ""))
    scratch = str(boot.get("scratch") or "")
    roots = [*boot.get("sys_path", ()), *dict(boot.get("package_dirs") or {}).values()]
    configure_state(
        learn=policy.get("mode") == "learn", policy_name=name, trusted_roots=tuple(roots)
    )
    # 1. configure
    _files.configure(
        _files.FileRules(
            policy.get("files") or {},
            scratch=scratch,
            policy_name=name,
            policy_file=str(policy.get("source_file") or ""),
            import_roots=roots,
            metadata_refused=bool(
                ((boot.get("worker_setup") or {}).get("seccomp") or {}).get("metadata")
            ),
        )
    )
    _imports.configure(_imports.ImportRules(policy.get("imports") or {}, name))
    egress = (boot.get("worker_setup") or {}).get("egress") or {}
    proxy = (str(egress["host"]), int(egress["port"])) if egress else None
    token = str(egress.get("token") or "")
    _net.configure(_net.NetRules(policy.get("net") or {}, name, proxy=proxy, token=token))
    _env.configure(boot.get("host_env_names") or (), name)
    _calls.configure(_calls.ApiRules(policy.get("api") or {}, name), policy.get("code") or {})
    # 2. temporary files go to scratch
    env_set = []
    for key, value in (("TMPDIR", scratch), ("MPLCONFIGDIR", os.path.join(scratch, ".mpl"))):
        if scratch and key not in os.environ:
            os.environ[key] = value
            env_set.append(key)
    # 3. patch, and 4. the user namespace's builtins (after the builtins were wrapped): done
    #    already when this process was forked from a worker template (`preinstall`).
    user_builtins = _preinstalled or _patch_everything()
    guards = Guards(namespace, user_builtins)
    guards.env_set = env_set
    if namespace is not None:
        namespace["__builtins__"] = guards.user_builtins
    return guards


def seal() -> None:
    """Refuse every later write of the guards' settings (the worker calls this once set up)."""
    state.seal()


def summary() -> dict[str, Any]:
    """What was installed, for the handshake's checks.

    `block` says where the C arming block is in this process's memory (see `_state.py`):
    reported once, before any user code ran, so the host reads the counter from outside.
    """
    return {
        "patches": len(_patch.patches()),
        # Patches of modules not imported yet (applied at their import): a worker forked
        # from a template has fewer of them, as its template imported a few more modules.
        "deferred": _patch.deferred(),
        "finder": sys.meta_path[:1] == [_imports.finder()],
        "block": block_info(),
    }
