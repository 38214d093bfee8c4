"""diffusers `WanTransformerBlock` (Wan 2.1, and Wan 2.2's per-token modulation).

Wan modulates in fp32: `(norm1(x.float()) * (1 + scale) + shift).type_as(x)` with fp32
(B, 1, D) `chunk` views (Wan 2.2 TI2V: (B, S, D)), FP32LayerNorm without affine, eps 1e-6. The
fused op takes bf16 x with fp32 shift/scale, computes in fp32 and casts back once: the same
numerics, up to fp32 summation order. It keeps only x (bf16) and per-row stats for backward,
where eager keeps fp32 copies of x and of norm1(x) (8 bytes per element instead of 2).
"""
from __future__ import annotations

from torch import Tensor, nn

from lightning_adaptiveload.surgery.core import (
    FP32_LAYER_NORM_CHECKED,
    AdaLNPattern,
    fused_modulate_fp32,
    layer_norms_check,
    patch_class,
    run_original,
    upcast_fallback_reason,
)

WAN_BLOCK_CHECKED = {"9cff22c73ad8ec81": "diffusers 0.42.1"}


def wan_block_forward(
    self: nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor, temb: Tensor, rotary_emb: Tensor
) -> Tensor:
    """WanTransformerBlock.forward of diffusers 0.42.1 with norm1/norm3 modulation fused."""
    reason = upcast_fallback_reason(hidden_states)
    if reason is not None:
        return run_original(self, reason, hidden_states, encoder_hidden_states, temb, rotary_emb)
    if temb.ndim == 4:
        # temb: batch_size, seq_len, 6, inner_dim (wan2.2 ti2v)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table.unsqueeze(0) + temb.float()
        ).chunk(6, dim=2)
        shift_msa = shift_msa.squeeze(2)
        scale_msa = scale_msa.squeeze(2)
        gate_msa = gate_msa.squeeze(2)
        c_shift_msa = c_shift_msa.squeeze(2)
        c_scale_msa = c_scale_msa.squeeze(2)
        c_gate_msa = c_gate_msa.squeeze(2)
    else:
        # temb: batch_size, 6, inner_dim (wan2.1/wan2.2 14B)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table + temb.float()
        ).chunk(6, dim=1)

    # 1. Self-attention
    norm_hidden_states = fused_modulate_fp32(self.norm1, hidden_states, shift_msa, scale_msa)
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

    # 2. Cross-attention (norm2 is affine and unmodulated: unchanged)
    norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states = hidden_states + attn_output

    # 3. Feed-forward
    norm_hidden_states = fused_modulate_fp32(self.norm3, hidden_states, c_shift_msa, c_scale_msa)
    ff_output = self.ffn(norm_hidden_states)
    hidden_states = (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)

    return hidden_states


WAN_BLOCK = AdaLNPattern(
    name="diffusers.WanTransformerBlock",
    class_name="WanTransformerBlock",
    fused_forward=wan_block_forward,
    checked=WAN_BLOCK_CHECKED,
    check=layer_norms_check("norm1", "norm3", fp32_forward=FP32_LAYER_NORM_CHECKED),
)
PATTERNS = [WAN_BLOCK]


def apply_fused_adaln_to_wan() -> dict[str, str]:
    """Patch diffusers' WanTransformerBlock so blocks built from now on use the fused op.

    Returns {class name: "patched" | "already patched" | reason left alone}. Raises ImportError
    when diffusers is not installed (`pip install lightning-adaptiveload[diffusers]`).
    """
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    return {"WanTransformerBlock": patch_class(WanTransformerBlock, WAN_BLOCK)}


__all__ = ["PATTERNS", "WAN_BLOCK", "apply_fused_adaln_to_wan", "wan_block_forward"]
