"""Play a newcomer: install the wheel with core dependencies only, then try the README.

Run by tests/core/test_newcomer.py (and by hand: `.venv/bin/python scripts/newcomer.py`).

1. Builds the wheel from this checkout (offline, no build isolation).
2. Makes a fresh virtualenv in a temporary directory and gives it the core dependencies only:
   the files of each installed distribution that `pyproject.toml` requires (and what those
   require), copied from this environment, since the tests never reach the package index.
   Then `pip install --no-index --no-deps` of the wheel, and `pip check`.
3. As an unprivileged user (uid 65534 through `setpriv`) when run as root, runs the README's
   quick start and its command-line examples, and checks what a newcomer's mistakes print
   (see CHECKS) against the expected text.

Prints one line per check and exits 1 if any failed. Leaves nothing behind.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534


def _requirement_names(requirements: list[str]) -> list[str]:
    names = []
    for req in requirements:
        if ";" in req and "extra ==" in req.split(";", 1)[1]:
            continue
        names.append(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])
    return names


def core_distributions() -> list[str]:
    """The core requirements of pyproject.toml and, recursively, what they require."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = _requirement_names(project["dependencies"])
    seen: dict[str, str] = {}
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        dist = metadata.distribution(name)
        seen[key] = dist.metadata["Name"]
        todo.extend(_requirement_names(dist.requires or []))
    return sorted(seen.values())


def copy_distribution(name: str, site: Path) -> None:
    dist = metadata.distribution(name)
    for file in dist.files or ():
        src = Path(str(dist.locate_file(file)))
        if file.parts[0] == ".." or not src.is_file():
            continue  # scripts outside site-packages, or files listed but absent
        dst = site / file
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    kw.setdefault("timeout", 180)
    return subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload, no-any-return]


_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.so",
    ".*_cache",
    ".hypothesis",
)


def build_wheel(out: Path) -> Path | str:
    """The wheel of this checkout, built offline without build isolation into `out` (also used
    by tests/core/test_wheel_install.py), or pip's error text.

    It builds from a copy of the sources under `out`: setuptools writes `build/` into the tree
    it builds, which would leave files in the checkout, and fail for a user who cannot write
    to it (the suite also runs as an unprivileged user)."""
    source = out / "source"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCE, symlinks=True)
    build = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        timeout=300,
    )
    shutil.rmtree(source, ignore_errors=True)
    if build.returncode != 0:
        return build.stderr[-800:]
    return next(out.glob("*.whl"))


def build_env(root: Path, base: str) -> Path:
    """A fresh venv under `root` on `base` with the wheel and the core dependencies."""
    wheels = root / "wheels"
    build = build_wheel(wheels)
    if isinstance(build, str):
        raise SystemExit(f"newcomer: cannot build the wheel: {build}")
    venv = root / "venv"
    made = run([base, "-m", "venv", str(venv)])
    if made.returncode != 0:
        raise SystemExit(f"newcomer: cannot make a virtualenv: {made.stderr[-800:]}")
    python = venv / "bin" / "python"
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    for name in core_distributions():
        copy_distribution(name, site)
    wheel = build
    inst = run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)])
    if inst.returncode != 0:
        raise SystemExit(f"newcomer: cannot install the wheel: {inst.stderr[-800:]}")
    return python


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def main() -> int:
    failures = 0
    as_user: list[str] = []
    if os.geteuid() == 0 and shutil.which("setpriv"):
        as_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    # The unprivileged user cannot reach an interpreter under root's 0700 home (pyenv's):
    # then the venv is made on Debian's own Python 3.11, as a newcomer's would be.
    # The wheel is built by this interpreter (its C extensions carry its version's tag), so
    # Debian's stands in only when it is the same version; otherwise (CI's 3.12 leg) the
    # newcomer is root on this interpreter.
    base = getattr(sys, "_base_executable", sys.executable)
    if as_user and base.startswith("/root/"):
        debian = (
            subprocess.run(
                ["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            if os.path.exists("/usr/bin/python3")
            else ""
        )
        if debian == str(sys.version_info[:2]):
            base = "/usr/bin/python3"
        else:
            as_user = []
    with tempfile.TemporaryDirectory(prefix="agent-sandbox-newcomer-") as tmp:
        root = Path(tmp)
        print(f"newcomer: workspace {root}")
        python = build_env(root, base)
        cli = python.parent / "agent-sandbox"
        home = root / "home"
        home.mkdir()
        work = root / "work"
        work.mkdir()
        for path in (root, home, work):
            path.chmod(0o755)
        if as_user:
            os.chown(home, NOBODY, NOBODY)
            os.chown(work, NOBODY, NOBODY)
        env = {"PATH": f"{python.parent}:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}

        def user(cmd: list[str]) -> subprocess.CompletedProcess[str]:
            return run([*as_user, *cmd], cwd=work, env=env)

        bad_key = work / "typo.toml"
        bad_key.write_text('name = "mine"\n[limits]\nwal = 60\n')
        bad_glob = work / "glob.toml"
        bad_glob.write_text('name = "mine"\n[imports]\nallow = ["pandas.*"]\n')
        bad_type = work / "type.toml"
        bad_type.write_text('name = "mine"\n[limits]\nwall_seconds = "60"\n')
        quick = readme_blocks("python")[0]
        checks: list[tuple[str, list[str], int, str]] = [
            (
                "pip check: core dependencies complete",
                [str(python), "-m", "pip", "check"],
                0,
                "No broken requirements",
            ),
            ("--version", [str(cli), "--version"], 0, "agent-sandbox-kit 0.1.0"),
            ("README quick start", [str(python), "-c", quick], 0, "files.read /etc/passwd"),
            ("README: run -c", [str(cli), "run", "-c", "print(sum(range(10)))"], 0, "45"),
            (
                "README: policy explain",
                [str(cli), "policy", "explain", "data-analysis"],
                0,
                "policy 'data-analysis'",
            ),
            ("README: doctor", [str(cli), "doctor"], 0, "landlock"),
            (
                "a negative --timeout",
                [str(cli), "run", "--timeout", "-1", "-c", "1"],
                64,
                "must be a positive number of seconds",
            ),
            (
                "a misspelled limit",
                [str(cli), "policy", "check", str(bad_key)],
                78,
                "unknown key; did you mean `wall_seconds`?",
            ),
            (
                "pandas.* in imports",
                [str(cli), "policy", "check", str(bad_glob)],
                78,
                "write 'pandas'",
            ),
            (
                "a number as a string",
                [str(cli), "policy", "check", str(bad_type)],
                78,
                "[limits.wall_seconds] Input should be a valid number",
            ),
            (
                "the langchain adapter without its extra",
                [str(python), "-c", "import agent_sandbox.adapters.langchain"],
                1,
                "pip install 'agent-sandbox-kit[langchain]'",
            ),
        ]
        for label, cmd, status, expected in checks:
            out = user(cmd)
            text = out.stdout + out.stderr
            ok = out.returncode == status and expected in text
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {label}")
            if not ok:
                print(f"     exit {out.returncode} (expected {status}); wanted {expected!r} in:")
                print("     " + text[-1500:].replace("\n", "\n     "))
    print(
        f"newcomer: {len(checks) - failures} passed, {failures} failed"
        + (f" (as uid {NOBODY})" if as_user else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
