"""Shared checks for the module-surgery tests (no tests here): patched vs original outputs and gradients, in fp32
against each other and in bf16 against an fp64 run of the original."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lightning_adaptiveload.surgery import apply_fused_adaln
from lightning_adaptiveload.surgery.verify import rel_err

FP32_RTOL = 1e-5
# bf16: the patched model's error against fp64 may be at most twice the original model's own
# error plus one bf16 unit roundoff (2**-8), which covers tensors whose error is dominated by the
# final rounding to bf16. A wrong eps, chunk order or dtype path gives errors of order 1.
BF16_UNIT_ROUNDOFF = 2.0**-8


# Gradients below this fraction of the whole gradient's norm are compared on that scale instead:
# e.g. attention key biases, whose gradient is exactly 0 in exact arithmetic (softmax shift invariance).
GRAD_FLOOR = 1e-3


class Attention(nn.Module):
    """Self-attention as in timm's Attention(qkv_bias=True), which the original DiT uses: x (B, N, D)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


def grad_floor(grads: dict[str, torch.Tensor]) -> float:
    return GRAD_FLOOR * float(torch.cat([g.double().flatten() for g in grads.values()]).norm())


def _flat_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "sample"):
        return [out.sample]
    return [t for t in out if isinstance(t, torch.Tensor)]


def run(model: nn.Module, inputs: tuple, cotangent_seed: int = 123) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs and parameter gradients of sum(<output, random cotangent>)."""
    model.zero_grad(set_to_none=True)
    outs = _flat_outputs(model(*inputs))
    gen = torch.Generator().manual_seed(cotangent_seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum() for o in outs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], grads


def cast_inputs(inputs: tuple, dtype: torch.dtype) -> tuple:
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)


def patched_copy(model: nn.Module, **kwargs) -> tuple[nn.Module, object]:
    clone = copy.deepcopy(model)
    return clone, apply_fused_adaln(clone, **kwargs)


def check_fp32(model: nn.Module, inputs: tuple, expected_replaced: int, **surgery) -> object:
    """Outputs and all parameter gradients agree to FP32_RTOL (gradients: see GRAD_FLOOR).
    `surgery`: keyword arguments of apply_fused_adaln. Returns the report."""
    model = model.float()
    patched, report = patched_copy(model, **surgery)
    assert report.num_replaced == expected_replaced, str(report)
    outs, grads = run(model, inputs)
    outs_p, grads_p = run(patched, inputs)
    for o, o_p in zip(outs, outs_p, strict=True):
        assert o_p.dtype == o.dtype and o_p.shape == o.shape
        assert rel_err(o_p, o) <= FP32_RTOL
    assert grads and grads.keys() == grads_p.keys()
    floor = grad_floor(grads)
    for name in grads:
        assert rel_err(grads_p[name], grads[name], floor) <= FP32_RTOL, name
    return report


def check_bf16_noise(model: nn.Module, inputs: tuple, expected_replaced: int, *, mixed: bool = False, **surgery) -> None:
    """bf16 patched error against a reference <= 2 x the original bf16 error + 2**-8, outputs and grads.

    mixed=False (bf16-true): parameters and inputs are rounded to bf16 first and the reference is
    the original model in fp64 on those exact values, so only the computation's rounding counts.
    mixed=True (bf16-mixed, for models built for autocast such as the example video DiT, whose
    fp32 time embedding cannot run in bf16 or fp64): fp32 parameters, bf16 autocast, and the
    reference is the fp32 model without autocast (2**16 times finer than bf16).
    """
    if mixed:
        model_bf16, reference, inputs_bf16, inputs_ref = model.float(), copy.deepcopy(model).float(), inputs, inputs
    else:
        model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
        reference = copy.deepcopy(model_bf16).to(torch.float64)
        inputs_bf16 = cast_inputs(inputs, torch.bfloat16)
        inputs_ref = cast_inputs(inputs_bf16, torch.float64)
    patched, report = patched_copy(model_bf16, **surgery)
    assert report.num_replaced == expected_replaced, str(report)
    outs_ref, grads_ref = run(reference, inputs_ref)
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=mixed):
        outs, grads = run(model_bf16, inputs_bf16)
        outs_p, grads_p = run(patched, inputs_bf16)
    for o_ref, o, o_p in zip(outs_ref, outs, outs_p, strict=True):
        assert o_p.dtype == o.dtype
        assert rel_err(o_p, o_ref) <= 2 * rel_err(o, o_ref) + BF16_UNIT_ROUNDOFF
    assert grads.keys() == grads_p.keys() == grads_ref.keys()
    floor = grad_floor(grads_ref)
    for name in grads:
        own = rel_err(grads[name], grads_ref[name], floor)
        assert rel_err(grads_p[name], grads_ref[name], floor) <= 2 * own + BF16_UNIT_ROUNDOFF, name


def check_state_dict_round_trip(model: nn.Module, **surgery) -> None:
    """Keys and values unchanged by surgery; checkpoints load both ways (strict)."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patched, report = patched_copy(model, **surgery)
    assert report.num_replaced > 0
    after = patched.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    fresh_patched, _ = patched_copy(model, **surgery)
    with torch.no_grad():
        for p in fresh_patched.parameters():
            p.add_(1.0)
    fresh_patched.load_state_dict(model.state_dict(), strict=True)  # original checkpoint -> patched
    assert all(torch.equal(fresh_patched.state_dict()[k], before[k]) for k in before)
    original = copy.deepcopy(model)
    with torch.no_grad():
        for p in original.parameters():
            p.add_(1.0)
    original.load_state_dict(patched.state_dict(), strict=True)  # patched checkpoint -> original
    assert all(torch.equal(original.state_dict()[k], before[k]) for k in before)


def check_idempotent(model: nn.Module, **surgery) -> None:
    patched, first = patched_copy(model, **surgery)
    forwards = {n: m.__dict__.get("forward") for n, m in patched.named_modules()}
    second = apply_fused_adaln(patched, **surgery)
    assert second.num_replaced == 0
    assert {p: sorted(n) for p, n in second.already_fused.items()} == {p: sorted(n) for p, n in first.replaced.items()}
    assert {n: m.__dict__.get("forward") for n, m in patched.named_modules()} == forwards
