"""The code layer's rewrite: checked code runs natively, with budgets and run-time checks.

`rewrite(tree, rules)` edits a checked tree in place so that, while it runs:

1. Every `for` loop and comprehension pulls one token per iteration from the call's shared
   budget iterator (`zip(iterable, budget)`, all in C); `while` loops and `async for` take a
   token per iteration through a call. When the `max_iterations` tokens are used up the next
   pull raises `LimitExceeded` (`code.iterations`).
2. Call depth is the interpreter's own recursion limit, set at the start of each call to the
   current depth plus `max_call_depth`; every function the code defines converts the
   `RecursionError` into `LimitExceeded` (`code.call-depth`). The check costs nothing per call.
3. Names and attributes that reach computed attribute access are routed through checks that
   apply the same rules as the static checker to the name known only at run time:
   `getattr`/`setattr`/`delattr`/`hasattr`, `operator.attrgetter`/`methodcaller`,
   `str.format`/`format_map` field access (`"{0.__class__}"`), `string.Formatter`'s `format`,
   `vformat` and `get_field`, and `AttributeError.obj`. A refusal is `AttributeDenied`.
4. Allocations whose size depends on values: `**` and `<<` on integers (unless the exponent
   or shift is a small constant), `*` with a str/bytes/list/tuple literal on one side, `%`
   formatting with a literal format string that uses `*` or a huge width, f-string format
   specs that are computed or huge, `format()`, and `str.rjust/ljust/center/zfill` widths.
   Above `max_allocation` bytes is `LimitExceeded` (`code.allocation`).

What it does NOT bound: `*` between two values that are not literals (`s * n`), loops inside C
functions (`sum(range(10**12))`, `list(itertools.count())`), lambdas recursing through each
other (their `RecursionError` stays a RecursionError), and string formatting done by library
code (logging's `{`-style formatter). Wall time, CPU and memory limits of the worker and the
OS layer bound those. Granting `__dict__`, `vars` or `globals` lets code reach unchecked
originals (`str.__dict__["format"]`); the presets do not grant them.

The helpers live in `builtins` under reserved `__sbx_*__` names, which the checker refuses in
user code, so user code can neither call nor shadow them.

This module is longer than 600 lines because it is one rewrite (`_Rewriter`) and the
run-time helpers the rewritten code calls: each inserted check and the helper it calls must
be read together (one changed without the other is a hole in the budget).
"""

from __future__ import annotations

import _operator
import _string  # type: ignore[import-not-found]
import ast
import builtins
import itertools
import re
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator

from agent_sandbox._denial import Denial
from agent_sandbox._errors import AttributeDenied, LimitExceeded
from agent_sandbox._worker import audit
from agent_sandbox.guards._code_check import (
    _CHILD_FIELDS,
    Rules,
    _child_fields,
    check_tree,
    compile_rules,
)

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Any, Literal, TypeVar, overload

    _N = TypeVar("_N", bound=ast.AST)

__all__ = [
    "SPECIAL_ATTRIBUTES",
    "CodeCheck",
    "SPECIAL_NAMES",
    "check_code",
    "ensure_installed",
    "make_code_check",
    "rewrite",
    "start_call",
]

#: Names whose value may be a computed-attribute or sizing builtin; loads are routed through
#: `__sbx_name__`, which swaps the builtin for its checked twin and passes anything else through.
SPECIAL_NAMES = frozenset(
    {"getattr", "setattr", "delattr", "hasattr", "attrgetter", "methodcaller", "format", "pow"}
)
#: Attribute names whose reads are routed through `__sbx_attr__` (see the module docstring).
SPECIAL_ATTRIBUTES = SPECIAL_NAMES | frozenset(
    {"format_map", "vformat", "get_field", "obj", "rjust", "ljust", "center", "zfill"}
)

_SMALL_EXPONENT = 64
_SMALL_SHIFT = 4096
_SMALL_REPEAT = 4096
_ZIP = "__sbx_zip__"
_BUDGET = "__sbx_budget__"
_TICK = "__sbx_tick__"
_DUMMY = "__sbx_x__"


# ---------------------------------------------------------------- the rewrite (pure AST)


def _name(id_: str) -> ast.Name:
    return ast.Name(id=id_, ctx=ast.Load())


def _call(func: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=_name(func), args=list(args), keywords=[])


