"""Recognise AdaLN idioms in forwards no pattern knows, and rewrite them to the fused op.

Mechanism: an AST rewrite of the module class's `forward` source. The source is parsed, every
expression that computes `norm(x') * (1 + scale) + shift` is found (forms below), each one is
replaced by a call to a `FusedSite` (which runs the fused op, or the same expression eagerly where
the op cannot reproduce it), and the new function is compiled with the forward's globals,
closure cells (`super()` included) and defaults, then bound on the instance. Everything else in
the forward runs as written, data-dependent control flow included (what torch.fx cannot trace).

Recognised (x' = x, x.float(), x.to(dtype), x.type_as(t); casts also on the norm output and on
the whole expression):
    norm(x') * (1 + scale) + shift          any operand order, `1` or `1.0`, `(1 + scale)[:, None]`
    torch.addcmul(shift, norm(x'), 1 + scale), shift.addcmul(...)
    helper(norm(x'), shift, scale)          a plain function (or method) whose body is one
                                            `return` of a recognised form, e.g. DiT's `modulate`
    h = norm(x'); ... h * (1 + scale) + shift   when `h` is used only there
norm is a submodule `self.<attr>` that is, per instance, an nn.LayerNorm over the last dim (or a
checked fp32 LayerNorm subclass), or `F.layer_norm` / `torch.layer_norm`. Not recognised: RMSNorm
and other norms, `- shift`, `* scale` without `1 +`, `scale` computed as `1 + s` in an earlier
statement, norms under another name than `self.<attr>`, decorated forwards. docs/surgery.md has
the whole list and how rewrites are verified (surgery/verify.py).
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_adaptiveload.ops.adaln import FLOAT_DTYPES
from lightning_adaptiveload.surgery import verify
from lightning_adaptiveload.surgery.core import (
    UPCAST_LAYER_NORMS,
    SurgeryReport,
    adaln_any_stride,
    modulation_fallback_reason,
    norm_reason,
    upcast_fallback_reason,
    warn_once,
)

SITES_NAME = "_fused_adaln_sites"  # the closure variable the rewritten forward reads its sites from
_LAYER_NORMS = (torch.nn.functional.layer_norm, torch.layer_norm)
_LAYER_NORM_ARGS = ("input", "normalized_shape", "weight", "bias", "eps")
_LAYER_NORM_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5}
_STATIC_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}
_MISSING = object()
_MAX_HELPER_DEPTH = 3
_TEXT_WIDTH = 90


# --- what a site is --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cast:
    """A dtype cast in a site: `t.float()` (method, no role), `t.to(D)` / `t.to(dtype=D)` /
    `t.type_as(T)` (the argument is the leaf `role`)."""

    method: str
    role: str | None = None
    keyword: bool = False

    def apply(self, t: Tensor, values: dict[str, Any]) -> Tensor:
        if self.role is None:
            return getattr(t, self.method)()
        arg = values[self.role]
        return t.to(dtype=arg) if self.keyword else getattr(t, self.method)(arg)

    def dtype(self, values: dict[str, Any], like: Tensor) -> torch.dtype | None:
        """The dtype this cast produces, or None when it is not a pure dtype cast (a device, a
        tensor on another device)."""
        if self.role is None:
            return _STATIC_CASTS[self.method]
        arg = values[self.role]
        if isinstance(arg, torch.dtype):
            return arg
        if isinstance(arg, Tensor) and arg.device == like.device:
            return arg.dtype
        return None


class FusedSite:
    """One rewritten AdaLN expression; the rewritten forward calls it with the expression's
    operands (leaves) in their source order.

    Eager semantics (the fallback, and what the fused op reproduces):
        h = norm(cast_in(x)); y = cast_mid(h) * (1 + scale) + shift   (or torch.addcmul); cast_out(y)
    The op computes in fp32 and writes x.dtype; it runs when the eager result has x's dtype and
    the norm computes in x's dtype or fp32 (see `fallback_reason`), else the eager expression runs
    for that call with one warning per reason.
    """

    def __init__(self, roles: tuple[str, ...], casts: dict[str, Cast], addcmul: bool, one: float,
                 layer_norm: Callable | None, where: str) -> None:
        self.roles = roles
        self.casts = casts
        self.addcmul = addcmul
        self.one = one
        self.layer_norm = layer_norm  # F.layer_norm / torch.layer_norm for functional sites, None for a module norm
        self.where = where

    def __call__(self, *leaves: Any) -> Any:
        values = dict(zip(self.roles, leaves))
        reason = self.fallback_reason(values)
        if reason is None:
            return self.fused(values)
        warn_once(f"fused AdaLN: eager fallback at {self.where} for {reason}")
        return self.eager(values)

    def _norm_params(self, values: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
        """(normalized_shape, weight, bias, eps) of the norm."""
        if self.layer_norm is None:
            norm = values["norm"]
            return tuple(norm.normalized_shape), norm.weight, norm.bias, norm.eps
        given = {k: values[k] if k in values else _LAYER_NORM_DEFAULTS.get(k) for k in _LAYER_NORM_ARGS[1:]}
        return given["normalized_shape"], given["weight"], given["bias"], given["eps"]

    def eager(self, values: dict[str, Any]) -> Any:
        h = values["x"]
        if "in" in self.casts:
            h = self.casts["in"].apply(h, values)
        if self.layer_norm is None:
            h = values["norm"](h)
        else:
            h = self.layer_norm(h, *self._norm_params(values))
        if "mid" in self.casts:
            h = self.casts["mid"].apply(h, values)
        factor = self.one + values["scale"]
        y = torch.addcmul(values["shift"], h, factor) if self.addcmul else h * factor + values["shift"]
        if "out" in self.casts:
            y = self.casts["out"].apply(y, values)
        return y

    def fused(self, values: dict[str, Any]) -> Tensor:
        _shape, weight, bias, eps = self._norm_params(values)
        return adaln_any_stride(values["x"], values["shift"], values["scale"], weight, bias, eps)

    def fallback_reason(self, values: dict[str, Any]) -> str | None:
        """Why the fused op cannot reproduce this call's eager result, or None."""
        x = values["x"]
        reason = upcast_fallback_reason(x)
        if reason is not None:
            return reason
        norm_dtype = self.casts["in"].dtype(values, x) if "in" in self.casts else x.dtype
        if norm_dtype is None:
            return "a cast of x that is not a dtype cast"
        if norm_dtype not in (x.dtype, torch.float32):
            return f"the norm computing in {norm_dtype} for x in {x.dtype} (the fused op computes in fp32)"
        if self.layer_norm is None and not isinstance(values["norm"], nn.LayerNorm):
            return f"the norm being a {type(values['norm']).__name__} now"
        shape, weight, bias, eps = self._norm_params(values)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if shape != (x.shape[-1],):
            return f"normalized_shape {shape} for x of shape {tuple(x.shape)} (the fused op normalizes the last dim)"
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and (not isinstance(p, Tensor) or p.dtype not in FLOAT_DTYPES):
                return f"norm {name} of type {getattr(p, 'dtype', type(p).__name__)}"
        if not isinstance(eps, (int, float)) or not eps > 0:
            return f"eps {eps!r}"
        shift, scale = values["shift"], values["scale"]
        if not (isinstance(shift, Tensor) and isinstance(scale, Tensor)):
            return f"shift/scale of types {type(shift).__name__}/{type(scale).__name__}"
        dtype = self.casts["mid"].dtype(values, x) if "mid" in self.casts else norm_dtype
        if dtype is None:
            return "a cast of the norm output that is not a dtype cast"
        dtype = torch.promote_types(torch.promote_types(dtype, scale.dtype), shift.dtype)
        if "out" in self.casts:
            dtype = self.casts["out"].dtype(values, x)
            if dtype is None:
                return "a cast of the result that is not a dtype cast"
        return modulation_fallback_reason(x, shift, scale, result_dtype=dtype)  # x was checked above


