"""A small transformer written without this package in mind, for the checkpointing tests: blocks with
self-attention, a keyword argument, dropout (so recomputation must replay the RNG) and a call counter
(a recomputed block runs its forward twice per step)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ToyBlock(nn.Module):
    def __init__(self, dim: int, p_drop: float = 0.1):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(p_drop), nn.Linear(2 * dim, dim))
        self.calls = 0  # forward executions, recomputation included (a plain attribute: not in state_dict)

    def forward(self, x: torch.Tensor, context: torch.Tensor, *, gate: float = 1.0) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # a Python side effect dynamo cannot trace under checkpoint
            self.calls += 1
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + gate * self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.ffn(x + context.mean(dim=1, keepdim=True))


class ToyNet(nn.Module):
    """x (B, N, dim), context (B, M, dim) -> (B, N, dim)."""

    def __init__(self, dim: int = 16, depth: int = 4, p_drop: float = 0.1):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim, p_drop) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, context, gate=0.5)
        return self.head(x)


def toy_batch(seed: int, batch: int = 3, tokens: int = 5, dim: int = 16, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, tokens, dim, generator=g, dtype=dtype),
            torch.randn(batch, 2, dim, generator=g, dtype=dtype))
