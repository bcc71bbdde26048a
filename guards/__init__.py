"""Python-level guards that run inside the worker (files, sockets, imports, env, calls).

They refuse operations from cooperative but wrong code and name the rule. They are not a
security boundary against hostile bytecode: native code walks around them; the OS
providers are the boundary.
"""

__all__: list[str] = []