@dataclass
class _Match:
    """A site found in the AST: its leaves (role, node), casts and form."""

    leaves: list[tuple[str, ast.expr]] = field(default_factory=list)
    casts: dict[str, tuple[str, ast.expr | None, bool]] = field(default_factory=dict)  # where -> (method, arg, keyword)
    addcmul: bool = False
    one: float = 1
    norm_attr: str | None = None  # "norm1" for self.norm1(...); None for F.layer_norm
    layer_norm: Callable | None = None
    inline_def: tuple[list, ast.stmt] | None = None  # `h = norm(x)` statement removed when fused
    structural: list[ast.AST] = field(default_factory=list)  # nodes consumed by the match (not leaves)
    refusal: str | None = None


@dataclass(frozen=True)
class SiteInfo:
    """What the report says about one site."""

    key: tuple[int, int, int, int]  # source position of the root expression
    line: int
    text: str
    norm_attr: str | None
    refusal: str | None

    def describe(self) -> str:
        return f"line {self.line}: {self.text}"


@dataclass
class _Def:
    """`name = <norm call>` whose value is read once, at `load` (a site's normed operand), or why not."""

    value: ast.expr
    stmts: list
    stmt: ast.stmt
    refusal: str | None = None


# --- name resolution and helpers ---------------------------------------------------------------------
class _Scope:
    """Static name resolution for one forward: closure cells, then globals, then builtins; names
    the forward assigns locally are unknown."""

    def __init__(self, fn: types.FunctionType, cls: type, local_names: set[str]) -> None:
        self.fn, self.cls, self.local_names = fn, cls, local_names
        self.cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))

    def lookup(self, name: str) -> Any:
        if name in self.local_names:
            return _MISSING
        if name in self.cells:
            try:
                return self.cells[name].cell_contents
            except ValueError:  # empty cell
                return _MISSING
        if name in self.fn.__globals__:
            return self.fn.__globals__[name]
        return getattr(builtins, name, _MISSING)

    def resolve(self, node: ast.expr) -> Any:
        """The object a Name / dotted Attribute chain refers to, or _MISSING."""
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if base is _MISSING or not isinstance(base, types.ModuleType):
                return _MISSING
            return getattr(base, node.attr, _MISSING)
        return _MISSING


