"""Pure-PyTorch AdaLN forward/backward with exactly the semantics of the CUDA kernels.

Canonical layout (the public wrapper in ops/adaln.py produces it):
    x            (B, N, D)  bf16 / fp16 / fp32
    shift, scale (B, M, D)  M = 1 (per sample) or M = N (per token); x.dtype or fp32, same dtype
    weight, bias (D,) fp32 or None
All arithmetic is fp32 (fp64 for fp64 inputs, which only tests use); y and dx are written in x.dtype, dshift/dscale in the modulation dtype,
dweight/dbias in fp32. mean and rstd are (B, N) fp32, the only tensors kept for backward
besides the inputs. Every output is contiguous, as the kernels' are and the fake kernels say: a
row-strided x (or dy) is read through a contiguous copy, as csrc/adaln_bindings.cpp does.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def adaln_fwd_reference(
    x: Tensor, shift: Tensor, scale: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """y = (xhat * weight + bias) * (1 + scale) + shift, xhat = (x - mean) * rstd. Returns (y, mean, rstd)."""
    xf = x.to(_compute_dtype(x)).contiguous()
    mean = xf.mean(dim=-1)
    centered = xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centered.square().mean(dim=-1) + eps)
    z = centered * rstd.unsqueeze(-1)
    if weight is not None:
        z = z * weight
    if bias is not None:
        z = z + bias
    y = z * (1.0 + scale.to(xf.dtype)) + shift.to(xf.dtype)
    return y.to(x.dtype), mean, rstd


def adaln_bwd_reference(
    dy: Tensor,
    x: Tensor,
    scale: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx, dshift, dscale, dweight, dbias) of adaln_fwd_reference.

    dshift/dscale have scale's shape (B, M, D): summed over the sequence when M = 1.
    dweight/dbias are (D,) fp32, or empty (0,) when weight/bias is None.
    """
    dyf = dy.to(_compute_dtype(x)).contiguous()
    xhat = (x.to(dyf.dtype).contiguous() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    z = xhat * weight if weight is not None else xhat
    if bias is not None:
        z = z + bias
    dz = dyf * (1.0 + scale.to(dyf.dtype))
    dshift, dscale = dyf, dyf * z
    if scale.shape[1] == 1:  # per-sample modulation: sum over the sequence
        dshift, dscale = dshift.sum(dim=1, keepdim=True), dscale.sum(dim=1, keepdim=True)
    # copy=True: a custom op's outputs must not alias its inputs (dshift is dy itself when per token)
    dshift, dscale = dshift.to(scale.dtype, copy=True), dscale.to(scale.dtype)
    dweight = (dz * xhat).sum(dim=(0, 1)) if weight is not None else x.new_empty(0, dtype=dyf.dtype)
    dbias = dz.sum(dim=(0, 1)) if bias is not None else x.new_empty(0, dtype=dyf.dtype)
    dxhat = dz * weight if weight is not None else dz
    dx = rstd.unsqueeze(-1) * (
        dxhat - dxhat.mean(dim=-1, keepdim=True) - xhat * (dxhat * xhat).mean(dim=-1, keepdim=True)
    )
    return dx.to(x.dtype), dshift, dscale, dweight, dbias
