"""The code layer's static check: the model's code string against the policy's sub-language.

What it enforces, before a single line runs:

1. Syntax: every AST node belongs to a syntax group (`loops`, `classes`, `async`, ...); a node
   whose group the policy does not grant is refused, and a node the checker has no rule for
   (including nodes a newer Python adds) is refused too (`code.syntax`).
2. Names: builtins that expose namespaces (`globals`, `locals`, `vars`, `breakpoint`) are refused
   unless `[code] names` lists them; `deny_names` refuses more; with a `names` allowlist instead of
   `"*"`, a name must be granted, bound by the code itself or already defined in the session
   (`code.name`).
3. Attributes: dunder names (`__x__`) are refused unless `[code] dunders` grants them
   (`code.dunder`); other attribute names must be in `[code] attributes` (`"*"` by default)
   (`code.attribute`). Frame, code, generator, traceback and class-hierarchy internals
   (`NEVER_GRANTABLE`: `gi_frame`, `f_globals`, `__globals__`, `__subclasses__`, ...) are refused
   everywhere: as attributes, as names, as bound names, and inside string constants (so a format
   string or an annotation string cannot name them either). The `__sbx` prefix is reserved for the
   rewritten code's helpers and refused everywhere, so no parameter (positional-only included),
   import alias, handler name or global can shadow them.

Every violation is collected, then reported at once with line, column, the offending text and
the exact policy line that would allow it (`check_code` raises `CodeRejected` carrying them all).

What it does NOT do: decide attribute names computed at run time (`getattr(x, name)`, format
fields, `operator.attrgetter`); `guards._code_budget` rewrites the code so those are checked when
they run, and counts budgets. It is not a security boundary against hostile code either: it
refuses the known escape shapes early and readably; the OS providers are the boundary.

Standard library only: the worker imports it before arming.

This module is longer than 600 lines because the sub-language is one table read by one
checker: each syntax group, name rule and attribute rule sits beside the check that applies
it (`Rules`, `_Checker`); split, a node type could be granted in one file and left
unchecked in the other.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterable, Mapping

from agent_sandbox._denial import Denial, FrozenValue
from agent_sandbox._errors import CodeRejected
from agent_sandbox._render import toml_fragment
from agent_sandbox._worker import audit

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "ATTRIBUTE_GROUPS",
    "DEFAULT_DUNDERS",
    "DEFAULT_SYNTAX",
    "DUNDER_GROUPS",
    "GUARDED_NAMES",
    "NAME_GROUPS",
    "NEVER_GRANTABLE",
    "RESERVED_PREFIX",
    "SYNTAX_GROUPS",
    "Rules",
    "Violation",
    "check_tree",
    "compile_rules",
    "find_violations",
    "is_dunder",
    "reject",
]

#: Identifiers starting with this belong to the rewritten code's helpers (`__sbx_loop__`, ...).
RESERVED_PREFIX = "__sbx"

#: Names no policy can grant: reaching them walks out of the Python layer (a load error if granted).
NEVER_GRANTABLE = frozenset(
    {
        # frames
        "f_globals",
        "f_locals",
        "f_builtins",
        "f_back",
        "f_code",
        "f_trace",
        "_getframe",
        "_current_frames",
        # generators, coroutines, async generators
        "gi_frame",
        "gi_code",
        "gi_yieldfrom",
        "cr_frame",
        "cr_code",
        "cr_await",
        "cr_origin",
        "ag_frame",
        "ag_code",
        "ag_await",
        # tracebacks
        "tb_frame",
        "tb_next",
        # code objects and function internals
        "co_code",
        "co_consts",
        "__code__",
        "__globals__",
        "__closure__",
        "cell_contents",
        "__defaults__",
        "__kwdefaults__",
        "__builtins__",
        # the class hierarchy and generic attribute access
        "__subclasses__",
        "__mro__",
        "mro",
        "__bases__",
        "__base__",
        "__getattribute__",
        # the guards' wrappers (wrapt) and their originals
        "__wrapped__",
        "_self_wrapper",
        "_self_parent",
        "_self_instance",
        "_self_binding",
        # import machinery
        "__loader__",
        "__spec__",
    }
)

#: Builtins refused unless `[code] names` lists them: they expose whole namespaces.
GUARDED_NAMES = frozenset({"globals", "locals", "vars", "breakpoint"})

#: Syntax groups and the AST node types each one allows.
SYNTAX_GROUPS: dict[str, tuple[type[ast.AST], ...]] = {
    "arithmetic": (ast.BinOp, ast.UnaryOp),
    "assert": (ast.Assert,),
    "assignment": (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr),
    "async": (ast.AsyncFunctionDef, ast.AsyncFor, ast.AsyncWith, ast.Await),
    "classes": (ast.ClassDef,),
    "comparisons": (ast.Compare, ast.BoolOp),
    "comprehensions": (
        ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.comprehension,
    ),
    "conditionals": (ast.If, ast.IfExp),
    "context-managers": (ast.With, ast.AsyncWith, ast.withitem),
    "delete": (ast.Delete,),
    "exception-groups": (ast.TryStar,),
    "exceptions": (ast.Try, ast.Raise, ast.ExceptHandler),
    "f-strings": (ast.JoinedStr, ast.FormattedValue),
    "functions": (ast.FunctionDef, ast.AsyncFunctionDef, ast.Return, ast.arguments, ast.arg),
    "generators": (ast.Yield, ast.YieldFrom),
    "global": (ast.Global, ast.Nonlocal),
    "imports": (ast.Import, ast.ImportFrom, ast.alias),
    "lambda": (ast.Lambda, ast.arguments, ast.arg),
    "loops": (ast.For, ast.AsyncFor, ast.While, ast.Break, ast.Continue),
    "pattern-matching": (
        ast.Match, ast.match_case, ast.MatchValue, ast.MatchSingleton, ast.MatchSequence,
        ast.MatchMapping, ast.MatchClass, ast.MatchStar, ast.MatchAs, ast.MatchOr,
    ),
}  # fmt: skip

#: The groups a policy gets when it does not list `syntax` (everything but `exception-groups`).
DEFAULT_SYNTAX = tuple(sorted(set(SYNTAX_GROUPS) - {"exception-groups"}))

# NOTE: allowed in every sub-language: literals, names, calls, subscripts, expression
# statements and the operator/context singletons; their contents are still checked.
_ALWAYS: tuple[type[ast.AST], ...] = (
    ast.Module,
    ast.Expression,
    ast.Interactive,
    ast.Expr,
    ast.Pass,
    ast.Constant,
    ast.Name,
    ast.Attribute,
    ast.Subscript,
    ast.Slice,
    ast.Starred,
    ast.Call,
    ast.keyword,
    ast.List,
    ast.Tuple,
    ast.Dict,
    ast.Set,
    ast.Load,
    ast.Store,
    ast.Del,
    ast.TypeIgnore,
    ast.operator,
    ast.unaryop,
    ast.cmpop,
    ast.boolop,
)


def _node_groups() -> dict[type[ast.AST], tuple[str, ...]]:
    """node type -> the groups that allow it (empty: always allowed)."""
    table: dict[type[ast.AST], tuple[str, ...]] = {}
    for base in _ALWAYS:
        for cls in [base, *_all_subclasses(base)]:
            table[cls] = ()
    for group, types in SYNTAX_GROUPS.items():
        for cls in types:
            table[cls] = (*table.get(cls, ()), group)
    return table


def _all_subclasses(cls: type) -> list[type]:
    out: list[type] = []
    subs: list[type] = type.__subclasses__(cls)
    for sub in subs:
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_NODE_GROUPS = _node_groups()

# NOTE: `ctx`, `op` and `ops` hold the operator/context singletons, which every sub-language
# allows; the node that owns them is checked, so the walk does not visit them.
_SKIPPED_FIELDS = frozenset({"ctx", "op", "ops"})


#: ASDL's builtin field types: a field of one of these never holds a node.
_LEAF_TYPES = frozenset({"identifier", "string", "constant", "int"})
_SIGNATURE = re.compile(r"(\w+)\((.*)\)")


def _field_types(cls: type) -> dict[str, str] | None:
    """field -> ASDL type of a node class, from the signature CPython writes as the first
    line of its docstring (`Name(identifier id, expr_context ctx)`); None when there is no
    signature or it does not name exactly the class's `_fields`."""
    doc = (cls.__doc__ or "").strip().splitlines()
    match = _SIGNATURE.fullmatch(doc[0]) if doc else None
    if match is None or match.group(1) != cls.__name__:
        return None
    types: dict[str, str] = {}
    for part in match.group(2).split(","):
        words = part.split()
        if len(words) != 2:
            return None
        types[words[1]] = words[0].rstrip("*?")
    if set(types) != set(getattr(cls, "_fields", ())):
        return None
    return types