def local_names(fdef: ast.FunctionDef) -> set[str]:
    """Names `fdef` binds anywhere in it (assignments, arguments, nested defs and classes, imports,
    exception names): a _Scope leaves them unresolved."""
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


def inline_helper(call: ast.Call, scope: _Scope, self_name: str) -> ast.expr | None:
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
        if fn.__globals__.get(name, getattr(builtins, name, _MISSING)) is not scope.lookup(name):
            return None
    return _substitute(expr, args, call)


def _callee_function(func: ast.expr, scope: _Scope,
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


def _dotted(node: ast.expr, self_name: str) -> str | None:
    """'norm1' for `self.norm1`, 'block.norm' for `self.block.norm`; None otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == self_name and parts:
        return ".".join(reversed(parts))
    return None


def _is_one(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and not isinstance(node.value, bool)
            and isinstance(node.value, (int, float)) and node.value == 1)


def _one_plus(node: ast.expr) -> tuple[ast.expr, float, list[ast.AST]] | None:
    """(scale, the constant 1 or 1.0, the nodes consumed) for `1 + scale`, `scale + 1`,
    `(1 + scale)[:, None]` or `(1 + scale).unsqueeze(k)`; the indexing moves onto scale."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        for one, scale in ((node.left, node.right), (node.right, node.left)):
            if _is_one(one):
                return scale, one.value, [node, one]
        return None
    if isinstance(node, ast.Subscript) and _is_view_index(node.slice):
        found = _one_plus(node.value)
        if found is not None:
            scale, one, nodes = found
            return ast.copy_location(ast.Subscript(value=scale, slice=node.slice, ctx=ast.Load()), node), one, nodes + [node]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unsqueeze"
            and len(node.args) + len(node.keywords) == 1):
        found = _one_plus(node.func.value)
        if found is not None:
            scale, one, nodes = found
            call = ast.Call(func=ast.Attribute(value=scale, attr="unsqueeze", ctx=ast.Load()), args=node.args,
                            keywords=node.keywords)
            return ast.copy_location(call, node), one, nodes + [node]
    return None


def _is_view_index(node: ast.expr) -> bool:
    """`[:, None]`, `[None]`, `[..., None, :]`: only new axes and full slices (commute with `1 +`)."""
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    for item in items:
        full_slice = isinstance(item, ast.Slice) and item.lower is None and item.upper is None and item.step is None
        if not (full_slice or (isinstance(item, ast.Constant) and item.value in (None, Ellipsis))):
            return False
    return True


