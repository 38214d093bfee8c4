"""The idiom matcher (surgery/idioms/matcher.py) on `ast.parse` snippets: AdaLN as DiT, Wan and
user code write it, and near-misses that must not match. Each test states what the match holds
(leaves by role, casts, form, norm, folded definition, refusal), written by hand from the snippet.
Nothing runs here: test_idioms.py checks rewritten blocks end to end."""
from __future__ import annotations

import ast
import textwrap

import pytest
import torch
import torch.nn.functional as F

from lightning_adaptiveload.surgery.idioms.matcher import Match, Matcher
from lightning_adaptiveload.surgery.idioms.scope import Scope, local_names
from lightning_adaptiveload.surgery.idioms.single_use import single_use_defs

# Helpers the snippets call, resolved in this module's globals as the forward's would be in its own.


def modulate(x, shift, scale):
    """The original DiT's helper (facebookresearch/DiT, models.py)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def shift_twice(x, shift, scale):
    return x * (1 + scale) + (shift + shift)


def two_statements(x, shift, scale):
    y = x * (1 + scale)
    return y + shift


class Block:
    """The class whose methods `self.<name>(...)` in a snippet resolves to."""

    def modulate(self, x, shift, scale):
        return x * (1 + scale) + shift


ARGS = "self, x, shift, scale, e, w, b"


def sites(body: str) -> list[Match]:
    """The matches in `def forward(self, x, shift, scale, e, w, b): <body>` (line 1 is the def),
    outermost first and not searched further inside, as the rewriter visits them."""
    source = f"def forward({ARGS}):\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")
    fdef = ast.parse(source).body[0]
    scope = Scope(sites, Block, local_names(fdef))  # a function of this module: the snippet's globals are ours
    matcher = Matcher(scope, "self", single_use_defs(fdef, scope, "self"))
    found = []

    def visit(node: ast.AST) -> None:
        match = matcher.match(node) if isinstance(node, ast.expr) else None
        if match is not None:
            found.append(match)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(fdef)
    return found


def fields(match: Match) -> dict:
    """A match as source text: leaves by role, casts by place as (method, argument, keyword)."""
    roles = [role for role, _ in match.leaves]
    assert len(roles) == len(set(roles)), roles
    return {
        "leaves": {role: ast.unparse(node) for role, node in match.leaves},
        "casts": {where: (method, None if arg is None else ast.unparse(arg), keyword)
                  for where, (method, arg, keyword) in match.casts.items()},
        "addcmul": match.addcmul,
        "one": repr(match.one),  # 1 and 1.0 compare equal; the site computes with the one written
        "norm_attr": match.norm_attr,
        "layer_norm": match.layer_norm,
        "folded": None if match.inline_def is None else ast.unparse(match.inline_def[1]),
        "refusal": match.refusal,
    }


def only(body: str) -> dict:
    found = sites(body)
    assert len(found) == 1, [fields(m) for m in found]
    return fields(found[0])


def site(scale: str = "scale", shift: str = "shift", x: str = "x", norm: str | None = "self.norm", *,
         casts: dict | None = None, addcmul: bool = False, one: str = "1", layer_norm=None,
         norm_args: dict | None = None, folded: str | None = None, refusal: str | None = None) -> dict:
    """The expected fields: a site on the module norm `norm` (None: functional, its arguments in
    `norm_args`), no casts, `normed * (1 + scale) + shift`, unless given."""
    leaves = {"scale": scale, "shift": shift, "x": x, **({"norm": norm} if norm else {}), **(norm_args or {})}
    return {"leaves": leaves, "casts": casts or {}, "addcmul": addcmul, "one": one,
            "norm_attr": norm.removeprefix("self.") if norm else None, "layer_norm": layer_norm,
            "folded": folded, "refusal": refusal}


# --- the forms --------------------------------------------------------------------------------------------
def test_dit_block_form():
    assert only("return self.norm1(x) * (1 + scale) + shift") == site(norm="self.norm1")


@pytest.mark.parametrize("expr, one", [
    ("shift + (1 + scale) * self.norm(x)", "1"),
    ("(scale + 1) * self.norm(x) + shift", "1"),
    ("shift + self.norm(x) * (1.0 + scale)", "1.0"),
])
def test_operand_orders(expr, one):
    assert only(f"return {expr}") == site(one=one)


def test_roles_come_from_the_form_not_from_names():
    assert only("return self.norm(x) * (1 + shift) + scale") == site(scale="shift", shift="scale")


@pytest.mark.parametrize("body, scale, shift", [
    ("s0, s1, gate = e.chunk(3, dim=1)\nreturn self.norm(x) * (1 + s1) + s0", "s1", "s0"),
    ("s1, s0, gate = e.chunk(3, dim=1)\nreturn self.norm(x) * (1 + s1) + s0", "s1", "s0"),
    ("return self.norm(x) * (1 + e[1]) + e[0]", "e[1]", "e[0]"),  # Wan 2.1: shift is chunk 0
    ("return self.norm(x) * (1 + e[0]) + e[1]", "e[0]", "e[1]"),
    ("return self.norm(x) * (1 + e.chunk(2, dim=1)[1]) + e.chunk(2, dim=1)[0]",
     "e.chunk(2, dim=1)[1]", "e.chunk(2, dim=1)[0]"),
])
def test_chunk_orders(body, scale, shift):
    """However the modulation is chunked or unpacked, scale is what `1 +` is added to."""
    assert only(body) == site(scale=scale, shift=shift)


@pytest.mark.parametrize("expr, scale, shift", [
    ("self.norm(x) * (1 + scale[:, None]) + shift[:, None]", "scale[:, None]", "shift[:, None]"),
    ("self.norm(x) * (1 + scale)[:, None] + shift[:, None]", "scale[:, None]", "shift[:, None]"),
    ("self.norm(x) * (1 + scale)[..., None, :] + shift", "scale[..., None, :]", "shift"),
    ("self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)", "scale.unsqueeze(1)", "shift.unsqueeze(1)"),
    ("self.norm(x) * (1 + scale).unsqueeze(1) + shift.unsqueeze(1)", "scale.unsqueeze(1)", "shift.unsqueeze(1)"),
])
def test_views_of_the_modulation(expr, scale, shift):
    """A view of `(1 + scale)` commutes with the `1 +`: the scale leaf is the view of scale."""
    assert only(f"return {expr}") == site(scale=scale, shift=shift)


def test_wan_fp32_modulation():
    """Wan 2.1's block (norm output to fp32, result back to x's dtype) and diffusers' Wan block
    (norm input to fp32)."""
    assert only("return (self.norm1(x).float() * (1 + e[1]) + e[0]).type_as(x)") == site(
        "e[1]", "e[0]", norm="self.norm1", casts={"mid": ("float", None, False), "out": ("type_as", "x", False)})
    assert only("return (self.norm1(x.float()) * (1 + scale) + shift).type_as(x)") == site(
        norm="self.norm1", casts={"in": ("float", None, False), "out": ("type_as", "x", False)})


@pytest.mark.parametrize("expr, casts", [
    ("self.norm(x.to(torch.float32)) * (1 + scale) + shift", {"in": ("to", "torch.float32", False)}),
    ("self.norm(x.to(dtype=torch.float32)) * (1 + scale) + shift", {"in": ("to", "torch.float32", True)}),
    ("self.norm(x).to(w) * (1 + scale) + shift", {"mid": ("to", "w", False)}),
    ("(self.norm(x.double()) * (1 + scale) + shift).to(x.dtype)",
     {"in": ("double", None, False), "out": ("to", "x.dtype", False)}),
])
def test_casts_by_place(expr, casts):
    """Which dtype a cast targets is the runtime's business (a fp64 norm input falls back per call):
    the matcher records where each cast is and its argument."""
    assert only(f"return {expr}") == site(casts=casts)


@pytest.mark.parametrize("expr", [
    "torch.addcmul(shift, self.norm(x), 1 + scale)",
    "torch.addcmul(shift, 1 + scale, self.norm(x))",
    "torch.addcmul(shift, self.norm(x), 1 + scale, value=1)",
    "shift.addcmul(self.norm(x), 1 + scale)",
])
def test_addcmul(expr):
    assert only(f"return {expr}") == site(addcmul=True)


def test_functional_layer_norm():
    """F.layer_norm's arguments are leaves by parameter name, whether passed by position or keyword."""
    assert only("return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale) + shift") == site(
        norm=None, layer_norm=F.layer_norm, norm_args={"normalized_shape": "(x.shape[-1],)", "eps": "1e-06"})
    assert only("return torch.layer_norm(x.float(), x.shape[-1:], w, b) * (1 + scale) + shift") == site(
        norm=None, layer_norm=torch.layer_norm, casts={"in": ("float", None, False)},
        norm_args={"normalized_shape": "x.shape[-1:]", "weight": "w", "bias": "b"})


