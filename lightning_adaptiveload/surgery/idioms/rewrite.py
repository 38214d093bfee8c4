"""The rewrite of one class's forward (`ForwardAnalysis`).

Mechanism: an AST rewrite of the module class's `forward` source. The source is parsed, every
expression that computes `norm(x') * (1 + scale) + shift` is found (matcher.py), each one is
replaced by a call to a `FusedSite` (runtime.py: it runs the fused op, or the same expression
eagerly where the op cannot reproduce it), and the new function is compiled with the forward's
globals, closure cells (`super()` included) and defaults; the recogniser binds it on the instance.
Everything else in the forward runs as written, data-dependent control flow included (what
torch.fx cannot trace). Forwards whose source is not the code that runs (decorated, wrapped,
edited since import) or that use name-mangled names are refused as a whole (`refusal`).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Callable

from lightning_adaptiveload.surgery.idioms.matcher import Match, Matcher
from lightning_adaptiveload.surgery.idioms.runtime import Cast, FusedSite
from lightning_adaptiveload.surgery.idioms.scope import Scope, local_names
from lightning_adaptiveload.surgery.idioms.single_use import single_use_defs, start

SITES_NAME = "_fused_adaln_sites"  # the closure variable the rewritten forward reads its sites from
_TEXT_WIDTH = 90


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


def _ordered_leaves(match: Match, forward_nodes: set[int]) -> list[tuple[str, ast.expr]]:
    """Leaves in the order the original code evaluated them: by source position of their forward
    nodes (helper-built nodes carry no order of their own)."""

    def key(leaf: ast.expr) -> tuple[int, int]:
        positions = [start(n) for n in ast.walk(leaf) if id(n) in forward_nodes and hasattr(n, "lineno")]
        return min(positions, default=(0, 0))

    return sorted(match.leaves, key=lambda item: key(item[1]))


class _Rewriter(ast.NodeTransformer):
    """Finds the sites of one forward (in visiting order) and replaces those in `accept` by calls
    `_fused_adaln_sites[k](leaves...)`."""

    def __init__(self, matchers: dict[int, Matcher], forward_nodes: set[int], accept: frozenset,
                 self_name: str, where: str) -> None:
        self.matchers, self.forward_nodes, self.accept = matchers, forward_nodes, accept
        self.self_name, self.where = self_name, where
        self.sites: list[SiteInfo] = []
        self.specs: dict[tuple[int, int, int, int], FusedSite] = {}  # site key -> its FusedSite, in call order
        self.removed: list[tuple[list, ast.stmt]] = []
        self.consumed: set[int] = set()
        self.matcher: Matcher | None = None

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

    def _site(self, node: ast.expr, match: Match) -> ast.AST:
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
        scope = Scope(self.fn, self.cls, local_names(fdef))
        forward_nodes = {id(n) for n in ast.walk(fdef)}
        matchers = {}
        for function in [fdef, *(n for n in ast.walk(fdef) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                                 and n is not fdef)]:
            matchers[id(function)] = Matcher(scope, self_name, single_use_defs(function, scope, self_name))
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
