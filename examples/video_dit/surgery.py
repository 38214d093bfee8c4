"""Fused-AdaLN patterns for the example's blocks (examples/video_dit/model.py: `DiTBlock`, `Head`),
registered through the public pattern API, as a user would for their own model:

    apply_fused_adaln(model, extra_patterns=VIDEO_DIT_PATTERNS)
    FusedAdaLNSurgery(extra_patterns=["examples.video_dit.surgery.VIDEO_DIT_PATTERNS"])   # YAML too

The blocks modulate like Wan 2.1: `(norm(x.to(acc)) * (1 + scale) + shift).type_as(x)` with
acc = promote(x.dtype, fp32) and fp32 (B, 1, D) chunks of `modulation + e`, autocast disabled.
For bf16/fp16/fp32 x that is the fused op's math exactly (fp32, one cast back); fp64 x (acc is
fp64) runs the original forward. The idiom recogniser fuses these blocks without the patterns
too, with the same numerics (tests/surgery/test_surgery.py); the patterns are the fast path and
pin the exact code: an edit of `DiTBlock.forward` or `Head.forward` changes its fingerprint and
the blocks are left to the recogniser until the copies below are updated.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_adaptiveload.surgery import AdaLNPattern, fused_modulate_fp32, layer_norms_check, run_original, upcast_fallback_reason

CHECKED_AT = "examples/video_dit/model.py @ 7aeea50"


def block_forward(self: nn.Module, x: Tensor, e: Tensor, context: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """examples.video_dit.model.DiTBlock.forward with norm1/norm2 modulation fused."""
    reason = upcast_fallback_reason(x)
    if reason is not None:
        return run_original(self, reason, x, e, context, rope)
    acc = torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = (
            self.modulation.to(acc) + e.to(acc)).chunk(6, dim=1)
        h = fused_modulate_fp32(self.norm1, x, shift_msa, scale_msa)
    y = self.self_attn(h, rope)
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = (x.to(acc) + y.to(acc) * gate_msa).type_as(x)
    x = x + self.cross_attn(self.norm3(x), context).type_as(x)
    with torch.autocast(device_type=x.device.type, enabled=False):
        h = fused_modulate_fp32(self.norm2, x, shift_ffn, scale_ffn)
    y = self.ffn(h)
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = (x.to(acc) + y.to(acc) * gate_ffn).type_as(x)
    return x


def head_forward(self: nn.Module, x: Tensor, time_emb: Tensor) -> Tensor:
    """examples.video_dit.model.Head.forward with the final modulation fused."""
    reason = upcast_fallback_reason(x)
    if reason is not None:
        return run_original(self, reason, x, time_emb)
    acc = torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        shift, scale = (self.modulation.to(acc) + time_emb.to(acc)[:, None]).chunk(2, dim=1)
        h = fused_modulate_fp32(self.norm, x, shift, scale)
    return self.head(h)


VIDEO_DIT_BLOCK = AdaLNPattern(
    name="video_dit.DiTBlock", class_name="DiTBlock", fused_forward=block_forward,
    checked={"d2ecd3e5fad7b2f0": CHECKED_AT},  # fingerprint of DiTBlock.forward -> where it was checked
    check=layer_norms_check("norm1", "norm2"),  # why an instance cannot be fused, or None
)
VIDEO_DIT_HEAD = AdaLNPattern(
    name="video_dit.Head", class_name="Head", fused_forward=head_forward,
    checked={"0257aa74e9be067c": CHECKED_AT},
    check=layer_norms_check("norm"),
)
VIDEO_DIT_PATTERNS = [VIDEO_DIT_BLOCK, VIDEO_DIT_HEAD]
