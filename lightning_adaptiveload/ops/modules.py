"""nn.Module front end of the fused AdaLN op."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_adaptiveload.ops import adaln_modulate


class FusedAdaLN(nn.Module):
    """LayerNorm(x) * (1 + scale) + shift in one kernel; drop-in for nn.LayerNorm + modulate.

    Parameter names match nn.LayerNorm (`weight`, `bias`, `normalized_shape`, `eps`) so a
    LayerNorm's state_dict loads unchanged, and so does `reset_parameters()` (weight 1, bias 0),
    which FSDP calls to materialize modules built on the meta device. forward(x (B, N, D) or
    (N, D), shift, scale) with shift/scale shapes as in ops.adaln_modulate; output has x's shape
    and dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False) -> None:
        super().__init__()
        if int(dim) < 1:
            raise ValueError(f"FusedAdaLN: dim must be >= 1, got {dim}")
        self.normalized_shape = (int(dim),)
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(dim))
            self.bias = nn.Parameter(torch.empty(dim))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        return adaln_modulate(x, shift, scale, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
