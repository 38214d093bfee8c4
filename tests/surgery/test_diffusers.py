"""Module surgery on tiny diffusers models with random weights (no hub download): Wan 2.1 / 2.2
(WanTransformer3DModel), SD3 / SD3.5 (SD3Transformer2DModel: JointTransformerBlock, AdaLayerNormZero,
SD35AdaLayerNormZeroX, AdaLayerNormContinuous) and Flux (FluxTransformer2DModel)."""
from __future__ import annotations


import pytest
import torch
from tests.helpers.surgery import (
    check_bf16_noise,
    check_fp32,
    check_idempotent,
    check_state_dict_round_trip,
    patched_copy,
    rel_err,
)

diffusers = pytest.importorskip("diffusers", reason="diffusers extra not installed (pip install '.[diffusers]')")
from diffusers.models import normalization  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel  # noqa: E402
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock  # noqa: E402

from lightning_adaptiveload.surgery import (  # noqa: E402
    apply_fused_adaln,
    apply_fused_adaln_to_sd3,
    apply_fused_adaln_to_wan,
    mmdit,
    wan,
)


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """diffusers zero-inits some projections; perturb every parameter so each term matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def tiny_wan() -> WanTransformer3DModel:
    torch.manual_seed(0)
    return _randomize(WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, rope_max_seq_len=64,
    ))


def wan_inputs(per_token: bool = False, batch: int = 2):
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, 4, 3, 4, 6, generator=gen)  # 3 * 2 * 3 = 18 tokens
    timestep = torch.randint(0, 1000, (batch, 18) if per_token else (batch,), generator=gen)
    return latents, timestep, torch.randn(batch, 5, 24, generator=gen)


def tiny_sd3(dual_attention_layers=(0,)) -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return _randomize(SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=8, dual_attention_layers=dual_attention_layers,
    ))


def sd3_inputs(batch: int = 2):
    gen = torch.Generator().manual_seed(2)
    return (torch.randn(batch, 4, 8, 8, generator=gen), torch.randn(batch, 6, 16, generator=gen),
            torch.randn(batch, 8, generator=gen), torch.randint(0, 1000, (batch,), generator=gen))


def tiny_flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return _randomize(FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    ))


def flux_inputs(batch: int = 2):
    gen = torch.Generator().manual_seed(3)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(3.0), torch.arange(4.0), indexing="ij"), -1)
    return (torch.randn(batch, 12, 8, generator=gen), torch.randn(batch, 5, 16, generator=gen),
            torch.randn(batch, 8, generator=gen), torch.rand(batch, generator=gen), img_ids.reshape(12, 3),
            torch.zeros(5, 3))


# --- Wan ----------------------------------------------------------------------------------------
def test_wan21_fp32_and_bf16():
    check_fp32(tiny_wan(), wan_inputs(), expected_replaced=2)
    check_bf16_noise(tiny_wan(), wan_inputs(), expected_replaced=2)


def test_wan22_per_token_modulation_fp32():
    check_fp32(tiny_wan(), wan_inputs(per_token=True), expected_replaced=2)


def test_wan_bf16_matches_eager_rounding():
    """Wan already modulates in fp32 and casts once, so patched bf16 is eager bf16 up to fp32
    summation order (a few bf16 ulps at most), not just within the model's noise."""
    model = tiny_wan().to(torch.bfloat16)
    patched, _ = patched_copy(model)
    inputs = wan_inputs()
    latents, timestep, text = inputs[0].bfloat16(), inputs[1], inputs[2].bfloat16()
    with torch.no_grad():
        assert rel_err(patched(latents, timestep, text).sample, model(latents, timestep, text).sample) <= 2**-7



