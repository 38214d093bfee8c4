"""AttentionBackends: run each training step's attention under its bucket's backend.

The plan (lightning_adaptiveload.attention.AttentionPlan: seq_len -> backend) comes from a JSON file,
from `set_plan`, or, with plan="measure", from measuring at fit start (`measure_plan`): the model's
attention calls recorded at two probe batches, derived for every bucket of the DataModule's bucket
table, every candidate backend timed and checked on them, the fastest correct one chosen per bucket.
Every batch of AdaptiveLoadDataModule carries its bucket's `seq_len`; from `on_train_batch_start` to
`on_train_batch_end` (forward, backward, including activation checkpointing's recomputation, and the
optimizer step) the step runs under `attention_backend(plan.backend_for(seq_len))`. Compiled regions
recompile once per backend they meet and then run the chosen one (docs/attention.md, "Compiled
models"); a bucket the plan does not name runs torch's own choice.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_adaptiveload._validation import require_int
from lightning_adaptiveload.attention.backends import (attention_backend, candidate_backends, install_router,
                                                       require_backend)
from lightning_adaptiveload.attention.calls import SdpaCall, record_sdpa_calls
from lightning_adaptiveload.attention.choose import choose_backends
from lightning_adaptiveload.attention.plan import AttentionPlan
from lightning_adaptiveload.attention.templates import CallTemplate, Probe, TemplateError
from lightning_adaptiveload.calibration.runner import StepRunner

TORCH_CHOICE = "torch's own choice"
MEASURE = "measure"
PLAN_FILE = "attention_plan.json"
PROBE_BATCH_SIZES = (2, 3)  # with two different seq_lens: the six ratios templates.py needs are distinct


class AttentionBackends(Callback):
    """Apply an AttentionPlan per training batch.

    plan: an AttentionPlan, the path of one written by `AttentionPlan.to_json`, "measure" (measure one
        at fit start: `measure_plan`), or None until calibration calls `set_plan`.
    batch_key: the batch entry with the bucket's tokens per sample.
    strict: only the chosen kernel may run (a call it refuses raises) instead of falling back to
        torch's other kernels.
    With plan="measure" only: backends: the candidates (default `candidate_backends` of the device:
        flash, efficient, cudnn and the importable external ones on CUDA); warmup, repeats: untimed and
        timed forward+backward runs per call (the median is kept); check: compare every candidate with
        the fp32 reference and never choose one outside `TOLERANCE`.
    `counts` is the number of training batches run under each backend (TORCH_CHOICE for None).
    """

    def __init__(self, plan: AttentionPlan | str | Path | None = None, batch_key: str = "seq_len",
                 strict: bool = False, backends: Sequence[str] | None = None, warmup: int = 2, repeats: int = 5,
                 check: bool = True) -> None:
        self.plan: AttentionPlan | None = None
        self.measure = isinstance(plan, str) and plan == MEASURE
        self.set_plan(None if self.measure else plan)
        self.batch_key = batch_key
        self.strict = bool(strict)
        self.backends = None if backends is None else [require_backend(b) for b in backends]
        self.warmup = require_int("AttentionBackends warmup", warmup, minimum=0)
        self.repeats = require_int("AttentionBackends repeats", repeats)
        self.check = bool(check)
        self.counts: Counter[str] = Counter()
        self._step: contextlib.ExitStack | None = None

    def set_plan(self, plan: AttentionPlan | str | Path | None) -> None:
        """Use `plan` from the next training batch on (None: torch's own choice everywhere)."""
        if isinstance(plan, (str, Path)):
            plan = AttentionPlan.from_json(plan)
        if plan is not None and not isinstance(plan, AttentionPlan):
            raise ValueError(f"AttentionBackends plan must be an AttentionPlan, a path to one, {MEASURE!r} or None, "
                             f"got {type(plan).__name__}")
        self.plan = plan

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # before anything compiles: a graph traced before the router replaced F.scaled_dot_product_attention
        # would recompile once more when it first meets it
        install_router()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # CostModelCalibration, listed before this callback, has planned the bucket table by now
        if self.measure:
            self.set_plan(self.measure_plan(trainer, pl_module))

    def measure_plan(self, trainer: Trainer, pl_module: LightningModule) -> AttentionPlan | None:
        """The plan of the fit's buckets, the same on every rank, written to the log dir as
        attention_plan.json; None (torch's own choice, said in the log) when there are fewer than
        two candidate backends (the CPU has one fused kernel, flash).

        Every rank records the model's attention calls (a sharded model's forward is collective):
        forwards without grad of synthetic batches at two probes (B = 2 and 3 at the two shortest
        buckets' seq_len), `CallTemplate` deriving each bucket's calls at its (B, S) (a bucket
        whose calls the probes do not determine is recorded directly, at its own B). Rank 0 alone
        then times and checks the candidates on them (`choose_backends`: kernels on random inputs with
        the recorded shapes and strides, no collective) and broadcasts the plan."""
        datamodule = trainer.datamodule
        if not all(callable(getattr(datamodule, m, None)) for m in ("bucket_table", "synthetic_batch")):
            raise TypeError(f"AttentionBackends(plan={MEASURE!r}) needs a datamodule with bucket_table() and "
                            f"synthetic_batch() (an AdaptiveLoadDataModule); got {type(datamodule).__name__}")
        device = trainer.strategy.root_device
        names = self.backends if self.backends is not None else candidate_backends(device.type)
        if len(names) < 2:
            rank_zero_info(f"AttentionBackends(plan={MEASURE!r}): nothing to choose on {device.type} (candidate "
                           f"backends: {names}); every step runs {TORCH_CHOICE}")
            return None
        buckets = {int(row["seq_len"]): int(row["batch_size"]) for row in datamodule.bucket_table().rows()}
        if not buckets:
            raise ValueError(f"AttentionBackends(plan={MEASURE!r}): the datamodule's bucket table has no buckets")
        begin = time.perf_counter()
        with StepRunner(trainer, pl_module) as runner:  # train mode, no logging; RNG, buffers, grads restored after
            calls = bucket_calls(runner, datamodule, buckets)
        doc = error = None
        if trainer.is_global_zero:
            try:
                doc = choose_backends(calls, backends=names, device=device, warmup=self.warmup,
                                      repeats=self.repeats, check=self.check).to_dict()
            except Exception as e:  # raised below on every rank: the others must not wait for a plan alone
                error = f"{type(e).__name__}: {e}"
        doc, error = trainer.strategy.broadcast((doc, error))
        if error is not None:
            raise RuntimeError(f"AttentionBackends(plan={MEASURE!r}): rank 0 failed to measure the backends: {error}")
        plan = AttentionPlan.from_dict(doc, "the measured attention plan")
        # trainer.log_dir is a collective (a broadcast): resolved on every rank
        path = Path(trainer.log_dir or trainer.default_root_dir) / PLAN_FILE
        if trainer.is_global_zero:
            plan.to_json(path)
        rank_zero_info(f"AttentionBackends: measured {', '.join(names)} on {len(buckets)} buckets in "
                       f"{time.perf_counter() - begin:.1f} s (ms: forward+backward of a step's attention calls; "
                       f"written to {path})\n{plan.format()}")
        return plan

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


def bucket_calls(runner: StepRunner, datamodule, buckets: Mapping[int, int]) -> dict[int, list[SdpaCall]]:
    """seq_len -> the attention calls (with counts) of one training step's forward of a batch of
    buckets[seq_len] samples, from `datamodule.synthetic_batch` batches run through the strategy's
    training_step without grad (so activation checkpointing recomputes nothing and counts stay per
    forward). Two probes derive every bucket's calls (`CallTemplate`); where they cannot, each bucket
    is recorded directly. `runner`: an entered StepRunner (its training_step, state restored after)."""
    def record(seq_len: int, batch_size: int) -> list[SdpaCall]:
        batch = runner.strategy.batch_to_device(datamodule.synthetic_batch(seq_len, batch_size))
        with torch.no_grad():
            calls = record_sdpa_calls(lambda: runner.training_step(batch))
        if not calls:
            raise ValueError(f"AttentionBackends(plan={MEASURE!r}): the model made no "
                             f"scaled_dot_product_attention call at B={batch_size}, S={seq_len}")
        return calls

    seq_lens = sorted(buckets)
    if len(seq_lens) >= 2:
        probes = [Probe(b, s, tuple(record(s, b))) for b, s in zip(PROBE_BATCH_SIZES, seq_lens)]
        try:
            template = CallTemplate.from_probes(*probes)
            return {s: template.instantiate(buckets[s], s) for s in seq_lens}
        except TemplateError as e:
            rank_zero_info(f"AttentionBackends: the probes do not determine the other buckets' attention calls ({e}); "
                           f"recording each of the {len(seq_lens)} buckets directly")
    return {s: record(s, buckets[s]) for s in seq_lens}
