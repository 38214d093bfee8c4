"""CUDA: one Wan-1.3B-shaped block of the example DiT (D = 1536, 12 heads, FFN 8960, 512 text tokens) at
B = 1 and S = 75,600 tokens (the shipped mix's longest bucket: latent 21x90x160 at patch (1, 2, 2)), with
the fused AdaLN, eager and compiled by `compile_blocks(..., "dynamic")` after a 256-token call (the
order calibration meets them), forward and backward under bf16 autocast, against the unfused block in
fp32 without autocast. Issue 29: `compile: dynamic` ended in an illegal memory access at this shape.
Bound as tests/helpers/surgery.check_bf16_noise: each error at most twice the unfused bf16 block's own
error plus one bf16 unit roundoff."""
from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers.surgery import BF16_UNIT_ROUNDOFF, grad_floor, rel_err

from examples.video_dit import surgery as video_dit
from examples.video_dit.model import DiTBlock, rope_3d
from lightning_adaptiveload.regional_compile import compile_blocks
from lightning_adaptiveload.surgery import apply_fused_adaln

pytestmark = pytest.mark.cuda

DIM, HEADS, FFN, TEXT = 1536, 12, 8960, 512
LONG, SHORT = (21, 45, 80), (1, 16, 16)  # token grids: 75,600 and 256 tokens


@pytest.fixture(autouse=True)
def exact_fp32_reference(monkeypatch):
    """TF32 would put the fp32 reference's matmuls at bf16's error scale."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def inputs(grid: tuple[int, int, int], seed: int) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2]
    x = torch.randn(1, tokens, DIM, generator=gen, device="cuda")
    e = 0.1 * torch.randn(1, 6, DIM, generator=gen, device="cuda")
    context = torch.randn(1, TEXT, DIM, generator=gen, device="cuda")
    return x, e, context, rope_3d(grid, DIM // HEADS, torch.device("cuda"))


def forward_backward(block: torch.nn.Module, args: tuple, autocast: bool):
    """Output, input gradient and parameter gradients of <output, fixed random cotangent>."""
    block.zero_grad(set_to_none=True)
    x = args[0].detach().clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = block(x, *args[1:])
    cotangent = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
    (out.float() * cotangent).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def test_fused_block_at_75600_tokens_eager_and_compiled_dynamic_match_the_unfused_fp32_block():
    torch.manual_seed(0)
    reference = DiTBlock(DIM, FFN, HEADS).cuda()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    fused = copy.deepcopy(reference)
    report = apply_fused_adaln(fused, extra_patterns=video_dit.VIDEO_DIT_PATTERNS)
    assert report.counts() == {"video_dit.DiTBlock": 1}, str(report)
    compiled = copy.deepcopy(fused)
    assert compile_blocks([compiled], "dynamic") == 1
    forward_backward(compiled, inputs(SHORT, seed=1), autocast=True)  # the dynamic graph is made at 256 tokens

    args = inputs(LONG, seed=2)
    want_out, want_dx, want_grads = forward_backward(reference, args, autocast=False)
    own_out, own_dx, own_grads = forward_backward(reference, args, autocast=True)
    floor = grad_floor(want_grads)
    for name, block in (("fused eager", fused), ("fused compiled dynamic", compiled)):
        out, dx, grads = forward_backward(block, args, autocast=True)
        assert out.shape == want_out.shape and out.dtype == own_out.dtype
        assert rel_err(out, want_out) <= 2 * rel_err(own_out, want_out) + BF16_UNIT_ROUNDOFF, name
        assert rel_err(dx, want_dx) <= 2 * rel_err(own_dx, want_dx) + BF16_UNIT_ROUNDOFF, name
        assert grads.keys() == want_grads.keys(), name
        for param in want_grads:
            own = rel_err(own_grads[param], want_grads[param], floor)
            assert rel_err(grads[param], want_grads[param], floor) <= 2 * own + BF16_UNIT_ROUNDOFF, (name, param)
