"""2-GPU FSDP Lightning run with FusedAdaLNSurgery on a Wan-1.3B-shaped diffusers model (4 layers).

    torchrun --nproc_per_node 2 tests/surgery/test_fsdp.py --out DIR

Two fits from the same seed and data, FULL_SHARD, bf16-mixed, FSDP auto-wrap and activation
checkpointing keyed on WanTransformerBlock: eager, then with the callback. Exits non-zero unless
the callback fused every block, FSDP still wrapped and checkpointed every block (classes kept),
and the per-step losses agree within 2% (bf16-mixed training of the same model on the same data).
Writes DIR/fsdp_surgery.json. Under pytest this file only launches itself (needs 2 GPUs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LOSS_RTOL = 2e-2


@pytest.mark.cuda
def test_fsdp_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("diffusers", reason="diffusers extra not installed")
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", __file__, "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert json.loads((tmp_path / "fsdp_surgery.json").read_text())["passed"]


def _run(fused: bool, steps: int, layers: int) -> tuple[list[float], dict]:
    import lightning as L
    import torch.nn.functional as F
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    from lightning_adaptiveload.callbacks import FusedAdaLNSurgery
    from lightning_adaptiveload.surgery.wan import wan_block_forward

    class WanModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960,
                                               num_layers=layers, text_dim=4096)

        def training_step(self, batch, batch_idx):
            latents, timestep, text, target = batch
            loss = F.mse_loss(self.model(latents, timestep, text).sample.float(), target.float())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 3, 60, 104, generator=gen), torch.randint(0, 1000, (), generator=gen),
             torch.randn(64, 4096, generator=gen), torch.randn(16, 3, 60, 104, generator=gen)) for _ in range(2 * steps)]
    L.seed_everything(0)
    module = WanModule()
    module.losses = []
    surgery = FusedAdaLNSurgery(require_replacement=True)
    strategy = FSDPStrategy(auto_wrap_policy={WanTransformerBlock}, activation_checkpointing_policy={WanTransformerBlock},
                            sharding_strategy="FULL_SHARD")
    trainer = L.Trainer(accelerator="cuda", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[surgery] if fused else [])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))

    def inner(m):
        return getattr(m, "_checkpoint_wrapped_module", m)

    blocks = [m for m in trainer.strategy.model.modules() if isinstance(m, WanTransformerBlock)]
    info = {
        "blocks": len(blocks),
        "fused_blocks": sum(getattr(b.__dict__.get("forward"), "__func__", None) is wan_block_forward for b in blocks),
        "fsdp_wrapped_blocks": sum(isinstance(m, FullyShardedDataParallel) and isinstance(inner(m.module), WanTransformerBlock)
                                   for m in trainer.strategy.model.modules()),
        "checkpointed_blocks": sum(isinstance(m, CheckpointWrapper) and isinstance(inner(m), WanTransformerBlock)
                                   for m in trainer.strategy.model.modules()),
        "report": surgery.report.to_dict() if fused else None,
    }
    return module.losses, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for fsdp_surgery.json")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    import diffusers
    import lightning

    from lightning_adaptiveload import ops

    eager_losses, eager_info = _run(False, args.steps, args.layers)
    fused_losses, fused_info = _run(True, args.steps, args.layers)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    rel = [abs(f - e) / abs(e) for f, e in zip(fused_losses, eager_losses)]
    checks = {
        "every block fused": fused_info["fused_blocks"] == args.layers,
        "eager run untouched": eager_info["fused_blocks"] == 0,
        "FSDP wrapped every block": fused_info["fsdp_wrapped_blocks"] == args.layers,
        "every block checkpointed": fused_info["checkpointed_blocks"] == args.layers,
        f"losses within {LOSS_RTOL:.0%}": len(rel) == args.steps and max(rel) <= LOSS_RTOL,
    }
    result = {
        "passed": all(checks.values()),
        "checks": checks,
        "eager_losses": eager_losses,
        "fused_losses": fused_losses,
        "max_rel_loss_diff": max(rel) if rel else None,
        "eager": eager_info,
        "fused": fused_info,
        "config": {"layers": args.layers, "steps": args.steps, "tokens": 3 * 30 * 52, "world_size": 2,
                   "strategy": "FSDP FULL_SHARD, bf16-mixed, activation checkpointing on WanTransformerBlock"},
        "backend": ops.backend(),
        "device": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__, "diffusers": diffusers.__version__},
        "command": " ".join(["torchrun --nproc_per_node 2"] + sys.argv),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fsdp_surgery.json").write_text(json.dumps(result, indent=1))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print("eager losses", [f"{x:.5f}" for x in eager_losses])
    print("fused losses", [f"{x:.5f}" for x in fused_losses])
    if not result["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
