"""The trust boundary is visible in the tree, and the import graph keeps it.

`agent_sandbox/` holds the host side (`_host/`, the agent's process, which never trusts a
worker), the worker side (`_worker/`, which runs inside the sandbox with the user's code), the
tools around both (`_tools/`), and, at its top, the public entry points and the few modules
both sides share. Every module of the package, and of the folders mapped into it, is read
with `ast` (imports inside functions and `importlib.import_module("...")` strings included);
nothing is imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "agent_sandbox"
#: The folders mapped into the package (pyproject's package-dir).
FOLDERS = {
    "agent_sandbox": ROOT / "agent_sandbox",
    "agent_sandbox.adapters": ROOT / "adapters",
    "agent_sandbox.guards": ROOT / "guards",
    "agent_sandbox.policies": ROOT / "policies",
    "agent_sandbox.providers": ROOT / "providers",
}
#: What both sides import: standard library only, and each other.
SHARED = frozenset(
    {
        "agent_sandbox._wire",
        "agent_sandbox._wire_boot",
        "agent_sandbox._wire_records",
        "agent_sandbox._denial",
        "agent_sandbox._errors",
        "agent_sandbox._render",
        "agent_sandbox._hints",
        # The Landlock system calls: the worker restricts itself with them, the host's
        # probes and the QEMU relay ask the kernel's ABI and restrict a child.
        "agent_sandbox._landlock_sys",
    }
)
#: The public entry points at the top of the package.
API = frozenset({"agent_sandbox", "agent_sandbox.__main__", "agent_sandbox.testing"})
#: The providers' modules that run in the worker's VM: the worker side.
WORKER_PROVIDERS = frozenset(
    {
        "agent_sandbox.providers.qemu.guest",  # the guest agent, inside the VM
    }
)
#: Outside agent_sandbox/'s own layout, but stdlib-only and read on both sides.
SHARED_OUTSIDE = frozenset(
    {
        # NOTE: allowed because the path language is pure functions the file guard uses.
        "agent_sandbox.policies._paths",
        # NOTE: allowed because a syntax hint checks the group's name against the
        # sub-language's own table (`SYNTAX_GROUPS`); the module is standard library only.
        "agent_sandbox.guards._code_check",
    }
)
#: Modules that decode worker bytes; on the host side only `_host/intake/` may import them.
DECODERS = frozenset({"pickle", "_pickle", "marshal", "h11", "httpx", "tblib"})
#: Host-side modules outside `_host/intake/` that may import one of them, and why.
DECODER_EXCEPTIONS = {
    # NOTE: allowed because the pod's process serves the agent's requests with h11 and relays
    # its worker's stream as bytes, judging nothing; the agent's host judges that stream in
    # `_host/intake/remote_transport.py` like any other.
    "agent_sandbox._host.remote.serve": {"h11"},
    # The same process's framing helpers (a fresh h11 parser for the agent's next request).
    "agent_sandbox._host.remote.serve_relay": {"h11"},
    # NOTE: allowed because the egress proxy parses the sandbox's outbound HTTP with h11 only
    # to judge its target against the policy, rebuilding each message from what was parsed;
    # nothing it reads reaches the agent as data (its findings are denials it makes itself).
    "agent_sandbox._host.egress.http1": {"h11"},
}
#: The longest a module may be without a reason at its top.
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path, *, runtime: bool = False) -> set[str]:
    """Every agent_sandbox module (or top-level module outside it) `name` imports, anywhere.

    With `runtime`, what can form an import cycle: static imports only, those under
    `if TYPE_CHECKING:` left out (they never run), and so are module names given to
    `importlib.import_module` (the CLI's sub-command modules, loaded on purpose later).
    """
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    checking_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            checking_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    dynamic = "import_module(" in path.read_text()

    def add(module: str) -> None:
        if module.startswith(PACKAGE + ".") or module == PACKAGE:
            while module not in MODULES and "." in module:
                module = module.rpartition(".")[0]
        found.add(module)

    for node in ast.walk(tree):
        if runtime and id(node) in checking_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in MODULES else base)
        elif (
            not runtime
            and dynamic
            and isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in MODULES
            and node.value != name
        ):
            add(node.value)  # a module the file loads with importlib.import_module
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
RUNTIME = {name: _imports(name, path, runtime=True) for name, path in MODULES.items()}


def _side(name: str) -> str:
    if name in WORKER_PROVIDERS:
        return "worker-providers"
    if name in SHARED:
        return "shared"
    if name in API:
        return "api"
    for side in ("_host", "_worker", "_tools"):
        if name == f"{PACKAGE}.{side}" or name.startswith(f"{PACKAGE}.{side}."):
            return side
    if name.startswith(PACKAGE + ".") and name.split(".")[1] in (
        "adapters",
        "guards",
        "policies",
        "providers",
    ):
        return name.split(".")[1]
    return "unplaced"


def _ours(imports: set[str]) -> set[str]:
    return {m for m in imports if m == PACKAGE or m.startswith(PACKAGE + ".")}


def test_every_module_of_the_package_has_a_side() -> None:
    """It places every module of agent_sandbox/ on a side: host, worker, tools, shared or API."""
    unplaced = sorted(n for n in MODULES if _side(n) == "unplaced")
    assert unplaced == [], "decide the side of: " + ", ".join(unplaced)


def test_the_worker_side_imports_nothing_of_the_host_side() -> None:
    """It keeps `_worker/` to its own modules, the shared ones, the guards and the providers."""
    allowed = {"_worker", "shared", "guards", "providers", "worker-providers"}
    bad = {
        name: sorted(
            m for m in _ours(imports) if _side(m) not in allowed and m not in SHARED_OUTSIDE
        )
        for name, imports in GRAPH.items()
        if _side(name) == "_worker"
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_providers_worker_steps_import_nothing_of_the_host_side() -> None:
    """It keeps the providers' modules that run in the worker, its launcher or its VM off
    the host side and the tools, as the worker's own modules are."""
    allowed = {"_worker", "shared", "guards", "providers", "worker-providers"}
    bad = {
        name: sorted(
            m for m in _ours(imports) if _side(m) not in allowed and m not in SHARED_OUTSIDE
        )
        for name, imports in GRAPH.items()
        if name in WORKER_PROVIDERS
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_guards_import_nothing_of_the_host_side() -> None:
    """It keeps the guards (they run in the worker) off the host side, the tools and the API."""
    allowed = {"_worker", "shared", "guards"}
    bad = {
        name: sorted(
            m for m in _ours(imports) if _side(m) not in allowed and m not in SHARED_OUTSIDE
        )
        for name, imports in GRAPH.items()
        if _side(name) == "guards"
    }
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize("side", ["_host", "_tools", "api", "adapters", "policies", "providers"])
def test_nothing_outside_the_worker_imports_the_worker_side(side: str) -> None:
    """It keeps the host, the tools, the API, the adapters, the policies and the providers'
    builders off `_worker/`: what runs in the agent's process never loads worker code."""
    bad = {
        name: sorted(m for m in _ours(imports) if _side(m) == "_worker")
        for name, imports in GRAPH.items()
        if _side(name) == side
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_shared_modules_use_the_standard_library_and_each_other_only() -> None:
    """It keeps the shared modules importable by a worker before it arms (standard library)."""
    bad = {}
    for name in SHARED:
        outside = sorted(
            m
            for m in GRAPH[name]
            if m not in SHARED
            and m not in SHARED_OUTSIDE
            and m.split(".")[0] not in sys.stdlib_module_names
        )
        if outside:
            bad[name] = outside
    assert bad == {}


def test_the_worker_entry_point_uses_the_standard_library_at_import() -> None:
    """It keeps `_worker/boot.py`'s module-level imports to the standard library: it runs
    before the worker's import roots and packages are set."""
    tree = ast.parse(MODULES["agent_sandbox._worker.boot"].read_text())
    top = [
        alias.name
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    ]
    assert [m for m in top if m.split(".")[0] not in sys.stdlib_module_names] == []


def test_only_the_intake_decodes_worker_bytes_on_the_host_side() -> None:
    """It lets only `_host/intake/` import a decoder of worker bytes (pickle, marshal, h11,
    httpx, tblib) among the modules that run in the agent's process."""
    host_sides = {"_host", "_tools", "api", "adapters", "policies", "shared"}
    bad = {
        name: sorted(
            m
            for m in imports
            if m.split(".")[0] in DECODERS and m not in DECODER_EXCEPTIONS.get(name, ())
        )
        for name, imports in GRAPH.items()
        if _side(name) in host_sides and not name.startswith("agent_sandbox._host.intake")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_folders_read_are_the_folders_mapped_into_the_package() -> None:
    """It reads every folder pyproject.toml maps into the package (a folder mapped but not
    read here would escape every check of this file)."""
    import tomllib

    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    # A folder at its natural place under its parent's folder is read with the parent.
    roots = {
        name: ROOT / folder
        for name, folder in mapped.items()
        if name.rpartition(".")[0] not in mapped
        or ROOT / folder != ROOT / mapped[name.rpartition(".")[0]] / name.rpartition(".")[2]
    }
    assert roots == FOLDERS
    for name, folder in mapped.items():
        assert any(m == name or m.startswith(name + ".") for m in MODULES), name
        assert (ROOT / folder / "__init__.py").exists(), folder


def test_the_package_has_no_import_cycle() -> None:
    """It finds no cycle among the package's modules, the folders mapped into it included,
    imports inside functions included (the root package, always imported first, is not an
    edge)."""
    graph = {n: {m for m in RUNTIME[n] if m in MODULES and m != PACKAGE} for n in MODULES}
    assert _cycles(graph) == []


def test_no_module_is_longer_than_a_sitting_without_saying_why() -> None:
    """It keeps every module of the package, the folders mapped into it included, under 600
    lines, or its docstring says why."""
    long = []
    for name, path in MODULES.items():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > MAX_LINES and "longer than 600 lines" not in doc:
            long.append(f"{name} ({text.count(chr(10))} lines)")
    assert long == []


def test_every_module_of_the_sides_declares_all() -> None:
    """It gives every module of `_host/`, `_worker/` and `_tools/` an `__all__` (the boot
    script excepted), as the top-level private modules have."""
    missing = []
    for name, path in MODULES.items():
        if _side(name) not in ("_host", "_worker", "_tools") or name.endswith("._worker.boot"):
            continue
        tree = ast.parse(path.read_text())
        if not any(
            isinstance(node, ast.Assign | ast.AnnAssign)
            and "__all__" in [t.id for t in ast.walk(node) if isinstance(t, ast.Name)]
            for node in tree.body
        ):
            missing.append(name)
    assert missing == []


def test_the_tests_follow_the_code() -> None:
    """It keeps a test folder for each side of the package, as the code is laid out."""
    for folder in ("host", "host/intake", "worker", "tools", "tools/learn", "policies"):
        assert list((ROOT / "tests" / folder).glob("test_*.py")), folder
