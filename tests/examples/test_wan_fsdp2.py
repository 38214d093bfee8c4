"""WanModule under FSDP2 (Lightning's ModelParallelStrategy) on two CPU ranks (gloo): one training
step with unequal batches (3 images on rank 0, 1 clip on rank 1), fused-AdaLN surgery and
PerBucketCheckpointing at a different depth per rank, gives the gradient of the mean loss over all
4 samples that a single unsharded model computes, and Lightning's norm clipping clips the global
norm. With bf16 compute and `pretrained`: each rank reads only its own rows of every weight, the
sharded weights are bit-exact, the modules diffusers keeps in fp32 outside the blocks gather and
compute in fp32 (their own fully_shard groups), the rest in bf16. The tests run this file as a
script (Lightning starts rank 1 by running it again)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64)
CLIP = 0.05  # far below the step's gradient norm (asserted), so clipping acts
DEPTH = {0: 2, 1: 1}  # blocks each rank checkpoints (batch["ac_blocks"])


def rank_batch(rank: int) -> dict:
    """Rank 0: 3 images of 4 tokens; rank 1: 1 clip of 16 tokens (unequal batch sizes and shapes)."""
    g = torch.Generator().manual_seed(100 + rank)
    batch_size, thw = (3, (1, 4, 4)) if rank == 0 else (1, (2, 4, 8))
    return {"latents": torch.randn(batch_size, 4, *thw, generator=g),
            "text": torch.randn(batch_size, 5, 32, generator=g), "ac_blocks": DEPTH[rank]}


def build_module(module_class, **kwargs):
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    kwargs = kwargs or dict(transformer_config=TINY, fsdp2_param_dtype="float32")
    return module_class(warmup_steps=0, **kwargs)


def _trainer(out_dir: Path, callbacks):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
                     tensor_parallel_size=1), max_steps=1, gradient_clip_val=CLIP, use_distributed_sampler=False,
                     callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(out_dir))


def mean_loss_backward(reference, drawn_files: list[Path]) -> None:
    """Backward of the mean loss over the 4 samples of both ranks (with the sigma and noise each rank
    drew) through one unsharded model: what scale_loss_to_global_mean + FSDP2's gradient average give."""
    from safetensors.torch import load_file

    total = 0
    for rank, path in enumerate(drawn_files):
        drawn, batch = load_file(str(path)), rank_batch(rank)
        n = batch["latents"].shape[0]
        total = total + n / 4 * reference.flow_matching_loss(batch["latents"], batch["text"], drawn["sigma"],
                                                             drawn["noise"])
    total.backward()


def _run_script(mode: str, out_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(key, None)  # a fresh two-process rendezvous
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), mode, str(out_dir)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


def run_two_ranks(out_dir: Path) -> None:
    from examples.wan.module import WanModule
    from lightning_adaptiveload.callbacks import FusedAdaLNSurgery, PerBucketCheckpointing

    class Recording(WanModule):
        def per_sample_loss(self, latents, text, sigma, noise):
            self.drawn = {"sigma": sigma.detach().clone(), "noise": noise.detach().clone()}
            self.depth = checkpointing.switch.checkpointed
            return super().per_sample_loss(latents, text, sigma, noise)

        def on_before_optimizer_step(self, optimizer):  # before Lightning clips
            self.grads = {name: p.grad.full_tensor() for name, p in self.transformer.named_parameters()}

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.clipped_norm = torch.stack([p.grad.full_tensor().norm() for p in self.parameters()]).norm().item()

        def train_dataloader(self):
            return torch.utils.data.DataLoader([rank_batch(self.global_rank)], batch_size=None)

    from safetensors.torch import save_file

    torch.set_num_threads(1)
    checkpointing = PerBucketCheckpointing(
        block_classes="diffusers.models.transformers.transformer_wan.WanTransformerBlock")
    module = build_module(Recording)
    trainer = _trainer(out_dir, [FusedAdaLNSurgery(require_replacement=True), checkpointing])
    trainer.fit(module)
    rank = trainer.global_rank
    weight = module.transformer.blocks[0].ffn.net[0].proj.weight
    save_file(module.drawn, str(out_dir / f"rank{rank}.safetensors"))
    info = {"depth": module.depth, "clipped_norm": module.clipped_norm, "local_rows": weight.to_local().shape[0],
            "rows": weight.shape[0], "placements": [str(p) for p in weight.placements],
            "fused": sum("forward" in vars(b) for b in module.transformer.blocks)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(info))
    if rank == 0:
        save_file(module.grads, str(out_dir / "grads.safetensors"))


