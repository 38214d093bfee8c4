"""What runs at each call of a rewritten forward: a `FusedSite` per rewritten AdaLN expression,
called with the expression's operands in their source order. It runs the fused op, or the same
expression eagerly where the op cannot reproduce it for that call. `Cast` is one dtype cast in a
site. Nothing here reads source: rewrite.py builds the sites from what matcher.py found.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_adaptiveload.ops.adaln import FLOAT_DTYPES
from lightning_adaptiveload.surgery.core import (
    adaln_any_stride,
    modulation_fallback_reason,
    upcast_fallback_reason,
    warn_once,
)

# F.layer_norm's parameters in order, and its defaults; STATIC_CASTS: the argument-free cast
# methods and their dtypes. The matcher recognises exactly these, so they are defined once, here.
LAYER_NORM_ARGS = ("input", "normalized_shape", "weight", "bias", "eps")
_LAYER_NORM_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5}
STATIC_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


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
            return STATIC_CASTS[self.method]
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
        given = {k: values[k] if k in values else _LAYER_NORM_DEFAULTS.get(k) for k in LAYER_NORM_ARGS[1:]}
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
