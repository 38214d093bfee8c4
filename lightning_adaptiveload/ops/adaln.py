"""AdaLN modulate as torch.library custom ops with autograd and fake (meta) kernels.

    y = ((x - mean) * rstd * weight + bias) * (1 + scale) + shift      (LayerNorm over the last dim)

`adaptiveload::adaln_fwd` / `adaptiveload::adaln_bwd` take the canonical layout documented in
ops/reference.py; `adaln_modulate` validates user input and brings it into that layout with
views only. On CUDA the compiled kernels run when ops.extension finds them, else the reference.
In eager mode on CUDA, `adaln_modulate` calls the extension's C++ autograd function instead of
the custom op (same kernels; the custom op's Python autograd layer cost more host time than the
kernels take at training shapes); torch.compile and every tracer still see the custom op.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_adaptiveload.ops.extension import load_extension
from lightning_adaptiveload.ops.reference import adaln_bwd_reference, adaln_fwd_reference

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.custom_op("adaptiveload::adaln_fwd", mutates_args=())
def adaln_fwd(
    x: Tensor, shift: Tensor, scale: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(y (B,N,D) x.dtype, mean (B,N) fp32, rstd (B,N) fp32); canonical layout only."""
    return adaln_fwd_reference(x, shift, scale, weight, bias, eps)


@adaln_fwd.register_kernel("cuda")
def _adaln_fwd_cuda(x, shift, scale, weight, bias, eps):
    ext, _ = load_extension()
    if ext is None:
        return adaln_fwd_reference(x, shift, scale, weight, bias, eps)
    return tuple(ext.adaln_fwd(x, shift, scale, weight, bias, eps))


