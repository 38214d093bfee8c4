"""The original DiT (facebookresearch/DiT `models.py`) and its many copies: `DiTBlock` and
`FinalLayer` with `adaLN_modulation` and `modulate(norm(x), shift, scale)`, where

    def modulate(x, shift, scale):
        return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)

Copies that reorder shift/scale or change `modulate` get a different fingerprint of `modulate`
and are left alone. Norms: non-affine LayerNorm, eps 1e-6, modulation in the input dtype.
"""
from __future__ import annotations

from torch import Tensor, nn

from lightning_adaptiveload.surgery.core import AdaLNPattern, fused_modulate, layer_norms_check, source_fingerprint

CHECKED_AT = "facebookresearch/DiT models.py @ 00d70ac"
MODULATE_CHECKED = {"65f91e09bb8983d1": CHECKED_AT}


def dit_block_forward(self: nn.Module, x: Tensor, c: Tensor) -> Tensor:
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
    h = fused_modulate(self.norm1, x, shift_msa.unsqueeze(1), scale_msa.unsqueeze(1))
    x = x + gate_msa.unsqueeze(1) * self.attn(h)
    h = fused_modulate(self.norm2, x, shift_mlp.unsqueeze(1), scale_mlp.unsqueeze(1))
    x = x + gate_mlp.unsqueeze(1) * self.mlp(h)
    return x


def final_layer_forward(self: nn.Module, x: Tensor, c: Tensor) -> Tensor:
    shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
    x = fused_modulate(self.norm_final, x, shift.unsqueeze(1), scale.unsqueeze(1))
    x = self.linear(x)
    return x


def _modulate_reason(module: nn.Module) -> str | None:
    modulate = type(module).forward.__globals__.get("modulate")
    if modulate is None or source_fingerprint(modulate) not in MODULATE_CHECKED:
        return "the `modulate` its forward calls is not DiT's `x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)`"
    return None


def _reason(*norms: str):
    norms_check = layer_norms_check(*norms)
    return lambda module: norms_check(module) or _modulate_reason(module)


DIT_BLOCK = AdaLNPattern("dit.DiTBlock", "DiTBlock", dit_block_forward, {"466c225e783cada2": CHECKED_AT}, _reason("norm1", "norm2"))
DIT_FINAL_LAYER = AdaLNPattern("dit.FinalLayer", "FinalLayer", final_layer_forward, {"321970891b38caa8": CHECKED_AT}, _reason("norm_final"))
PATTERNS = [DIT_BLOCK, DIT_FINAL_LAYER]