def _at(new: _N, ref: ast.AST) -> _N:
    """Give the new nodes in `new` the position of `ref`.

    The walk stops at nodes that already have a position: those are the original nodes
    the new ones wrap, and their subtrees are placed already.
    """
    line = getattr(ref, "lineno", 1)
    col = getattr(ref, "col_offset", 0)
    end_line = getattr(ref, "end_lineno", line)
    end_col = getattr(ref, "end_col_offset", col)
    stack: list[ast.AST] = [new]
    while stack:
        node = stack.pop()
        if "lineno" in node._attributes:
            if hasattr(node, "lineno"):
                continue
            node.lineno, node.col_offset = line, col  # type: ignore[attr-defined]
            node.end_lineno, node.end_col_offset = end_line, end_col  # type: ignore[attr-defined]
        for field in _fields_of(type(node)):
            value = getattr(node, field, None)
            if type(value) is list:
                stack.extend(v for v in value if isinstance(v, ast.AST))
            elif isinstance(value, ast.AST):
                stack.append(value)
    return new


def _fields_of(cls: type) -> tuple[str, ...]:
    fields = _CHILD_FIELDS.get(cls)
    if fields is None:
        fields = _CHILD_FIELDS[cls] = _child_fields(cls)
    return fields


def _const_int(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return int(node.value)
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub | ast.UAdd)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    ):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    return None


