"""The C extensions (guards/_fastimport.c, guards/_fastscan.c) and the editable mode; the rest
is in pyproject.toml.

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

from typing import Any

from setuptools import Extension, setup
from setuptools.command.editable_wheel import editable_wheel


class StrictEditableWheel(editable_wheel):  # type: ignore[misc]
    """`editable_wheel` whose mode is `strict` unless the installer names one."""

    def finalize_options(self) -> None:
        if not self.mode:
            self.mode = "strict"
        super().finalize_options()


cmdclass: dict[str, Any] = {"editable_wheel": StrictEditableWheel}

setup(
    cmdclass=cmdclass,
    ext_modules=[
        Extension(
            "agent_sandbox.guards._fastimport", sources=["guards/_fastimport.c"], optional=True
        ),
        # The host's pickle prescan for plain data and strict base64
        # (agent_sandbox/_host/intake/unpickle.py falls back to its Python path without it).
        Extension("agent_sandbox.guards._fastscan", sources=["guards/_fastscan.c"], optional=True),
    ],
)
