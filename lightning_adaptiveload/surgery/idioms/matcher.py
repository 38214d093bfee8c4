"""The matcher: one expression of a forward against the recognised AdaLN forms.

Recognised (x' = x, x.float(), x.to(dtype), x.type_as(t); casts also on the norm output and on
the whole expression):
    norm(x') * (1 + scale) + shift          any operand order, `1` or `1.0`, `(1 + scale)[:, None]`
    torch.addcmul(shift, norm(x'), 1 + scale), shift.addcmul(...)
    helper(norm(x'), shift, scale)          a plain function (or method) whose body is one
                                            `return` of a recognised form, e.g. DiT's `modulate`
    h = norm(x'); ... h * (1 + scale) + shift   when `h` is used only there (single_use.py)
norm is a submodule `self.<attr>` that is, per instance, an nn.LayerNorm over the last dim (or a
checked fp32 LayerNorm subclass), or `F.layer_norm` / `torch.layer_norm`. Not recognised: RMSNorm
and other norms, `- shift`, `* scale` without `1 +`, `scale` computed as `1 + s` in an earlier
statement, norms under another name than `self.<attr>`, decorated forwards. docs/surgery.md has
the whole list and how rewrites are verified (surgery/verify.py).

The matcher reads shapes of code only: that `self.<attr>` is a LayerNorm on an instance is checked
by the recogniser, decorated forwards are refused by rewrite.ForwardAnalysis. `cast_of` and
`norm_call` are also what the single-use analysis recognises a norm output by.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable

import torch

from lightning_adaptiveload.surgery.idioms.runtime import LAYER_NORM_ARGS, STATIC_CASTS
from lightning_adaptiveload.surgery.idioms.scope import MISSING, Scope, inline_helper

_LAYER_NORMS = (torch.nn.functional.layer_norm, torch.layer_norm)
_MAX_HELPER_DEPTH = 3


@dataclass
class Match:
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


@dataclass
class NormDef:
    """`name = <norm call>` whose value is read once, at `load` (a site's normed operand), or why not."""

    value: ast.expr
    stmts: list
    stmt: ast.stmt
    refusal: str | None = None


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


def cast_of(node: ast.expr) -> tuple[ast.expr, tuple[str, ast.expr | None, bool]] | None:
    """(operand, (method, arg, keyword)) for a dtype cast call, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    method, args, kws = node.func.attr, node.args, node.keywords
    if method in STATIC_CASTS and not args and not kws:
        return node.func.value, (method, None, False)
    if method in ("to", "type_as") and len(args) == 1 and not kws and not isinstance(args[0], ast.Starred):
        return node.func.value, (method, args[0], False)
    if method == "to" and not args and len(kws) == 1 and kws[0].arg == "dtype":
        return node.func.value, (method, kws[0].value, True)
    return None


def norm_call(node: ast.expr, scope: Scope, self_name: str) -> str | None:
    """'module' for `self.<attr>(x)`, 'functional' for F.layer_norm / torch.layer_norm, else None."""
    if not isinstance(node, ast.Call):
        return None
    if _dotted(node.func, self_name) is not None:
        return "module" if len(node.args) == 1 and not node.keywords and not isinstance(node.args[0], ast.Starred) else None
    return "functional" if scope.resolve(node.func) in _LAYER_NORMS else None


class Matcher:
    """Matches one expression against the recognised forms (module docstring). `defs`, from
    single_use.single_use_defs: id of a Name node read as a site's normed operand -> its definition."""

    def __init__(self, scope: Scope, self_name: str, defs: dict[int, NormDef]) -> None:
        self.scope, self.self_name, self.defs = scope, self_name, defs

    def match(self, node: ast.expr) -> Match | None:
        match = Match()
        expr = self._expand(node, match, 0)
        return self._site(expr, match) if expr is not None else None

    # helpers: modulate(norm(x), shift, scale) -> the helper's expression with the arguments in place
    def _expand(self, node: ast.expr, match: Match, depth: int) -> ast.expr | None:
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

    def _peel(self, node: ast.expr, where: str, match: Match) -> ast.expr:
        cast = cast_of(node)
        if cast is None:
            return node
        match.casts[where] = cast[1]
        match.structural.append(node)
        return cast[0]

    def _site(self, expr: ast.expr, match: Match) -> Match | None:
        core = self._peel(expr, "out", match)
        parts = self._sum(core, match)
        if parts is None:
            return None
        normed, scale, shift = parts
        match.leaves += [("scale", scale), ("shift", shift)]
        normed = self._peel(normed, "mid", match)
        return match if self._norm(normed, match) else None

    def _sum(self, node: ast.expr, match: Match) -> tuple[ast.expr, ast.expr, ast.expr] | None:
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
                    and self.scope.resolve(func) is MISSING:
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

    def _pair(self, a: ast.expr, b: ast.expr, match: Match) -> tuple[ast.expr, ast.expr] | None:
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

    def _norm(self, node: ast.expr, match: Match) -> bool:
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
            bound = dict(zip(LAYER_NORM_ARGS, node.args))
            for keyword in node.keywords:
                if keyword.arg not in LAYER_NORM_ARGS or keyword.arg in bound:
                    return False
                bound[keyword.arg] = keyword.value
            if len(node.args) > len(LAYER_NORM_ARGS) or "input" not in bound or "normalized_shape" not in bound:
                return False
            match.layer_norm = self.scope.resolve(node.func)
            x = bound.pop("input")
            match.leaves += list(bound.items())
        match.leaves.append(("x", self._peel(x, "in", match)))
        return True
