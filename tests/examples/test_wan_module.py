"""examples/wan: WanModule trains diffusers' WanTransformer3DModel. The loss against the
flow-matching formula by hand (fp64), the loss scaling, forward + backward on the DataModule's batch
format, the optimizer and its warm-up, fused-AdaLN surgery of every block, FSDP2
(ModelParallelStrategy) on one CPU process, the configs, and the CPU demo end to end. The noise
levels, caption dropout and loss weighting: test_wan_objective.py; loading: test_wan_loading.py;
precision: test_wan_precision.py; the EMA: test_wan_ema.py."""
import copy
import csv
import json
import math
import types
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

diffusers = pytest.importorskip("diffusers")

from examples.wan.module import WAN21_T2V_1_3B, WanModule  # noqa: E402
from lightning_adaptiveload.cli import main  # noqa: E402
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.surgery import apply_fused_adaln  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(transformer_config=None, **kwargs) -> WanModule:
    torch.manual_seed(0)
    module = WanModule(transformer_config=transformer_config or TINY, **kwargs)
    module.log = lambda *args, **kw: None  # no Trainer attached
    return module


def _batch(batch_size=2, thw=(3, 4, 6), text_len=5, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(batch_size, TINY["in_channels"], *thw, generator=g),
            "text": torch.randn(batch_size, text_len, TINY["text_dim"], generator=g)}


# -- the model --

