"""GPU: surgery with the CUDA kernels on Wan-1.3B-shaped and SD3.5-shaped diffusers models
(2 layers each, random weights): fp32 agreement and bf16 within the model's own noise against
an fp64 run (Wan: by its pattern and by the idiom recogniser), plus torch.compile (inductor) of a
patched Wan block. Run by benchmarks/gpu_surgery.sh."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.surgery import check_bf16_noise, check_fp32, grad_floor, patched_copy, rel_err

pytestmark = pytest.mark.cuda
diffusers = pytest.importorskip("diffusers", reason="diffusers extra not installed (pip install '.[diffusers]')")
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel  # noqa: E402

from lightning_adaptiveload import ops  # noqa: E402

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """TF32 would hide fp32 differences of the op behind matmul rounding."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen, device=DEVICE, dtype=p.dtype))
    return model


def wan_1p3b_layers(num_layers: int = 2) -> WanTransformer3DModel:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                      in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                      num_layers=num_layers)
    return _randomize(model)


def wan_inputs(per_token: bool = False):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    latents = torch.randn(2, 16, 3, 32, 52, generator=gen, device=DEVICE)  # 3 * 16 * 26 = 1248 tokens
    shape = (2, 1248) if per_token else (2,)
    timestep = torch.randint(0, 1000, shape, generator=gen, device=DEVICE)
    return latents, timestep, torch.randn(2, 64, 4096, generator=gen, device=DEVICE)


def sd35_layers() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=2,
                                      attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                                      caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                                      pos_embed_max_size=96, dual_attention_layers=(0,))
    return _randomize(model)


def sd3_inputs():
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    return (torch.randn(2, 16, 32, 32, generator=gen, device=DEVICE), torch.randn(2, 77, 4096, generator=gen, device=DEVICE),
            torch.randn(2, 2048, generator=gen, device=DEVICE), torch.randint(0, 1000, (2,), generator=gen, device=DEVICE))


def test_cuda_kernels_are_used():
    assert ops.backend().startswith("cuda"), ops.backend()


@pytest.mark.parametrize("surgery", [{}, {"patterns": []}], ids=["pattern", "idiom"])
def test_wan21_cuda_fp32_and_bf16(surgery):
    check_fp32(wan_1p3b_layers(), wan_inputs(), expected_replaced=2, **surgery)
    check_bf16_noise(wan_1p3b_layers(), wan_inputs(), expected_replaced=2, **surgery)


def test_wan22_per_token_cuda_bf16():
    check_bf16_noise(wan_1p3b_layers(), wan_inputs(per_token=True), expected_replaced=2)


def test_sd35_cuda_fp32_and_bf16():
    check_fp32(sd35_layers(), sd3_inputs(), expected_replaced=7)
    check_bf16_noise(sd35_layers(), sd3_inputs(), expected_replaced=7)


def test_compile_patched_wan_block_inductor():
    model = wan_1p3b_layers(num_layers=1).to(torch.bfloat16)
    patched, _ = patched_copy(model)
    patched.blocks[0] = torch.compile(patched.blocks[0], fullgraph=True)
    latents, timestep, text = wan_inputs()
    latents, text = latents.bfloat16(), text.bfloat16()
    out = patched(latents, timestep, text).sample
    out.float().square().mean().backward()
    ref = model(latents, timestep, text).sample
    ref.float().square().mean().backward()
    # compiled vs eager bf16: inductor fuses the surrounding ops and rounds differently
    assert rel_err(out, ref) <= 2**-6
    floor = grad_floor({n: p.grad for n, p in model.named_parameters()})
    for (name, p), p_ref in zip(patched.named_parameters(), model.parameters(), strict=True):
        assert rel_err(p.grad, p_ref.grad, floor) <= 2**-5, name
