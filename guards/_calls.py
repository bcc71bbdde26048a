"""The sensitive-call guard: a registry of dangerous functions by category, denied by default.

What it enforces, while armed:

1. Every function in `REGISTRY` is refused (`CallDenied`, a PermissionError) unless the
   policy's `[api]` grants it, even where its module may be imported. Categories:
   `process-exec`, `process-control`, `native-code`, `dynamic-code`, `deserialization`,
   `introspection`. C twins (`posix.system`, `_pickle.loads`, `_posixsubprocess.fork_exec`,
   `_ctypes.dlopen`, `_signal.signal`) are in the registry too.
2. Precedence: a function rule (`subprocess.run`) beats its category; at the same level a
   DENY beats an ALLOW; nothing granted means refused.
3. Inside a granted call, nested registry calls of the same category pass (a granted
   `subprocess.run` may create its `Popen`); other categories are still judged (a granted
   `pickle.loads` whose stream calls `os.system` is refused).
4. Some entries are judged only when user code calls them directly (`user_only`): the
   standard library and packages use them routinely (`exec` in `dataclasses` and
   `namedtuple`, `sys._getframe` in `logging`, `signal.signal` in `asyncio.run`).
5. `eval`/`exec`/`compile` are judged for source text and ASTs, not for code objects.
   When `dynamic-code` is granted and the policy's code layer is enabled, the string is
   checked by the code layer (`guards._code_budget.check_code`) before it runs.

What it does NOT stop: the immutable C type `pickle.Unpickler` (its `load` cannot be
patched without breaking subclassing), `ctypes.pythonapi` and other objects created before
arming, the originals kept in each wrapper (`__wrapped__`) and reachable through the class
hierarchy, and anything a C extension does. The OS providers are the boundary.
"""

from __future__ import annotations
import __future__

import ast
import sys
import threading
from collections.abc import Callable

from agent_sandbox._denial import Denial
from agent_sandbox._errors import CallDenied
from agent_sandbox._hints import grant_hint
from agent_sandbox.guards import _patch
from agent_sandbox.guards._state import is_user_frame, refuse, state

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["REGISTRY", "ApiRules", "Entry", "configure", "install"]

_st = state
_getframe = sys._getframe


class Entry:
    """One registry entry: the category, where the function lives, and how it is judged."""

    __slots__ = ("attr", "category", "label", "module", "user_only")

    def __init__(
        self, category: str, module: str, attr: str, label: str = "", user_only: bool = False
    ) -> None:
        self.category = category
        self.module = module
        self.attr = attr
        self.label = label
        self.user_only = user_only

    @property
    def name(self) -> str:
        return self.label or f"{self.module}.{self.attr}"


def _entries(category: str, module: str, attrs: str, *, user_only: bool = False) -> list[Entry]:
    return [Entry(category, module, a, user_only=user_only) for a in attrs.split()]


_EXEC_OS = (
    "system execv execve execl execle execlp execlpe execvp execvpe spawnv spawnve spawnvp "
    "spawnvpe spawnl spawnle spawnlp spawnlpe posix_spawn posix_spawnp"
)