def test_default_config_is_the_published_wan21_t2v_1_3b():
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json; diffusers' class defaults are the 14B
    published = {"patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
                 "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
                 "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
                 "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None}
    assert WAN21_T2V_1_3B == published
    with torch.device("meta"):  # shapes only: no 5.7 GB of fp32 weights
        module = WanModule()
    assert isinstance(module.transformer, diffusers.WanTransformer3DModel)
    assert dict(module.transformer.config) | published == dict(module.transformer.config)
    # the count the example VideoDiT has at the same shape (docs/lightning.md), which loads these weights
    assert sum(p.numel() for p in module.parameters()) == 1_418_996_800


def test_transformer_config_overrides_key_by_key_and_rejects_unknown_keys():
    module = _tiny()
    config = module.transformer.config
    assert (config.num_layers, config.ffn_dim, config.text_dim) == (2, 64, 32)
    assert config.eps == 1e-6 and config.cross_attn_norm and tuple(config.patch_size) == (1, 2, 2)  # kept
    with pytest.raises(ValueError, match="does not take: \\['num_blocks'\\]"):
        WanModule(transformer_config={"num_blocks": 2})
    for bad, match in [(dict(compile="fast"), "compile must be one of"), (dict(shift_rule="flux"), "shift_rule"),
                       (dict(timestep_sampling="beta"), "timestep_sampling"),
                       (dict(shift=0.0), "shift must be a finite number > 0"),
                       (dict(shift_reference_area=0), "shift_reference_area"), (dict(shift_min=0), "shift_min"),
                       (dict(caption_dropout=1.0), "caption_dropout must be a probability"),
                       (dict(caption_dropout=-0.1), "caption_dropout"),
                       (dict(loss_weighting="pixel"), "loss_weighting"),
                       (dict(loss_weighting="token"), "loss_reference_tokens"),
                       (dict(lr=0), "lr"), (dict(warmup_steps=-1), "warmup_steps"),
                       (dict(ema_decay=1.0), "ema_decay must be in"),
                       (dict(fsdp2_param_dtype="float16"), "fsdp2_param_dtype")]:
        with pytest.raises(ValueError, match=match):
            WanModule(transformer_config=TINY, **bad)


def test_configure_model_builds_when_deferred_and_compiles_every_block_once():
    from lightning_adaptiveload.calibration.compiled import compiled_submodules

    module = WanModule(transformer_config=TINY, build_in_configure_model=True, compile="dynamic")
    assert module.transformer is None and not list(module.parameters())
    module.configure_model()
    first = [block._compiled_call_impl for block in module.transformer.blocks]
    transformer = module.transformer
    module.configure_model()  # Lightning may call it again: nothing is built or compiled twice
    assert module.transformer is transformer
    assert [block._compiled_call_impl for block in module.transformer.blocks] == first
    assert compiled_submodules(module) == ["transformer.blocks.0", "transformer.blocks.1"]
    assert module.input_dtype() == torch.float32  # no trainer, no FSDP2: the parameters' dtype


# -- the objective --

def test_loss_is_the_flow_matching_formula_by_hand_fp64():
    module = _tiny()
    batch = _batch(seed=1)
    x0 = batch["latents"].double()
    g = torch.Generator().manual_seed(2)
    sigma = torch.tensor([0.2, 0.85])
    noise = torch.randn(x0.shape, generator=g)
    seen = {}

    def record(mod, args, kwargs, output):
        seen.update(x_t=kwargs["hidden_states"], timestep=kwargs["timestep"], text=kwargs["encoder_hidden_states"],
                    pred=output[0])

    module.transformer.register_forward_hook(record, with_kwargs=True)
    loss = module.flow_matching_loss(batch["latents"], batch["text"], sigma, noise)

    s = sigma.double().view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * noise.double()
    torch.testing.assert_close(seen["x_t"].double(), x_t, rtol=0, atol=1e-6)  # fp32 rounding of the same formula
    torch.testing.assert_close(seen["timestep"], sigma * 1000, rtol=0, atol=0)  # float timesteps, not truncated
    assert seen["timestep"].dtype == torch.float32
    torch.testing.assert_close(seen["text"], batch["text"], rtol=0, atol=0)
    velocity = noise.double() - x0
    expected = sum(((seen["pred"][i].double() - velocity[i]) ** 2).mean() for i in range(2)) / 2
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_sigma_shift_follows_the_batch_frame_area():
    module = _tiny(shift_rule="sqrt_area", shift=2.0, shift_reference_area=24)
    seen = {}
    original = module.sample_sigmas

    def spy(batch_size, frame_tokens, device):
        seen["frame_tokens"] = frame_tokens
        return original(batch_size, frame_tokens, device)

    module.sample_sigmas = spy
    module.training_step(_batch(thw=(3, 4, 6)), 0)  # patch (1, 2, 2): 3 frames of 2 x 3 tokens
    assert seen["frame_tokens"] == 6
    assert module.shift_for(6) == 1.0  # 2 * sqrt(6 / 24) = 1, the floor
    assert module.shift_for(96) == pytest.approx(2.0 * math.sqrt(96 / 24))
    assert _tiny().shift_for(6) == _tiny().shift_for(10**6) == 3.0  # the default: fixed 3


def test_training_step_draws_sigma_then_noise_and_returns_the_unscaled_loss_too(monkeypatch):
    calls = []

    def fake_scale(loss, count):
        calls.append(count)
        return loss * 0.25

    monkeypatch.setattr("examples.wan.module.scale_loss_to_global_mean", fake_scale)
    module = _tiny()
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    batch = _batch(batch_size=3, seed=5)
    torch.manual_seed(7)
    out = module.training_step(batch, 0)
    torch.manual_seed(7)
    sigma = module.sample_sigmas(3, 6, "cpu")
    expected = module.flow_matching_loss(batch["latents"], batch["text"], sigma, torch.randn(batch["latents"].shape))
    assert calls == [3]  # the rank's sample count
    torch.testing.assert_close(out["local_loss"], expected.detach(), rtol=0, atol=0)
    torch.testing.assert_close(out["loss"], expected * 0.25, rtol=0, atol=0)
    torch.testing.assert_close(logged["train/loss"], expected.detach(), rtol=0, atol=0)
    assert out["loss"].requires_grad and not out["local_loss"].requires_grad


def test_loss_scaling_is_identity_on_one_process():
    module = _tiny()
    torch.manual_seed(1)
    out = module.training_step(_batch(), 0)
    torch.testing.assert_close(out["loss"].detach(), out["local_loss"], rtol=0, atol=0)


def test_training_step_runs_forward_and_backward_on_a_datamodule_batch():
    dm = AdaptiveLoadDataModule(shards="unused", latent_channels=4, text_len=8, text_dim=32)
    batch = dm.synthetic_batch((2, 8, 8), 3)  # the training batch structure: latents, text, seq_len, ...
    assert batch["seq_len"] == 2 * 4 * 4
    module = _tiny()
    torch.manual_seed(0)
    out = module.training_step(batch, 0)
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    for name, param in module.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
    opt = module.configure_optimizers()["optimizer"]
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == module.hparams.lr
    before = [p.detach().clone() for p in module.parameters()]
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, module.parameters()))


