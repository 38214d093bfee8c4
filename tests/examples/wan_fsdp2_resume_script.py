"""Run by tests/examples/test_wan_fsdp2.py: WanModule under FSDP2 (ModelParallelStrategy, two CPU ranks,
gloo) on the real AdaptiveLoadDataModule, three fits in the same two processes (Lightning starts rank 1
by running this script again):

  first      max_steps=RESUME_AT, a distributed checkpoint at that step (mid-epoch)
  resumed    from that checkpoint to the end of the epoch
  reference  one uninterrupted epoch

Each rank writes the keys of every batch it trained on, per fit (keys_{fit}_rank{r}.jsonl).
Usage: python tests/examples/wan_fsdp2_resume_script.py OUT_DIR
"""
from __future__ import annotations

import faulthandler
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from examples.wan.module import WanModule  # noqa: E402
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: E402
from tests.helpers.resume import BatchKeyRecorder  # noqa: E402

RESUME_AT = 3
WATCHDOG_S = 300  # a hung collective ends the run with every thread's stack instead of stalling CI
TINY = dict(num_layers=1, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64)
DATA_KWARGS = dict(policy="token_equal", m_mem=256, latent_channels=4, text_len=8, text_dim=32, num_workers=0,
                   seed=0, drop_last=False, synthesize_shapes=str(REPO / "examples" / "configs" / "demo_mix.jsonl"))
NUM_SAMPLES = 64


def make_datamodule(out: Path) -> AdaptiveLoadDataModule:
    return AdaptiveLoadDataModule(shards=str(out / "shards"), index=str(out / "index.jsonl"), synthesize=NUM_SAMPLES,
                                  **DATA_KWARGS)


def fit(out: Path, name: str, ckpt_path: str | None = None) -> None:
    pl.seed_everything(0)
    module = WanModule(transformer_config=TINY, fsdp2_param_dtype="float32", shift_rule="fixed", shift=3.0)
    callbacks = [BatchKeyRecorder(out, name)]
    if name == "first":
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=RESUME_AT, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
                         tensor_parallel_size=1), use_distributed_sampler=False,
                         max_steps=RESUME_AT if name == "first" else -1, max_epochs=1, default_root_dir=str(out),
                         logger=False, callbacks=callbacks, enable_checkpointing=name == "first",
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=make_datamodule(out), ckpt_path=ckpt_path)


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    torch.set_num_threads(1)
    fit(out, "first")
    fit(out, "resumed", ckpt_path=str(out / "ckpt" / f"epoch=0-step={RESUME_AT}.ckpt"))
    fit(out, "reference")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
