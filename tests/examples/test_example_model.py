"""The example Wan-2.1-style video DiT: shapes, gradients, block numerics and the loss against
hand formulas in fp64."""
import copy

import pytest
import torch
import torch.distributed.fsdp

from examples.video_dit.model import (DiTBlock, DiTConfig, VideoDiT, apply_rope, flow_matching_loss, rope_3d,
                                      timestep_embedding, unpatchify)
from examples.video_dit.module import VideoDiTModule

TINY = DiTConfig(in_channels=4, out_channels=4, dim=48, num_layers=2, num_heads=4, ffn_dim=96, text_dim=24,
                 freq_dim=32, patch=(1, 2, 2))


def _inputs(batch=2, t=3, h=4, w=6, text_len=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, TINY.in_channels, t, h, w, generator=g)
    text = torch.randn(batch, text_len, TINY.text_dim, generator=g)
    times = torch.rand(batch, generator=g)
    return latents, times, text


def test_forward_backward_shapes_and_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = VideoDiT(TINY)
    latents, times, text = _inputs()
    out = model(latents, times, text)
    assert out.shape == latents.shape
    out.square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_flow_matching_loss_matches_hand_formula_fp64():
    latents, times, text = (v.double() for v in _inputs(seed=1))
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    weight = torch.randn(latents.shape[1:], generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def model(x, t, txt):  # any function of (x_t, t, text) will do for checking the loss algebra
        return x * weight + t.view(-1, 1, 1, 1, 1) + txt.mean()

    loss = flow_matching_loss(model, latents, text, times, noise)
    expected = 0.0
    for i in range(latents.shape[0]):
        x_t = (1 - times[i]) * latents[i] + times[i] * noise[i]
        pred = x_t * weight + times[i] + text.mean()
        expected += ((pred - (noise[i] - latents[i])) ** 2).mean() / latents.shape[0]
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_block_modulation_chunk_order_and_fp32_formula():
    torch.manual_seed(0)
    block = DiTBlock(TINY.dim, TINY.ffn_dim, TINY.num_heads).double()
    x = torch.randn(2, 12, TINY.dim, dtype=torch.float64)
    e = torch.randn(2, 6, TINY.dim, dtype=torch.float64)
    context = torch.randn(2, 5, TINY.dim, dtype=torch.float64)
    rope = tuple(v.double() for v in rope_3d((1, 3, 4), TINY.dim // TINY.num_heads, x.device))

    seen = {}
    block.self_attn.register_forward_pre_hook(lambda m, args: seen.__setitem__("attn_in", args[0]))
    block.ffn.register_forward_pre_hook(lambda m, args: seen.__setitem__("ffn_in", args[0]))
    out = block(x, e, context, rope)

    mod = block.modulation + e  # (B, 6, D): shift, scale, gate (attention), shift, scale, gate (FFN)
    ln = lambda v: (v - v.mean(-1, keepdim=True)) / torch.sqrt(v.var(-1, unbiased=False, keepdim=True) + 1e-6)
    torch.testing.assert_close(seen["attn_in"], ln(x) * (1 + mod[:, 1:2]) + mod[:, 0:1])
    x1 = x + block.self_attn(seen["attn_in"], rope) * mod[:, 2:3]
    x2 = x1 + block.cross_attn(block.norm3(x1), context)
    torch.testing.assert_close(seen["ffn_in"], ln(x2) * (1 + mod[:, 4:5]) + mod[:, 3:4])
    torch.testing.assert_close(out, x2 + block.ffn(seen["ffn_in"]) * mod[:, 5:6])


def test_block_names_and_norm_types_are_the_surgery_contract():
    block = DiTBlock(TINY.dim, TINY.ffn_dim, TINY.num_heads)
    for name in ("norm1", "norm2"):
        norm = getattr(block, name)
        assert type(norm) is torch.nn.LayerNorm and not norm.elementwise_affine and norm.eps == 1e-6
    assert block.norm3.elementwise_affine
    assert block.modulation.shape == (1, 6, TINY.dim)


def test_rope_preserves_norm_and_depends_only_on_relative_position():
    head_dim = 12
    cos, sin = rope_3d((5, 1, 1), head_dim, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    rot = lambda v: apply_rope(v.expand(1, 1, 5, head_dim).double(), cos.double(), sin.double())[0, 0]
    rq, rk = rot(q), rot(k)
    torch.testing.assert_close(rq.norm(dim=-1), q.double().norm().expand(5))
    # <R_i q, R_j k> is a function of i - j only
    torch.testing.assert_close(rq[3] @ rk[1], rq[4] @ rk[2])
    torch.testing.assert_close(rq[2] @ rk[2], q.double() @ k.double())


def test_unpatchify_inverts_token_layout_of_patch_embedding():
    b, c, (pt, ph, pw), (gt, gh, gw) = 2, 3, (1, 2, 2), (2, 3, 4)
    latents = torch.randn(b, c, gt * pt, gh * ph, gw * pw)
    # token n = (t, h, w) in row-major order holds its patch's pixels in (pt, ph, pw, C) order
    tokens = latents.reshape(b, c, gt, pt, gh, ph, gw, pw).permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, gt * gh * gw, -1)
    torch.testing.assert_close(unpatchify(tokens, (gt, gh, gw), (pt, ph, pw), c), latents)
    # Conv3d patch embedding flattens its output grid in the same (t, h, w) order
    conv = torch.nn.Conv3d(c, 5, kernel_size=(pt, ph, pw), stride=(pt, ph, pw))
    emb = conv(latents).flatten(2).transpose(1, 2)
    manual = tokens.view(b, -1, pt, ph, pw, c).permute(0, 1, 5, 2, 3, 4).flatten(2) @ conv.weight.flatten(1).T + conv.bias
    torch.testing.assert_close(emb, manual, rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = VideoDiT(TINY)
    ckpt = copy.deepcopy(plain)
    ckpt.config = DiTConfig(**{**TINY.__dict__, "activation_checkpointing": True})
    latents, times, text = _inputs(seed=4)
    for model in (plain, ckpt):
        model(latents, times, text).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_bf16_autocast_keeps_modulation_fp32_and_output_dtype():
    torch.manual_seed(0)
    model = VideoDiT(TINY)
    latents, times, text = _inputs(seed=5)
    seen = {}
    model.blocks[0].norm1.register_forward_hook(lambda m, args, out: seen.__setitem__("norm1", out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(latents, times, text)
    assert seen["norm1"] == torch.float32
    ref = model(latents, times, text)
    assert (out.float() - ref).norm() / ref.norm() < 5e-2  # bf16 matmuls, fp32 modulation


@pytest.mark.parametrize("bad, match", [
    (lambda l, t, x: (l[:, :3], t, x), "latents must be"),
    (lambda l, t, x: (l[..., :5], t, x), "multiple of patch"),
    (lambda l, t, x: (l, t, x[..., :7]), "text must be"),
])
def test_bad_input_names_the_argument(bad, match):
    model = VideoDiT(TINY)
    with pytest.raises(ValueError, match=match):
        model(*bad(*_inputs()))


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        DiTConfig(dim=50, num_heads=4)
    with pytest.raises(ValueError, match="num_layers"):
        DiTConfig(num_layers=0)


def test_module_training_step_is_the_flow_matching_loss_of_its_batch():
    torch.manual_seed(0)
    module = VideoDiTModule(in_channels=4, dim=48, num_layers=1, num_heads=4, ffn_dim=96, text_dim=24, freq_dim=32)
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)  # no Trainer attached
    latents, _, text = _inputs(seed=6)
    torch.manual_seed(7)
    out = module.training_step({"latents": latents, "text": text, "seq_len": 36}, 0)
    torch.manual_seed(7)  # the step draws t, then the noise, from the global generator
    t = torch.rand(latents.shape[0])
    expected = flow_matching_loss(module.dit, latents, text, t, torch.randn_like(latents))
    torch.testing.assert_close(out["loss"], expected, rtol=0, atol=0)  # one process: no rescaling
    torch.testing.assert_close(logged["train/loss"], expected.detach())
    torch.testing.assert_close(out["local_loss"], expected.detach(), rtol=0, atol=0)
    assert out["loss"].requires_grad and not out["local_loss"].requires_grad
    opt = module.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == module.hparams.lr


def test_module_returns_the_unscaled_loss_next_to_the_rescaled_one(monkeypatch):
    # Under several ranks the returned "loss" is rescaled by this rank's share of the global batch;
    # callbacks that record the loss (benchmarks/e2e/e2e.py compares loss curves) need the unscaled one.
    monkeypatch.setattr("examples.video_dit.module.scale_loss_to_global_mean", lambda loss, count: loss * 0.25)
    torch.manual_seed(0)
    module = VideoDiTModule(in_channels=4, dim=48, num_layers=1, num_heads=4, ffn_dim=96, text_dim=24, freq_dim=32)
    module.log = lambda *args, **kwargs: None
    latents, _, text = _inputs(seed=6)
    torch.manual_seed(7)
    out = module.training_step({"latents": latents, "text": text, "seq_len": 36}, 0)
    torch.manual_seed(7)
    expected = flow_matching_loss(module.dit, latents, text, torch.rand(latents.shape[0]), torch.randn_like(latents))
    torch.testing.assert_close(out["local_loss"], expected.detach(), rtol=0, atol=0)
    torch.testing.assert_close(out["loss"], expected * 0.25, rtol=0, atol=0)


def test_module_can_build_the_network_in_configure_model():
    module = VideoDiTModule(in_channels=4, dim=48, num_layers=1, num_heads=4, ffn_dim=96, text_dim=24,
                            freq_dim=32, build_in_configure_model=True)
    assert module.dit is None and not list(module.parameters())
    module.configure_model()
    dit = module.dit
    module.configure_model()  # Lightning may call it again: keep the network
    assert module.dit is dit and isinstance(dit, VideoDiT) and len(dit.blocks) == 1


def _from_diffusers_wan(state: dict) -> dict:
    """diffusers WanTransformer3DModel state dict -> VideoDiT state dict (same tensors, Wan 2.1 T2V)."""
    renames = [("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
               ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
               ("condition_embedder.time_proj.", "time_projection.1."),
               ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
               ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
               (".attn1.to_out.0.", ".self_attn.o."), (".attn2.to_out.0.", ".cross_attn.o."),
               (".attn1.to_", ".self_attn."), (".attn2.to_", ".cross_attn."),
               (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."),
               (".norm2.", ".norm3."),  # diffusers' norm2 is the affine cross-attention norm
               (".ffn.net.0.proj.", ".ffn.0."), (".ffn.net.2.", ".ffn.2."),
               (".scale_shift_table", ".modulation"), ("proj_out.", "head.head.")]
    out = {}
    for key, value in state.items():
        key = "head.modulation" if key == "scale_shift_table" else key
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    return out


def test_matches_diffusers_wan_transformer_with_the_same_weights():
    """Independent reference: diffusers' Wan 2.1 transformer (fp64, random weights, tiny config)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=TINY.num_heads, attention_head_dim=TINY.dim // TINY.num_heads,
        in_channels=TINY.in_channels, out_channels=TINY.out_channels, text_dim=TINY.text_dim,
        freq_dim=TINY.freq_dim, ffn_dim=TINY.ffn_dim, num_layers=TINY.num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6).double().eval()
    with torch.no_grad():  # diffusers initialises the AdaLN tables and biases to constants: randomise
        for param in ref.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    # Diffusers computes the timestep sinusoid in fp32 (1e-5 error at 1000 rad); give it ours in fp64.
    class Sinusoid(torch.nn.Module):
        def forward(self, timesteps):
            return timestep_embedding(timesteps / 1000, TINY.freq_dim)

    ref.condition_embedder.timesteps_proj = Sinusoid()
    ours = VideoDiT(TINY).double().eval()
    ours.load_state_dict(_from_diffusers_wan(ref.state_dict()), strict=True)
    latents, times, text = (v.double() for v in _inputs(seed=8))
    with torch.no_grad():
        expected = ref(latents, times * 1000, text, return_dict=False)[0]
        got = ours(latents, times, text)
    # diffusers' FP32LayerNorm runs in fp32 even for an fp64 model: agreement to fp32 precision,
    # far below what any structural difference (chunk order, a missing norm, rope layout) gives
    rel_err = ((got - expected).norm() / expected.norm()).item()
    assert rel_err < 1e-6, rel_err


def test_timestep_embedding_matches_diffusers_and_the_formula():
    diffusers = pytest.importorskip("diffusers")
    t = torch.tensor([0.0, 0.25, 0.731, 1.0], dtype=torch.float64)
    ours = timestep_embedding(t, 32)
    half = torch.arange(16, dtype=torch.float64)
    args = 1000 * t[:, None] * torch.exp(-torch.log(torch.tensor(10000.0, dtype=torch.float64)) * half / 16)
    torch.testing.assert_close(ours, torch.cat([args.cos(), args.sin()], dim=1), rtol=0, atol=1e-12)
    ref = diffusers.models.embeddings.get_timestep_embedding(t * 1000, 32, flip_sin_to_cos=True, downscale_freq_shift=0)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=0, atol=1e-4)  # diffusers: fp32 arguments


def test_clips_through_the_packages_fsdp_norm_clipping():
    """The FSDP1 clipping override is the package's (tests/test_clipping.py tests it)."""
    from examples.video_dit.module import VideoDiTModule
    from lightning_adaptiveload.clipping import FSDPNormClipping

    assert issubclass(VideoDiTModule, FSDPNormClipping)
    assert VideoDiTModule.configure_gradient_clipping is FSDPNormClipping.configure_gradient_clipping


def test_compile_option_compiles_every_block_once_in_configure_model():
    from examples.video_dit.module import VideoDiTModule
    from lightning_adaptiveload.calibration.compiled import compiled_submodules

    tiny = dict(in_channels=4, dim=32, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=16)
    eager = VideoDiTModule(**tiny)
    eager.configure_model()
    assert compiled_submodules(eager) == []
    module = VideoDiTModule(**tiny, compile="dynamic")
    module.configure_model()
    first = [block._compiled_call_impl for block in module.dit.blocks]
    module.configure_model()  # Lightning may call it again: nothing is compiled twice
    assert [block._compiled_call_impl for block in module.dit.blocks] == first
    assert compiled_submodules(module) == ["dit.blocks.0", "dit.blocks.1"]
    with pytest.raises(ValueError, match="compile must be one of"):
        VideoDiTModule(**tiny, compile="fast")