def _child_fields(cls: type) -> tuple[str, ...]:
    """The fields of `cls` the walk visits: all but `ctx`/`op`/`ops`, and but those whose
    ASDL type is a builtin (a name, a string, a constant, an int: never a node). Without a
    signature that matches (`_field_types`), every field is visited."""
    fields: tuple[str, ...] = getattr(cls, "_fields", ())
    types = _field_types(cls) or {}
    return tuple(f for f in fields if f not in _SKIPPED_FIELDS and types.get(f) not in _LEAF_TYPES)


_CHILD_FIELDS: dict[type, tuple[str, ...]] = {cls: _child_fields(cls) for cls in _NODE_GROUPS}

#: Attribute groups a policy may list in `[code] attributes` instead of single names.
ATTRIBUTE_GROUPS: dict[str, frozenset[str]] = {
    "string-methods": frozenset(n for n in dir(str) if not n.startswith("_")),
    "bytes-methods": frozenset(n for n in dir(bytes) if not n.startswith("_")),
    "list-methods": frozenset(n for n in dir(list) if not n.startswith("_")),
    "dict-methods": frozenset(n for n in dir(dict) if not n.startswith("_")),
    "set-methods": frozenset(n for n in dir(set) if not n.startswith("_")),
    "number-methods": frozenset(
        n for t in (int, float, complex) for n in dir(t) if not n.startswith("_")
    ),
    "exception-attributes": frozenset({"args", "name", "errno", "strerror", "filename"}),
}

