"""`pip install -e .` gives a layout a type checker follows, and the worker its C fast path.

setup.py makes editable installs strict: a tree of links under `build/` laid out under the
import names, reached by a plain `.pth` line (setuptools' default import hook, which the
`package-dir` mapping needs, is invisible to mypy). This installs a copy of the sources into a
fresh virtualenv (offline, no build isolation; the dependencies come from this environment)
and checks what a user's mypy and a worker see there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("agent_sandbox", "adapters", "guards", "providers", "policies")

USER_CODE = """
from agent_sandbox import Sandbox
from agent_sandbox._errors import SandboxClosed
from agent_sandbox.adapters import sandboxed
from agent_sandbox.providers._walk import walk_capped

closed: int = SandboxClosed("x")
walked: str = walk_capped
"""

WORKER_CODE = """
import warnings
warnings.simplefilter("ignore")
from agent_sandbox import Policy, Sandbox
policy = Policy(name="danger-editable", imports={"allow": ["*"]}, code={"enabled": False})
with Sandbox(policy, warm=0) as sb:
    r = sb.run("import sys\\nm = sys.modules.get('agent_sandbox.guards._fastimport')\\n"
               "m.__file__ if m else None")
print(r.value)
"""

pytestmark = pytest.mark.slow


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False
    )


def _pip_install_editable(python: Path, source: Path) -> list[str]:
    """Offline, with this environment's setuptools (no build isolation)."""
    options = ["-q", "--no-deps", "--no-build-isolation", "--no-index"]
    return [str(python), "-m", "pip", "install", *options, "-e", str(source)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the copy of the sources, the virtualenv's python) after `pip install -e`."""
    base = tmp_path_factory.mktemp("editable")
    source = base / "source"
    source.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for name in SOURCES:
        shutil.copytree(REPO / name, source / name, ignore=skip)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, source / name)
    venv = base / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], base)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    # This environment's packages (pip, setuptools, mypy, the dependencies), behind the venv's.
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], base
    )
    Path(purelib.stdout.strip(), "dev-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = _run(_pip_install_editable(python, source), base)
    if install.returncode != 0:
        pytest.skip(f"cannot install offline here: {install.stderr.strip()[-300:]}")
    return source, python


def test_the_editable_install_is_a_plain_path_into_the_checkout(
    installed: tuple[Path, Path],
) -> None:
    """It adds one plain path (no import hook) to a link tree under the checkout's build/."""
    source, python = installed
    out = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], source
    )
    (pth,) = Path(out.stdout.strip()).glob("__editable__*.pth")
    lines = pth.read_text().split()
    assert len(lines) == 1 and not lines[0].startswith("import"), lines
    assert Path(lines[0]).parent == source / "build", lines
    link = Path(lines[0]) / "agent_sandbox" / "providers" / "_walk.py"
    assert link.resolve() == source / "providers" / "_walk.py"


def test_a_users_mypy_sees_the_package(installed: tuple[Path, Path], tmp_path: Path) -> None:
    """It resolves the package and its remapped sub-packages through the install, with their
    types (two wrong assignments are reported, nothing is missing)."""
    _, python = installed
    user = tmp_path / "user.py"
    user.write_text(USER_CODE)
    # Only the two modules named below are analysed (the others are found, then skipped).
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\nstrict = True\nfollow_imports = skip\nincremental = False\n"
        "[mypy-agent_sandbox._errors,agent_sandbox.providers._walk]\nfollow_imports = normal\n"
    )
    out = _run(
        [
            str(python),
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--python-executable",
            str(python),
            str(user),
        ],
        tmp_path,
    )
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, out.stdout + out.stderr
    assert 'expression has type "SandboxClosed"' in errors[0], errors
    assert 'expression has type "Callable[' in errors[1], errors
    assert "import-not-found" not in out.stdout


def test_the_worker_finds_the_c_fast_path_and_a_change_rebuilds_it(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    """It loads guards/_fastimport from the source folder in the worker, and installing again
    after the C file changed rebuilds it there."""
    source, python = installed
    built = sorted((source / "guards").glob("_fastimport*.so"))
    assert len(built) == 1, built
    out = _run([str(python), "-c", WORKER_CODE], tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(built[0]), out.stdout
    before = built[0].stat().st_mtime_ns
    c_file = source / "guards" / "_fastimport.c"
    os.utime(c_file, ns=(before + 10**9, before + 10**9))
    again = _run(_pip_install_editable(python, source), tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert built[0].stat().st_mtime_ns > before


def test_running_from_the_checkout_root_reaches_the_sub_packages(
    installed: tuple[Path, Path],
) -> None:
    """`python -c` in the checkout's root finds the bare `agent_sandbox/` folder first (the
    current directory leads `sys.path`); its sub-packages still come from the install."""
    source, python = installed
    out = _run(
        [
            str(python),
            "-c",
            "import agent_sandbox, agent_sandbox.guards as g, agent_sandbox.policies as p\n"
            "print(agent_sandbox.__file__); print(g.__file__); print(p.load_policy)",
        ],
        source,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, guards, _ = out.stdout.splitlines()
    assert first == str(source / "agent_sandbox" / "__init__.py")
    assert Path(guards).resolve() == source / "guards" / "__init__.py"
