"""The C extensions (guards/_fastimport.c, _host/intake/_fastscan.c, _worker/_nsfork.c) and the
editable mode; the rest is in pyproject.toml.

`optional`: without a compiler the install still succeeds and the guard falls back to its
Python `__import__` (slower; tests/guards/test_fast_import.py::test_the_c_fast_path_is_built
then fails, so the figure cannot regress silently).

Editable installs (`pip install -e .`) are strict by default: a tree of links under `build/`
in the checkout, laid out under the import names (`agent_sandbox/guards` -> `guards/`),
reached by a plain `.pth` line. Type checkers follow that (mypy cannot follow setuptools'
default import hook, which the `package-dir` mapping would need); the extensions are still
built next to their sources. A new module needs the install run again (`scripts/setup.sh`
does it when the list of modules changes); `--config-settings editable_mode=lenient` asks for
the import hook instead.
"""

import contextlib
import os
import subprocess
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.editable_wheel import editable_wheel


class StrictEditableWheel(editable_wheel):  # type: ignore[misc]
    """`editable_wheel` whose mode is `strict` unless the installer names one."""

    def finalize_options(self) -> None:
        if not self.mode:
            self.mode = "strict"
        super().finalize_options()


#: The init of a worker forked from a namespace template (_worker/_nsinit.c): a program, not a
#: module, built next to the fork's extension (_worker/_nsfork.c; static where the C library
#: allows it, so that it needs no loader in the sandbox's view). Optional like the extensions:
#: without it the template's Python loop serves as that init
#: (tests/providers/test_ns_templates.py checks it is built).
NSINIT_SOURCE = "agent_sandbox/_worker/_nsinit.c"
NSINIT_NAME = "_nsinit"


def _runs(program: str) -> bool:
    """The built init answers a wrong command line with its usage line and status 64."""
    try:
        done = subprocess.run([program], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 64 and done.stderr.startswith(b"usage: _nsinit")


class BuildExtWithInit(build_ext):  # type: ignore[misc]
    """`build_ext` that also links _worker/_nsinit.c into an executable beside `_nsfork`."""

    def run(self) -> None:
        super().run()
        folder = os.path.dirname(self.get_ext_fullpath("agent_sandbox._worker._nsfork"))
        target = os.path.join(folder, NSINIT_NAME)
        # Linked under another name and renamed into place: an agent running from this
        # checkout may be executing the current one (a rename never shows it half written).
        staged = target + ".new"
        for build in (self._link_without_libc, self._link_with_libc):
            try:
                build(staged)
            except Exception as exc:  # optional, like the extensions
                print(f"note: {NSINIT_SOURCE}: {build.__name__} failed ({exc})")
                continue
            if _runs(staged):
                os.chmod(staged, 0o755)
                os.replace(staged, target)
                return
            print(f"note: {NSINIT_SOURCE}: the program from {build.__name__} does not run")
        with contextlib.suppress(OSError):
            os.unlink(staged)
        with contextlib.suppress(OSError):
            os.unlink(target)
        print(f"warning: {NSINIT_SOURCE} not built; the Python init serves")

    def _link_without_libc(self, target: str) -> None:
        """Two pages, its own system calls (x86-64 and arm64; `#error` elsewhere)."""
        flags = ["-Os", "-Wall", "-fno-stack-protector", "-fno-asynchronous-unwind-tables"]
        flags += ["-ffreestanding", "-fno-builtin", "-fno-tree-loop-distribute-patterns"]
        objects = self.compiler.compile(
            [NSINIT_SOURCE],
            output_dir=os.path.join(self.build_temp, "nolibc"),
            macros=[("NSINIT_NOLIBC", "1")],
            extra_postargs=flags,
        )
        self.compiler.link_executable(
            objects, target, extra_postargs=["-nostdlib", "-static", "-no-pie", "-s"]
        )

    def _link_with_libc(self, target: str) -> None:
        objects = self.compiler.compile(
            [NSINIT_SOURCE], output_dir=self.build_temp, extra_postargs=["-O2", "-Wall"]
        )
        try:
            self.compiler.link_executable(objects, target, extra_postargs=["-static", "-s"])
        except Exception:  # no static C library: a dynamic one (the view has libc)
            self.compiler.link_executable(objects, target)

    def get_outputs(self) -> list[str]:
        folder = os.path.dirname(self.get_ext_fullpath("agent_sandbox._worker._nsfork"))
        return [*super().get_outputs(), os.path.join(folder, NSINIT_NAME)]


cmdclass: dict[str, Any] = {"editable_wheel": StrictEditableWheel, "build_ext": BuildExtWithInit}

setup(
    cmdclass=cmdclass,
    ext_modules=[
        Extension(
            "agent_sandbox.guards._fastimport", sources=["guards/_fastimport.c"], optional=True
        ),
        # The host's pickle prescan for plain data and strict base64
        # (agent_sandbox/_host/intake/unpickle.py falls back to its Python path without it).
        Extension(
            "agent_sandbox._host.intake._fastscan",
            sources=["agent_sandbox/_host/intake/_fastscan.c"],
            optional=True,
        ),
        # A namespace template's fork of a worker (agent_sandbox/_worker/nstemplate.py falls
        # back to a helper process and Python without it).
        Extension(
            "agent_sandbox._worker._nsfork",
            sources=["agent_sandbox/_worker/_nsfork.c"],
            optional=True,
        ),
    ],
)