def test_optimizer_defaults_are_a_full_fine_tune_with_a_linear_warm_up():
    module = _tiny()
    hp = module.hparams
    assert (hp.lr, hp.warmup_steps, hp.weight_decay, hp.ema_decay) == (1e-5, 100, 0.01, None)
    module = _tiny(lr=2e-5, warmup_steps=4)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"  # per optimizer step, not per epoch
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2e-5 * k / 4 for k in (1, 2, 3, 4)] + [2e-5, 2e-5], rel=1e-12)
    assert isinstance(_tiny(warmup_steps=0).configure_optimizers(), torch.optim.AdamW)  # no scheduler


@pytest.mark.parametrize("bad, match", [
    (dict(latents=torch.randn(2, 3, 1, 4, 4)), r"latents'\] must be \(B, 4, T, H, W\)"),
    (dict(latents=torch.randn(2, 4, 1, 5, 4)), "not a multiple of patch_size"),
    (dict(text=torch.randn(2, 5, 31)), r"text'\] must be \(2, L, 32\)"),
    (dict(text=torch.randn(3, 5, 32)), r"text'\] must be \(2, L, 32\)"),
])
def test_bad_batch_names_the_input(bad, match):
    batch = {**_batch(thw=(1, 4, 4)), **bad}
    with pytest.raises(ValueError, match=match):
        _tiny().training_step(batch, 0)


# -- surgery --

def test_fused_adaln_surgery_replaces_every_block_and_keeps_the_outputs(monkeypatch):
    import lightning_adaptiveload.surgery.core as core

    fused_calls = []
    op = core.adaln_any_stride
    monkeypatch.setattr(core, "adaln_any_stride", lambda *args: fused_calls.append(args[0].dtype) or op(*args))
    module = _tiny(transformer_config={**TINY, "num_layers": 3})
    unfused = copy.deepcopy(module)
    report = apply_fused_adaln(module)
    names = [f"transformer.blocks.{i}" for i in range(3)]
    assert report.replaced == {"diffusers.WanTransformerBlock": names}
    assert [m for m, _, _ in report.left_alone] == ["transformer"]  # the root's once-per-step output AdaLN
    assert all("forward" in block.__dict__ for block in module.transformer.blocks)
    batch = _batch(seed=9)
    sigma = torch.tensor([0.3, 0.9])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (module, unfused):
        loss = model.flow_matching_loss(batch["latents"], batch["text"], sigma, noise)
        loss.backward()
        losses.append(loss)
    assert fused_calls == [torch.float32] * 6  # the fused op ran at norm1 and norm3 of each block, once
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    for (name, p), q in zip(module.named_parameters(), unfused.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # bf16 compute (what bf16-mixed runs): the fused op rounds once, eager after each step
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        x_t = (1 - sigma.view(-1, 1, 1, 1, 1)) * batch["latents"] + sigma.view(-1, 1, 1, 1, 1) * noise
        fused, plain = (m.transformer(x_t, sigma * 1000, batch["text"], return_dict=False)[0].float()
                        for m in (module, unfused))
    assert fused_calls[6:] == [torch.bfloat16] * 6
    # on the CPU the op's reference computes what Wan's eager expression does (fp32, one cast back)
    assert ((fused - plain).norm() / plain.norm()).item() < 1e-2


# -- gradient clipping --

def test_clips_through_the_packages_fsdp_norm_clipping():
    """The FSDP1 clipping override is the package's (tests/test_clipping.py tests it)."""
    from examples.wan.module import WanModule
    from lightning_adaptiveload.clipping import FSDPNormClipping

    assert issubclass(WanModule, FSDPNormClipping)
    assert WanModule.configure_gradient_clipping is FSDPNormClipping.configure_gradient_clipping


# -- FSDP2 on the CPU --

def test_model_parallel_strategy_shards_with_fsdp2_and_trains_on_one_cpu_process(tmp_path):
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    module = _tiny()
    del module.log  # a real Trainer logs
    initial = {k: v.clone() for k, v in module.transformer.state_dict().items()}
    batches = [_batch(batch_size=2, thw=(1, 4, 4), seed=s) for s in range(3)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(1, 1), max_steps=3,
                        gradient_clip_val=0.5, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=loader)
    assert isinstance(module.transformer, FSDPModule)
    assert all(isinstance(block, FSDPModule) for block in module.transformer.blocks)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in module.parameters())  # fp32 master
    assert module.input_dtype() == torch.bfloat16  # compute dtype of the MixedPrecisionPolicy
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    after = {k: v.full_tensor() for k, v in module.transformer.state_dict().items()}
    assert all(not torch.equal(initial[k], after[k]) for k in initial)  # every tensor trained