@pytest.mark.slow
def test_two_cpu_ranks_give_the_single_process_gradient_and_clip_the_global_norm(tmp_path):
    _run_script("gradient", tmp_path)
    from safetensors.torch import load_file

    from examples.wan.module import WanModule

    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, info in enumerate(infos):
        assert info["depth"] == DEPTH[rank]  # PerBucketCheckpointing switched per rank
        assert info["fused"] == 2  # surgery's instance forwards survived fully_shard
        assert info["placements"] == ["S(0)"] and info["local_rows"] * 2 == info["rows"]  # sharded in two

    # Reference: one unsharded fp32 model, the two ranks' samples with their sigma and noise, the
    # mean loss over all 4 samples (what scale_loss_to_global_mean + FSDP2's gradient average give).
    reference = build_module(WanModule)
    mean_loss_backward(reference, [tmp_path / f"rank{rank}.safetensors" for rank in (0, 1)])
    grads = load_file(str(tmp_path / "grads.safetensors"))
    assert grads.keys() == dict(reference.transformer.named_parameters()).keys()
    for name, param in reference.transformer.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
    norm = torch.stack([p.grad.norm() for p in reference.parameters()]).norm().item()
    assert norm > 10 * CLIP
    for info in infos:  # clipped to CLIP by the norm over both shards
        assert info["clipped_norm"] == pytest.approx(CLIP, rel=1e-4)


@pytest.mark.slow
def test_a_mid_epoch_fsdp2_checkpoint_resumes_without_repeating_or_losing_a_sample(tmp_path):
    """Stop at step 3 of an epoch with a distributed (FSDP2) checkpoint, resume from it: each rank
    trains exactly the batches of an uninterrupted epoch, in the same order, each sample once."""
    from tests.examples.wan_fsdp2_resume_script import DATA_KWARGS, NUM_SAMPLES, RESUME_AT
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    from tests.helpers.resume import read_batches

    # shards and index written once, here, so the two ranks never race to create them
    AdaptiveLoadDataModule(shards=str(tmp_path / "shards"), index=str(tmp_path / "index.jsonl"),
                           synthesize=NUM_SAMPLES, **DATA_KWARGS).prepare_data()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "examples" / "wan_fsdp2_resume_script.py"),
                          str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]

    assert (tmp_path / "ckpt" / f"epoch=0-step={RESUME_AT}.ckpt").is_dir()  # FSDP2 writes a sharded checkpoint
    trained = []
    for rank in (0, 1):
        first, resumed, reference = (read_batches(tmp_path, fit, rank) for fit in ("first", "resumed", "reference"))
        assert len(first) == RESUME_AT and len(reference) > RESUME_AT + 1
        assert [b["keys"] for b in first + resumed] == [b["keys"] for b in reference]
        assert [b["step"] for b in resumed] == list(range(RESUME_AT, len(reference)))
        trained += [k for b in first + resumed for k in b["keys"]]
    # each sample once; with drop_last=False all but those longer than m_mem (the demo mix's longest
    # shape, skipped at setup and counted)
    skipped = AdaptiveLoadDataModule(shards=str(tmp_path / "shards"), index=str(tmp_path / "index.jsonl"),
                                     **DATA_KWARGS)
    skipped.setup("fit")
    assert len(trained) == len(set(trained)) == NUM_SAMPLES - skipped.skipped["over_max_seq_len"] > 0.9 * NUM_SAMPLES


