"""The blocked reference attention against fp64 autograd through torch's math SDPA (an independent
implementation) on random data: plain, causal, bool and float masks, GQA, strided inputs; blocks of one
query row give the same as one block."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_adaptiveload.attention import reference_attention, relative_error
from tests.helpers.seeds import stable_seed


def sdpa_fp64(q, k, v, g, **kwargs):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = kwargs.pop("attn_mask", None)
    if mask is not None and mask.is_floating_point():
        mask = mask.double()
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, **kwargs)
    return (out, *torch.autograd.grad(out, leaves, g.double()))


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "scale": dict(scale=0.3),
    "bool_mask": dict(attn_mask="bool"),
    "float_mask": dict(attn_mask="float"),
    "gqa": dict(enable_gqa=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_bytes", [1, 2 ** 30])  # one query row per block, or one block
def test_reference_matches_fp64_math_sdpa(case, block_bytes):
    kwargs = dict(CASES[case])
    g = torch.Generator().manual_seed(stable_seed((case, block_bytes)))
    b, h, s_q, s_k, d = 2, 4, 9, 13, 8
    h_k = 2 if case == "gqa" else h
    q = torch.randn(b, s_q, h, d, generator=g).transpose(1, 2)  # the example's transposed views
    k = torch.randn(b, s_k, h_k, d, generator=g).transpose(1, 2)
    v = torch.randn(b, h_k, s_k, d + 2, generator=g)
    grad = torch.randn(b, h, s_q, d + 2, generator=g)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(b, 1, s_q, s_k, generator=g) > 0.3
        kwargs["attn_mask"][..., 0] = True  # no fully masked row (its softmax is undefined)
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(s_q, s_k, generator=g)
    if case == "causal":
        s_k = s_q
        k, v = k[..., :s_q, :], v[..., :s_q, :]
    ref = reference_attention(q, k, v, grad, dtype=torch.float64, block_bytes=block_bytes, **kwargs)
    expected = sdpa_fp64(q, k, v, grad, **kwargs)
    for name, got, want in zip(("out", "dq", "dk", "dv"), ref, expected):
        assert got.shape == want.shape, name
        assert relative_error(got, want) < 1e-12, name


def test_relative_error_is_inf_for_nan_and_scale_free():
    ref = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert relative_error(ref * (1 + 1e-3), ref) == pytest.approx(1e-3, rel=1e-4)
    assert relative_error(ref * 1e6 * (1 + 1e-3), ref * 1e6) == pytest.approx(1e-3, rel=1e-4)
    bad = ref.clone()
    bad[3] = float("nan")
    assert relative_error(bad, ref) == float("inf")


def test_reference_refuses_mismatched_heads_without_gqa():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="enable_gqa"):
        reference_attention(q, k, k, torch.randn(1, 4, 3, 8))
