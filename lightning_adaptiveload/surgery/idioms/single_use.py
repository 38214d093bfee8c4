"""Single-use norm outputs: `h = self.norm(x)` ... `h * (1 + scale) + shift`.

`single_use_defs` finds, per function scope, each `name = <norm call>` whose next read is in a
later statement of the same block, and why folding the norm into that read would change what runs
(the read repeats in a loop or a nested function, it is one of several, the norm's input is used
or changed in between, the name is read again later). The matcher takes these definitions as the
norm of the site that reads them, with the refusal if any; the rewriter removes the assignment of
a fused one.
"""
from __future__ import annotations

import ast

from lightning_adaptiveload.surgery.idioms.matcher import NormDef, cast_of, norm_call
from lightning_adaptiveload.surgery.idioms.scope import Scope


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


def start(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


_REPEATING = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
              ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)


def _repeated(stmt: ast.stmt, target: ast.AST) -> bool:
    """Whether `target`, a node under `stmt`, may be evaluated more than once per run of `stmt`."""
    return any(isinstance(n, _REPEATING) and any(m is target for m in ast.walk(n)) for n in ast.walk(stmt))


def single_use_defs(function: ast.AST, scope: Scope, self_name: str) -> dict[int, NormDef]:
    """For each `name = <norm call>` in this function scope whose next read is in a later statement
    of the same block: that read's Name node -> the definition (or why it cannot be moved there)."""
    defs: dict[int, NormDef] = {}
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
                    later = [n for n in _names(function, ast.Load) if n.id == name and start(n) > _end(stmts[use])]
                    inside = [lp for lp in loops if start(lp) <= start(stmt) and _end(stmt) <= _end(lp)]
                    earlier_in_loop = [n for lp in inside for n in _names(lp, ast.Load)
                                       if n.id == name and start(n) < start(stmt)]
                    if later or earlier_in_loop:
                        where = (later or earlier_in_loop)[0].lineno
                        refusal = f"the norm output `{name}` is used again at line {where}, not only modulated"
            defs[id(loads[0])] = NormDef(value, stmts, stmt, refusal)
    return defs