@adaln_fwd.register_fake
def _adaln_fwd_fake(x, shift, scale, weight, bias, eps):
    stats = x.new_empty(x.shape[:2], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, stats.clone()


@torch.library.custom_op("adaptiveload::adaln_bwd", mutates_args=())
def adaln_bwd(
    dy: Tensor,
    x: Tensor,
    scale: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dshift, dscale, dweight, dbias); dweight/dbias are empty (0,) when weight/bias is None."""
    return adaln_bwd_reference(dy, x, scale, weight, bias, mean, rstd)


@adaln_bwd.register_kernel("cuda")
def _adaln_bwd_cuda(dy, x, scale, weight, bias, mean, rstd):
    ext, _ = load_extension()
    if ext is None:
        return adaln_bwd_reference(dy, x, scale, weight, bias, mean, rstd)
    return tuple(ext.adaln_bwd(dy, x, scale, weight, bias, mean, rstd))


@adaln_bwd.register_fake
def _adaln_bwd_fake(dy, x, scale, weight, bias, mean, rstd):
    def param_grad(p):
        return x.new_empty((p.shape[0] if p is not None else 0,), dtype=torch.float32)

    mod_grad = x.new_empty(scale.shape, dtype=scale.dtype)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        mod_grad,
        torch.empty_like(mod_grad),
        param_grad(weight),
        param_grad(bias),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, _shift, scale, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, scale, weight, bias, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, scale, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dshift, dscale, dweight, dbias = torch.ops.adaptiveload.adaln_bwd(
        dy.contiguous(), x, scale, weight, bias, mean, rstd
    )
    return (
        dx,
        dshift,
        dscale,
        dweight if weight is not None else None,
        dbias if bias is not None else None,
        None,
    )


adaln_fwd.register_autograd(_backward, setup_context=_setup_context)


def _as_batch_rows(t: Tensor, name: str, x: Tensor, batch: int, seq: int, dim: int) -> Tensor:
    """View shift/scale as (B, M, D), M in {1, N}; error names the argument otherwise."""
    shape = t.shape
    if x.dim() == 3:
        if shape != (batch, 1, dim) and shape != (batch, seq, dim):
            if shape != (batch, dim):
                _bad_modulation_shape(t, name, x, [(batch, dim), (batch, 1, dim), (batch, seq, dim)])
            t = t.unsqueeze(1)
    elif shape == (dim,) or shape == (1, dim):
        t = t.view(1, 1, dim)
    elif shape == (seq, dim):
        t = t.unsqueeze(0)
    else:
        _bad_modulation_shape(t, name, x, [(dim,), (1, dim), (seq, dim)])
    if dim > 1 and t.stride(-1) != 1:
        raise ValueError(f"adaln_modulate: {name} must have unit stride in its last dim, got strides {t.stride()}")
    return t


def _bad_modulation_shape(t: Tensor, name: str, x: Tensor, allowed: list[tuple[int, ...]]) -> None:
    raise ValueError(
        f"adaln_modulate: {name} has shape {tuple(t.shape)}, expected one of {allowed} for x of shape {tuple(x.shape)}"
    )


def _check_tensor(t: object, name: str, x: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"adaln_modulate: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"adaln_modulate: {name} has dtype {t.dtype}, expected one of {FLOAT_DTYPES}")
    if t.device != x.device:
        raise ValueError(f"adaln_modulate: {name} is on {t.device} but x is on {x.device}")


def _canonical_args(
    x: Tensor, shift: Tensor, scale: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, float]:
    """Validate adaln_modulate's arguments and view them in the ops' canonical layout (ops/reference.py):
    x (B, N, D), shift/scale (B, M, D) of one dtype (x.dtype or fp32), weight/bias fp32, eps a float.

    Views and dtype casts only; every check runs before any kernel. Costs a few microseconds per
    call (benchmarks/kernel/adaln_host.py), so it is kept to what a wrong call would otherwise get wrong.
    """
    _check_tensor(x, "x", x)
    _check_tensor(shift, "shift", x)
    _check_tensor(scale, "scale", x)
    ndim = x.dim()
    if ndim != 3 and ndim != 2:
        raise ValueError(f"adaln_modulate: x must be (B, N, D) or (N, D), got shape {tuple(x.shape)}")
    dim = x.shape[-1]
    if dim < 1:
        raise ValueError(f"adaln_modulate: x must have a last dim (D) >= 1, got shape {tuple(x.shape)}")
    if dim > 1 and x.stride(-1) != 1:
        raise ValueError(f"adaln_modulate: x must have unit stride in its last dim, got shape {tuple(x.shape)} strides {x.stride()}")
    if not eps > 0:
        raise ValueError(f"adaln_modulate: eps must be > 0, got {eps}")
    params = []
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            _check_tensor(p, name, x)
            if p.shape != (dim,):
                raise ValueError(f"adaln_modulate: {name} has shape {tuple(p.shape)}, expected ({dim},) for x of shape {tuple(x.shape)}")
            if p.dtype != torch.float32:
                p = p.float()
        params.append(p)
    batch, seq = (x.shape[0], x.shape[1]) if ndim == 3 else (1, x.shape[0])
    shift3 = _as_batch_rows(shift, "shift", x, batch, seq, dim)
    scale3 = _as_batch_rows(scale, "scale", x, batch, seq, dim)
    if shift3.shape != scale3.shape:
        raise ValueError(f"adaln_modulate: shift {tuple(shift.shape)} and scale {tuple(scale.shape)} must have the same shape")
    if shift3.dtype != scale3.dtype or (shift3.dtype != x.dtype and shift3.dtype != torch.float32):
        shift3, scale3 = shift3.float(), scale3.float()
    return x if ndim == 3 else x.unsqueeze(0), shift3, scale3, params[0], params[1], float(eps)


def _eager_kernels(x: Tensor) -> ModuleType | None:
    """The compiled extension when a call on x may take its C++ autograd path, else None."""
    return load_extension()[0] if x.is_cuda else None


def adaln_modulate(
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Fused LayerNorm(x; eps, weight, bias) * (1 + scale) + shift, math in fp32, output in x.dtype.

    x: (B, N, D) or (N, D), bf16/fp16/fp32, unit stride in the last dim.
    shift, scale: per sample (B, D) or (B, 1, D), or per token (B, N, D); for 2D x: (D,), (1, D)
        or (N, D). Any row strides (e.g. `chunk` views), unit inner stride. dtype x.dtype or
        fp32; any other float dtype (or shift/scale dtypes that differ) is upcast to fp32, exactly.
    weight, bias: (D,) LayerNorm affine parameters or None; used in fp32.
    With fp32 shift/scale and bf16 x this equals Wan 2.1's
    `(norm_fp32(x.float()) * (1 + scale) + shift).type_as(x)` up to fp32 summation order.

    Two routes with the same kernels and results: in eager mode on CUDA with the extension, the
    extension's C++ autograd function (no Python in forward or backward beyond this call);
    under torch.compile/export, tracers, dispatch modes, tensor subclasses or functorch
    transforms (and on CPU), the `adaptiveload::adaln_fwd` custom op with its fake kernel.
    """
    args = _canonical_args(x, shift, scale, weight, bias, eps)
    y = None
    if not torch.compiler.is_compiling():
        ext = _eager_kernels(x)
        if ext is not None:
            y = ext.adaln_eager(*args)  # None when the dispatcher must see the op
    if y is None:
        y = torch.ops.adaptiveload.adaln_fwd(*args)[0]
    return y if x.dim() == 3 else y.view(x.shape)


def backend() -> str:
    """Which implementation CUDA tensors use and why, e.g. 'cuda: prebuilt extension ...'.

    CPU tensors always run the reference. Calling this may trigger the one-time JIT build
    (silently; `ensure_extension()` does the same with progress lines).
    """
    return load_extension()[1]