def test_wan_broadcast_time_embedding_falls_back_exactly():
    """A (1, 6, D) temb shared by a batch of 2 broadcasts in eager Wan; the op takes (B, 1, D) only,
    so the block runs Wan's own expression for that call (docs/surgery.md), not a ValueError."""
    model = tiny_wan()
    block = model.blocks[0]
    patched, _ = patched_copy(block)
    gen = torch.Generator().manual_seed(6)
    x, context = torch.randn(2, 18, 32, generator=gen), torch.randn(2, 5, 32, generator=gen)
    temb = torch.randn(1, 6, 32, generator=gen)
    rotary = model.rope(wan_inputs()[0])
    with pytest.warns(RuntimeWarning, match=r"eager fallback for shift of shape \(1, 1, 32\)"):
        out = patched(x, context, temb, rotary)
    assert torch.equal(out, block(x, context, temb, rotary))

def test_wan_report_state_dict_idempotence():
    model = tiny_wan()
    check_state_dict_round_trip(model)
    check_idempotent(model)
    report = apply_fused_adaln(model)
    assert report.counts() == {"diffusers.WanTransformerBlock": 2}
    assert report.replaced["diffusers.WanTransformerBlock"] == ["blocks.0", "blocks.1"]
    assert [(m, c) for m, c, _ in report.left_alone] == [("", "WanTransformer3DModel")]
    assert type(model.blocks[0]) is WanTransformerBlock


def test_wan_gradient_checkpointing_path():
    model = tiny_wan()
    model.enable_gradient_checkpointing()
    check_fp32(model, wan_inputs(), expected_replaced=2)


def test_wan_class_helper(monkeypatch):
    monkeypatch.setattr(WanTransformerBlock, "__init__", WanTransformerBlock.__init__)  # undone after the test
    assert apply_fused_adaln_to_wan() == {"WanTransformerBlock": "patched"}
    assert apply_fused_adaln_to_wan() == {"WanTransformerBlock": "already patched"}
    model = tiny_wan()
    assert all(block.forward.__func__ is wan.wan_block_forward for block in model.blocks)
    report = apply_fused_adaln(model)
    assert report.num_replaced == 0 and report.already_fused == {"diffusers.WanTransformerBlock": ["blocks.0", "blocks.1"]}


def test_unchecked_diffusers_code_is_left_alone(monkeypatch):
    """A forward that is not the code we checked (another diffusers version) is reported, not patched."""
    source_forward = normalization.AdaLayerNormZero.forward

    def changed_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        return source_forward(self, x, timestep, class_labels, hidden_dtype, emb)

    monkeypatch.setattr(normalization.AdaLayerNormZero, "forward", changed_forward)
    report = apply_fused_adaln(normalization.AdaLayerNormZero(16))
    assert report.num_replaced == 0
    (_, cls, reason), = report.left_alone
    assert cls == "AdaLayerNormZero" and "checked against (diffusers 0.42.1)" in reason
    monkeypatch.setattr(WanTransformerBlock, "forward", lambda self, *a: None)
    monkeypatch.setattr(WanTransformerBlock, "__init__", WanTransformerBlock.__init__)
    with pytest.warns(RuntimeWarning, match="left WanTransformerBlock alone"):
        status = apply_fused_adaln_to_wan()
    assert "is not the code" in status["WanTransformerBlock"]


# --- SD3 / SD3.5 --------------------------------------------------------------------------------
SD35_COUNTS = {
    "diffusers.SD35AdaLayerNormZeroX": 1,  # block 0 norm1 (dual attention)
    "diffusers.AdaLayerNormZero": 2,  # block 0 norm1_context, block 1 norm1
    "diffusers.AdaLayerNormContinuous": 2,  # block 1 norm1_context (context_pre_only), norm_out
    "diffusers.JointTransformerBlock.norm2": 2,
}


def test_sd3_fp32_and_bf16():
    check_fp32(tiny_sd3(), sd3_inputs(), expected_replaced=7)
    check_bf16_noise(tiny_sd3(), sd3_inputs(), expected_replaced=7)


def test_sd3_chunked_feed_forward_fp32():
    model = tiny_sd3()
    model.enable_forward_chunking(chunk_size=2, dim=1)
    check_fp32(model, sd3_inputs(), expected_replaced=7)


