"""The C extensions (guards/_fastimport.c, guards/_fastscan.c); the rest is in pyproject.toml.

`optional`: without a compiler the install still succeeds and the guard falls back to its
Python `__import__` (slower; tests/guards/test_fast_import.py::test_the_c_fast_path_is_built
then fails, so the figure cannot regress silently).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "agent_sandbox.guards._fastimport", sources=["guards/_fastimport.c"], optional=True
        ),
        # The host's pickle prescan for plain data and strict base64
        # (agent_sandbox/_host/intake/unpickle.py falls back to its Python path without it).
        Extension("agent_sandbox.guards._fastscan", sources=["guards/_fastscan.c"], optional=True),
    ]
)
