"""Python-level guards that run inside the worker (files, sockets, imports, env, calls).

They refuse operations from cooperative but wrong code and name the rule. They are not a
security boundary against hostile bytecode: native code walks around them; the OS
providers are the boundary. See docs/guards.md for the escape matrix.

Modules (all private; the worker imports them directly, this file is not run there):

* `_patch`   the one module that monkey-patches (wrapt), and undoes it
* `_state`   the arming state and `refuse()`, the one way a guard refuses
* `_files`, `_net`, `_imports`, `_env`, `_calls`  the guards
* `_install` installs them at worker start, arms them per call, checks for tampering
* `_code_check`, `_code_budget`  the code layer (see docs/code-layer.md)
"""

__all__: list[str] = []
