"""examples/wan/precision.py: the time embedder computes in fp32 under bf16 autocast; FSDP1 with the
Wan mixed precision (torch's FSDP on one gloo process, as Lightning's FSDPStrategy wraps it: Lightning
refuses FSDP on the CPU) gathers the time embedder in fp32, the rest in bf16, leaves the RoPE tables
and the batch alone and reduces in fp32; WanModule.setup gives FSDPStrategy under bf16-mixed that
policy unless the config has one. The same through Lightning on a GPU (cuda mark). FSDP2's fp32
groups on two gloo processes: test_wan_fsdp2.py."""
import os
import socket
import types

import lightning as L
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from examples.wan.module import WanModule  # noqa: E402
from examples.wan.precision import fsdp1_mixed_precision, kept_in_fp32  # noqa: E402

TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(**kwargs) -> WanModule:
    torch.manual_seed(0)
    module = WanModule(transformer_config=TINY, warmup_steps=0, **kwargs)
    module.log = lambda *args, **kw: None
    return module


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(2, 4, 1, 4, 4, generator=g), "text": torch.randn(2, 5, 32, generator=g)}


def _record_dtypes(transformer) -> dict:
    """What the kept-in-fp32 and the bf16 modules compute with, seen from inside their forwards."""
    seen = {}
    embedder = transformer.condition_embedder.time_embedder
    embedder.linear_1.register_forward_hook(lambda m, a, o: seen.update(
        time_weight=m.weight.dtype, time_input=a[0].dtype, time_output=o.dtype))
    embedder.linear_2.register_forward_hook(lambda m, a, o: seen.update(time_embedding=o.dtype))
    transformer.patch_embedding.register_forward_hook(lambda m, a, o: seen.update(patch_weight=m.weight.dtype,
                                                                                  patch_output=o.dtype))
    transformer.blocks[0].attn1.to_q.register_forward_hook(lambda m, a, o: seen.update(attn_output=o.dtype))
    transformer.blocks[0].norm2.register_forward_hook(lambda m, a, o: seen.update(norm2_output=o.dtype))
    transformer.norm_out.register_forward_hook(lambda m, a, o: seen.update(
        norm_out_output=o.dtype, rope=transformer.rope.freqs_cos.dtype))
    return seen


def test_kept_in_fp32_matches_diffusers_names():
    keep = tuple(diffusers.WanTransformer3DModel._keep_in_fp32_modules)
    assert {"time_embedder", "scale_shift_table", "norm1", "norm2", "norm3", "rope"} <= set(keep)
    assert kept_in_fp32("condition_embedder.time_embedder.linear_1.weight", keep)
    assert kept_in_fp32("blocks.3.norm2.bias", keep) and kept_in_fp32("scale_shift_table", keep)
    assert not kept_in_fp32("blocks.3.attn1.norm_q.weight", keep)  # a component match, not a substring
    assert not kept_in_fp32("condition_embedder.time_proj.weight", keep)


def test_time_embedder_computes_in_fp32_under_bf16_autocast():
    module = _tiny()
    plain = diffusers.WanTransformer3DModel(**TINY)  # diffusers' own forward, for contrast
    plain.load_state_dict(module.transformer.state_dict())
    seen, plain_seen = _record_dtypes(module.transformer), _record_dtypes(plain)
    batch = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        module.training_step(batch, 0)
        plain(batch["latents"], torch.tensor([500.0, 17.0]), batch["text"], return_dict=False)
    assert seen["time_input"] == seen["time_output"] == seen["time_embedding"] == torch.float32
    assert plain_seen["time_output"] == torch.bfloat16  # what autocast alone does to it
    assert seen["attn_output"] == seen["patch_output"] == torch.bfloat16  # the rest still autocasts
    assert seen["norm2_output"] == torch.float32  # FP32LayerNorm on the block's fp32 input
    # the fp32 time embedding itself, against the module's own forward without autocast
    sinusoid = module.transformer.condition_embedder.timesteps_proj(torch.tensor([500.0, 17.0]))
    embedder = module.transformer.condition_embedder.time_embedder
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32 = embedder(sinusoid)
    torch.testing.assert_close(fp32, type(embedder).forward(embedder, sinusoid), rtol=0, atol=0)


