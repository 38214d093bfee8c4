"""The batch record of the multi-process resume tests (tests/callbacks/ddp_e2e_script.py,
tests/examples/wan_fsdp2_resume_script.py): each rank writes one JSON line per training batch and
fit, and the tests compare the fits' keys (first + resumed against one uninterrupted reference)."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl


def keys_path(out: Path, fit: str, rank: int) -> Path:
    return Path(out) / f"keys_{fit}_rank{rank}.jsonl"


def read_batches(out: Path, fit: str, rank: int) -> list[dict]:
    """The rows `BatchKeyRecorder` wrote for `fit` on `rank`, in training order."""
    return [json.loads(line) for line in keys_path(out, fit, rank).read_text().splitlines() if line.strip()]


class BatchKeyRecorder(pl.Callback):
    """Appends {"epoch", "step", "batch_idx", "seq_len", "keys"} of every batch this rank trains on
    to keys_{fit}_rank{r}.jsonl in `out`."""

    def __init__(self, out: Path, fit: str):
        self.out, self.fit = Path(out), fit

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        row = {"epoch": trainer.current_epoch, "step": trainer.global_step, "batch_idx": batch_idx,
               "seq_len": int(batch["seq_len"]), "keys": list(batch["keys"])}
        with open(keys_path(self.out, self.fit, trainer.global_rank), "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