def _is_float(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (float, complex)


def _literal_size(node: ast.AST) -> int | None:
    """Bytes per repetition of a sequence literal, or None when `node` is not one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
        return len(node.value)
    if isinstance(node, ast.List | ast.Tuple):
        return 8 * len(node.elts)
    if isinstance(node, ast.JoinedStr | ast.ListComp):
        return 1
    return None


def _max_number(spec: str) -> int:
    best = 0
    for digits in re.findall(r"\d+", spec):
        best = max(best, int(digits) if len(digits) < 19 else 10**19)
    return best


class _Rewriter:
    def __init__(self, rules: Rules) -> None:
        self.done: set[int] = set()
        self.loops = rules.max_iterations > 0
        self.depth = rules.max_call_depth > 0
        self.limit = rules.max_allocation if rules.max_allocation > 0 else None

    def run(self, root: ast.AST) -> None:
        """Walk once, pre-order, without recursion. A handler runs on each node as it is
        found in its parent's field (in-place handlers return the node itself; the others
        return what takes its place, or a list of statements); then the result's own fields
        are walked. `done` marks original nodes already wrapped, so they are not wrapped twice.
        """
        handlers = _HANDLERS
        stack: list[ast.AST] = [root]
        while stack:
            node = stack.pop()
            for field in _fields_of(type(node)):
                value = getattr(node, field, None)
                if type(value) is list:
                    spliced = False
                    for i, item in enumerate(value):
                        cls = type(item)
                        handler = handlers.get(cls)
                        if handler is None:
                            if cls not in _LEAVES and isinstance(item, ast.AST):
                                stack.append(item)
                            continue
                        if id(item) in self.done:
                            continue
                        out = handler(self, item)
                        if type(out) is list:
                            value[i] = out
                            spliced = True
                            stack.extend(out)
                        elif out is not item or cls is not ast.Name:
                            value[i] = out
                            stack.append(out)
                    if spliced:
                        value[:] = [
                            x for item in value for x in (item if type(item) is list else [item])
                        ]
                elif isinstance(value, ast.AST):
                    cls = type(value)
                    handler = handlers.get(cls)
                    if handler is not None and id(value) not in self.done:
                        out = handler(self, value)
                        if out is value and cls is ast.Name:
                            continue
                        setattr(node, field, out)
                        value = out
                    if cls not in _LEAVES or value.__class__ is not cls:
                        stack.append(value)

    # loops
    def for_(self, node: ast.For) -> ast.AST:
        if self.loops:
            node.iter = _at(_call(_ZIP, node.iter, _name(_BUDGET)), node.iter)
            dummy = ast.Name(id=_DUMMY, ctx=ast.Store())
            node.target = _at(ast.Tuple(elts=[node.target, dummy], ctx=ast.Store()), node.target)
        return node

    def comprehension(self, node: ast.comprehension) -> ast.AST:
        if self.loops:
            if node.is_async:
                node.iter = _at(_call("__sbx_aloop__", node.iter), node.iter)
            else:
                node.iter = _at(_call(_ZIP, node.iter, _name(_BUDGET)), node.iter)
                dummy = ast.Name(id=_DUMMY, ctx=ast.Store())
                node.target = _at(
                    ast.Tuple(elts=[node.target, dummy], ctx=ast.Store()), node.target
                )
        return node

    def async_for(self, node: ast.AsyncFor) -> ast.AST:
        if self.loops:
            node.iter = _at(_call("__sbx_aloop__", node.iter), node.iter)
        return node

    def while_(self, node: ast.While) -> ast.AST:
        if self.loops:
            node.body.insert(0, _at(ast.Expr(value=_call(_TICK)), node))
        return node

    # call depth
    def function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        if not self.depth:
            return node
        body = node.body
        head: list[ast.stmt] = []
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            head, body = body[:1], body[1:]
        if not body:
            return node
        handler = ast.ExceptHandler(
            type=_name("__sbx_recursion_error__"),
            name=None,
            body=[ast.Raise(exc=_call("__sbx_deep__"), cause=ast.Constant(None))],
        )
        guard = ast.Try(body=body, handlers=[handler], orelse=[], finalbody=[])
        node.body = [*head, _at(guard, body[0])]
        return node

    # computed attribute access
    def name(self, node: ast.Name) -> ast.AST:
        if node.id in SPECIAL_NAMES and isinstance(node.ctx, ast.Load):
            self.done.add(id(node))
            return _at(_call("__sbx_name__", node, ast.Constant(node.id)), node)
        return node

    def attribute(self, node: ast.Attribute) -> ast.AST:
        if node.attr in SPECIAL_ATTRIBUTES and isinstance(node.ctx, ast.Load):
            return _at(_call("__sbx_attr__", node.value, ast.Constant(node.attr)), node)
        return node

    def import_from(self, node: ast.ImportFrom) -> Any:
        extra: list[ast.stmt] = []
        for alias in node.names:
            if alias.name in SPECIAL_ATTRIBUTES:
                bound = alias.asname or alias.name
                load = _name(bound)
                self.done.add(id(load))
                value = _call("__sbx_name__", load, ast.Constant(alias.name))
                target = ast.Name(id=bound, ctx=ast.Store())
                extra.append(_at(ast.Assign(targets=[target], value=value), node))
        return [node, *extra] if extra else node

    # allocations
    def binop(self, node: ast.BinOp) -> ast.AST:
        op = node.op
        helper = None
        if isinstance(op, ast.Pow):
            exp = _const_int(node.right)
            if not (
                _is_float(node.right)
                or _is_float(node.left)
                or (exp is not None and exp <= _SMALL_EXPONENT)
            ):
                helper = "__sbx_pow__"
        elif isinstance(op, ast.LShift):
            shift = _const_int(node.right)
            if shift is None or shift > _SMALL_SHIFT:
                helper = "__sbx_lshift__"
        elif isinstance(op, ast.Mult):
            for seq, other in ((node.left, node.right), (node.right, node.left)):
                size = _literal_size(seq)
                if size is None:
                    continue
                count = _const_int(other)
                small = count is not None and (
                    count <= _SMALL_REPEAT
                    or (self.limit is not None and size * count <= self.limit)
                )
                if not small:
                    helper = "__sbx_mul__"
        elif isinstance(op, ast.Mod) and self.limit is not None:
            left = node.left
            if isinstance(left, ast.Constant) and isinstance(left.value, str | bytes):
                text = left.value if isinstance(left.value, str) else left.value.decode("latin-1")
                if "%" in text and ("*" in text or _max_number(text) > self.limit):
                    helper = "__sbx_mod__"
        if helper is None:
            return node
        return _at(_call(helper, node.left, node.right), node)

    def aug_assign(self, node: ast.AugAssign) -> ast.AST:
        if not isinstance(node.target, ast.Name):
            return node
        helper = None
        value = _const_int(node.value)
        if isinstance(node.op, ast.Pow) and not (
            _is_float(node.value) or (value is not None and value <= _SMALL_EXPONENT)
        ):
            helper = "__sbx_ipow__"
        elif isinstance(node.op, ast.LShift) and (value is None or value > _SMALL_SHIFT):
            helper = "__sbx_ilshift__"
        if helper is None:
            return node
        load = ast.Name(id=node.target.id, ctx=ast.Load())
        assign = ast.Assign(targets=[node.target], value=_call(helper, load, node.value))
        return _at(assign, node)

    def formatted(self, node: ast.FormattedValue) -> ast.AST:
        spec = node.format_spec
        if spec is None or self.limit is None:
            return node
        parts = spec.values if isinstance(spec, ast.JoinedStr) else [spec]
        dynamic = any(not isinstance(p, ast.Constant) for p in parts)
        if not dynamic:
            text = "".join(str(p.value) for p in parts if isinstance(p, ast.Constant))
            if _max_number(text) <= self.limit:
                return node
        call = _call("__sbx_format__", node.value, ast.Constant(node.conversion), spec)
        return _at(ast.FormattedValue(value=call, conversion=-1, format_spec=None), node)


# Nodes with no children the rewrite could change: not walked into.
_LEAVES = frozenset({ast.Constant, ast.Name, ast.Pass, ast.Break, ast.Continue, ast.alias})

_HANDLERS: dict[type[ast.AST], Callable[[_Rewriter, Any], Any]] = {
    ast.For: _Rewriter.for_,
    ast.comprehension: _Rewriter.comprehension,
    ast.AsyncFor: _Rewriter.async_for,
    ast.While: _Rewriter.while_,
    ast.FunctionDef: _Rewriter.function,
    ast.AsyncFunctionDef: _Rewriter.function,
    ast.Name: _Rewriter.name,
    ast.Attribute: _Rewriter.attribute,
    ast.ImportFrom: _Rewriter.import_from,
    ast.BinOp: _Rewriter.binop,
    ast.AugAssign: _Rewriter.aug_assign,
    ast.FormattedValue: _Rewriter.formatted,
}


def rewrite(tree: ast.AST, rules: Rules | dict[str, Any]) -> ast.AST:
    """Rewrite a checked tree in place (see the module docstring); returns the same tree."""
    _Rewriter(compile_rules(rules)).run(tree)
    return tree


# ---------------------------------------------------------------- run-time helpers

_rules: Rules | None = None
_recorded: dict[tuple[str, str], Denial] = {}
_orig_getattr = builtins.getattr
_orig_setattr = builtins.setattr
_orig_delattr = builtins.delattr
_orig_hasattr = builtins.hasattr
_orig_format = builtins.format
_orig_pow = builtins.pow
_orig_attrgetter = _operator.attrgetter
_orig_methodcaller = _operator.methodcaller


def _current() -> Rules:
    if _rules is None:  # pragma: no cover - helpers are installed with rules
        raise RuntimeError("the code layer's helpers are not installed")
    return _rules


def _deny(rule: str, action: str, target: str, detail: str, hint: str) -> Denial:
    denial = Denial(rule=rule, action=action, target=target, detail=detail, hint=hint)
    key = (rule, target)
    known = _recorded.get(key)
    if known is None:
        known = _recorded[key] = audit.record(denial)
    return known


def _limit(rule: str, target: str, detail: str, hint: str, action: str) -> LimitExceeded:
    return LimitExceeded(_deny(rule, action, target, detail, hint))


def _vet(name: str, action: str) -> None:
    problem = _current().attribute_problem(name)
    if problem is not None:
        rule, detail, hint = problem
        raise AttributeDenied(_deny(rule, action, name, f"at run time: {detail}", hint))


def _exact(name: Any) -> Any:
    # A str subclass could compare or hash differently from the text getattr finally uses.
    return str.__str__(name) if isinstance(name, str) else name


def _checked_getattr(obj: Any, name: Any, *default: Any) -> Any:
    name = _exact(name)
    if type(name) is str:
        _vet(name, "getattr")
        value = _orig_getattr(obj, name, *default)
        special = _SPECIAL_ATTR.get(name)
        return value if special is None else special(_owner(obj), value)
    return _orig_getattr(obj, name, *default)


def _checked_setattr(obj: Any, name: Any, value: Any) -> None:
    name = _exact(name)
    if type(name) is str:
        _vet(name, "setattr")
    _orig_setattr(obj, name, value)


def _checked_delattr(obj: Any, name: Any) -> None:
    name = _exact(name)
    if type(name) is str:
        _vet(name, "delattr")
    _orig_delattr(obj, name)


def _checked_hasattr(obj: Any, name: Any) -> bool:
    name = _exact(name)
    if type(name) is str:
        try:
            _vet(name, "hasattr")
        except AttributeDenied:
            return False
    return _orig_hasattr(obj, name)


def _dotted(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = _checked_getattr(obj, part)
    return obj


def _checked_attrgetter(attr: Any, *more: Any) -> Callable[[Any], Any]:
    paths = tuple(_exact(a) for a in (attr, *more))
    for path in paths:
        if type(path) is not str:
            raise TypeError("attribute name must be a string")
        for part in path.split("."):
            _vet(part, "attrgetter")
    if not any(p in SPECIAL_ATTRIBUTES for path in paths for p in path.split(".")):
        getter: Callable[[Any], Any] = _orig_attrgetter(*paths)
        return getter
    if len(paths) == 1:
        return lambda obj: _dotted(obj, paths[0])
    return lambda obj: tuple(_dotted(obj, p) for p in paths)


def _checked_methodcaller(name: Any, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
    name = _exact(name)
    if type(name) is not str:
        raise TypeError("method name must be a string")
    _vet(name, "methodcaller")
    if name in SPECIAL_ATTRIBUTES:
        return lambda obj: _checked_getattr(obj, name)(*args, **kwargs)
    caller: Callable[[Any], Any] = _orig_methodcaller(name, *args, **kwargs)
    return caller


def _too_big(size: int, what: str) -> None:
    limit = _current().max_allocation
    if limit > 0 and size > limit:
        raise _limit(
            "code.allocation",
            what,
            f"an allocation of about {size} bytes exceeds the code budget max_allocation = {limit}",
            f"[code.budgets] max_allocation = {size + 1}",
            "allocate",
        )


def _vet_spec(spec: Any) -> None:
    if isinstance(spec, str | bytes) and spec:
        text = spec if isinstance(spec, str) else spec.decode("latin-1")
        _too_big(_max_number(text), f"format width {text!r}")


def _vet_format_string(fmt: Any, depth: int = 0, args: Any = (), kwargs: Any = None) -> None:
    if not isinstance(fmt, str) or "{" not in fmt:
        return
    try:
        parsed = list(_string.formatter_parser(str.__str__(fmt)))
    except ValueError:
        return  # the real call raises the same error
    for _literal, field, spec, _conv in parsed:
        if field:
            try:
                _first, rest = _string.formatter_field_name_split(field)
                parts = list(rest)
            except ValueError:
                return
            for is_attr, key in parts:
                if is_attr:
                    _vet(key, "format field")
        if spec:
            if "{" in spec and depth < 2:
                _vet_format_string(spec, depth + 1)
                # A nested `{}` takes the width from the arguments: vet the integer ones.
                values = [*args, *(kwargs.values() if isinstance(kwargs, dict) else ())]
                for item in values:
                    if isinstance(item, int):
                        _too_big(int(item), f"format width {item}")
            else:
                _vet_spec(spec)


def _checked_format(value: Any, spec: Any = "") -> str:
    _vet_spec(spec)
    return _orig_format(value, spec)


def _checked_pow(base: Any, exp: Any, mod: Any = None) -> Any:
    if mod is None:
        return _pow(base, exp)
    return _orig_pow(base, exp, mod)


_CHECKED_BUILTINS: dict[str, tuple[Any, Any]] = {
    "getattr": (_orig_getattr, _checked_getattr),
    "setattr": (_orig_setattr, _checked_setattr),
    "delattr": (_orig_delattr, _checked_delattr),
    "hasattr": (_orig_hasattr, _checked_hasattr),
    "format": (_orig_format, _checked_format),
    "pow": (_orig_pow, _checked_pow),
    "attrgetter": (_orig_attrgetter, _checked_attrgetter),
    "methodcaller": (_orig_methodcaller, _checked_methodcaller),
}


def _swap(name: str, value: Any) -> Any:
    entry = _CHECKED_BUILTINS.get(name)
    if entry is not None and value is entry[0]:
        return entry[1]
    for orig, checked in _CHECKED_BUILTINS.values():
        if value is orig:
            return checked
    return value


def _sbx_name(value: Any, name: str) -> Any:
    return _swap(name, value)


def _formatter_cls() -> type | None:
    module = sys.modules.get("string")
    cls = getattr(module, "Formatter", None) if module is not None else None
    return cls if isinstance(cls, type) else None


def _is_formatter(obj: Any) -> tuple[bool, bool]:
    """(is a Formatter, is the class itself rather than an instance)."""
    cls = _formatter_cls()
    if cls is None:
        return False, False
    if isinstance(obj, type):
        return issubclass(obj, cls), True
    return isinstance(obj, cls), False


def _wrap_format(obj: Any, value: Any) -> Any:
    if value is _orig_format:
        return _checked_format
    if isinstance(obj, str):

        def bound(*args: Any, **kwargs: Any) -> Any:
            _vet_format_string(obj, args=args, kwargs=kwargs)
            return value(*args, **kwargs)

        return bound
    unbound_str = isinstance(obj, type) and issubclass(obj, str)
    formatter, is_class = _is_formatter(obj)
    if unbound_str or formatter:
        skip = 1 if (formatter and is_class) else 0

        def checked(*args: Any, **kwargs: Any) -> Any:
            if len(args) > skip:
                _vet_format_string(args[skip], args=args[skip + 1 :], kwargs=kwargs)
            return value(*args, **kwargs)

        return checked
    return value


def _wrap_formatter_method(obj: Any, value: Any, field: bool) -> Any:
    formatter, is_class = _is_formatter(obj)
    if not formatter:
        return value
    skip = 1 if is_class else 0

    def checked(*args: Any, **kwargs: Any) -> Any:
        if len(args) > skip:
            if field and isinstance(args[skip], str):
                _vet_format_string("{" + args[skip] + "}")
            else:
                _vet_format_string(args[skip])
        return value(*args, **kwargs)

    return checked


def _wrap_obj(obj: Any, value: Any) -> Any:
    if isinstance(obj, AttributeError):
        raise AttributeDenied(
            _deny(
                "code.attribute",
                "getattr",
                "AttributeError.obj",
                "the object behind an AttributeError is not readable in the sub-language",
                "",
            )
        )
    return value


def _wrap_width(obj: Any, value: Any) -> Any:
    if not isinstance(obj, str | bytes | bytearray):
        return value

    def checked(width: Any, *args: Any) -> Any:
        if isinstance(width, int):
            _too_big(int(width), f"{type(obj).__name__} padded to {width}")
        return value(width, *args)

    return checked


_SPECIAL_ATTR: dict[str, Callable[[Any, Any], Any]] = {
    "format": _wrap_format,
    "format_map": _wrap_format,
    "vformat": lambda o, v: _wrap_formatter_method(o, v, field=False),
    "get_field": lambda o, v: _wrap_formatter_method(o, v, field=True),
    "obj": _wrap_obj,
    "rjust": _wrap_width,
    "ljust": _wrap_width,
    "center": _wrap_width,
    "zfill": _wrap_width,
}


def _swapper(name: str) -> Callable[[Any, Any], Any]:
    return lambda _obj, value: _swap(name, value)


for _n in ("getattr", "setattr", "delattr", "hasattr", "pow", "attrgetter", "methodcaller"):
    _SPECIAL_ATTR[_n] = _swapper(_n)


def _owner(obj: Any) -> Any:
    # `super().get_field` is bound to the instance (or class) behind the super object.
    if type(obj) is super:
        inner = obj.__self__  # type: ignore[attr-defined]
        return obj if inner is None else inner
    return obj


def _sbx_attr(obj: Any, name: str) -> Any:
    value = _orig_getattr(obj, name)
    return _SPECIAL_ATTR[name](_owner(obj), value)


def _int_bits(value: Any) -> int | None:
    return int.bit_length(value) if isinstance(value, int) else None


def _pow(base: Any, exp: Any) -> Any:
    if isinstance(exp, int) and exp > _SMALL_EXPONENT:
        bits = _int_bits(base)
        if bits is not None and bits > 1:
            _too_big(bits * int(exp) // 8, f"{type(base).__name__} ** {exp}")
    return base**exp


def _lshift(value: Any, shift: Any) -> Any:
    if isinstance(shift, int) and shift > _SMALL_SHIFT:
        bits = _int_bits(value)
        if bits:
            _too_big((bits + int(shift)) // 8, f"int << {shift}")
    return value << shift


def _ipow(value: Any, exp: Any) -> Any:
    _pow_check(value, exp)
    value **= exp
    return value


def _pow_check(base: Any, exp: Any) -> None:
    if isinstance(exp, int) and exp > _SMALL_EXPONENT:
        bits = _int_bits(base)
        if bits is not None and bits > 1:
            _too_big(bits * int(exp) // 8, f"{type(base).__name__} ** {exp}")


def _ilshift(value: Any, shift: Any) -> Any:
    if isinstance(shift, int) and shift > _SMALL_SHIFT:
        bits = _int_bits(value)
        if bits:
            _too_big((bits + int(shift)) // 8, f"int << {shift}")
    value <<= shift
    return value


def _seq_bytes(seq: Any) -> int:
    if isinstance(seq, str | bytes | bytearray):
        return len(seq)
    if isinstance(seq, list | tuple):
        return 8 * len(seq)
    return 0


def _mul(left: Any, right: Any) -> Any:
    if isinstance(right, int):
        seq, count = left, right
    elif isinstance(left, int):
        seq, count = right, left
    else:
        return left * right
    if count > 1:
        per = _seq_bytes(seq)
        if per:
            _too_big(per * int(count), f"{type(seq).__name__} * {count}")
    return left * right


_PERCENT = re.compile(r"%(\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def _mod(fmt: Any, args: Any) -> Any:
    if isinstance(fmt, str | bytes):
        text = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
        values = args if isinstance(args, tuple) else (args,)
        index = 0
        for match in _PERCENT.finditer(text):
            key, width, precision, conv = match.groups()
            if conv == "%":
                continue
            for part in (width, precision):
                if part == "*":
                    size = values[index] if index < len(values) else 0
                    index += 1
                    if isinstance(size, int):
                        _too_big(int(size), f"format width {size}")
                elif part:
                    _too_big(_max_number(part), f"format width {part}")
            if key is None:
                index += 1
    return fmt % args


def _format_value(value: Any, conversion: int, spec: str) -> str:
    if conversion == ord("r"):
        value = repr(value)
    elif conversion == ord("s"):
        value = str(value)
    elif conversion == ord("a"):
        value = ascii(value)
    _vet_spec(spec)
    return _orig_format(value, spec)


class _Exhausted:
    """The end of the iteration budget: pulling from it raises `LimitExceeded`."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        raise _limit(
            "code.iterations",
            "loop iterations",
            f"the call ran more than {self.budget} loop iterations "
            f"(code budget max_iterations = {self.budget})",
            f"[code.budgets] max_iterations = {self.budget * 10}",
            "loop",
        )