def test_fsdp2_refuses_tensor_parallelism():
    module = _tiny()
    mesh = {"tensor_parallel": types.SimpleNamespace(size=lambda: 2)}
    module._device_mesh = mesh
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        module._fully_shard()


# -- configs --

@pytest.mark.parametrize("name", ["wan21_demo", "wan21_1.3b", "wan21_1.3b_fsdp2"])
def test_configs_parse(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "examples.wan.module.WanModule"
    callbacks = [cb["class_path"].rsplit(".", 1)[1] for cb in printed["trainer"]["callbacks"]]
    assert callbacks[0] == "FusedAdaLNSurgery" and "CostModelCalibration" in callbacks
    assert printed["trainer"]["callbacks"][0]["init_args"]["require_replacement"] is True
    if name == "wan21_demo":
        assert printed["model"]["init_args"]["transformer_config"]["num_layers"] == 2
        assert printed["trainer"]["accelerator"] == "cpu"
    else:
        assert callbacks.index("PerBucketCheckpointing") < callbacks.index("CostModelCalibration")
        assert printed["data"]["init_args"]["memory_planning"] is True
        assert printed["model"]["init_args"]["compile"] == "auto"
    if name == "wan21_1.3b_fsdp2":
        strategy = printed["trainer"]["strategy"]
        assert strategy["class_path"].endswith("ModelParallelStrategy")
        assert strategy["init_args"]["tensor_parallel_size"] == 1 and printed["trainer"]["precision"] == "32-true"


@pytest.mark.slow
def test_wan21_demo_config_trains_end_to_end_on_cpu(tmp_path, capsys):
    """wan21_demo.yaml with fewer samples, a smaller calibration grid and 3 steps, under tmp_path."""
    config = yaml.safe_load((CONFIGS / "wan21_demo.yaml").read_text())
    config["trainer"].update(max_steps=3, default_root_dir=str(tmp_path), enable_progress_bar=False,
                             enable_model_summary=False, log_every_n_steps=1)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path)
    calibration = next(cb["init_args"] for cb in config["trainer"]["callbacks"]
                       if cb["class_path"].endswith("CostModelCalibration"))
    # any fit is trusted here: CPU timings on a shared machine are noise (the trust check has its own tests)
    calibration.update(num_seq_lens=3, batch_sizes=[1, 2, 4], repeats=1, max_heldout_error=float("inf"),
                       min_work_correlation=-1)
    config["data"]["init_args"].update(shards=str(tmp_path / "shards"), index=str(tmp_path / "index.jsonl"),
                                       synthesize=48, synthesize_shapes=str(CONFIGS / "demo_mix.jsonl"))
    path = tmp_path / "wan21_demo.yaml"
    path.write_text(yaml.safe_dump(config))

    assert main(["fit", "--config", str(path)]) == 0
    log_dir = tmp_path / "logs" / "version_0"
    surgery = json.loads((log_dir / "fused_adaln_surgery.json").read_text())
    assert surgery["replaced"] == {"diffusers.WanTransformerBlock": ["transformer.blocks.0", "transformer.blocks.1"]}
    doc = json.loads((log_dir / "calibration.json").read_text())
    assert len(doc["measurements"]) == 9 and doc["trusted"]
    shapes = doc["verification"]["shapes"]
    assert shapes and all(m["status"] == "fits" for m in shapes)
    with open(log_dir / "metrics.csv") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) == 3 and all(0 < v < 100 for v in losses)
    assert (log_dir / "balance_per_rank.csv").exists() and "LoadBalanceMonitor" in capsys.readouterr().out