#: Dunder groups a policy may list in `[code] dunders`.
DUNDER_GROUPS: dict[str, frozenset[str]] = {
    # Metadata ordinary code reads: names, docs, versions, the class of a value, constructors.
    "common": frozenset(
        {
            "__name__", "__qualname__", "__doc__", "__module__", "__version__", "__class__",
            "__init__", "__new__", "__post_init__", "__annotations__", "__slots__", "__all__",
            "__match_args__", "__dataclass_fields__", "__main__", "__file__", "__hash__",
        }
    ),
    # The data model's protocol methods (calling `x.__len__()` or `super().__eq__(o)`).
    "protocol": frozenset(
        {
            "__len__", "__iter__", "__next__", "__reversed__", "__contains__", "__getitem__",
            "__setitem__", "__delitem__", "__missing__", "__call__", "__enter__", "__exit__",
            "__aenter__", "__aexit__", "__aiter__", "__anext__", "__await__",
            "__repr__", "__str__", "__format__", "__bytes__", "__bool__", "__int__",
            "__float__", "__complex__", "__index__", "__round__", "__trunc__", "__floor__",
            "__ceil__", "__abs__", "__neg__", "__pos__", "__invert__", "__array__",
            "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__fspath__",
            "__add__", "__sub__", "__mul__", "__matmul__", "__truediv__", "__floordiv__",
            "__mod__", "__divmod__", "__pow__", "__lshift__", "__rshift__", "__and__",
            "__xor__", "__or__", "__radd__", "__rsub__", "__rmul__", "__rmatmul__",
            "__rtruediv__", "__rfloordiv__", "__rmod__", "__rdivmod__", "__rpow__",
            "__rlshift__", "__rrshift__", "__rand__", "__rxor__", "__ror__", "__iadd__",
            "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
            "__iand__", "__ixor__", "__ior__", "__copy__", "__deepcopy__", "__sizeof__",
            "__length_hint__", "__class_getitem__", "__set_name__", "__init_subclass__",
        }
    ),
}  # fmt: skip

#: The dunders a policy gets when it does not list `dunders`.
DEFAULT_DUNDERS = ("common", "protocol")