def _deep() -> LimitExceeded:
    # Runs at the recursion limit: if even this frame does not fit, the RecursionError goes
    # to the next outer frame's handler, which calls here again one level up. Once this line
    # runs, the limit is lifted briefly so recording the denial has room, then restored.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 100)
    try:
        depth = _current().max_call_depth
        return _limit(
            "code.call-depth",
            "call depth",
            f"calls nested deeper than {depth} frames (code budget max_call_depth = {depth})",
            f"[code.budgets] max_call_depth = {min(depth * 2, 10_000)}",
            "call",
        )
    finally:
        sys.setrecursionlimit(limit)


async def _aloop(source: AsyncIterable[Any]) -> AsyncIterator[Any]:
    async for item in source:
        builtins.__sbx_tick__()  # type: ignore[attr-defined]
        yield item


_HELPERS: dict[str, Any] = {
    _ZIP: zip,
    "__sbx_aloop__": _aloop,
    "__sbx_deep__": _deep,
    "__sbx_recursion_error__": RecursionError,
    "__sbx_name__": _sbx_name,
    "__sbx_attr__": _sbx_attr,
    "__sbx_pow__": _pow,
    "__sbx_lshift__": _lshift,
    "__sbx_ipow__": _ipow,
    "__sbx_ilshift__": _ilshift,
    "__sbx_mul__": _mul,
    "__sbx_mod__": _mod,
    "__sbx_format__": _format_value,
}