def test_any_self_attribute_call_is_a_candidate_norm():
    """The matcher reads code, not instances: whether `self.proj` is a LayerNorm is the recogniser's
    per-instance check (test_idioms.py: a Linear there is left alone)."""
    assert only("return self.proj(x) * (1 + scale) + shift") == site(norm="self.proj")
    assert only("return self.block.norm(x) * (1 + scale) + shift") == site(norm="self.block.norm")


def test_wan_block_has_two_sites():
    """Wan 2.1's WanAttentionBlock.forward, abridged: the self-attention and FFN inputs."""
    found = sites("""
        y = self.self_attn(self.norm1(x).float() * (1 + e[1]) + e[0], w)
        x = x + y * e[2]
        y = self.ffn(self.norm2(x).float() * (1 + e[4]) + e[3])
        return x + y * e[5]
    """)
    mid = {"mid": ("float", None, False)}
    assert [fields(m) for m in found] == [site("e[1]", "e[0]", norm="self.norm1", casts=mid),
                                          site("e[4]", "e[3]", norm="self.norm2", casts=mid)]


# --- helpers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expr, expected", [
    ("modulate(self.norm1(x), shift, scale)", site("scale.unsqueeze(1)", "shift.unsqueeze(1)", norm="self.norm1")),
    ("modulate(self.norm1(x), scale=scale, shift=shift)",
     site("scale.unsqueeze(1)", "shift.unsqueeze(1)", norm="self.norm1")),
    ("modulate(self.norm(x).float(), shift, scale)",
     site("scale.unsqueeze(1)", "shift.unsqueeze(1)", casts={"mid": ("float", None, False)})),
    ("self.modulate(self.norm(x), e[0], e[1])", site("e[1]", "e[0]")),
    ("shift_twice(self.norm(x), shift, scale)", site(shift="shift + shift")),
])
def test_helper_inlined(expr, expected):
    """A one-`return` helper is matched as its expression with the call's arguments in place."""
    assert only(f"return {expr}") == expected


