"""Run by tests/data/test_integrity.py once per rank (the test starts both processes with LOCAL_RANK
set, so Lightning launches none and no rank's error handling kills the other): 2-process DDP (gloo,
CPU) training on the dataset the test prepared, in which every sample of one rank's batch at one
step is corrupt. Each rank writes result_rank{r}.json: the batches it trained on and the error it
stopped with. Usage: python -m tests.data.integrity_ddp_script OUT_DIR (OUT_DIR/dm_args.json holds
the DataModule's arguments)."""
from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import lightning.pytorch as pl

from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from tests.helpers.data import KeyRecorder

WATCHDOG_S = 150  # a hung collective ends the run with every thread's stack


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    model = KeyRecorder()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=False, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out))
    error = None
    try:
        trainer.fit(model, datamodule=AdaptiveLoadDataModule(**json.loads((out / "dm_args.json").read_text())))
    except RuntimeError as e:
        error = str(e)
    (out / f"result_rank{trainer.global_rank}.json").write_text(json.dumps({"keys": model.keys, "error": error}))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