def _new_budget(rules: Rules, namespace: dict[str, Any] | None = None) -> None:
    n = rules.max_iterations
    budget: Iterator[Any] = (
        itertools.chain(itertools.repeat(None, n), _Exhausted(n))
        if n > 0
        else itertools.repeat(None)
    )
    fresh = {_BUDGET: budget, _TICK: budget.__next__}
    targets: list[dict[str, Any]] = [builtins.__dict__]
    # The guards give the user namespace its own copy of builtins: refresh that one too.
    own = namespace.get("__builtins__") if namespace is not None else None
    if isinstance(own, dict):
        targets.append(own)
    elif own is not None and own is not builtins:
        targets.append(own.__dict__)
    for target in targets:
        # Every helper put back (one C-level update: the same as comparing each first).
        target.update(_HELPERS)
        target.update(fresh)


def ensure_installed(rules: Rules) -> None:
    """Install the helpers in `builtins` for `rules` (cheap when already installed)."""
    global _rules
    _rules = rules
    if getattr(builtins, "__sbx_name__", None) is not _sbx_name:
        for key, value in _HELPERS.items():
            setattr(builtins, key, value)
    if not hasattr(builtins, _BUDGET):
        _new_budget(rules)


def start_call(
    rules: Rules, *, set_depth: bool = True, namespace: dict[str, Any] | None = None
) -> None:
    """Begin one call: a fresh iteration budget, and the recursion limit for the call depth.

    The recursion limit becomes the current depth plus `max_call_depth` plus a margin for the
    worker's own frames between here and the user code.
    """
    ensure_installed(rules)
    _recorded.clear()
    _new_budget(rules, namespace)
    if set_depth and rules.max_call_depth > 0:
        depth = 0
        frame = sys._getframe()
        while frame is not None:
            depth += 1
            frame = frame.f_back  # type: ignore[assignment]
        sys.setrecursionlimit(depth + 30 + rules.max_call_depth)


