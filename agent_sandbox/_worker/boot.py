"""The worker's entry point: the first code that runs in the sandboxed process.

Started as `python -I -S -B _worker/boot.py <boot-fd>`. The order matters:

1. Read the boot configuration (JSON) from the inherited pipe and close it.
2. Set `sys.path` to the explicit import roots and map the `agent_sandbox` packages to
   their folders (no `site`, no `.pth` file is processed).
3. Apply the policy's rlimits and the provider's in-worker restrictions (Landlock,
   seccomp, ...) while the process still has a single thread.
4. Install the guards, then serve calls on the inherited socket until told to stop.

Only the standard library is used before step 2 completes.
"""

import json
import os
import sys


def _read_boot(fd: int) -> dict:  # type: ignore[type-arg]
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))  # type: ignore[no-any-return]


def _map_packages(package_dirs: dict) -> None:  # type: ignore[type-arg]
    # Bare package objects: the packages' __init__ files (the host-side public API, which
    # imports pydantic) are not executed in the worker; only the modules it needs load.
    import types

    for name in sorted(package_dirs, key=len):
        module = types.ModuleType(name)
        module.__path__ = [package_dirs[name]]
        module.__package__ = name
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def load(fd: int) -> dict:  # type: ignore[type-arg]
    """Steps 1 and 2: the boot configuration, then the import roots and packages."""
    boot = _read_boot(fd)
    # The agent's owner mark (see `_host/guardian.py`) stays in /proc/self/environ for the
    # agent's clean-up, but is none of the code's business.
    os.environ.pop("AGENT_SANDBOX_OWNER", None)
    sys.path[:] = list(boot["sys_path"])
    _map_packages(boot["package_dirs"])
    return boot


def import_worker(boot: dict) -> None:  # type: ignore[type-arg]
    """The modules step 3 and 4 will import, imported ahead; nothing is applied or served.

    Optional: the `unshare` launcher calls it while its init still builds the view.
    """
    if "template_fd" in boot:
        return  # a template imports its modules itself (`_worker/template.py`)
    from agent_sandbox._worker.server import serve  # noqa: F401
    from agent_sandbox._worker.setup import import_ahead

    import_ahead(boot)


def run(boot: dict) -> None:  # type: ignore[type-arg]
    """Steps 3 and 4 (or the template's loop); never returns."""
    if "template_fd" in boot:  # a pre-imported template that forks workers on request
        from agent_sandbox._worker.template import run_template

        run_template(int(boot["template_fd"]), _read_boot, namespace=bool(boot.get("namespace")))
    from agent_sandbox._worker.server import serve

    serve(boot)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the process that started this one ends (the host's lasting launch
    thread, or the sandbox's launcher); exit now if it already ended (`parent` is the
    parent seen before the request: a later one means it is gone)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _die_with_agent(fd: int) -> None:
    """SIGKILL from the kernel when the agent is gone: `fd` is the read end of the life line,
    a pipe whose only write end the agent holds (`WorkerSpec.life_fd`). Its last writer's
    close (the agent's end, however it died) sends this process the pipe's I/O signal, set
    here to SIGKILL: nothing in this process runs for it, so a call that never yields (a C
    loop holding the interpreter) ends too. For a worker no parent-death signal reaches (a
    set-user-ID launcher's exec clears it). Exit now if the agent is already gone."""
    import fcntl
    import select
    import signal

    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGKILL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    watch = select.poll()
    watch.register(fd, select.POLLIN)
    if watch.poll(0):  # its writer closed before it was armed (the agent never writes)
        os._exit(1)


_PR_SET_CHILD_SUBREAPER = 36
#: The keeper's parent-death signal (a real-time signal nothing else sends it; the keeper
#: acts on it only once its parent has changed).
_DEATH = 40
#: Signals the keeper relays to the worker (the host's SIGTERM to the keeper's group).
_RELAYED = (15, 1, 2, 3)  # SIGTERM, SIGHUP, SIGINT, SIGQUIT


def _keep(parent: int) -> None:
    """Become the worker's keeper; return only in the worker, forked below it.

    For providers with no pid namespace (`subprocess`, `landlock`): nothing else ends what
    the worker detaches (a setsid double fork) when the agent and its guardian die
    together. The keeper is a subreaper (set before the fork, so every descendant's
    orphan comes here, never to init) with a parent-death signal of its own; the worker
    dies with it (SIGKILL). The keeper runs no user code, is outside the worker's
    Landlock domain and seccomp filter, and only waits: when its parent (the host's launch
    thread) is gone, or when the worker exits, it SIGKILLs every child until none is left,
    then exits with the worker's status (a signal as the same signal), so the host sees the
    worker's end as from a direct child. The worker starts its own session, as before."""
    import ctypes
    import signal

    from agent_sandbox._worker.reaper import end_children

    libc = ctypes.CDLL(None)
    caught = {signal.SIGCHLD, _DEATH, *_RELAYED}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, caught)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(_PR_SET_PDEATHSIG, _DEATH, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    keeper = os.getpid()
    worker = os.fork()
    if worker == 0:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != keeper:
            os._exit(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.setsid()
        return
    # The keeper holds nothing of the worker's (its socket, its pipes): only the log.
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.close(int(name))
            except OSError:
                pass
    status = -1
    while status < 0:
        info = signal.sigwaitinfo(caught)
        if info.si_signo == signal.SIGCHLD:
            while True:
                try:
                    pid, wstatus = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    pid, wstatus = worker, 0
                if pid == 0:
                    break
                if pid == worker:
                    status = wstatus
                    break
        elif info.si_signo == _DEATH:
            if os.getppid() != parent:
                status = signal.SIGKILL  # (a wait status: killed by SIGKILL) ended below
        else:
            try:
                os.kill(worker, info.si_signo)  # an unreaped child: never a reused pid
            except OSError:
                pass
    end_children(5.0)
    if os.WIFSIGNALED(status):
        import resource

        signum = os.WTERMSIG(status)
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the keeper
            if signum not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            os.kill(keeper, signum)
        except (OSError, ValueError):
            pass
        os._exit(128 + signum)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 70)


def main() -> None:
    parent = os.getppid()
    boot = load(int(sys.argv[1]))
    if boot.get("life_fd") is not None:
        _die_with_agent(int(boot["life_fd"]))
    if boot.get("keeper"):
        _keep(parent)  # returns in the worker only
    elif boot.get("die_with_parent"):
        # A worker started from scratch: nothing else ends it when the agent and its
        # guardian both die (a template's workers die with their template instead).
        _die_with_parent(parent)
    run(boot)


if __name__ == "__main__":
    main()