#: Name groups a policy may list in `[code] names` (an allowlist instead of `"*"`).
NAME_GROUPS: dict[str, frozenset[str]] = {
    "builtins": frozenset(
        {
            "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable",
            "chr", "classmethod", "complex", "dict", "dir", "divmod", "enumerate", "filter",
            "float", "format", "frozenset", "getattr", "hasattr", "hash", "hex", "id", "int",
            "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "next",
            "object", "oct", "ord", "pow", "print", "property", "range", "repr", "reversed",
            "round", "set", "setattr", "slice", "sorted", "staticmethod", "str", "sum",
            "super", "tuple", "type", "zip", "aiter", "anext", "delattr", "NotImplemented",
            "Ellipsis", "None", "True", "False",
        }
    ),
    "exceptions": frozenset(
        n
        for n in dir(builtins)
        if n.endswith(("Error", "Exception", "Warning", "Iteration", "Exit", "Interrupt"))
    ),
}  # fmt: skip

_NEVER_IN_TEXT = re.compile(
    r"(?<![A-Za-z0-9_])("
    + "|".join(re.escape(n) for n in sorted(NEVER_GRANTABLE, key=len, reverse=True))
    + r")(?![A-Za-z0-9_])|"
    + re.escape(RESERVED_PREFIX)
)


def is_dunder(name: str) -> bool:
    """Whether `name` has the `__x__` shape."""
    return len(name) > 4 and name[:2] == "__" and name[-2:] == "__"


class Violation(FrozenValue):
    """One place where the code leaves the sub-language.

    `hint` is the exact policy line that would allow it, or "" when nothing can
    (a never-grantable name, a node the checker has no rule for).
    """

    __slots__ = ("column", "detail", "hint", "line", "rule", "text")
    rule: str
    line: int
    column: int
    text: str
    detail: str
    hint: str

    def __init__(
        self, rule: str, line: int, column: int, text: str, detail: str, hint: str = ""
    ) -> None:
        init = object.__setattr__
        init(self, "rule", rule)
        init(self, "line", line)
        init(self, "column", column)
        init(self, "text", text)
        init(self, "detail", detail)
        init(self, "hint", hint)

    def describe(self) -> str:
        """One line for the model: where, what, why and how to allow it."""
        out = f"line {self.line}, column {self.column}: `{self.text}`: {self.detail}"
        if self.hint.startswith("[[grant]]"):
            out += f" (to allow it, add to the policy file: {self.hint.replace(chr(10), ' ')})"
        elif self.hint:
            out += f" (to allow it: {self.hint})"
        return out

    def to_denial(self, policy: str = "") -> Denial:
        """The structured record the operator sees."""
        return Denial(
            rule=self.rule,
            action="use",
            target=self.text,
            policy=policy,
            hint=self.hint,
            detail=f"line {self.line}, column {self.column}: {self.detail}",
        )