class CodeCheck:
    """The worker's hook 5a: `check(code, tree)` checks the parsed cell and rewrites it in place.

    Each call: (1) a fresh iteration budget and the recursion limit for the call depth
    (`start()`), (2) the static check (names already defined in the session count as
    bound), (3) the rewrite. `CodeRejected` propagates to the runner, which reports it.

    `pure` says whether the outcome of (2) and (3) depends on the cell's text alone: true
    unless `[code] names` is an allowlist (then the session's names count too). Where it
    is, the runner may reuse what it compiled for an identical, accepted cell, and then
    calls only `start()`.
    """

    def __init__(self, rules: Rules, namespace: dict[str, Any]) -> None:
        self.rules = rules
        self.namespace = namespace
        self.pure = rules.any_name

    def start(self) -> None:
        start_call(self.rules, namespace=self.namespace)

    def __call__(self, code: str, tree: ast.Module) -> None:
        start_call(self.rules, namespace=self.namespace)
        check_tree(tree, self.rules, "<cell>", source=code, known_names=self.namespace.keys())
        _Rewriter(self.rules).run(tree)


def make_code_check(
    code_policy: dict[str, Any], namespace: dict[str, Any], policy_name: str = ""
) -> CodeCheck:
    """The worker's code-layer hook for one session namespace (see `CodeCheck`)."""
    rules = compile_rules(code_policy, policy_name)
    ensure_installed(rules)
    return CodeCheck(rules, namespace)


