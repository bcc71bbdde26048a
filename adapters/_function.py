"""`SandboxedFunction`: the body of a tool or a plain function, run in a worker under a policy.

`sandboxed()` (`_sandboxed.py`) picks this for a plain function, and the LangChain and CrewAI
helpers build on it for their tools. How a call crosses (data only, nothing is pickled):

1. At wrap time the function's source is taken with `inspect.getsource`, dedented, and its
   decorators are stripped. The module-level imports and literal constants it refers to are
   copied in front of it, so a function defined in a script (`__main__`), a notebook or a module
   works the same way: nothing is imported by module name in the worker.
2. At call time the arguments must be JSON data; they are written into the call as Python
   literals (`f(*[...], **{...})`) and the call is the last expression, whose value comes back
   as data (`RunResult.value`).
3. The result is mapped back by `RunResult.raise_error()`: the return value (data, or rich
   objects when the policy's `result_mode` is `objects`); a policy refusal or limit raises the
   matching `SandboxDenied` subclass (`ImportDenied`, `NetworkDenied`, `LimitExceeded`, ...);
   an exception raised by the function comes back as its own type with the worker's traceback
   spliced in, or as a `ChildException` stand-in when the host does not have its class; a
   crash raises `WorkerCrashed`. Our own exceptions get `.result` (the `RunResult`) attached.

What is NOT carried: closures, helpers defined elsewhere in the module (define them inside the
function), non-literal globals, and `self` beyond the tool's own JSON-safe fields (a tool's
`_run` method gets a plain object holding those fields as its `self`).

LangChain and CrewAI tools are wrapped by helpers in `adapters.langchain` / `adapters.crewai`
(imported only when such a tool is passed), which return a tool of the same framework whose
refusals are handled tool errors / `ToolFailure`s.
"""

from __future__ import annotations

import ast
import builtins
import dis
import functools
import inspect
import json
import keyword
import textwrap
import threading
import types
from typing import Any, Generic, ParamSpec, TypeVar, cast

from agent_sandbox._errors import SandboxError
from agent_sandbox._host.boundary import resolve_boundary
from agent_sandbox._host.result import RunResult
from agent_sandbox._host.sandbox import Sandbox
from agent_sandbox.adapters._common import PolicySpec, internal_failure
from agent_sandbox.policies import resolve_policy

__all__ = ["SandboxedFunction", "function_program", "tool_body"]

_SELF_CLASS = "SandboxedToolSelf"

_P = ParamSpec("_P")
_R = TypeVar("_R")


def tool_body(tool: Any, base: type) -> tuple[types.FunctionType, dict[str, Any] | None]:
    """The function to ship for a framework tool, and the `self` fields for a method body.

    A tool built from a function (`@tool`, `StructuredTool`, CrewAI `Tool`) ships `.func`;
    a subclass ships its `_run` method with its own JSON-safe fields as `self`.
    """
    func = getattr(tool, "func", None)
    if isinstance(func, types.FunctionType):
        return func, None
    run = getattr(type(tool), "_run", None)
    if not isinstance(run, types.FunctionType) or run is getattr(base, "_run", None):
        raise TypeError(f"cannot find the body of tool {getattr(tool, 'name', tool)!r}")
    own = set(type(tool).model_fields) - set(getattr(base, "model_fields", {}))
    fields: dict[str, Any] = {}
    for name in sorted(own):
        value = getattr(tool, name, None)
        try:
            fields[name] = json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError):
            continue  # not data: the body cannot use it in the worker
    return run, fields


def function_program(func: types.FunctionType, self_fields: dict[str, Any] | None = None) -> str:
    """The source shipped to the worker: needed imports and constants, then the function."""
    if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
        raise TypeError(f"{func.__qualname__} is async; sandboxed() takes a sync function")
    if func.__closure__:
        raise TypeError(
            f"{func.__qualname__} uses variables of an enclosing function (a closure); "
            "define it at module level so its source is self-contained"
        )
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as exc:
        raise TypeError(f"the source of {func.__qualname__} is not available: {exc}") from exc
    tree = ast.parse(source)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if not defs:
        raise TypeError(f"{func.__qualname__} is not a plain `def` function (a lambda?)")
    node = defs[0]
    node.decorator_list = []
    node.name = func.__name__
    parts = _module_context(func)
    _refuse_uncarried_globals(func, parts)
    if self_fields is not None:
        body = [
            f"    {k} = {v!r}"
            for k, v in self_fields.items()
            if k.isidentifier() and not keyword.iskeyword(k)
        ]
        parts.append(f"class {_SELF_CLASS}:\n" + ("\n".join(body) or "    pass"))
    parts.append(ast.unparse(node))
    return "\n".join(parts) + "\n"


