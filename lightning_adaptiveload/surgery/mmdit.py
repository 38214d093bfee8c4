"""diffusers MMDiT AdaLN sites (SD3, SD3.5, Flux): the AdaLayerNorm* modules and the inline
`norm2` / `norm2_context` modulation of JointTransformerBlock and FluxTransformerBlock.

All of them compute `norm(x) * (1 + scale[:, None]) + shift[:, None]` in the promoted dtype of
their inputs, with a non-affine LayerNorm (eps 1e-6; AdaLayerNormContinuous: any eps, affine or
not; chunk order scale, shift). Each fused forward below is the diffusers 0.42.1 forward with
that expression replaced by `fused_modulate`, which falls back to the same expression when the
op cannot reproduce its result dtype.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_adaptiveload.surgery.core import FP32_LAYER_NORM_CHECKED, AdaLNPattern, fused_modulate, layer_norms_check, patch_class

CHECKED_AT = "diffusers 0.42.1"


def ada_layer_norm_zero_forward(
    self: nn.Module,
    x: Tensor,
    timestep: Tensor | None = None,
    class_labels: torch.LongTensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    emb: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = fused_modulate(self.norm, x, shift_msa[:, None], scale_msa[:, None])
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def ada_layer_norm_zero_single_forward(self: nn.Module, x: Tensor, emb: Tensor | None = None) -> tuple[Tensor, Tensor]:
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    x = fused_modulate(self.norm, x, shift_msa[:, None], scale_msa[:, None])
    return x, gate_msa


def ada_layer_norm_continuous_forward(self: nn.Module, x: Tensor, conditioning_embedding: Tensor) -> Tensor:
    # convert back to the original dtype in case `conditioning_embedding` is upcasted to float32 (hunyuanDiT)
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return fused_modulate(self.norm, x, shift[:, None, :], scale[:, None, :])


def sd35_ada_layer_norm_zero_x_forward(self: nn.Module, hidden_states: Tensor, emb: Tensor | None = None) -> tuple[Tensor, ...]:
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = emb.chunk(
        9, dim=1
    )
    # Eager normalizes once and modulates twice; the fused op recomputes the row stats instead
    # of keeping the normalized tensor alive.
    out = fused_modulate(self.norm, hidden_states, shift_msa[:, None], scale_msa[:, None])
    norm_hidden_states2 = fused_modulate(self.norm, hidden_states, shift_msa2[:, None], scale_msa2[:, None])
    return out, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2


def joint_transformer_block_forward(
    self: nn.Module,
    hidden_states: torch.FloatTensor,
    encoder_hidden_states: torch.FloatTensor,
    temb: torch.FloatTensor,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """JointTransformerBlock.forward (SD3/SD3.5) with the inline norm2/norm2_context modulation fused."""
    joint_attention_kwargs = joint_attention_kwargs or {}
    if self.use_dual_attention:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2 = self.norm1(
            hidden_states, emb=temb
        )
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)

    if self.context_pre_only:
        norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb
        )

    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        **joint_attention_kwargs,
    )
    attn_output = gate_msa.unsqueeze(1) * attn_output
    hidden_states = hidden_states + attn_output

    if self.use_dual_attention:
        attn_output2 = self.attn2(hidden_states=norm_hidden_states2, **joint_attention_kwargs)
        attn_output2 = gate_msa2.unsqueeze(1) * attn_output2
        hidden_states = hidden_states + attn_output2

    norm_hidden_states = fused_modulate(self.norm2, hidden_states, shift_mlp[:, None], scale_mlp[:, None])
    if self._chunk_size is not None:
        from diffusers.models.attention import _chunked_feed_forward

        ff_output = _chunked_feed_forward(self.ff, norm_hidden_states, self._chunk_dim, self._chunk_size)
    else:
        ff_output = self.ff(norm_hidden_states)
    ff_output = gate_mlp.unsqueeze(1) * ff_output

    hidden_states = hidden_states + ff_output

    if self.context_pre_only:
        encoder_hidden_states = None
    else:
        context_attn_output = c_gate_msa.unsqueeze(1) * context_attn_output
        encoder_hidden_states = encoder_hidden_states + context_attn_output

        norm_encoder_hidden_states = fused_modulate(
            self.norm2_context, encoder_hidden_states, c_shift_mlp[:, None], c_scale_mlp[:, None]
        )
        if self._chunk_size is not None:
            from diffusers.models.attention import _chunked_feed_forward

            context_ff_output = _chunked_feed_forward(
                self.ff_context, norm_encoder_hidden_states, self._chunk_dim, self._chunk_size
            )
        else:
            context_ff_output = self.ff_context(norm_encoder_hidden_states)
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output

    return encoder_hidden_states, hidden_states


def flux_transformer_block_forward(
    self: nn.Module,
    hidden_states: Tensor,
    encoder_hidden_states: Tensor,
    temb: Tensor,
    image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """FluxTransformerBlock.forward with the inline norm2/norm2_context modulation fused."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)

    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb
    )
    joint_attention_kwargs = joint_attention_kwargs or {}

    attention_outputs = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    if len(attention_outputs) == 2:
        attn_output, context_attn_output = attention_outputs
    elif len(attention_outputs) == 3:
        attn_output, context_attn_output, ip_attn_output = attention_outputs

    attn_output = gate_msa.unsqueeze(1) * attn_output
    hidden_states = hidden_states + attn_output

    norm_hidden_states = fused_modulate(self.norm2, hidden_states, shift_mlp[:, None], scale_mlp[:, None])

    ff_output = self.ff(norm_hidden_states)
    ff_output = gate_mlp.unsqueeze(1) * ff_output

    hidden_states = hidden_states + ff_output
    if len(attention_outputs) == 3:
        hidden_states = hidden_states + ip_attn_output

    context_attn_output = c_gate_msa.unsqueeze(1) * context_attn_output
    encoder_hidden_states = encoder_hidden_states + context_attn_output

    norm_encoder_hidden_states = fused_modulate(
        self.norm2_context, encoder_hidden_states, c_shift_mlp[:, None], c_scale_mlp[:, None]
    )

    context_ff_output = self.ff_context(norm_encoder_hidden_states)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)

    return encoder_hidden_states, hidden_states


