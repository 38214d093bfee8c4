"""attention_backend and the router: the kernel that really runs (profiled aten ops), strict and fallback,
nesting and restoring, and the external FlashAttention hook with a stand-in module (the real ones need a
GPU) against torch's math attention."""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from lightning_adaptiveload.attention import attention_backend, backends, backends_run, external_status
from lightning_adaptiveload.attention.backends import EXTERNAL_BACKENDS, SDPA, TORCH_BACKENDS, active_backend


def qkv(seed=0, dtype=torch.float32, s=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, s, 3, 8, generator=g, dtype=torch.float32).to(dtype).transpose(1, 2).requires_grad_()
            for _ in range(3)]


def fwd_bwd(q, k, v, **kwargs):
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    out.sum().backward()
    return out


# strict: torch's CPU selection ignores the priority order (flash, then math, always), so there only the
# strict "math" excludes flash; the CUDA tests check the non-strict order
@pytest.mark.parametrize("name", ["flash", "math"])
def test_the_named_kernel_runs_forward_and_backward(name):
    q, k, v = qkv()
    with attention_backend(name, strict=True):
        assert backends_run(lambda: fwd_bwd(q, k, v)) == {name}
        assert F.scaled_dot_product_attention is backends.scaled_dot_product_attention  # the router is installed
    assert active_backend() is None
    assert backends_run(lambda: fwd_bwd(q, k, v)) == {"flash"}  # torch's own choice on the CPU again


def test_strict_refuses_what_fallback_runs_and_the_state_is_restored():
    q, k, v = qkv()
    before = torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    with attention_backend("efficient"):  # no CPU kernel: torch's next one runs
        assert active_backend()[0] == TORCH_BACKENDS["efficient"]
        assert backends_run(lambda: fwd_bwd(q, k, v)) == {"flash"}
    with pytest.raises(RuntimeError, match="No viable backend"):
        with attention_backend("efficient", strict=True):
            fwd_bwd(q, k, v)
    assert active_backend() is None
    assert (torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before


def test_nesting_and_none():
    q, k, v = qkv()
    with attention_backend("math", strict=True):
        with attention_backend(None):  # None changes nothing: still math
            assert backends_run(lambda: fwd_bwd(q, k, v)) == {"math"}
        with attention_backend("flash"):
            assert backends_run(lambda: fwd_bwd(q, k, v)) == {"flash"}
        assert backends_run(lambda: fwd_bwd(q, k, v)) == {"math"}
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'"):
        with attention_backend("flash3"):
            pass


def test_the_router_is_sdpa_when_nothing_is_active():
    backends.install_router()
    q, k, v = qkv(1)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), SDPA(q, k, v, is_causal=True))


def test_external_backends_are_detected_not_required():
    status = external_status()
    assert set(status) == {"fa4", "fa3"}
    for name, why in status.items():
        if why is not None:
            assert "Error" in why  # the import's failure, recorded
            with pytest.raises(Exception):
                with attention_backend(name):
                    pass


@pytest.fixture
def stand_in_fa3(monkeypatch):
    """flash_attn_interface replaced by math attention on (B, S, h, d) that records what it was given,
    allowed on the CPU."""
    seen = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        seen.append((tuple(q.shape), q.stride(-1), softmax_scale, causal))
        out = SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale)
        return out.transpose(1, 2), None  # FA returns (out, lse)

    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    monkeypatch.setitem(EXTERNAL_BACKENDS, "fa3", dataclasses.replace(EXTERNAL_BACKENDS["fa3"], devices=("cpu",)))
    monkeypatch.setattr(backends, "_externals", {})
    return seen


def test_external_hook_gets_flash_attention_layout_and_matches_math(stand_in_fa3):
    q, k, v = qkv(2, torch.bfloat16)
    want = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = SDPA(*want, is_causal=True, scale=0.25)
    ref.sum().backward()
    with attention_backend("fa3"):
        out = fwd_bwd(q, k, v, is_causal=True, scale=0.25)
    assert stand_in_fa3 == [((2, 6, 3, 8), 1, 0.25, True)]  # (B, S, h, d), last dim contiguous
    assert out.shape == (2, 3, 6, 8)
    for got, expected in [(out, ref)] + [(t.grad, w.grad) for t, w in zip((q, k, v), want)]:
        assert torch.allclose(got.double(), expected, atol=3e-2, rtol=3e-2)


def test_external_hook_leaves_what_it_cannot_take_to_torch(stand_in_fa3):
    q, k, v = qkv(3, torch.bfloat16)
    mask = torch.ones(6, 6, dtype=torch.bool)
    with attention_backend("fa3"):
        fwd_bwd(q, k, v, attn_mask=mask)
    assert stand_in_fa3 == []
    with pytest.raises(RuntimeError, match="fa3 does not take an attention mask"):
        with attention_backend("fa3", strict=True):
            fwd_bwd(q, k, v, attn_mask=mask)