class Rules(FrozenValue):
    """A policy's `code` section compiled to sets (built once per policy dict)."""

    __slots__ = (
        "any_attribute",
        "any_name",
        "attributes",
        "attributes_listed",
        "deny_names",
        "dunders",
        "dunders_listed",
        "max_allocation",
        "max_call_depth",
        "max_iterations",
        "names",
        "names_listed",
        "policy_name",
        "syntax",
        "syntax_listed",
    )
    policy_name: str
    syntax: frozenset[str]
    syntax_listed: tuple[str, ...]
    any_name: bool
    names: frozenset[str]
    names_listed: tuple[str, ...]
    deny_names: frozenset[str]
    any_attribute: bool
    attributes: frozenset[str]
    attributes_listed: tuple[str, ...]
    dunders: frozenset[str]
    dunders_listed: tuple[str, ...]
    max_iterations: int
    max_call_depth: int
    max_allocation: int

    def __init__(
        self,
        *,
        policy_name: str,
        syntax: frozenset[str],
        syntax_listed: tuple[str, ...],
        any_name: bool,
        names: frozenset[str],
        names_listed: tuple[str, ...],
        deny_names: frozenset[str],
        any_attribute: bool,
        attributes: frozenset[str],
        attributes_listed: tuple[str, ...],
        dunders: frozenset[str],
        dunders_listed: tuple[str, ...],
        max_iterations: int,
        max_call_depth: int,
        max_allocation: int,
    ) -> None:
        init = object.__setattr__
        init(self, "policy_name", policy_name)
        init(self, "syntax", syntax)
        init(self, "syntax_listed", syntax_listed)
        init(self, "any_name", any_name)
        init(self, "names", names)
        init(self, "names_listed", names_listed)
        init(self, "deny_names", deny_names)
        init(self, "any_attribute", any_attribute)
        init(self, "attributes", attributes)
        init(self, "attributes_listed", attributes_listed)
        init(self, "dunders", dunders)
        init(self, "dunders_listed", dunders_listed)
        init(self, "max_iterations", max_iterations)
        init(self, "max_call_depth", max_call_depth)
        init(self, "max_allocation", max_allocation)

    def attribute_problem(self, name: str) -> tuple[str, str, str] | None:
        """(rule, detail, hint) when reading attribute `name` is refused, else None."""
        if name in NEVER_GRANTABLE or name.startswith(RESERVED_PREFIX):
            return (
                "code.attribute",
                f"`{name}` reaches interpreter internals; no policy can grant it",
                "",
            )
        if is_dunder(name):
            if name in self.dunders:
                return None
            return (
                "code.dunder",
                f"the dunder `{name}` is not granted",
                _list_line("dunders", self.dunders_listed, name),
            )
        if self.any_attribute or name in self.attributes:
            return None
        return (
            "code.attribute",
            f"the attribute `{name}` is not in the sub-language",
            _list_line("attributes", self.attributes_listed, name),
        )

    def binding_problem(self, name: str) -> tuple[str, str, str] | None:
        """(rule, detail, hint) when binding `name` (a parameter, target, alias) is refused."""
        if name in NEVER_GRANTABLE or name.startswith(RESERVED_PREFIX):
            return ("code.name", f"`{name}` is reserved; no policy can grant binding it", "")
        if is_dunder(name) and name not in self.dunders:
            return (
                "code.dunder",
                f"binding the dunder `{name}` is not granted",
                _list_line("dunders", self.dunders_listed, name),
            )
        return None

    def name_problem(
        self, name: str, bound: frozenset[str] | set[str]
    ) -> tuple[str, str, str] | None:
        """(rule, detail, hint) when reading the name `name` is refused."""
        if name in NEVER_GRANTABLE or name.startswith(RESERVED_PREFIX):
            return (
                "code.name",
                f"`{name}` reaches interpreter internals; no policy can grant it",
                "",
            )
        if is_dunder(name):
            if name in self.dunders:
                return None
            return (
                "code.dunder",
                f"the dunder name `{name}` is not granted",
                _list_line("dunders", self.dunders_listed, name),
            )
        if name in self.deny_names:
            return (
                "code.name",
                f"the name `{name}` is denied by `[code] deny_names`",
                f'[code] deny_names: remove "{name}"',
            )
        if name in self.names:
            return None
        if name in GUARDED_NAMES:
            return (
                "code.name",
                f"`{name}()` exposes a whole namespace and is not granted",
                _list_line("names", self.names_listed, name),
            )
        if self.any_name or name in bound:
            return None
        return (
            "code.name",
            f"the name `{name}` is not in the sub-language",
            _list_line("names", self.names_listed, name),
        )


def _list_line(key: str, listed: tuple[str, ...], item: str) -> str:
    """The `[[grant]]` adding `item` to `[code] key` (what the policy lists stays)."""
    del listed
    return toml_fragment({f"code.{key}": [item]})


def _expand(items: Iterable[str], groups: Mapping[str, frozenset[str]]) -> frozenset[str]:
    out: set[str] = set()
    for item in items:
        out |= groups.get(item, frozenset({item}))
    return frozenset(out)


_RULES_CACHE: dict[int, tuple[Mapping[str, Any], Rules]] = {}


