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


def main() -> None:
    parent = os.getppid()
    boot = load(int(sys.argv[1]))
    if boot.get("die_with_parent"):
        # A worker started from scratch: nothing else ends it when the agent and its
        # guardian both die (a template's workers die with their template instead).
        _die_with_parent(parent)
    run(boot)


if __name__ == "__main__":
    main()
