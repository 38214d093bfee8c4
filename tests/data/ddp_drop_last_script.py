"""Run by tests/data/test_drop_last.py: 2-process DDP (gloo, CPU) training with
AdaptiveLoadDataModule(drop_last=False) on the tiny dataset the test wrote to OUT_DIR/data. Each
rank writes the keys of every batch it trained on (keys_rank{r}.jsonl, one line per batch) and the
DataModule's counters at the end (counters_rank{r}.json). Lightning re-runs this script for rank 1.
Usage: python tests/data/ddp_drop_last_script.py OUT_DIR
"""
from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.helpers

from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: E402
from tests.helpers.data import C, D_TEXT, L_TEXT, KeyRecorder  # noqa: E402

EPOCHS = 2
WATCHDOG_S = 120  # a hung collective ends the run with every thread's stack
DATA_KWARGS = dict(policy="balanced", p=1.5, m_comp=500.0, m_mem=128, latent_channels=C, text_len=L_TEXT,
                   text_dim=D_TEXT, num_workers=0, seed=3, drop_last=False)


class RankRecorder(KeyRecorder):
    def __init__(self, out: Path):
        super().__init__()
        self.out = out

    def training_step(self, batch, batch_idx):
        with open(self.out / f"keys_rank{self.global_rank}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"epoch": self.current_epoch, "keys": list(batch["keys"])}) + "\n")
        return super().training_step(batch, batch_idx)


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    torch.set_num_threads(1)
    dm = AdaptiveLoadDataModule(shards=str(out / "data"), index=str(out / "data" / "index.jsonl"), **DATA_KWARGS)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=False,
                         max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out))
    trainer.fit(RankRecorder(out), datamodule=dm)
    (out / f"counters_rank{trainer.global_rank}.json").write_text(json.dumps(dm.counters()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
