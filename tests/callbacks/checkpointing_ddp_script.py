"""Run by tests/callbacks/test_checkpointing.py: 2-process Lightning DDP (gloo, CPU, fp64) of the toy module,
each rank with its own checkpointing depth per step (batch["ac_blocks"]), once with PerBucketCheckpointing
("switched") and once without ("plain"). Each rank writes {fit}_rank{r}.json: per-step losses, per-step block
forward counts and the final parameters. Lightning re-launches this script for rank 1.

Usage: python tests/callbacks/checkpointing_ddp_script.py OUT_DIR
"""
from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_adaptiveload.callbacks import PerBucketCheckpointing  # noqa: E402
from tests.callbacks.checkpointing_module import CallRecorder, ToyModule, batches  # noqa: E402
from tests.checkpointing.toy import ToyBlock  # noqa: E402

RANK_DEPTHS = {0: [0, 4, 2, 1], 1: [4, 1, 0, 3]}
WATCHDOG_S = 300


class RankData(L.LightningDataModule):
    """Each rank its own batches and depths (the AdaptiveLoad DataModule plans per rank, too)."""

    def train_dataloader(self):
        rank = self.trainer.global_rank
        return torch.utils.data.DataLoader(batches(RANK_DEPTHS[rank], seed=100 * rank), batch_size=None)


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    torch.set_num_threads(1)
    for name in ("switched", "plain"):
        L.seed_everything(0)
        recorder = CallRecorder()
        callbacks = [PerBucketCheckpointing(block_classes=[ToyBlock])] if name == "switched" else []
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", precision="64-true", max_epochs=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False,
                            callbacks=callbacks + [recorder])
        module = ToyModule()
        trainer.fit(module, datamodule=RankData())
        doc = {"losses": module.losses, "calls": recorder.calls,
               "params": {n: p.detach().flatten().tolist() for n, p in module.named_parameters()}}
        (out / f"{name}_rank{trainer.global_rank}.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
