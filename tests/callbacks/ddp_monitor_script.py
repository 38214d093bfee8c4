"""Run by tests/callbacks/test_monitor.py: a 2-process DDP (gloo, CPU) fit with LoadBalanceMonitor
where rank r trains on batches of known, rank-specific shapes, so the gathered per-rank rows and the
logged cross-rank statistics can be checked against them. Lightning re-launches this script for
rank 1. Usage: python tests/callbacks/ddp_monitor_script.py OUT_DIR [cpu|gpu]   (gpu: 2 GPUs, NCCL)
"""
from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_adaptiveload.callbacks import LoadBalanceMonitor

STEPS = 6
# (B, S) per step for each rank: rank 0 many short samples, rank 1 few long ones.
RANK_SHAPES = {0: [(4, 16), (6, 16), (2, 64), (4, 16), (8, 16), (3, 16)],
               1: [(1, 64), (2, 64), (1, 16), (1, 64), (2, 64), (4, 16)]}


class PowerCost:
    """predict(B, S) = B * S^1.5 ms: a cost model with a known closed form."""

    def predict(self, batch_size, seq_len):
        return batch_size * seq_len ** 1.5


class RankBatches(torch.utils.data.Dataset):
    def __init__(self, rank: int):
        self.shapes = RANK_SHAPES[rank]

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, i):
        b, s = self.shapes[i]
        g = torch.Generator().manual_seed(i)
        return {"latents": torch.randn(b, 4, 1, 2, 2, generator=g), "seq_len": s}  # seq_len is what counts


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        x = batch["latents"].movedim(1, -1)
        return ((self.proj(x) - x) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(RankBatches(self.global_rank), batch_size=None, shuffle=False)


def main(out_dir: str, accelerator: str) -> None:
    torch.set_num_threads(1)
    trainer = pl.Trainer(accelerator=accelerator, devices=2, strategy="ddp", max_epochs=1,
                         use_distributed_sampler=False,
                         logger=CSVLogger(out_dir, name="run", version=0), log_every_n_steps=4,
                         callbacks=[LoadBalanceMonitor(cost_model=PowerCost(), window=3)],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