# --- matching ---------------------------------------------------------------------------------------
def cast_of(node: ast.expr) -> tuple[ast.expr, tuple[str, ast.expr | None, bool]] | None:
    """(operand, (method, arg, keyword)) for a dtype cast call, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    method, args, kws = node.func.attr, node.args, node.keywords
    if method in _STATIC_CASTS and not args and not kws:
        return node.func.value, (method, None, False)
    if method in ("to", "type_as") and len(args) == 1 and not kws and not isinstance(args[0], ast.Starred):
        return node.func.value, (method, args[0], False)
    if method == "to" and not args and len(kws) == 1 and kws[0].arg == "dtype":
        return node.func.value, (method, kws[0].value, True)
    return None


def norm_call(node: ast.expr, scope: _Scope, self_name: str) -> str | None:
    """'module' for `self.<attr>(x)`, 'functional' for F.layer_norm / torch.layer_norm, else None."""
    if not isinstance(node, ast.Call):
        return None
    if _dotted(node.func, self_name) is not None:
        return "module" if len(node.args) == 1 and not node.keywords and not isinstance(node.args[0], ast.Starred) else None
    return "functional" if scope.resolve(node.func) in _LAYER_NORMS else None


class _Matcher:
    """Matches one expression against the recognised forms (module docstring)."""

    def __init__(self, scope: _Scope, self_name: str, defs: dict[int, _Def]) -> None:
        self.scope, self.self_name, self.defs = scope, self_name, defs

    def match(self, node: ast.expr) -> _Match | None:
        match = _Match()
        expr = self._expand(node, match, 0)
        return self._site(expr, match) if expr is not None else None

    # helpers: modulate(norm(x), shift, scale) -> the helper's expression with the arguments in place
    def _expand(self, node: ast.expr, match: _Match, depth: int) -> ast.expr | None:
        if depth > _MAX_HELPER_DEPTH:
            return None
        inlined = inline_helper(node, self.scope, self.self_name) if isinstance(node, ast.Call) else None
        if inlined is not None:
            match.structural.append(node)
            return self._expand(inlined, match, depth + 1)
        cast = cast_of(node)
        if cast is not None and isinstance(cast[0], ast.Call):
            inner = self._expand(cast[0], match, depth)
            if inner is not cast[0]:
                rebuilt = ast.copy_location(ast.Call(func=ast.Attribute(value=inner, attr=node.func.attr, ctx=ast.Load()),
                                                     args=node.args, keywords=node.keywords), node)
                match.structural.append(node)
                return rebuilt
        return node

    def _peel(self, node: ast.expr, where: str, match: _Match) -> ast.expr:
        cast = cast_of(node)
        if cast is None:
            return node
        match.casts[where] = cast[1]
        match.structural.append(node)
        return cast[0]

    def _site(self, expr: ast.expr, match: _Match) -> _Match | None:
        core = self._peel(expr, "out", match)
        parts = self._sum(core, match)
        if parts is None:
            return None
        normed, scale, shift = parts
        match.leaves += [("scale", scale), ("shift", shift)]
        normed = self._peel(normed, "mid", match)
        return match if self._norm(normed, match) else None

    def _sum(self, node: ast.expr, match: _Match) -> tuple[ast.expr, ast.expr, ast.expr] | None:
        """(normed, scale, shift) of `normed * (1 + scale) + shift` or `addcmul(shift, normed, 1 + scale)`."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for product, shift in ((node.left, node.right), (node.right, node.left)):
                if isinstance(product, ast.BinOp) and isinstance(product.op, ast.Mult):
                    pair = self._pair(product.left, product.right, match)
                    if pair is not None:
                        match.structural += [node, product]
                        return pair[0], pair[1], shift
            return None
        if isinstance(node, ast.Call) and not any(k.arg != "value" for k in node.keywords):
            if any(k.arg == "value" and not _is_one(k.value) for k in node.keywords):
                return None
            func = node.func
            if self.scope.resolve(func) is torch.addcmul and len(node.args) == 3:
                shift, t1, t2 = node.args
            elif isinstance(func, ast.Attribute) and func.attr == "addcmul" and len(node.args) == 2 \
                    and self.scope.resolve(func) is _MISSING:
                shift, (t1, t2) = func.value, node.args
            else:
                return None
            pair = self._pair(t1, t2, match)
            if pair is None:
                return None
            match.addcmul = True
            match.structural.append(node)
            return pair[0], pair[1], shift
        return None

    def _pair(self, a: ast.expr, b: ast.expr, match: _Match) -> tuple[ast.expr, ast.expr] | None:
        """(normed, scale) where one operand is `1 + scale`, the other a (cast) norm output."""
        for normed, factor in ((a, b), (b, a)):
            found = _one_plus(factor)
            if found is not None and self._looks_normed(normed):
                scale, match.one, nodes = found
                match.structural += nodes
                return normed, scale
        return None

    def _looks_normed(self, node: ast.expr) -> bool:
        cast = cast_of(node)
        node = cast[0] if cast is not None else node
        if isinstance(node, ast.Name):
            return id(node) in self.defs
        return norm_call(node, self.scope, self.self_name) is not None

    def _norm(self, node: ast.expr, match: _Match) -> bool:
        """Fill the norm's leaves, x and the input cast; False if `node` is not a norm call."""
        if isinstance(node, ast.Name):
            definition = self.defs[id(node)]
            if definition.refusal is not None:
                match.refusal = definition.refusal
            match.structural.append(node)
            match.inline_def = (definition.stmts, definition.stmt)
            value = definition.value
            cast = cast_of(value)
            if cast is not None:
                if "mid" in match.casts:
                    return False
                match.casts["mid"] = cast[1]
                value = cast[0]
            node = value
        kind = norm_call(node, self.scope, self.self_name)
        if kind is None:
            return False
        match.structural.append(node)
        if kind == "module":
            match.norm_attr = _dotted(node.func, self.self_name)
            match.leaves.append(("norm", node.func))
            x = node.args[0]
        else:
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                return False
            bound = dict(zip(_LAYER_NORM_ARGS, node.args))
            for keyword in node.keywords:
                if keyword.arg not in _LAYER_NORM_ARGS or keyword.arg in bound:
                    return False
                bound[keyword.arg] = keyword.value
            if len(node.args) > len(_LAYER_NORM_ARGS) or "input" not in bound or "normalized_shape" not in bound:
                return False
            match.layer_norm = self.scope.resolve(node.func)
            x = bound.pop("input")
            match.leaves += list(bound.items())
        match.leaves.append(("x", self._peel(x, "in", match)))
        return True


