"""Name resolution and helper inlining for one forward, static, when the surgery runs.

`Scope` says what a name in the forward refers to: closure cells, then globals, then builtins;
names the forward binds itself (`local_names`) are unknown. `inline_helper` turns a call of a
plain function or method whose body is one `return` (DiT's `modulate(x, shift, scale)`) into that
expression with the call's arguments in place, so the matcher sees the AdaLN form inside it.
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
import types
from typing import Any

MISSING = object()


class Scope:
    """Static name resolution for one forward: closure cells, then globals, then builtins; names
    the forward assigns locally are unknown."""

    def __init__(self, fn: types.FunctionType, cls: type, local_names: set[str]) -> None:
        self.fn, self.cls, self.local_names = fn, cls, local_names
        self.cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))

    def lookup(self, name: str) -> Any:
        if name in self.local_names:
            return MISSING
        if name in self.cells:
            try:
                return self.cells[name].cell_contents
            except ValueError:  # empty cell
                return MISSING
        if name in self.fn.__globals__:
            return self.fn.__globals__[name]
        return getattr(builtins, name, MISSING)

    def resolve(self, node: ast.expr) -> Any:
        """The object a Name / dotted Attribute chain refers to, or MISSING."""
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if base is MISSING or not isinstance(base, types.ModuleType):
                return MISSING
            return getattr(base, node.attr, MISSING)
        return MISSING


def local_names(fdef: ast.FunctionDef) -> set[str]:
    """Names `fdef` binds anywhere in it (assignments, arguments, nested defs and classes, imports,
    exception names): a Scope leaves them unresolved."""
    names = set()
    for n in ast.walk(fdef):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fdef:
            names.add(n.name)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
    return names


@functools.lru_cache(maxsize=None)
def _helper_body(fn: types.FunctionType) -> tuple[list[str], dict[str, Any], ast.expr] | None:
    """(parameter names, defaults, the returned expression) of a function whose body is a single
    `return <expr>` (after an optional docstring), or None."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef) or fdef.decorator_list:
        return None
    args = fdef.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs:
        return None
    body = [s for s in fdef.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return None
    params = [a.arg for a in args.args]
    defaults = dict(zip(params[len(params) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()))
    return params, defaults, body[0].value


def _is_pure(node: ast.expr) -> bool:
    """Evaluating it twice or never has no effect: names, constants, attributes of those."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    return isinstance(node, ast.Attribute) and _is_pure(node.value)


def _substitute(node: ast.AST, args: dict[str, ast.expr], at: ast.AST) -> ast.AST:
    """A copy of a helper's expression with its parameters replaced by the call's argument nodes
    (not copied: they keep their place in the forward's source) and positions set to the call's."""
    if isinstance(node, ast.Name) and node.id in args:
        return args[node.id]
    new = type(node)()
    for name, value in ast.iter_fields(node):
        if isinstance(value, ast.AST):
            value = _substitute(value, args, at)
        elif isinstance(value, list):
            value = [_substitute(v, args, at) if isinstance(v, ast.AST) else v for v in value]
        setattr(new, name, value)
    return ast.copy_location(new, at)


def inline_helper(call: ast.Call, scope: Scope, self_name: str) -> ast.expr | None:
    """The expression a call of a one-`return` helper stands for, its parameters replaced by the
    call's arguments; None when `call` is no such helper call or inlining would change what runs."""
    fn, bound_self = _callee_function(call.func, scope, self_name)
    if fn is None:
        return None
    body = _helper_body(fn)
    if body is None:
        return None
    params, defaults, expr = body
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    given = ([bound_self] if bound_self is not None else []) + list(call.args)
    if len(given) > len(params):
        return None
    args = dict(zip(params, given))
    for keyword in call.keywords:
        if keyword.arg not in params or keyword.arg in args:
            return None
        args[keyword.arg] = keyword.value
    for p in params:
        if p not in args:
            if p not in defaults or not isinstance(defaults[p], (int, float, type(None))):
                return None
            args[p] = ast.Constant(defaults[p])
    loads = [n.id for n in ast.walk(expr) if isinstance(n, ast.Name)]
    for p, arg in args.items():
        if loads.count(p) != 1 and not _is_pure(arg):
            return None  # an argument evaluated twice or never would change what the code does
    for name in set(loads) - set(params):  # the helper's other names must mean the same here
        if fn.__globals__.get(name, getattr(builtins, name, MISSING)) is not scope.lookup(name):
            return None
    return _substitute(expr, args, call)


def _callee_function(func: ast.expr, scope: Scope,
                     self_name: str) -> tuple[types.FunctionType | None, ast.expr | None]:
    """(plain function, node bound to its first parameter) for `helper(...)`, `module.helper(...)`
    or `self.method(...)`; (None, None) otherwise."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == self_name:
        attr = inspect.getattr_static(scope.cls, func.attr, None)
        if isinstance(attr, types.FunctionType):
            return attr, func.value
        return None, None
    obj = scope.resolve(func)
    return (obj, None) if isinstance(obj, types.FunctionType) else (None, None)
