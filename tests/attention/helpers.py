"""A tiny Wan-style VideoDiT (examples/video_dit) and its forward, for the attention tests."""
from __future__ import annotations

import torch

from examples.video_dit.model import DiTConfig, VideoDiT

CONFIG = DiTConfig(dim=48, num_layers=3, num_heads=4, ffn_dim=64, text_dim=16, freq_dim=16)
TEXT_LEN = 7


def tiny_dit(seed: int = 0) -> VideoDiT:
    torch.manual_seed(seed)
    return VideoDiT(CONFIG)


def forward(model: VideoDiT, batch: int, latent: tuple[int, int, int], seed: int = 0):
    """fn() running the model on random latents (B, 16, T, H, W): S = T * H/2 * W/2 tokens."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, CONFIG.in_channels, *latent, generator=g)
    text = torch.randn(batch, TEXT_LEN, CONFIG.text_dim, generator=g)
    t = torch.rand(batch, generator=g)
    return lambda: model(latents, t, text)


def tokens(latent: tuple[int, int, int]) -> int:
    t, h, w = latent
    return t * (h // 2) * (w // 2)