# --- single-use norm outputs: `h = self.norm(x)` ... `h * (1 + scale) + shift` ----------------------------
def _scope_nodes(root: ast.AST) -> list[ast.AST]:
    """Nodes of one function scope: nested functions, lambdas and classes are not entered."""
    out, stack = [], list(ast.iter_child_nodes(root))
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return out


def _statement_lists(root: ast.AST) -> list[list]:
    lists = []
    for node in [root, *_scope_nodes(root)]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)) and node is not root:
            continue
        for name in ("body", "orelse", "finalbody"):
            value = getattr(node, name, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                lists.append(value)
        for handler in getattr(node, "handlers", []):
            lists.append(handler.body)
    return lists


def _names(node: ast.AST, ctx: type | tuple[type, ...]) -> list[ast.Name]:
    """Name nodes under `node` (nested scopes below it not entered) with context `ctx`."""
    return [n for n in [node, *_scope_nodes(node)] if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)]


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, node.end_col_offset


def _start(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


_REPEATING = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
              ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)


def _repeated(stmt: ast.stmt, target: ast.AST) -> bool:
    """Whether `target`, a node under `stmt`, may be evaluated more than once per run of `stmt`."""
    return any(isinstance(n, _REPEATING) and any(m is target for m in ast.walk(n)) for n in ast.walk(stmt))