# --- a norm output folded into its one use -----------------------------------------------------------------
def test_folded_norm_output():
    assert only("""
        h = self.norm(x)
        return h * (1 + scale) + shift
    """) == site(folded="h = self.norm(x)")
    assert only("""
        h = self.norm(x).float()
        return (h * (1 + scale) + shift).type_as(x)
    """) == site(folded="h = self.norm(x).float()",
                 casts={"mid": ("float", None, False), "out": ("type_as", "x", False)})


@pytest.mark.parametrize("body, refusal", [
    ("""
        h = self.norm(x)
        y = h * (1 + scale) + shift
        return y + h
     """, "the norm output `h` is used again at line 4, not only modulated"),
    ("""
        h = self.norm(x)
        x = x + 1
        return h * (1 + scale) + shift
     """, "the norm input of `h` is used or changed before line 4"),
    ("""
        h = self.norm(x)
        for _ in range(2):
            x = h * (1 + scale) + shift
        return x
     """, "the norm output `h` is read inside a loop or nested function at line 4"),
], ids=["read-again", "input-changed", "read-in-a-loop"])
def test_folded_norm_output_refused(body, refusal):
    """The site is still found (the report names it), carrying why the norm cannot move there."""
    assert only(body) == site(folded="h = self.norm(x)", refusal=refusal)


# --- near-misses -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    "return self.norm(x) * scale + shift",  # no `1 +`
    "return self.norm(x) * (1 + scale) - shift",
    "return self.norm(x) * (2 + scale) + shift",
    "return self.norm(x) * (True + scale) + shift",  # a bool is not the constant 1
    "return self.norm(x) * (1 + scale)[0] + shift",  # an index that is not a view
    "return x * (1 + scale) + shift",  # no norm
    "return self.norms[0](x) * (1 + scale) + shift",  # a norm reached by index
    "return self.norm1(x, e) * (1 + scale) + shift",  # a norm module called with more than x
    "return F.rms_norm(x, (x.shape[-1],)) * (1 + scale) + shift",  # a different norm
    "return F.group_norm(x, 4) * (1 + scale) + shift",
    "return torch.mul(self.norm(x), 1 + scale) + shift",  # a spelling not recognised
    "return torch.addcmul(shift, self.norm(x), scale)",
    "return torch.addcmul(shift, self.norm(x), 1 + scale, value=2)",
    "norm = self.norm\nreturn norm(x) * (1 + scale) + shift",  # the norm under a local name
    "F = e\nreturn F.layer_norm(x, (8,)) * (1 + scale) + shift",  # F is not torch's here
    "s = 1 + scale\nreturn self.norm(x) * s + shift",  # `1 +` in an earlier statement
    "return two_statements(self.norm(x), shift, scale)",  # a helper of two statements
    "return shift_twice(self.norm(x), e[0], scale)",  # inlined, `e[0]` would be evaluated twice
])
def test_near_misses_match_nothing(body):
    assert sites(body) == []