@pytest.fixture
def gloo_one_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield  # conftest's no_process_group_left_behind destroys the group


def test_fsdp1_wan_policy_keeps_the_time_embedder_rope_and_batch_out_of_bf16(gloo_one_process):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    from lightning.pytorch.strategies.strategy import _ForwardRedirection
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    module = _tiny()
    seen = _record_dtypes(module.transformer)
    inputs = {}
    module.transformer.register_forward_pre_hook(lambda m, a, k: inputs.update(x_t=k["hidden_states"].dtype),
                                                 with_kwargs=True)
    latents_seen = []
    step = module.training_step
    module.training_step = lambda batch, i: latents_seen.append(batch["latents"].dtype) or step(batch, i)
    policy = fsdp1_mixed_precision()
    assert (policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype) == (torch.bfloat16, torch.float32, None)
    # as Lightning's FSDPStrategy wraps: the LightningModule the root, auto_wrap_policy the blocks
    wrapped = FSDP(module, auto_wrap_policy=ModuleWrapPolicy({WanTransformerBlock}), mixed_precision=policy,
                   device_id=torch.device("cpu"), use_orig_params=True)
    units = [name for name, m in wrapped.named_modules() if isinstance(m, FSDP)]
    assert "_fsdp_wrapped_module.transformer.condition_embedder.time_embedder" in units
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _ForwardRedirection()(wrapped, module, "training_step", _batch(), 0)
    out["loss"].backward()
    assert latents_seen == [torch.float32]  # the batch is not cast to bf16 before training_step
    assert seen["time_weight"] == seen["time_output"] == seen["time_embedding"] == torch.float32
    assert seen["patch_weight"] == torch.bfloat16 and seen["attn_output"] == torch.bfloat16
    assert seen["rope"] == torch.float32  # the RoPE tables keep their dtype (Lightning's default: bf16)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in wrapped.parameters())


def test_setup_gives_fsdp1_under_bf16_mixed_the_wan_policy_unless_the_config_has_one():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
    from torch.distributed.fsdp import MixedPrecision

    def setup(strategy, precision):
        module = _tiny()
        module._trainer = types.SimpleNamespace(strategy=strategy, precision=precision)
        module.setup("fit")
        return strategy

    assert setup(FSDPStrategy(), "bf16-mixed").mixed_precision == fsdp1_mixed_precision()
    own = MixedPrecision(param_dtype=torch.bfloat16)
    assert setup(FSDPStrategy(mixed_precision=own), "bf16-mixed").mixed_precision is own
    assert setup(FSDPStrategy(), "32-true").mixed_precision is None
    assert not hasattr(setup(DDPStrategy(), "bf16-mixed"), "mixed_precision")


@pytest.mark.cuda
def test_lightning_fsdp1_bf16_mixed_on_a_gpu_keeps_the_fp32_modules(tmp_path):
    """The policy as Lightning's FSDPStrategy applies it (GPU only: Lightning refuses FSDP on the CPU)."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    from lightning.pytorch.strategies import FSDPStrategy

    module = _tiny()
    del module.log
    seen = _record_dtypes(module.transformer)
    loader = torch.utils.data.DataLoader([_batch(s) for s in range(2)], batch_size=None)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=FSDPStrategy(auto_wrap_policy={WanTransformerBlock}),
                        precision="bf16-mixed", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.strategy.mixed_precision == fsdp1_mixed_precision()
    assert seen["time_weight"] == seen["time_output"] == torch.float32
    assert seen["patch_weight"] == torch.bfloat16 and seen["rope"] == torch.float32
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
