"""Run by tests/callbacks/test_ddp_e2e.py: 2-process DDP (gloo, CPU) training of the example video DiT on
the real AdaptiveLoadDataModule (tiny shards written by the test), with CostModelCalibration and
LoadBalanceMonitor. Three fits in the same two processes (Lightning re-launches this script for
rank 1, which then runs the same three fits):

  first      max_steps=RESUME_AT, checkpoint at that step (mid-epoch)
  resumed    from that checkpoint to the end of the epoch (calibration from the checkpoint: the
             cache is hidden during this fit)
  reference  one uninterrupted epoch

Each rank writes, per fit, the keys of every batch it trained on (keys_{fit}_rank{r}.jsonl) and the
cost model it trained with (calib_{fit}_rank{r}.json). Usage: python tests/callbacks/ddp_e2e_script.py OUT_DIR
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # examples/ is not an installed package

from examples.video_dit.module import VideoDiTModule  # noqa: E402
from lightning_adaptiveload.callbacks import CostModelCalibration, LoadBalanceMonitor  # noqa: E402
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: E402
from tests.helpers.resume import BatchKeyRecorder  # noqa: E402

RESUME_AT = 3
WATCHDOG_S = 150  # a hung collective ends the run with every thread's stack instead of stalling CI
DATA_KWARGS = dict(policy="balanced", m_mem=256, latent_channels=4, text_len=8, text_dim=32, num_workers=1, seed=0,
                   synthesize_shapes=str(REPO / "examples" / "configs" / "demo_mix.jsonl"))
NUM_SAMPLES = 160


def make_datamodule(out: Path) -> AdaptiveLoadDataModule:
    return AdaptiveLoadDataModule(shards=str(out / "shards"), index=str(out / "index.jsonl"), synthesize=NUM_SAMPLES,
                                  **DATA_KWARGS)


class BatchRecorder(BatchKeyRecorder):
    """This rank's batch keys (BatchKeyRecorder) and the cost model it trains with."""

    def on_train_start(self, trainer, pl_module):
        cm = trainer.datamodule.cost_model
        doc = {"form": cm.form, "params": cm.params, "p": cm.p, "m_mem": trainer.datamodule.m_mem,
               "num_training_batches": trainer.num_training_batches, "global_step": trainer.global_step}
        (self.out / f"calib_{self.fit}_rank{trainer.global_rank}.json").write_text(json.dumps(doc))


def fit(out: Path, name: str, ckpt_path: str | None = None) -> None:
    pl.seed_everything(0)
    model = VideoDiTModule(in_channels=4, dim=32, num_layers=1, num_heads=2, ffn_dim=64, text_dim=32, freq_dim=32)
    # any fit is trusted here: the trust check has its own tests, and a launch-bound tiny model on two
    # CPU ranks can fail it (the run would then fall back to token_equal with no cost model)
    callbacks = [CostModelCalibration(num_seq_lens=3, batch_sizes=[1, 2, 4], warmup=0, repeats=1,
                                      max_heldout_error=float("inf"), min_work_correlation=-1.0),
                 LoadBalanceMonitor(window=4), BatchRecorder(out, name)]
    if name == "first":
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=RESUME_AT, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=False,
                         max_steps=RESUME_AT if name == "first" else -1, max_epochs=1,
                         default_root_dir=str(out), logger=CSVLogger(str(out), name=name, version=0),
                         log_every_n_steps=2, callbacks=callbacks, enable_checkpointing=name == "first",
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=make_datamodule(out), ckpt_path=ckpt_path)


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    torch.set_num_threads(1)
    fit(out, "first")
    # The resumed fit must take its calibration from the checkpoint: the cache (read by rank 0 only)
    # is hidden meanwhile; a new measurement would not match the sampler's resume state.
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    cache, hidden = out / "calibration_cache.json", out / "calibration_cache.hidden"
    if rank0:
        cache.rename(hidden)
    fit(out, "resumed", ckpt_path=str(out / "ckpt" / f"epoch=0-step={RESUME_AT}.ckpt"))
    if rank0:
        hidden.rename(cache)
    fit(out, "reference")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