def compile_rules(code_policy: Mapping[str, Any] | Rules, policy_name: str = "") -> Rules:
    """Compile a wire `code` section (a plain dict) to `Rules`; cached per dict object."""
    if isinstance(code_policy, Rules):
        return code_policy
    hit = _RULES_CACHE.get(id(code_policy))
    if hit is not None and hit[0] is code_policy and hit[1].policy_name == policy_name:
        return hit[1]
    syntax = tuple(code_policy.get("syntax", DEFAULT_SYNTAX))
    names = tuple(code_policy.get("names", ("*",)))
    attributes = tuple(code_policy.get("attributes", ("*",)))
    dunders = tuple(code_policy.get("dunders", DEFAULT_DUNDERS))
    budgets = code_policy.get("budgets") or {}
    rules = Rules(
        policy_name=policy_name,
        syntax=frozenset(syntax),
        syntax_listed=syntax,
        any_name="*" in names,
        names=_expand(names, NAME_GROUPS) - NEVER_GRANTABLE,
        names_listed=names,
        deny_names=frozenset(code_policy.get("deny_names", ())),
        any_attribute="*" in attributes,
        attributes=_expand(attributes, ATTRIBUTE_GROUPS) - NEVER_GRANTABLE,
        attributes_listed=attributes,
        dunders=_expand(dunders, DUNDER_GROUPS) - NEVER_GRANTABLE,
        dunders_listed=dunders,
        max_iterations=int(budgets.get("max_iterations", 10_000_000)),
        max_call_depth=int(budgets.get("max_call_depth", 1000)),
        max_allocation=int(budgets.get("max_allocation", 100_000_000)),
    )
    if len(_RULES_CACHE) > 32:
        _RULES_CACHE.clear()
    _RULES_CACHE[id(code_policy)] = (code_policy, rules)
    return rules


_ALLOWED_TYPES: dict[frozenset[str], frozenset[type]] = {}


def _allowed_types(syntax: frozenset[str]) -> frozenset[type]:
    """The node types a sub-language with these syntax groups allows (cached per set)."""
    allowed = _ALLOWED_TYPES.get(syntax)
    if allowed is None:
        allowed = frozenset(
            cls for cls, need in _NODE_GROUPS.items() if not need or any(g in syntax for g in need)
        )
        if len(_ALLOWED_TYPES) >= 64:
            _ALLOWED_TYPES.clear()
        _ALLOWED_TYPES[syntax] = allowed
    return allowed


class _Checker:
    """One walk over the tree; violations are appended, never raised."""

    def __init__(self, rules: Rules, source: str | None) -> None:
        self.rules = rules
        self.source = source
        self.out: list[Violation] = []
        self.bound: set[str] = set()
        self.loads: list[ast.Name] = []
        self.lenient: set[int] = set()  # ids of class-body bindings (dunder methods allowed)
        self.attribute_problems: dict[str, tuple[str, str, str] | None] = {}  # by name
        self.binding_problems: dict[str, tuple[str, str, str] | None] = {}  # by name

    def add(self, node: Any, problem: tuple[str, str, str], text: str | None = None) -> None:
        rule, detail, hint = problem
        line = getattr(node, "lineno", 0) or 0
        col = (getattr(node, "col_offset", -1) or 0) + 1
        self.out.append(Violation(rule, line, col, text or self.text(node), detail, hint))

    def text(self, node: Any) -> str:
        seg = None
        if self.source is not None:
            try:
                seg = ast.get_source_segment(self.source, node)
            except Exception:
                seg = None
        if seg is None:
            try:
                seg = ast.unparse(node)
            except Exception:
                seg = type(node).__name__
        seg = " ".join(seg.split())
        return seg if len(seg) <= 80 else seg[:77] + "..."

    def walk(self, root: ast.AST) -> None:
        stack: list[Any] = [root]
        node: Any
        allowed = _allowed_types(self.rules.syntax)
        steps = _STEPS
        pop, push, extend = stack.pop, stack.append, stack.extend
        loads, bind = self.loads, self.bind
        name_type, load_type = ast.Name, ast.Load
        while stack:
            node = pop()
            cls = type(node)
            # The common case is one set look-up; anything else (a refused or unknown node
            # type, or a None or other non-node from a field) takes `_unusual`.
            if cls not in allowed and not self._unusual(node, cls):
                continue
            if cls is name_type and _NAME_IS_LEAF:  # the commonest node, handled inline
                if isinstance(node.ctx, load_type):
                    loads.append(node)
                else:
                    bind(node, node.id)
                continue
            step = steps.get(cls)
            if step is None:
                step = steps[cls] = _step(cls)
            handler, fields = step
            if handler is not None:
                handler(self, node)
            for field in fields:
                value = getattr(node, field, None)
                if type(value) is list:
                    extend(value)  # an optional slot may hold None: skipped when popped
                elif value is not None:
                    push(value)

    def _unusual(self, node: Any, cls: type) -> bool:
        """Report a node type the sub-language refuses or the checker has no rule for; True
        when the walk goes on into the node (its type is known but refused)."""
        if not isinstance(node, ast.AST):
            return False  # None in an optional slot, or a value that is not a node
        need = _NODE_GROUPS.get(cls)
        if need is None:
            self.add(
                node,
                (
                    "code.syntax",
                    f"`{cls.__name__}` syntax has no rule in this checker and is refused",
                    "",
                ),
            )
            return False
        self.add(
            node,
            (
                "code.syntax",
                f"{_syntax_label(cls)} is not in the sub-language",
                _list_line("syntax", self.rules.syntax_listed, need[0]),
            ),
        )
        return True

    def bind(self, node: Any, name: str | None) -> None:
        if name is None:
            return
        self.bound.add(name)
        problems = self.binding_problems
        if name in problems:
            problem = problems[name]
        else:
            problem = problems[name] = self.rules.binding_problem(name)
        if problem is not None and not (id(node) in self.lenient and problem[0] == "code.dunder"):
            self.add(node, problem, name)

    def finish(self) -> list[Violation]:
        bound = self.bound
        problems: dict[str, tuple[str, str, str] | None] = {}
        for node in self.loads:
            name = node.id
            if name in problems:
                problem = problems[name]
            else:
                problem = problems[name] = self.rules.name_problem(name, bound)
            if problem is not None:
                self.add(node, problem)
        self.out.sort(key=lambda v: (v.line, v.column))
        return self.out