_norm_reason = layer_norms_check("norm", fp32_forward=FP32_LAYER_NORM_CHECKED)


def _norm2_reason(block: nn.Module) -> str | None:
    attrs = ("norm2",) if getattr(block, "context_pre_only", False) else ("norm2", "norm2_context")
    return layer_norms_check(*attrs)(block)


ADA_LAYER_NORM_ZERO = AdaLNPattern(
    "diffusers.AdaLayerNormZero", "AdaLayerNormZero", ada_layer_norm_zero_forward,
    {"8d53301f68852097": CHECKED_AT}, _norm_reason,
)
ADA_LAYER_NORM_ZERO_SINGLE = AdaLNPattern(
    "diffusers.AdaLayerNormZeroSingle", "AdaLayerNormZeroSingle", ada_layer_norm_zero_single_forward,
    {"82973cd1632ed05f": CHECKED_AT}, _norm_reason,
)
ADA_LAYER_NORM_CONTINUOUS = AdaLNPattern(
    "diffusers.AdaLayerNormContinuous", "AdaLayerNormContinuous", ada_layer_norm_continuous_forward,
    {"bfee5949ad241352": CHECKED_AT}, _norm_reason,
)
SD35_ADA_LAYER_NORM_ZERO_X = AdaLNPattern(
    "diffusers.SD35AdaLayerNormZeroX", "SD35AdaLayerNormZeroX", sd35_ada_layer_norm_zero_x_forward,
    {"9d1ed1386964833e": CHECKED_AT}, _norm_reason,
)
JOINT_TRANSFORMER_BLOCK = AdaLNPattern(
    "diffusers.JointTransformerBlock.norm2", "JointTransformerBlock", joint_transformer_block_forward,
    {"ccbb39db65d299ce": CHECKED_AT}, _norm2_reason,
)
FLUX_TRANSFORMER_BLOCK = AdaLNPattern(
    "diffusers.FluxTransformerBlock.norm2", "FluxTransformerBlock", flux_transformer_block_forward,
    {"0e5dede637fa82eb": CHECKED_AT}, _norm2_reason,
)
PATTERNS = [
    ADA_LAYER_NORM_ZERO,
    ADA_LAYER_NORM_ZERO_SINGLE,
    ADA_LAYER_NORM_CONTINUOUS,
    SD35_ADA_LAYER_NORM_ZERO_X,
    JOINT_TRANSFORMER_BLOCK,
    FLUX_TRANSFORMER_BLOCK,
]


def _patch_normalization(names: list[str]) -> dict[str, str]:
    from diffusers.models import normalization

    by_class = {p.class_name: p for p in PATTERNS}
    return {name: patch_class(getattr(normalization, name), by_class[name]) for name in names}


def apply_fused_adaln_to_sd3() -> dict[str, str]:
    """Patch the diffusers classes of SD3/SD3.5 (JointTransformerBlock, AdaLayerNormZero,
    SD35AdaLayerNormZeroX, AdaLayerNormContinuous) so instances built from now on use the fused op.

    Returns {class name: "patched" | "already patched" | reason left alone}.
    """
    from diffusers.models.attention import JointTransformerBlock

    status = _patch_normalization(["AdaLayerNormZero", "SD35AdaLayerNormZeroX", "AdaLayerNormContinuous"])
    status["JointTransformerBlock"] = patch_class(JointTransformerBlock, JOINT_TRANSFORMER_BLOCK)
    return status


def apply_fused_adaln_to_flux() -> dict[str, str]:
    """Patch the diffusers classes of Flux (FluxTransformerBlock, AdaLayerNormZero,
    AdaLayerNormZeroSingle, AdaLayerNormContinuous) so instances built from now on use the fused op."""
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    status = _patch_normalization(["AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous"])
    status["FluxTransformerBlock"] = patch_class(FluxTransformerBlock, FLUX_TRANSFORMER_BLOCK)
    return status
