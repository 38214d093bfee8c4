"""A LightningModule written without this package in mind (the toy transformer of tests/checkpointing), its
batches (dicts with the `ac_blocks` entry the DataModule adds), and a callback that records how often each
block ran per step. Shared by tests/callbacks/test_checkpointing.py and its DDP script."""
from __future__ import annotations

import lightning as L
import torch

from lightning_adaptiveload.checkpointing import find_blocks, select_instances
from tests.checkpointing.toy import ToyBlock, ToyNet, toy_batch

DEPTH = 4


class ToyModule(L.LightningModule):
    def __init__(self, build_in_configure_model: bool = False):
        super().__init__()
        self.net = None if build_in_configure_model else ToyNet(depth=DEPTH)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = ToyNet(depth=DEPTH)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch["x"], batch["context"]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(depths: list[int | None], seed: int = 0, dtype=torch.float64) -> list[dict]:
    """One batch per entry; None leaves the `ac_blocks` key out (checkpoint every block)."""
    out = []
    for step, k in enumerate(depths):
        x, context = toy_batch(seed + step, dtype=dtype)
        out.append({"x": x, "context": context} | ({} if k is None else {"ac_blocks": k}))
    return out


class CallRecorder(L.Callback):
    """Forward executions of each block per training step (2 = recomputed in backward)."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        blocks = find_blocks(pl_module, select_instances([ToyBlock]))
        self.calls.append([b.calls for b in blocks])
        for b in blocks:
            b.calls = 0