if TYPE_CHECKING:  # (the overloads are for type checkers only)

    @overload
    def check_code(
        source: str | bytes,
        code_policy: Mapping[str, Any] | Rules,
        filename: str = ...,
        *,
        mode: Literal["exec"] = ...,
        known_names: Iterable[str] = ...,
        policy_name: str = ...,
    ) -> ast.Module: ...

    @overload
    def check_code(
        source: str | bytes,
        code_policy: Mapping[str, Any] | Rules,
        filename: str = ...,
        *,
        mode: Literal["eval"],
        known_names: Iterable[str] = ...,
        policy_name: str = ...,
    ) -> ast.Expression: ...

    @overload
    def check_code(
        source: str | bytes,
        code_policy: Mapping[str, Any] | Rules,
        filename: str = ...,
        *,
        mode: Literal["single"],
        known_names: Iterable[str] = ...,
        policy_name: str = ...,
    ) -> ast.Interactive: ...


def check_code(
    source: str | bytes,
    code_policy: Mapping[str, Any] | Rules,
    filename: str = "<string>",
    *,
    mode: str = "exec",
    known_names: Iterable[str] = (),
    policy_name: str = "",
) -> ast.Module | ast.Expression | ast.Interactive:
    """Parse `source`, check it, and return the tree rewritten to run under budgets.

    1. Parse with `mode` (`exec`, `eval` or `single`); a parse error is the ordinary
       `SyntaxError`, exactly as plain Python would raise it.
    2. Check against the policy's sub-language; every violation is recorded as a denial and
       `CodeRejected` carries them all.
    3. Rewrite (this module) so computed attribute access, loops, call depth and
       large allocations are checked while it runs; compile the returned tree as usual. The
       runtime helpers are installed in `builtins` on first use.
    """
    text = source.decode("utf-8") if isinstance(source, bytes) else source
    tree = ast.parse(text, filename, mode)
    rules = compile_rules(code_policy, policy_name)
    check_tree(tree, rules, filename, source=text, known_names=known_names)
    ensure_installed(rules)
    rewrite(tree, rules)
    return tree  # type: ignore[return-value]
