"""Run by tests/callbacks/test_monitor.py: a DDP (gloo on CPU, NCCL on GPU) fit with
LoadBalanceMonitor. Lightning re-launches this script for every further rank.

    python tests/callbacks/ddp_monitor_script.py OUT_DIR [cpu|gpu] [DEVICES] [balance|busy]

balance (default): rank r trains on batches of known, rank-specific shapes (RANK_SHAPES), so the
gathered per-rank rows and the logged cross-rank statistics can be checked against them; with
DEVICES=1 it is a 1-process distributed run (a process group of size 1).
busy: every rank trains on the same shapes, but rank r first does WORK_UNITS[r] units of matrix
products outside autograd, and every logged step is profiled: DDP's gradient all-reduce makes the
ranks' step times equal while their busy times follow the work.
"""
from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

# Run as a script, Python puts only tests/callbacks/ on sys.path: without the repository root every
# rank would import an installed copy of the package (maybe another commit's), not this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_adaptiveload.callbacks import LoadBalanceMonitor  # noqa: E402

STEPS = 6
# (B, S) per step for each rank: rank 0 many short samples, rank 1 few long ones.
RANK_SHAPES = {0: [(4, 16), (6, 16), (2, 64), (4, 16), (8, 16), (3, 16)],
               1: [(1, 64), (2, 64), (1, 16), (1, 64), (2, 64), (4, 16)]}
BUSY_STEPS = 12
WORK_UNITS = {0: 1, 1: 4}  # rank 1 does 4x rank 0's extra work
MATMULS_PER_UNIT = 12  # 256 x 256 products: a few ms per unit on one CPU thread


class PowerCost:
    """predict(B, S) = B * S^1.5 ms: a cost model with a known closed form."""

    def predict(self, batch_size, seq_len):
        return batch_size * seq_len ** 1.5


class RankBatches(torch.utils.data.Dataset):
    def __init__(self, shapes: list[tuple[int, int]]):
        self.shapes = shapes

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, i):
        b, s = self.shapes[i]
        g = torch.Generator().manual_seed(i)
        return {"latents": torch.randn(b, 4, 1, 2, 2, generator=g), "seq_len": s}  # seq_len is what counts


class Model(pl.LightningModule):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.proj = torch.nn.Linear(4, 4)
        self.work = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) / 16

    def training_step(self, batch, batch_idx):
        if self.mode == "busy":
            with torch.no_grad():  # rank-dependent compute before the gradient all-reduce
                w = self.work
                for _ in range(WORK_UNITS[self.global_rank] * MATMULS_PER_UNIT):
                    w = torch.tanh(w @ self.work)
        x = batch["latents"].movedim(1, -1)
        return ((self.proj(x) - x) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        shapes = RANK_SHAPES[self.global_rank] if self.mode == "balance" else [(2, 16)] * BUSY_STEPS
        return DataLoader(RankBatches(shapes), batch_size=None, shuffle=False)


def main(out_dir: str, accelerator: str, devices: int, mode: str) -> None:
    torch.set_num_threads(1)
    monitor = (LoadBalanceMonitor(cost_model=PowerCost(), window=3, busy_every_n_logs=0) if mode == "balance"
               else LoadBalanceMonitor(window=4, busy_every_n_logs=1))
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy="ddp", max_epochs=1,
                         use_distributed_sampler=False,
                         logger=CSVLogger(out_dir, name="run", version=0), log_every_n_steps=4 if mode == "balance" else 1,
                         callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Model(mode))
    if trainer.is_global_zero:
        print(f"process group initialized: {torch.distributed.is_initialized()}, "
              f"world size {torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1] if len(args) > 1 else "cpu", int(args[2]) if len(args) > 2 else 2,
         args[3] if len(args) > 3 else "balance")
