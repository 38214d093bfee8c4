"""The attention calls of the shipped Wan-1.3B-shaped model at B = 1 (12 heads of dim 128, bf16), in the
layout the example model hands SDPA: q, k, v are (B, S, h, d) projections transposed to (B, h, S, d)."""
from __future__ import annotations

from lightning_adaptiveload.attention import SdpaCall

HEADS, HEAD_DIM, TEXT_LEN = 12, 128, 512
SEQ_LENS = (256, 3600, 9408, 32400, 75600)  # reference-mix buckets from one image to 81 frames at 720p


def self_attention(seq: int) -> SdpaCall:
    return SdpaCall.of_projections(1, HEADS, seq, seq, HEAD_DIM, "bfloat16")


def cross_attention(seq: int) -> SdpaCall:
    return SdpaCall.of_projections(1, HEADS, seq, TEXT_LEN, HEAD_DIM, "bfloat16")