#: Every sensitive function, by category. C twins are listed beside their Python names.
REGISTRY: tuple[Entry, ...] = (
    # process-exec
    Entry("process-exec", "subprocess", "Popen.__init__", "subprocess.Popen"),
    *_entries(
        "process-exec", "subprocess", "run call check_call check_output getoutput getstatusoutput"
    ),
    *_entries("process-exec", "os", _EXEC_OS + " popen"),
    *_entries("process-exec", "posix", "system execv execve posix_spawn posix_spawnp"),
    Entry("process-exec", "pty", "spawn"),
    Entry("process-exec", "_posixsubprocess", "fork_exec"),
    # process-control
    *_entries("process-control", "os", "fork forkpty kill killpg abort"),
    *_entries("process-control", "posix", "fork forkpty kill killpg abort"),
    *_entries("process-control", "signal", "pthread_kill raise_signal alarm setitimer"),
    *_entries("process-control", "_signal", "pthread_kill raise_signal alarm setitimer"),
    # NOTE: judged for user code only, because asyncio.run installs a SIGINT handler.
    Entry("process-control", "signal", "signal", user_only=True),
    Entry("process-control", "_signal", "signal", user_only=True),
    # native-code
    # NOTE: judged for user code only, because importing ctypes (numpy does) builds
    # `ctypes.pythonapi` through CDLL.__init__ and dlopen.
    Entry("native-code", "ctypes", "CDLL.__init__", "ctypes.CDLL", user_only=True),
    Entry(
        "native-code",
        "ctypes",
        "LibraryLoader.LoadLibrary",
        "ctypes.cdll.LoadLibrary",
        user_only=True,
    ),
    Entry(
        "native-code",
        "ctypes",
        "LibraryLoader.__getattr__",
        "ctypes.cdll.__getattr__",
        user_only=True,
    ),
    Entry(
        "native-code",
        "ctypes",
        "LibraryLoader.__getitem__",
        "ctypes.cdll.__getitem__",
        user_only=True,
    ),
    Entry("native-code", "_ctypes", "dlopen", user_only=True),
    *_entries("native-code", "ctypes", "string_at wstring_at memmove memset cast", user_only=True),
    Entry("native-code", "cffi", "FFI.dlopen", "cffi.FFI.dlopen"),
    # dynamic-code (only source text and ASTs are judged; see _dynamic_wrapper)
    *_entries("dynamic-code", "builtins", "eval exec compile", user_only=True),
    # deserialization
    *_entries("deserialization", "pickle", "loads load _loads _load"),
    Entry("deserialization", "pickle", "_Unpickler.load", "pickle._Unpickler.load"),
    *_entries("deserialization", "_pickle", "loads load"),
    # NOTE: judged for user code only, because the import system loads every .pyc with it.
    *_entries("deserialization", "marshal", "loads load", user_only=True),
    Entry("deserialization", "shelve", "open"),
    # introspection (libraries use these all the time: judged for user code only)
    *_entries(
        "introspection",
        "sys",
        "_getframe _current_frames settrace setprofile _settraceallthreads _setprofileallthreads",
        user_only=True,
    ),
    # NOTE: a trace or profile function, or a `sys.monitoring` callback, set by user code
    # runs later in the worker's own threads, after the call, where nothing is armed; the
    # `_all_threads` forms (3.12+) and `sys.monitoring` (3.12+) are skipped where missing.
    *_entries(
        "introspection",
        "threading",
        "settrace setprofile settrace_all_threads setprofile_all_threads",
        user_only=True,
    ),
    *(
        Entry("introspection", "sys", f"monitoring.{attr}", f"sys.monitoring.{attr}", True)
        for attr in ("use_tool_id", "register_callback", "set_events", "set_local_events")
    ),
    *_entries("introspection", "gc", "get_referrers get_referents get_objects", user_only=True),
    *_entries("introspection", "inspect", "currentframe stack", user_only=True),
)


class ApiRules:
    """The `[api]` section: grants and denials by category or dotted function name."""

    def __init__(self, api: dict[str, Any], policy_name: str = "") -> None:
        self.allow = frozenset(api.get("allow", ()))
        self.deny = frozenset(api.get("deny", ()))
        self.policy_name = policy_name

    def granted(self, name: str, category: str) -> bool:
        if name in self.deny:
            return False
        if name in self.allow:
            return True
        if category in self.deny:
            return False
        return category in self.allow

    def denial(self, name: str, category: str) -> Denial:
        if name in self.deny or (name not in self.allow and category in self.deny):
            entry = name if name in self.deny else category
            return Denial(
                f"api.{category}",
                "call",
                name,
                self.policy_name,
                detail=f"{entry!r} is listed in [api] deny, which beats [api] allow",
                hint=f"remove {entry!r} from [api] deny",
            )
        return Denial(
            f"api.{category}",
            "call",
            name,
            self.policy_name,
            detail=f"{name} is a sensitive call ({category}) the policy does not grant",
            hint=grant_hint({"api.allow": [name]}),
        )


_rules = ApiRules({})
_local = threading.local()
_code_check: Callable[..., Any] | None = None
_code_policy: dict[str, Any] = {}


def configure(rules: ApiRules, code_policy: dict[str, Any] | None = None) -> None:
    global _rules, _code_policy
    _rules = rules
    _code_policy = dict(code_policy or {})


def _inside() -> dict[str, int]:
    depth: dict[str, int] | None = getattr(_local, "depth", None)
    if depth is None:
        depth = _local.depth = {}
    return depth


def _run_granted(category: str, wrapped: Any, args: Any, kwargs: Any) -> Any:
    depth = _inside()
    depth[category] = depth.get(category, 0) + 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        depth[category] -= 1


def _make_wrapper(entry: Entry) -> Any:
    category, name, user_only = entry.category, entry.name, entry.user_only

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (_st.armed or (_st.user_threads and threading.get_ident() in _st.user_threads)):
            return wrapped(*args, **kwargs)
        if user_only and not is_user_frame(_getframe(1).f_code.co_filename):
            return wrapped(*args, **kwargs)
        if _inside().get(category):
            return wrapped(*args, **kwargs)
        if _rules.granted(name, category):
            return _run_granted(category, wrapped, args, kwargs)
        refuse(CallDenied, _rules.denial(name, category))
        return _run_granted(category, wrapped, args, kwargs)  # learning mode

    return wrapper


#: The `from __future__` flags a frame's code carries, which `compile()` inherits.
_FUTURE_FLAGS = 0
for _feature in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _feature).compiler_flag
_COMPILE_ARGS = ("source", "filename", "mode", "flags", "dont_inherit", "optimize")