def _loaded_globals(code: types.CodeType) -> set[str]:
    """Names `code` (and the functions nested in it) read as globals."""
    names = {
        str(ins.argval)
        for ins in dis.get_instructions(code)
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _loaded_globals(const)
    return names


def _refuse_uncarried_globals(func: types.FunctionType, carried: list[str]) -> None:
    """A TypeError at wrap time for a module global the worker would not have.

    Without it, a helper defined beside the function fails only at call time, in the worker,
    as a `NameError` the caller cannot trace back to `sandboxed()`.
    """
    defined: set[str] = {func.__name__, _SELF_CLASS}
    for stmt in carried:
        for node in ast.walk(ast.parse(stmt)):
            if isinstance(node, ast.alias):
                defined.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.Name):
                defined.add(node.id)
    missing = sorted(
        name
        for name in _loaded_globals(func.__code__)
        if name in func.__globals__ and name not in defined and not hasattr(builtins, name)
    )
    if missing:
        what = ", ".join(f"`{n}` ({type(func.__globals__[n]).__name__})" for n in missing)
        raise TypeError(
            f"sandboxed({func.__qualname__}): it uses {what} from its module, which the worker "
            "does not get (only imports and literal constants are carried); define it inside "
            f"{func.__name__} or import it there"
        )


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _module_context(func: types.FunctionType) -> list[str]:
    """Top-level imports and literal constants of `func`'s module that `func` refers to."""
    module = inspect.getmodule(func)
    if module is None:
        return []
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return []
    wanted = _global_names(func.__code__)
    out: list[str] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            aliases = [a for a in stmt.names if (a.asname or a.name.split(".")[0]) in wanted]
            if aliases:
                out.append(ast.unparse(ast.Import(names=aliases)))
        elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module != "__future__":
            aliases = [a for a in stmt.names if (a.asname or a.name) in wanted]
            if aliases:
                out.append(ast.unparse(ast.ImportFrom(module=stmt.module, names=aliases, level=0)))
        elif (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id in wanted
        ):
            try:
                ast.literal_eval(stmt.value)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            out.append(ast.unparse(stmt))
    return out


def call_expression(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, method: bool = False
) -> str:
    """`name(*[...], **{...})` with the arguments as literals; refuses non-JSON arguments."""
    try:
        data = json.loads(json.dumps([list(args), kwargs], allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"sandboxed() arguments must be JSON data: {exc}") from exc
    lead = f"{_SELF_CLASS}(), " if method else ""
    return f"{name}({lead}*{data[0]!r}, **{data[1]!r})"


class SandboxedFunction(Generic[_P, _R]):
    """A function that runs in a sandboxed worker on every call (see the module docstring).

    Typed like the function it wraps: calling it takes the same arguments and returns the
    same type (checked at run time by the data rules above)."""

    def __init__(
        self,
        func: types.FunctionType,
        *,
        policy: PolicySpec = None,
        provider: str | None = None,
        timeout: float | None = None,
        warm: int = 0,
        self_fields: dict[str, Any] | None = None,
    ) -> None:
        self.func = func
        self.policy = resolve_policy(policy)
        self.provider = provider
        #: The kernel boundary the calls run behind; a provider that cannot serve the
        #: policy here fails now, not at the first call.
        self.boundary = resolve_boundary(self.policy, provider)
        self.timeout = timeout
        self.warm = warm
        self.program = function_program(func, self_fields)
        self._method = self_fields is not None
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()
        self.last_result: RunResult | None = None
        functools.update_wrapper(self, func)

    def code_for(self, *args: Any, **kwargs: Any) -> str:
        """The exact code one call runs in the worker."""
        call = call_expression(self.func.__name__, args, kwargs, method=self._method)
        return self.program + call + "\n"

    def _get_sandbox(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None or self._sandbox.closed:
                self._sandbox = Sandbox(
                    self.policy, provider=self.provider, warm=self.warm, tool=self.func.__name__
                )
            return self._sandbox

    def run(self, *args: _P.args, **kwargs: _P.kwargs) -> RunResult:
        """Call the function in a fresh worker and return the whole `RunResult` (never raises
        for a failure in the worker; raises TypeError for arguments that are not data)."""
        code = self.code_for(*args, **kwargs)
        try:
            result = self._get_sandbox().run(code, timeout=self.timeout)
        except Exception as exc:
            result = internal_failure(exc, self.policy)
        self.last_result = result
        return result

    async def arun(self, *args: _P.args, **kwargs: _P.kwargs) -> RunResult:
        """The async twin of `run()`."""
        code = self.code_for(*args, **kwargs)
        try:
            result = await self._get_sandbox().arun(code, timeout=self.timeout)
        except Exception as exc:
            result = internal_failure(exc, self.policy)
        self.last_result = result
        return result

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        result = self.run(*args, **kwargs)
        if result.error is None:
            if isinstance(result.value, dict) and set(result.value) == {"__repr__", "__type__"}:
                # data-only mode carried a description, not the value: say so, do not pass it
                # off as the function's return value.
                raise TypeError(
                    f"{self.func.__qualname__} returned a {result.value['__type__']}, which "
                    "the policy's data-only result mode cannot carry (JSON data only: dict, "
                    "list, str, int, float, bool, None); return one of those, e.g. a list "
                    'or an ISO date string, or use `result_mode = "objects"`'
                )
            return cast("_R", result.value)
        try:
            result.raise_error()
        except SandboxError as exc:
            exc.result = result  # type: ignore[attr-defined]
            raise
        return cast("_R", result.value)

    def close(self) -> None:
        with self._lock:
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()

    def __enter__(self) -> SandboxedFunction[_P, _R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<sandboxed {self.func.__qualname__} policy={self.policy.name!r}>"
