"""AttentionBackends: run each training step's attention under its bucket's backend.

The plan (lightning_adaptiveload.attention.AttentionPlan: seq_len -> backend) comes from
calibration (`set_plan`) or a JSON file. Every batch of AdaptiveLoadDataModule carries its bucket's
`seq_len`; from `on_train_batch_start` to `on_train_batch_end` (forward, backward, including
activation checkpointing's recomputation, and the optimizer step) the step runs under
`attention_backend(plan.backend_for(seq_len))`. Compiled regions recompile once per backend they
meet and then run the chosen one (docs/attention.md, "Compiled models"); a bucket the plan does not
name runs torch's own choice.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_adaptiveload.attention.backends import attention_backend, install_router
from lightning_adaptiveload.attention.plan import AttentionPlan

TORCH_CHOICE = "torch's own choice"


class AttentionBackends(Callback):
    """Apply an AttentionPlan per training batch.

    plan: an AttentionPlan, the path of one written by `AttentionPlan.to_json`, or None until
        calibration calls `set_plan`. batch_key: the batch entry with the bucket's tokens per sample.
    strict: only the chosen kernel may run (a call it refuses raises) instead of falling back to
        torch's other kernels.
    `counts` is the number of training batches run under each backend (TORCH_CHOICE for None).
    """

    def __init__(self, plan: AttentionPlan | str | Path | None = None, batch_key: str = "seq_len",
                 strict: bool = False) -> None:
        self.plan: AttentionPlan | None = None
        self.set_plan(plan)
        self.batch_key = batch_key
        self.strict = bool(strict)
        self.counts: Counter[str] = Counter()
        self._step: contextlib.ExitStack | None = None

    def set_plan(self, plan: AttentionPlan | str | Path | None) -> None:
        """Use `plan` from the next training batch on (None: torch's own choice everywhere)."""
        if isinstance(plan, (str, Path)):
            plan = AttentionPlan.from_json(plan)
        if plan is not None and not isinstance(plan, AttentionPlan):
            raise ValueError(f"AttentionBackends plan must be an AttentionPlan, a path to one or None, "
                             f"got {type(plan).__name__}")
        self.plan = plan

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # before anything compiles: a graph traced before the router replaced F.scaled_dot_product_attention
        # would recompile once more when it first meets it
        install_router()

    def backend_of(self, batch) -> str | None:
        """The plan's backend for `batch` (None: torch's own choice, also without a plan)."""
        if self.plan is None:
            return None
        if not isinstance(batch, Mapping) or self.batch_key not in batch:
            raise ValueError(f"AttentionBackends needs batch[{self.batch_key!r}] (the bucket's tokens per sample, "
                             f"which AdaptiveLoadDataModule's batches carry); got a {type(batch).__name__} without it")
        return self.plan.backend_for(int(batch[self.batch_key]))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._leave()
        backend = self.backend_of(batch)
        self._step = contextlib.ExitStack()
        self._step.enter_context(attention_backend(backend, strict=self.strict))
        self.counts[backend or TORCH_CHOICE] += 1

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._leave()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._leave()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._leave()
        if self.counts:
            rank_zero_info("AttentionBackends: training batches per attention backend: "
                           + ", ".join(f"{name} {n}" for name, n in self.counts.most_common()))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._step is not None:
            step, self._step = self._step, None
            step.close()