def _as_caller(
    name: str, wrapped: Any, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any
) -> Any:
    """Call eval/exec/compile as if from `caller`, not from the wrapper's own frame.

    The built-ins read the calling frame: eval/exec without globals use its namespace and
    put its builtins into a globals dict that has none; compile inherits its `__future__`
    flags. Called from a wrapper they would see the wrapper, so this passes them explicitly.
    """
    if name == "builtins.compile":
        call = dict(zip(_COMPILE_ARGS, args, strict=False))
        call.update(kwargs)
        if not call.get("dont_inherit"):
            call["flags"] = int(call.get("flags", 0)) | (caller.f_code.co_flags & _FUTURE_FLAGS)
            call["dont_inherit"] = True
        return wrapped(**call)
    if len(args) == 1:
        args = (args[0], caller.f_globals, caller.f_locals)
    elif len(args) > 1 and isinstance(args[1], dict) and "__builtins__" not in args[1]:
        args[1]["__builtins__"] = caller.f_builtins
    return wrapped(*args, **kwargs)


_plain_compile = compile  # bound at import, before any guard is installed


def _checked_source(
    name: str, source: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Check granted dynamic code with the code layer and hand on the *rewritten* tree.

    The rewrite is what makes budgets and run-time attribute checks apply to eval/exec'd
    code too; running the original string after checking it would skip them. A compile
    asked for an AST only (`PyCF_ONLY_AST`) returns the checked, unrewritten tree: it is
    checked and rewritten again when it is compiled or run.
    """
    assert _code_check is not None
    if isinstance(source, str):
        text = source
    elif isinstance(source, ast.AST):
        text = ast.unparse(source)
    else:
        text = bytes(source).decode("utf-8", "replace")
    if name == "builtins.compile":
        filename = args[1] if len(args) > 1 else kwargs.get("filename", "<string>")
        mode = args[2] if len(args) > 2 else kwargs.get("mode", "exec")
        flags = args[3] if len(args) > 3 else kwargs.get("flags", 0)
    else:
        filename, flags = "<string>", 0
        mode = "eval" if name == "builtins.eval" else "exec"
    if isinstance(filename, bytes | bytearray):
        filename = bytes(filename).decode("utf-8", "replace")
    tree = _code_check(text, _code_policy, str(filename), mode=str(mode))
    if isinstance(flags, int) and flags & ast.PyCF_ONLY_AST:
        return args, kwargs
    replacement: Any = tree
    if name != "builtins.compile":
        replacement = _plain_compile(tree, "<string>", mode)
    if args:
        return (replacement, *args[1:]), kwargs
    return args, {**kwargs, "source": replacement}


def _dynamic_wrapper(entry: Entry) -> Any:
    name = entry.name

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        caller = _getframe(1)
        if not (_st.armed or (_st.user_threads and threading.get_ident() in _st.user_threads)):
            return _as_caller(name, wrapped, args, kwargs, caller)
        source = args[0] if args else kwargs.get("source")
        if not isinstance(source, str | bytes | bytearray | ast.AST):
            return _as_caller(name, wrapped, args, kwargs, caller)
        if not is_user_frame(caller.f_code.co_filename):
            return _as_caller(name, wrapped, args, kwargs, caller)
        if not _rules.granted(name, "dynamic-code"):
            refuse(CallDenied, _rules.denial(name, "dynamic-code"))
            return _as_caller(name, wrapped, args, kwargs, caller)  # learning mode
        if _code_check is not None and _code_policy.get("enabled", False):
            args, kwargs = _checked_source(name, source, args, kwargs)
        return _as_caller(name, wrapped, args, kwargs, caller)

    return wrapper


#: Registry entries whose result depends on the calling frame (see `_frame_wrapper`).
_FRAME_SENSITIVE = frozenset({"sys._getframe", "inspect.currentframe", "inspect.stack"})


def _frame_wrapper(entry: Entry) -> Any:
    """A wrapper for the frame getters that answers for the caller, not for itself."""
    category, name = entry.category, entry.name

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        active = _st.armed or (_st.user_threads and threading.get_ident() in _st.user_threads)
        if (
            active
            and is_user_frame(_getframe(1).f_code.co_filename)
            and not _rules.granted(name, category)
        ):
            refuse(CallDenied, _rules.denial(name, category))
        if name == "sys._getframe":
            depth = args[0] if args else kwargs.get("depth", 0)
            return _getframe(depth + 1)  # counted from the caller, not from this wrapper
        if name == "inspect.currentframe":
            return _getframe(1)
        return wrapped(*args, **kwargs)[1:]  # inspect.stack: drop this wrapper's own frame

    return wrapper


def install() -> None:
    """Wrap every registry entry (deferred for modules not imported yet)."""
    global _code_check
    try:
        from agent_sandbox.guards._code_budget import check_code
    except ImportError:  # the code layer is optional here
        _code_check = None
    else:
        _code_check = check_code
    for entry in REGISTRY:
        if entry.category == "dynamic-code":
            factory = _dynamic_wrapper
        elif entry.name in _FRAME_SENSITIVE:
            factory = _frame_wrapper
        else:
            factory = _make_wrapper
        _patch.wrap_later(entry.module, entry.attr, factory(entry), label=entry.name)