def _syntax_label(cls: type) -> str:
    return {
        ast.TryStar: "`try/except*` (exception groups)",
        ast.Await: "`await`",
        ast.Lambda: "`lambda`",
    }.get(cls, f"`{cls.__name__}` syntax")


def _on_name(c: _Checker, node: ast.Name) -> None:
    if isinstance(node.ctx, ast.Load):
        c.loads.append(node)
    else:
        c.bind(node, node.id)


def _on_attribute(c: _Checker, node: ast.Attribute) -> None:
    name = node.attr
    problems = c.attribute_problems
    if name in problems:
        problem = problems[name]
    else:
        problem = problems[name] = c.rules.attribute_problem(name)
    if problem is not None:
        c.add(node, problem)


def _on_def(c: _Checker, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
    c.bind(node, node.name)
    if isinstance(node, ast.ClassDef):
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                c.lenient.add(id(stmt))
            elif isinstance(stmt, ast.Assign):
                c.lenient.update(id(t) for t in stmt.targets if isinstance(t, ast.Name))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                c.lenient.add(id(stmt.target))


def _on_arg(c: _Checker, node: ast.arg) -> None:
    c.bind(node, node.arg)


def _on_alias(c: _Checker, node: ast.alias) -> None:
    if node.name != "*":
        for part in node.name.split("."):
            if (
                part in NEVER_GRANTABLE
                or part.startswith(RESERVED_PREFIX)
                or (is_dunder(part) and part not in c.rules.dunders)
            ):
                problem = c.rules.attribute_problem(part)
                if problem is not None:
                    c.add(node, problem, node.name)
    bound = node.asname or node.name.split(".")[0]
    if bound != "*":
        c.bind(node, bound)


def _on_import_from(c: _Checker, node: ast.ImportFrom) -> None:
    for part in (node.module or "").split("."):
        if part and (part in NEVER_GRANTABLE or part.startswith(RESERVED_PREFIX)):
            c.add(node, ("code.name", f"`{part}` is reserved", ""), node.module)


def _on_names_stmt(c: _Checker, node: ast.Global | ast.Nonlocal) -> None:
    for name in node.names:
        c.bind(node, name)


def _on_handler(c: _Checker, node: ast.ExceptHandler) -> None:
    c.bind(node, node.name)


def _on_keyword(c: _Checker, node: ast.keyword) -> None:
    if node.arg is not None and (
        node.arg in NEVER_GRANTABLE or node.arg.startswith(RESERVED_PREFIX)
    ):
        c.add(node, ("code.name", f"the keyword `{node.arg}` is reserved", ""), node.arg)


def _on_constant(c: _Checker, node: ast.Constant) -> None:
    value = node.value
    if type(value) is str and ("_" in value) and (m := _NEVER_IN_TEXT.search(value)):
        c.add(
            node,
            (
                "code.attribute",
                f"a string naming `{m.group(0)}`, which reaches "
                "interpreter internals; no policy can grant it",
                "",
            ),
        )


def _on_match_class(c: _Checker, node: ast.MatchClass) -> None:
    for name in node.kwd_attrs:
        problem = c.rules.attribute_problem(name)
        if problem is not None:
            c.add(node, problem, name)


def _on_match_capture(c: _Checker, node: ast.MatchAs | ast.MatchStar) -> None:
    c.bind(node, node.name)


def _on_match_mapping(c: _Checker, node: ast.MatchMapping) -> None:
    c.bind(node, node.rest)


_SPECIAL: dict[type[ast.AST], Any] = {
    ast.Name: _on_name,
    ast.Attribute: _on_attribute,
    ast.FunctionDef: _on_def,
    ast.AsyncFunctionDef: _on_def,
    ast.ClassDef: _on_def,
    ast.arg: _on_arg,
    ast.alias: _on_alias,
    ast.ImportFrom: _on_import_from,
    ast.Global: _on_names_stmt,
    ast.Nonlocal: _on_names_stmt,
    ast.ExceptHandler: _on_handler,
    ast.keyword: _on_keyword,
    ast.Constant: _on_constant,
    ast.MatchClass: _on_match_class,
    ast.MatchAs: _on_match_capture,
    ast.MatchStar: _on_match_capture,
    ast.MatchMapping: _on_match_mapping,
}


#: `Name` holds no node (its `id` is a name, its `ctx` is skipped): the walk handles it inline.
_NAME_IS_LEAF = _child_fields(ast.Name) == ()

#: node type -> (its handler or None, the fields the walk visits): one look-up per node.
_STEPS: dict[type, tuple[Any, tuple[str, ...]]] = {}


def _step(cls: type) -> tuple[Any, tuple[str, ...]]:
    fields = _CHILD_FIELDS.get(cls)
    if fields is None:
        fields = _CHILD_FIELDS[cls] = _child_fields(cls)
    return _SPECIAL.get(cls), fields


def find_violations(
    tree: ast.AST,
    code_policy: Mapping[str, Any] | Rules,
    *,
    source: str | None = None,
    known_names: Iterable[str] = (),
) -> list[Violation]:
    """Every place `tree` leaves the sub-language, sorted by position. Pure: runs nothing.

    `known_names` are names already defined (a session's earlier calls); they only matter
    when `[code] names` is an allowlist rather than `"*"`.
    """
    rules = compile_rules(code_policy)
    checker = _Checker(rules, source)
    if not rules.any_name:
        checker.bound.update(known_names)
    checker.walk(tree)
    return checker.finish()


def reject(violations: list[Violation], filename: str, policy_name: str = "") -> CodeRejected:
    """Record each violation as a denial and build the one exception that carries them all."""
    for v in violations:
        audit.record(v.to_denial(policy_name))
    first = violations[0]
    count = len(violations)
    listing = "\n".join(f"  {v.describe()}" for v in violations)
    summary = Denial(
        rule=first.rule,
        action="run",
        target=filename,
        policy=policy_name,
        detail=(
            f"the code leaves the policy's sub-language in {count} "
            f"place{'s' if count > 1 else ''}; fix all of them and run it again:\n{listing}\n"
        ),
    )
    exc = CodeRejected(summary, violations=violations)
    exc.filename = filename
    exc.lineno = first.line
    exc.offset = first.column
    exc.text = first.text
    return exc


def check_tree(
    tree: ast.AST,
    code_policy: Mapping[str, Any] | Rules,
    filename: str,
    *,
    source: str | None = None,
    known_names: Iterable[str] = (),
    policy_name: str = "",
) -> None:
    """Raise `CodeRejected` (after recording each violation) if `tree` leaves the sub-language."""
    violations = find_violations(tree, code_policy, source=source, known_names=known_names)
    if violations:
        rules = compile_rules(code_policy)
        raise reject(violations, filename, policy_name or rules.policy_name)