def test_sd3_report_state_dict_idempotence():
    model = tiny_sd3()
    check_state_dict_round_trip(model)
    check_idempotent(model)
    report = apply_fused_adaln(model)
    assert report.counts() == SD35_COUNTS and report.left_alone == []
    assert report.replaced["diffusers.JointTransformerBlock.norm2"] == ["transformer_blocks.0", "transformer_blocks.1"]
    assert report.replaced["diffusers.SD35AdaLayerNormZeroX"] == ["transformer_blocks.0.norm1"]


def test_sd3_class_helper(monkeypatch):
    for cls in (normalization.AdaLayerNormZero, normalization.SD35AdaLayerNormZeroX,
                normalization.AdaLayerNormContinuous, diffusers.models.attention.JointTransformerBlock):
        monkeypatch.setattr(cls, "__init__", cls.__init__)
    assert set(apply_fused_adaln_to_sd3().values()) == {"patched"}
    report = apply_fused_adaln(tiny_sd3())
    assert report.num_replaced == 0 and {p: len(n) for p, n in report.already_fused.items()} == SD35_COUNTS


def test_ada_layer_norm_variants():
    gen = torch.Generator().manual_seed(4)
    x, emb = torch.randn(2, 9, 16, generator=gen), torch.randn(2, 16, generator=gen)
    # affine LayerNorm with bias, eps 1e-5: weight/bias/eps come from the module's own norm
    continuous = _randomize(normalization.AdaLayerNormContinuous(16, 16, elementwise_affine=True, eps=1e-5))
    check_fp32(continuous, (x, emb), expected_replaced=1)
    # norm_type="fp32_layer_norm": FP32LayerNorm with its default eps 1e-5
    zero_fp32 = _randomize(normalization.AdaLayerNormZero(16, norm_type="fp32_layer_norm"))
    check_fp32(zero_fp32, (x, None, None, None, emb), expected_replaced=1)
    # DiT-in-diffusers: timestep + class-label embedding inside the module
    labelled = _randomize(normalization.AdaLayerNormZero(16, num_embeddings=10))
    check_fp32(labelled, (x, torch.tensor([3, 700]), torch.tensor([1, 7]), torch.float32), expected_replaced=1)
    # RMSNorm: not a LayerNorm, reported and left alone
    rms = normalization.AdaLayerNormContinuous(16, 16, elementwise_affine=False, eps=1e-6, norm_type="rms_norm")
    report = apply_fused_adaln(rms)
    assert report.num_replaced == 0 and "RMSNorm, not a LayerNorm" in report.left_alone[0][2]


def test_dtype_promotion_falls_back_exactly():
    """bf16 x with an fp32 modulation Linear: eager's result is fp32, which the op cannot write."""
    module = _randomize(normalization.AdaLayerNormZero(16))
    patched, _ = patched_copy(module)
    gen = torch.Generator().manual_seed(5)
    x, emb = torch.randn(2, 9, 16, generator=gen).bfloat16(), torch.randn(2, 16, generator=gen)
    with pytest.warns(RuntimeWarning, match="eager fallback for result dtype torch.float32"):
        out = patched(x, emb=emb)
    expected = module(x, emb=emb)
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))


# --- Flux ---------------------------------------------------------------------------------------
def test_flux_fp32_bf16_and_report():
    counts = {"diffusers.AdaLayerNormZero": 2, "diffusers.FluxTransformerBlock.norm2": 1,
              "diffusers.AdaLayerNormZeroSingle": 1, "diffusers.AdaLayerNormContinuous": 1}
    check_fp32(tiny_flux(), flux_inputs(), expected_replaced=5)
    check_bf16_noise(tiny_flux(), flux_inputs(), expected_replaced=5)
    model = tiny_flux()
    check_state_dict_round_trip(model)
    check_idempotent(model)
    assert apply_fused_adaln(model).counts() == counts
    assert model.single_transformer_blocks[0].norm.forward.__func__ is mmdit.ada_layer_norm_zero_single_forward