def _single_use_defs(function: ast.AST, scope: _Scope, self_name: str) -> dict[int, _Def]:
    """For each `name = <norm call>` in this function scope whose next read is in a later statement
    of the same block: that read's Name node -> the definition (or why it cannot be moved there)."""
    defs: dict[int, _Def] = {}
    scope_nodes = _scope_nodes(function)
    nested = [n for n in scope_nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    nested_names = {n.id for f in nested for n in ast.walk(f) if isinstance(n, ast.Name)}
    loops = [n for n in scope_nodes if isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
    for stmts in _statement_lists(function):
        for i, stmt in enumerate(stmts):
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
                continue
            name, value = stmt.targets[0].id, stmt.value
            cast = cast_of(value)
            if norm_call(cast[0] if cast is not None else value, scope, self_name) is None:
                continue
            use = next((j for j in range(i + 1, len(stmts)) if any(n.id == name for n in _names(stmts[j], (ast.Load, ast.Store)))), None)
            if use is None:
                continue
            loads = [n for n in _names(stmts[use], ast.Load) if n.id == name]
            if not loads:
                continue
            refusal = None
            reads = {n.id for n in _names(value, ast.Load)}
            between = stmts[i + 1:use]
            if _repeated(stmts[use], loads[0]):  # folded there, the norm would run once per iteration
                refusal = f"the norm output `{name}` is read inside a loop or nested function at line {loads[0].lineno}"
            elif name in nested_names:
                refusal = f"the norm output `{name}` is also read by a nested function"
            elif len(loads) > 1:
                refusal = f"the norm output `{name}` is read {len(loads)} times in line {stmts[use].lineno}"
            elif any(n.id in reads for s in between for n in _names(s, ast.Store)) or any(
                    n.id in reads - {self_name} for s in between for n in _names(s, ast.Load)):
                refusal = f"the norm input of `{name}` is used or changed before line {stmts[use].lineno}"
            else:
                rebinds = any(n.id == name for t in getattr(stmts[use], "targets", []) for n in ast.walk(t)
                              if isinstance(n, ast.Name))
                if not rebinds:
                    later = [n for n in _names(function, ast.Load) if n.id == name and _start(n) > _end(stmts[use])]
                    inside = [lp for lp in loops if _start(lp) <= _start(stmt) and _end(stmt) <= _end(lp)]
                    earlier_in_loop = [n for lp in inside for n in _names(lp, ast.Load)
                                       if n.id == name and _start(n) < _start(stmt)]
                    if later or earlier_in_loop:
                        where = (later or earlier_in_loop)[0].lineno
                        refusal = f"the norm output `{name}` is used again at line {where}, not only modulated"
            defs[id(loads[0])] = _Def(value, stmts, stmt, refusal)
    return defs


# --- the rewrite ----------------------------------------------------------------------------------------
def _ordered_leaves(match: _Match, forward_nodes: set[int]) -> list[tuple[str, ast.expr]]:
    """Leaves in the order the original code evaluated them: by source position of their forward
    nodes (helper-built nodes carry no order of their own)."""

    def key(leaf: ast.expr) -> tuple[int, int]:
        positions = [_start(n) for n in ast.walk(leaf) if id(n) in forward_nodes and hasattr(n, "lineno")]
        return min(positions, default=(0, 0))

    return sorted(match.leaves, key=lambda item: key(item[1]))


class _Rewriter(ast.NodeTransformer):
    """Finds the sites of one forward (in visiting order) and replaces those in `accept` by calls
    `_fused_adaln_sites[k](leaves...)`."""

    def __init__(self, matchers: dict[int, _Matcher], forward_nodes: set[int], accept: frozenset,
                 self_name: str, where: str) -> None:
        self.matchers, self.forward_nodes, self.accept = matchers, forward_nodes, accept
        self.self_name, self.where = self_name, where
        self.sites: list[SiteInfo] = []
        self.specs: dict[tuple[int, int, int, int], FusedSite] = {}  # site key -> its FusedSite, in call order
        self.removed: list[tuple[list, ast.stmt]] = []
        self.consumed: set[int] = set()
        self.matcher: _Matcher | None = None

    def _enter(self, node: ast.AST) -> ast.AST:
        outer = self.matcher
        self.matcher = self.matchers.get(id(node), outer)
        try:
            return self.generic_visit(node)
        finally:
            self.matcher = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        params = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
        if self.matcher is not None and self.self_name in params:  # a nested def rebinding `self`
            return node
        return self._enter(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        if self.self_name in {a.arg for a in node.args.args}:
            return node
        return self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return node

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and id(node) not in self.consumed and self.matcher is not None:
            match = self.matcher.match(node)
            if match is not None:
                return self._site(node, match)
        return super().visit(node)

    def _site(self, node: ast.expr, match: _Match) -> ast.AST:
        for where, (_method, arg, _keyword) in match.casts.items():
            if arg is not None:
                match.leaves.append((f"{where}_cast", arg))
        leaf_ids = {id(n) for _, leaf in match.leaves for n in ast.walk(leaf)}
        self.consumed |= {id(n) for s in match.structural for n in ast.walk(s)} - leaf_ids
        self.consumed.add(id(node))
        key = (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)
        text = ast.unparse(node)
        text = text if len(text) <= _TEXT_WIDTH else text[:_TEXT_WIDTH - 3] + "..."
        self.sites.append(SiteInfo(key, node.lineno, text, match.norm_attr, match.refusal))
        if key not in self.accept:
            return self.generic_visit(node)
        leaves = _ordered_leaves(match, self.forward_nodes)
        casts = {where: Cast(method, None if arg is None else f"{where}_cast", keyword)
                 for where, (method, arg, keyword) in match.casts.items()}
        index = len(self.specs)
        self.specs[key] = FusedSite(tuple(role for role, _ in leaves), casts, match.addcmul, match.one,
                                    match.layer_norm, f"{self.where} line {node.lineno}")
        if match.inline_def is not None:
            self.removed.append(match.inline_def)
        call = ast.Call(func=ast.Subscript(value=ast.Name(SITES_NAME, ast.Load()), slice=ast.Constant(index),
                                           ctx=ast.Load()),
                        args=[self.visit(leaf) for _, leaf in leaves], keywords=[])
        return ast.copy_location(call, node)


def _strip_def_time_expressions(fdef: ast.FunctionDef) -> None:
    """Annotations and defaults are evaluated when a def runs, and the rewritten def runs outside
    the class body: drop them (the compiled function gets the original's __defaults__)."""
    fdef.decorator_list = []
    fdef.returns = None
    fdef.args.defaults = [ast.Constant(None) for _ in fdef.args.defaults]
    fdef.args.kw_defaults = [None if d is None else ast.Constant(None) for d in fdef.args.kw_defaults]
    for node in ast.walk(fdef):
        if isinstance(node, ast.arg):
            node.annotation = None


class ForwardAnalysis:
    """The AdaLN sites of one class's forward, and rewritten forwards for chosen sets of them."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.fn = cls.forward
        self.where = f"{cls.__qualname__}.forward"
        self.refusal = self._refusal()
        self.sites: list[SiteInfo] = []
        self._built: dict[frozenset, tuple[Callable, dict]] = {}
        parsed = self._parse()
        if parsed is None:
            return
        self.sites = self._rewrite(parsed, frozenset()).sites
        fdef = parsed[1]
        mangled = sorted({n for n in (getattr(x, "attr", None) or getattr(x, "id", None) for x in ast.walk(fdef))
                          if isinstance(n, str) and n.startswith("__") and not n.endswith("__")})
        if self.refusal is None and fdef.decorator_list:
            self.refusal = f"forward has decorator(s) {', '.join(ast.unparse(d) for d in fdef.decorator_list)}"
        elif self.refusal is None and mangled:
            self.refusal = f"forward uses class-private (name-mangled) names {mangled}"
        if self.sites and self.refusal is None:
            self.refusal = self._same_code_reason()

    def _refusal(self) -> str | None:
        fn = self.fn
        if not isinstance(fn, types.FunctionType):
            return f"forward is a {type(fn).__name__}, not a plain function"
        if hasattr(fn, "__wrapped__"):
            return "forward is wrapped by a decorator, so its source is not the code that runs"
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
            return "forward is a coroutine or generator"
        for cell in fn.__closure__ or ():
            try:
                _ = cell.cell_contents  # an empty cell raises
            except ValueError:
                return "forward reads a closure variable that is not set yet"
        return None

    def _parse(self) -> tuple[ast.Module, ast.FunctionDef] | None:
        try:
            lines, first = inspect.getsourcelines(self.fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            return None
        fdef = tree.body[0] if tree.body else None
        if not isinstance(fdef, ast.FunctionDef) or not fdef.args.args and not fdef.args.posonlyargs:
            return None
        ast.increment_lineno(tree, first - 1)
        return tree, fdef

    def _rewrite(self, parsed: tuple[ast.Module, ast.FunctionDef], accept: frozenset) -> _Rewriter:
        tree, fdef = parsed
        self_name = (fdef.args.posonlyargs + fdef.args.args)[0].arg
        scope = _Scope(self.fn, self.cls, local_names(fdef))
        forward_nodes = {id(n) for n in ast.walk(fdef)}
        matchers = {}
        for function in [fdef, *(n for n in ast.walk(fdef) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                                 and n is not fdef)]:
            matchers[id(function)] = _Matcher(scope, self_name, _single_use_defs(function, scope, self_name))
        rewriter = _Rewriter(matchers, forward_nodes, accept, self_name, self.where)
        rewriter.visit(fdef)
        for stmts, stmt in rewriter.removed:
            stmts.remove(stmt)
            if not stmts:
                stmts.append(ast.Pass())
        return rewriter

    def _compile(self, fdef: ast.FunctionDef, specs: tuple[FusedSite, ...]) -> types.FunctionType:
        """fdef compiled as a closure with the forward's free variables and globals."""
        fn = self.fn
        freevars = fn.__code__.co_freevars
        _strip_def_time_expressions(fdef)
        factory = ast.FunctionDef(
            name="_fused_adaln_factory",
            args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in (SITES_NAME, *freevars)],
                               kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=[fdef, ast.Return(value=ast.Name(fdef.name, ast.Load()))], decorator_list=[], returns=None,
            type_params=[])
        module = ast.Module(body=[factory], type_ignores=[])
        ast.fix_missing_locations(module)
        namespace: dict[str, Any] = {}
        exec(compile(module, fn.__code__.co_filename, "exec"), fn.__globals__, namespace)
        new = namespace["_fused_adaln_factory"](specs, *(c.cell_contents for c in fn.__closure__ or ()))
        new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
        new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        new._fused_adaln_source = ast.unparse(fdef)  # what runs, for whoever debugs a rewrite
        return new

    def _same_code_reason(self) -> str | None:
        """Compiled from the parsed source without changes, the forward must use the names the loaded
        code uses (globals and attributes, locals, free variables, arguments): otherwise the file
        changed since import, or something rewrote the code. (Bytecode itself depends on the
        compile context, e.g. 3.11 calls `torch.f()` differently when it sees `import torch`.)"""
        try:
            plain = self._compile(self._parse()[1], ())
        except Exception as error:  # noqa: BLE001 - any failure means we cannot reproduce the forward
            return f"its source does not compile outside the class ({type(error).__name__}: {error})"
        fields = ("co_names", "co_varnames", "co_freevars", "co_argcount", "co_kwonlyargcount", "co_posonlyargcount")
        if any(getattr(plain.__code__, f) != getattr(self.fn.__code__, f) for f in fields):
            return "its source (on disk) is not the code that was loaded"
        return None

    def build(self, accept: frozenset) -> tuple[Callable, dict]:
        """(rewritten forward, {site key: FusedSite}) with the sites whose keys are in `accept` fused."""
        if accept not in self._built:
            parsed = self._parse()
            rewriter = self._rewrite(parsed, accept)
            self._built[accept] = (self._compile(parsed[1], tuple(rewriter.specs.values())), rewriter.specs)
        return self._built[accept]


# --- per instance ---------------------------------------------------------------------------------------
def _is_norm_like(obj: object) -> bool:
    return isinstance(obj, nn.Module) and any("norm" in c.__name__.lower() for c in type(obj).__mro__)


def _attr(module: nn.Module, dotted: str) -> object:
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def _bound_forward(rewritten: Callable, name: str) -> Callable:
    """The forward bound on instances: the rewritten one, run against the original on its first
    eager call (verify.FirstCallCheck). Under torch.compile the check is not traced."""

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            check = self.__dict__.get(verify.CHECK_ATTR)
            if check is not None:
                return check.run(self, rewritten, args, kwargs)
        return rewritten(self, *args, **kwargs)

    forward._fused_adaln_name = name
    forward._fused_adaln_source = rewritten._fused_adaln_source  # print(block.forward._fused_adaln_source)
    forward.__qualname__ = f"fused_adaln[{name}]"
    return forward


class IdiomRecogniser:
    """The idiom pass of one `apply_fused_adaln` call, as run_surgery's `fuse_idioms`. Analyses
    and rewritten forwards are cached per class for this call only: a helper such as `modulate`
    may be replaced between calls, and the analysis resolved it by identity."""

    def __init__(self) -> None:
        self._analyses: dict[type, ForwardAnalysis | None] = {}
        self._forwards: dict[tuple[type, frozenset], Callable] = {}
        self._checks: dict[tuple, str | None] = {}

    def _check_site(self, site: FusedSite, norm: nn.Module | None) -> str | None:
        """verify.check_site, once per site and norm configuration (the 30 blocks of a model share one)."""
        config = None if norm is None else (
            type(norm), tuple(norm.normalized_shape), norm.eps,
            *((p.dtype, p.device) if p is not None else None for p in (norm.weight, norm.bias)))
        key = (id(site), config)
        if key not in self._checks:
            self._checks[key] = verify.check_site(site, norm)
        return self._checks[key]

    def analyze(self, cls: type) -> ForwardAnalysis | None:
        """The AdaLN sites of `cls.forward`, or None when it has none (or no source)."""
        if cls not in self._analyses:
            analysis = ForwardAnalysis(cls)
            self._analyses[cls] = analysis if analysis.sites else None
        return self._analyses[cls]

    def __call__(self, module: nn.Module, module_name: str, report: SurgeryReport, dry_run: bool) -> list[str]:
        """Rewrite the recognised AdaLN sites of `module`'s forward (per-instance norm checks, then a
        numeric check of each site); record it in `report`. Returns why sites were left alone."""
        cls = type(module)
        analysis = self.analyze(cls)
        if analysis is None:
            return []
        lines = ", ".join(str(s.line) for s in analysis.sites)
        if "forward" in module.__dict__:
            return [f"AdaLN at line(s) {lines}, but forward is already overridden on this instance"]
        if analysis.refusal is not None:
            return [f"AdaLN at line(s) {lines} of {analysis.where}, not rewritten: {analysis.refusal}"]
        accepted, reasons = [], []
        for site in analysis.sites:
            if site.refusal is not None:
                reasons.append(f"{site.describe()}: {site.refusal}")
                continue
            if site.norm_attr is not None:
                norm = _attr(module, site.norm_attr)
                if not _is_norm_like(norm):
                    continue  # e.g. `self.proj(x) * (1 + s) + t`: not a norm at all
                reason = norm_reason(norm, site.norm_attr, upcast_forwards=UPCAST_LAYER_NORMS)
                if reason is not None:
                    reasons.append(f"{site.describe()}: {reason}")
                    continue
            accepted.append(site)
        while accepted:
            keys = frozenset(s.key for s in accepted)
            try:
                rewritten, specs = analysis.build(keys)
            except Exception as error:  # noqa: BLE001 - an unforeseen construct: leave the module alone, say why
                reasons.append(f"{analysis.where} could not be rewritten ({type(error).__name__}: {error})")
                return reasons
            failed = []
            for site in accepted:
                reason = self._check_site(specs[site.key], _attr(module, site.norm_attr) if site.norm_attr else None)
                if reason is not None:
                    failed.append(site)
                    reasons.append(f"{site.describe()}: numeric check failed: {reason}")
            if not failed:
                break
            accepted = [s for s in accepted if s not in failed]
        if not accepted:
            return reasons
        name = f"idiom:{cls.__qualname__}"
        if len(accepted) < len(analysis.sites):
            name += f" (lines {', '.join(str(s.line) for s in accepted)})"
        report.add_replaced(name, module_name)
        report.sites[name] = [s.describe() for s in accepted]
        if not dry_run:
            if (cls, keys) not in self._forwards:
                self._forwards[(cls, keys)] = _bound_forward(rewritten, name)
            module.forward = types.MethodType(self._forwards[(cls, keys)], module)
            module.__dict__[verify.CHECK_ATTR] = verify.FirstCallCheck(report, module_name, name)
            report.verification[module_name] = verify.PENDING
        return reasons