def run_pretrained_bf16(out_dir: Path) -> None:
    """bf16 compute from the pretrained folder out_dir/pretrained: what each rank read from the files,
    the weights right after loading, the dtypes inside the forward, the FSDP groups, the gradients."""
    import examples.wan.loading as loading
    from examples.wan.module import WanModule
    from lightning_adaptiveload.callbacks import FusedAdaLNSurgery, PerBucketCheckpointing
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FSDPModule

    reads = []
    read_rows = loading.read_rows
    loading.read_rows = lambda file, key, index: reads.append((key, [[i.start, i.stop] for i in index])) \
        or read_rows(file, key, index)

    class Recording(WanModule):
        def on_fit_start(self):
            t = self.transformer
            self.loaded = {n: v.full_tensor() for n, v in t.state_dict().items()}  # every rank: a collective
            self.groups = sorted(n for n, m in t.named_modules() if isinstance(m, FSDPModule))
            self.seen = seen = {}
            embedder = t.condition_embedder.time_embedder
            embedder.linear_1.register_forward_hook(lambda m, a, o: seen.update(
                time_weight=str(m.weight.dtype), time_input=str(a[0].dtype), time_output=str(o.dtype)))
            # pre-hooks on the groups' own modules: after FSDP's unshard, before its reshard
            t.patch_embedding.register_forward_pre_hook(lambda m, a: seen.update(patch_weight=str(m.weight.dtype)))
            t.proj_out.register_forward_pre_hook(lambda m, a: seen.update(proj_out_weight=str(m.weight.dtype)))
            t.blocks[0].attn1.to_q.register_forward_hook(lambda m, a, o: seen.update(
                attn_weight=str(m.weight.dtype), block_scale_shift_table=str(t.blocks[0].scale_shift_table.dtype)))
            t.norm_out.register_forward_hook(lambda m, a, o: seen.update(
                norm_out_output=str(o.dtype), output_scale_shift_table=str(t.scale_shift_table.dtype)))

        def per_sample_loss(self, latents, text, sigma, noise):
            self.drawn = {"sigma": sigma.detach().clone(), "noise": noise.detach().clone()}
            return super().per_sample_loss(latents, text, sigma, noise)

        def on_before_optimizer_step(self, optimizer):
            self.grads = {name: p.grad.full_tensor() for name, p in self.transformer.named_parameters()}
            self.master = {name: str(p.dtype) for name, p in self.transformer.named_parameters()}

        def train_dataloader(self):
            return torch.utils.data.DataLoader([rank_batch(self.global_rank)], batch_size=None)

    torch.set_num_threads(1)
    block = "diffusers.models.transformers.transformer_wan.WanTransformerBlock"
    module = build_module(Recording, pretrained=str(out_dir / "pretrained"), fsdp2_param_dtype="bfloat16")
    trainer = _trainer(out_dir, [FusedAdaLNSurgery(require_replacement=True),
                                 PerBucketCheckpointing(block_classes=block)])
    trainer.fit(module)
    rank = trainer.global_rank
    save_file(module.drawn, str(out_dir / f"drawn{rank}.safetensors"))
    info = {"reads": reads, "seen": module.seen, "groups": module.groups, "master": module.master}
    (out_dir / f"bf16_rank{rank}.json").write_text(json.dumps(info))
    if rank == 0:
        save_file(module.grads, str(out_dir / "bf16_grads.safetensors"))
        save_file(module.loaded, str(out_dir / "loaded.safetensors"))


@pytest.mark.slow
def test_two_cpu_ranks_read_only_their_shards_and_keep_the_fp32_modules_in_fp32(tmp_path):
    import diffusers
    from safetensors.torch import load_file

    from examples.wan.module import WanModule

    torch.manual_seed(0)
    reference_model = diffusers.WanTransformer3DModel(**TINY)
    reference_model.save_pretrained(tmp_path / "pretrained", max_shard_size="20KB")  # several files + index
    _run_script("pretrained_bf16", tmp_path)
    infos = [json.loads((tmp_path / f"bf16_rank{r}.json").read_text()) for r in (0, 1)]

    # each rank read its own rows of every parameter, together every row once
    expected = reference_model.state_dict()
    for name, value in expected.items():
        rows = value.shape[0]
        chunk = -(-rows // 2)
        got = [[index for key, index in info["reads"] if key == name] for info in infos]
        spans = [(r * chunk, min((r + 1) * chunk, rows)) for r in (0, 1)]
        for rank in (0, 1):
            begin, end = spans[rank]
            wanted = [] if begin >= end else [[[begin, end]] + [[0, n] for n in value.shape[1:]]]
            assert got[rank] == wanted, (name, rank, got[rank])
    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())  # bit-exact after sharding

    # the groups: every block, each bf16 module of the root, and the root (what is kept in fp32)
    assert infos[0]["groups"] == ["", "blocks.0", "blocks.1", "condition_embedder.text_embedder",
                                  "condition_embedder.time_proj", "patch_embedding", "proj_out"]
    for info in infos:
        seen = info["seen"]
        fp32 = ("time_weight", "time_input", "time_output", "output_scale_shift_table", "norm_out_output")
        assert all(seen[k] == "torch.float32" for k in fp32), seen
        bf16 = ("patch_weight", "proj_out_weight", "attn_weight", "block_scale_shift_table")  # the block's: doc
        assert all(seen[k] == "torch.bfloat16" for k in bf16), seen
        assert set(info["master"].values()) == {"torch.float32"}  # sharded master weights stay fp32

    # the gradient of the mean loss over the 4 samples, against one unsharded fp32 model: bf16 compute
    # is close, and a group reduced wrongly (summed, or missing a rank) would be off by 2x or more
    reference = build_module(WanModule, transformer_config=TINY, fsdp2_param_dtype="float32")
    reference.transformer.load_state_dict(expected)
    mean_loss_backward(reference, [tmp_path / f"drawn{rank}.safetensors" for rank in (0, 1)])
    grads = load_file(str(tmp_path / "bf16_grads.safetensors"))
    for name, param in reference.transformer.named_parameters():
        error = ((grads[name] - param.grad).norm() / param.grad.norm()).item()
        assert error < 0.1, (name, error)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    {"gradient": run_two_ranks, "pretrained_bf16": run_pretrained_bf16}[sys.argv[1]](Path(sys.argv[2]))
