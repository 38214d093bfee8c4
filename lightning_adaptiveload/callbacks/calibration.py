"""CostModelCalibration: benchmark the user's training step on a (B, S) grid before fit, fit the
step-time cost model, rebuild the DataModule's bucket table from it, and warm every scheduled
batch shape.

Runs once in `on_fit_start` (after the strategy wrapped the model and the optimizers exist,
before the train loader is built). The parts live in `lightning_adaptiveload.calibration`: the grid,
the state-preserving step runner (real forward + backward of `training_step` under the active
strategy and precision, no optimizer step, every trace restored), the fit and its trust check,
the optimizer-state rule, the shape warm-up and the record. docs/lightning.md describes the grid,
the memory rule, the warm-up and the files written.

With a `PerBucketCheckpointing` callback among the trainer's callbacks it also plans memory
(docs/memory.md): every point runs with all L blocks checkpointed, the points the fit needs run
again at k = L // 2, and rank 0 fits the memory model peak(B, S, k) and the time model t(B, S, k);
the DataModule gets them through `set_memory_plan`, so each bucket has its (B, k).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import lightning
import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_adaptiveload.calibration.compiled import compiled_submodules, raise_recompile_limit
from lightning_adaptiveload.calibration.fit import (DEFAULT_MAX_HELDOUT_ERROR, DEFAULT_MIN_WORK_CORRELATION,
                                                    distrust_reasons, fit_memory_models, fit_points)
from lightning_adaptiveload.calibration.grid import (calibration_grid, predicted_depth_peak_bytes, predicted_peak_bytes,
                                                     required_points, seq_len_grid)
from lightning_adaptiveload.calibration.memory import OptimizerMemory, device_memory_bytes, optimizer_memory
from lightning_adaptiveload.calibration.record import (FORMAT, INFEASIBLE, VERSION, model_fingerprint,
                                                       read_cache, write_json)
from lightning_adaptiveload.calibration.runner import StepRunner, agree
from lightning_adaptiveload.calibration.warmup import warm_shapes
from lightning_adaptiveload.callbacks.checkpointing import PerBucketCheckpointing
from lightning_adaptiveload.checkpointing import BlockCheckpointing
from lightning_adaptiveload.scheduling.buckets import ScheduledShape
from lightning_adaptiveload.scheduling.cost_model import CostModel, DepthCostModel, load_cost_model, plot_fit
from lightning_adaptiveload.scheduling.depth_choice import DEPTH_BATCH_KEY
from lightning_adaptiveload.scheduling.memory_model import MemoryModel

FALLBACK_POLICY = "token_equal"  # what trains when the cost model cannot be trusted
REMEASURE_REPEATS = 3  # a distrusted fit is measured once more with this many times the repeats


class CostModelCalibration(Callback):
    """Fit the step-time cost model t(B, S) on the real training step, call
    `datamodule.set_cost_model(cost_model, m_mem)`, then warm every scheduled batch shape. With a
    `PerBucketCheckpointing` callback (listed before this one) also fit the memory model and the
    time model with a checkpointing depth and call `datamodule.set_memory_plan(...)`.

    Args:
        num_seq_lens: bucket lengths S benchmarked (see `calibration.grid.seq_len_grid`).
        batch_sizes: batch sizes B tried at each S (default powers of two 1..256); at each S the
            sizes after the first out-of-memory are skipped (memory grows with B and S).
        max_tokens: skip points with B*S above this (tokens); None probes until OOM.
        warmup, repeats: untimed and timed steps per point; the median time counts.
        time_budget_s: seconds for the optional grid points. The points the fit needs (B = 1 at
            every S, a few B at the shortest S: `calibration.grid.required_points`) always run; the
            others stop starting once this budget, counted after the required points, is spent
            (agreed across ranks).
        m_mem: memory budget (tokens per batch) to hand to the DataModule instead of measuring.
        memory_margin: M_mem = floor(margin * largest feasible B*S) when some point did not fit.
            Under a memory plan the DataModule keeps its own m_mem (the token cap of its batches):
            the memory model bounds them.
        max_memory_fraction: the share of the device's memory a step may use. On CUDA, a point whose
            peak memory, extrapolated from the previous points (linearly in B at its S; at the
            second depth, by the extra bytes per token the un-checkpointed blocks took so far),
            would exceed it is recorded infeasible without running it (an OOM inside an FSDP
            collective on one rank cannot be agreed on without risking a hang; predicting it avoids
            most of them); the memory plan keeps every bucket's predicted peak under it.
        form: cost-model form passed to `CostModel.fit`.
        max_heldout_error, min_work_correlation: a fit whose cross-validated mean relative error is
            above `max_heldout_error`, or whose times do not grow with the step's tokens (Spearman
            rank correlation below `min_work_correlation`; -1 turns that check off), is not trusted:
            measured once more with
            REMEASURE_REPEATS times the repeats, and if still not trusted the DataModule falls back
            to the token_equal policy; a distrusted fit is never cached.
        shape_warmup: after the fit, run one forward + backward of every (B, latent shape) the
            DataModule can schedule (its `scheduled_batch_shapes()`), so no training step pays for
            building that shape's kernels (cuDNN attention graphs, a compiled model's graphs).
        shape_warmup_budget_s: seconds for the shape warm-up; the most frequent shapes go first and
            the rest are left cold (counted and reported).
        cache_path: calibration JSON reused when its key (model fingerprint, strategy, precision,
            world size, device, grid) matches; default `<default_root_dir>/calibration_cache.json`.
        cost_model_path: a fitted cost-model JSON (`calibration_cost_model.json` of an earlier run)
            to schedule with as it is: no benchmark, no fit, no memory plan (trusted as given; e.g. to
            train a variant of a run on exactly its batches); M_mem from `m_mem` or the DataModule.
            The shape warm-up still runs.
    """

    def __init__(self, num_seq_lens: int = 4, batch_sizes: list[int] | None = None, max_tokens: int | None = None,
                 warmup: int = 1, repeats: int = 3, time_budget_s: float = 180.0, m_mem: int | None = None,
                 memory_margin: float = 0.9, max_memory_fraction: float = 0.85, form: str = "auto",
                 max_heldout_error: float = DEFAULT_MAX_HELDOUT_ERROR,
                 min_work_correlation: float = DEFAULT_MIN_WORK_CORRELATION, shape_warmup: bool = True,
                 shape_warmup_budget_s: float = 600.0, cache_path: str | None = None,
                 cost_model_path: str | None = None):
        if num_seq_lens < 1 or warmup < 0 or repeats < 1 or time_budget_s <= 0 or shape_warmup_budget_s < 0:
            raise ValueError("CostModelCalibration: need num_seq_lens >= 1, warmup >= 0, repeats >= 1, "
                             f"time_budget_s > 0, shape_warmup_budget_s >= 0; got {num_seq_lens}, {warmup}, "
                             f"{repeats}, {time_budget_s}, {shape_warmup_budget_s}")
        if not 0 < memory_margin <= 1 or not 0 < max_memory_fraction <= 1:
            raise ValueError("CostModelCalibration: memory_margin and max_memory_fraction must be in (0, 1]")
        if not max_heldout_error > 0:
            raise ValueError(f"CostModelCalibration: max_heldout_error must be > 0, got {max_heldout_error}")
        self.num_seq_lens = num_seq_lens
        self.batch_sizes = list(batch_sizes) if batch_sizes else [2**i for i in range(9)]
        if any(int(b) != b or b < 1 for b in self.batch_sizes):
            raise ValueError(f"CostModelCalibration.batch_sizes must be integers >= 1, got {self.batch_sizes}")
        self.max_tokens = max_tokens
        self.warmup, self.repeats, self.time_budget_s = warmup, repeats, time_budget_s
        self.m_mem, self.memory_margin, self.max_memory_fraction = m_mem, memory_margin, max_memory_fraction
        self.form, self.max_heldout_error, self.cache_path = form, max_heldout_error, cache_path
        self.cost_model_path = cost_model_path
        self.min_work_correlation = min_work_correlation
        self.shape_warmup, self.shape_warmup_budget_s = shape_warmup, shape_warmup_budget_s
        # Results, for the user and the tests.
        self.cost_model: CostModel | None = None
        self.trusted = False
        self.distrust_reasons: list[str] = []
        self.measured_m_mem: int | None = None
        self.points: list[dict] = []
        self.source = ""  # "measured", "measured again", "cache", "checkpoint" or "given"
        self.warmed_shapes: list[dict] = []
        # With PerBucketCheckpointing: the models of the memory plan (None when not fitted, and why),
        # the optimizer memory calibration's steps lack, the device memory the plan budgets against.
        self.memory_model: MemoryModel | None = None
        self.depth_cost_model: DepthCostModel | None = None
        self.memory_distrust_reasons: list[str] = []
        self.memory_plan_used = False
        self.optimizer_memory: OptimizerMemory | None = None
        self.device_memory_bytes: int | None = None
        self._restored_points: list[dict] | None = None  # from a checkpoint, see load_state_dict

    # ---------------------------------------------------------------- hook

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = trainer.datamodule
        for method in ("synthetic_batch", "bucket_seq_lens", "set_cost_model"):
            if not callable(getattr(datamodule, method, None)):
                raise TypeError(f"CostModelCalibration needs a datamodule with {method}() (an "
                                f"AdaptiveLoadDataModule); got {type(datamodule).__name__}")
        if not pl_module.automatic_optimization:  # same module on every rank: every rank raises
            raise TypeError(f"CostModelCalibration needs automatic optimization; {type(pl_module).__name__} "
                            "steps its optimizers inside training_step (manual optimization), which would "
                            "change the parameters during the benchmark")
        start = time.perf_counter()
        switch = _checkpointing_switch(trainer)
        seq_lens = seq_len_grid(datamodule.bucket_seq_lens(), self.num_seq_lens)
        grid = calibration_grid(seq_lens, self.batch_sizes, self.max_tokens)
        depth_points = len(required_points(seq_lens, self.batch_sizes, self.max_tokens)) if switch else 0
        compiled = compiled_submodules(pl_module)
        recompile_limit = None
        if compiled:  # before the key: the limit is part of what the compiled steps run under
            # a compiled block traces the checkpointing switch: the second depth's points compile again.
            # The schedule is not known before the fit: a bucket runs its full batch and at most one
            # smaller one (its remainder), so two shapes per bucket bound the warm-up's.
            shapes = 2 * len(datamodule.bucket_seq_lens())
            recompile_limit = raise_recompile_limit(len(grid) + depth_points + shapes)
            rank_zero_info(f"CostModelCalibration: {len(compiled)} compiled region(s) (e.g. {compiled[0] or '<root>'}); "
                           f"dynamo recompile_limit {recompile_limit[0]} -> {recompile_limit[1]} for "
                           f"{len(grid) + depth_points} grid points and the scheduled shapes")
        key = self._key(trainer, pl_module, grid, switch)
        cache_path = Path(self.cache_path or os.path.join(trainer.default_root_dir, "calibration_cache.json"))

        with StepRunner(trainer, pl_module) as runner:
            if switch is not None:
                self._measure_memory_terms(trainer, runner)
            if self.cost_model_path is not None:  # every rank reads the same file
                self.points, self.source = [], "given"
                self.cost_model, self.trusted, self.distrust_reasons = load_cost_model(self.cost_model_path), True, []
                self.measured_m_mem = self.m_mem
                if switch is not None:
                    self.memory_distrust_reasons = ["the cost model was given: no memory measured"]
                rank_zero_info(f"CostModelCalibration: scheduling with the cost model {self.cost_model_path} as given; "
                               "no benchmark run")
            else:
                self.points, self.source = self._points(trainer, runner, datamodule, grid, key, cache_path, switch)
                self._fit_and_judge(trainer, switch)
            if not self.trusted and self.source == "measured":
                rank_zero_warn("CostModelCalibration: the fit is not trusted (" + "; ".join(self.distrust_reasons)
                               + f"); measuring again with {REMEASURE_REPEATS * self.repeats} repeats per point")
                self.points = self._benchmark(runner, datamodule, grid, REMEASURE_REPEATS * self.repeats, switch)
                self.source = "measured again"
                self._fit_and_judge(trainer, switch)
            if self.trusted:
                self._apply(datamodule, switch)
            else:
                rank_zero_warn("CostModelCalibration: the cost model is NOT trusted ("
                               + "; ".join(self.distrust_reasons) + f"); training falls back to the "
                               f"{FALLBACK_POLICY} policy with "
                               + (f"M_mem = {self.measured_m_mem}" if self.measured_m_mem else "the DataModule's M_mem")
                               + " and no cost model"
                               + (", every block checkpointed" if switch is not None else "")
                               + "; nothing is cached. Calibrate on a quiet machine or widen the grid "
                               "(docs/cost_model.md).")
                datamodule.set_cost_model(None, self.measured_m_mem, policy=FALLBACK_POLICY)
                if switch is not None:
                    self.memory_distrust_reasons = ["the cost model is not trusted"] + self.memory_distrust_reasons
            calibration_s = time.perf_counter() - start
            warm_start = time.perf_counter()
            self.warmed_shapes = self._warm(runner, datamodule, switch) if self.shape_warmup else []
            warmup_s = time.perf_counter() - warm_start

        # trainer.log_dir is a collective (a broadcast): resolve it on every rank, not in rank 0 alone.
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        write_error = None
        if trainer.is_global_zero:
            try:
                doc = self._document(trainer, key, calibration_s, warmup_s, compiled, recompile_limit)
                if self.trusted and self.source.startswith("measured"):
                    write_json(cache_path, doc)
                self._save_outputs(log_dir, doc)
                self._report(trainer, doc, max(seq_lens), datamodule)
            except Exception as e:  # raised below on every rank: the others must not train on alone
                write_error = e
        if agree(trainer.strategy, write_error is not None):
            detail = f": {type(write_error).__name__}: {write_error}" if write_error else ""
            raise RuntimeError(f"CostModelCalibration: rank 0 failed to write or report the calibration{detail}") \
                from write_error

    # A resumed fit must schedule with the cost model it started with: the sampler's resume state
    # holds m_mem, m_comp and p, and a new measurement (or a cache since overwritten) would differ.
    def state_dict(self) -> dict:
        return {"points": self.points}

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored_points = state_dict.get("points") or None

    # ---------------------------------------------------------------- benchmark

    def _points(self, trainer: Trainer, runner: StepRunner, datamodule, grid, key: dict, cache_path: Path,
                switch: BlockCheckpointing | None) -> tuple[list[dict], str]:
        """The grid's points and where they come from: the checkpoint of a resumed fit, a cache with
        this key, or a new measurement."""
        if self._restored_points is not None:  # every rank loaded the same checkpoint
            points, self._restored_points = self._restored_points, None
            rank_zero_info("CostModelCalibration: resuming with the calibration stored in the checkpoint; "
                           "no benchmark run")
            return points, "checkpoint"
        cached = trainer.strategy.broadcast(read_cache(cache_path, key) if trainer.is_global_zero else None)
        if cached is not None:
            rank_zero_info(f"CostModelCalibration: reusing {cache_path} (same model, strategy, precision, "
                           "world size, device and grid); no benchmark run")
            return cached["points"], "cache"
        return self._benchmark(runner, datamodule, grid, self.repeats, switch), "measured"

    def _benchmark(self, runner: StepRunner, datamodule, grid: list[tuple[int, int]], repeats: int,
                   switch: BlockCheckpointing | None) -> list[dict]:
        """The grid's points in order, each at k = L (every block checkpointed; None without a switch);
        with a switch, each required point that fits is measured again right after at k = L // 2
        (the same (B, S) for the time ratio, and right after for the same machine state)."""
        required = set(required_points(sorted({s for _, s in grid}), self.batch_sizes, self.max_tokens))
        device = runner.device
        memory_limit = self.max_memory_fraction * device_memory_bytes(device) if device.type == "cuda" else None
        full = None if switch is None else switch.num_blocks
        second = None if switch is None else switch.num_blocks // 2
        points: list[dict] = []
        budget_start = None  # the optional points' clock starts after the last required point

        def measure(b: int, s: int, k: int | None, settle: bool) -> dict:
            with switch.checkpointing(k) if switch is not None else contextlib.nullcontext():
                return runner.measure(lambda: datamodule.synthetic_batch(s, b), self.warmup, repeats, settle=settle)

        for i, (b, s) in enumerate(grid):
            point = {"batch_size": b, "seq_len": s, "checkpointed": full}
            if (b, s) not in required and budget_start is None:
                budget_start = time.perf_counter()
            out_of_time = budget_start is not None and time.perf_counter() - budget_start > self.time_budget_s
            if runner.agree(out_of_time):
                point["status"] = "skipped_budget"
            elif _dominated(points, b, s, full):
                point["status"] = "skipped_oom"  # a smaller (B, S) already did not fit
            elif memory_limit is not None and predicted_peak_bytes(points, b, s, full) > memory_limit:
                point["status"] = "predicted_oom"
            else:
                point.update(measure(b, s, full, settle=not any(p["status"] == "ok" for p in points)))
            points.append(point)
            rank_zero_info(f"calibration {i + 1}/{len(grid)}: B={b} S={s} " + _point_line(point))
            if second is None or (b, s) not in required or point["status"] != "ok":
                continue
            deeper = {"batch_size": b, "seq_len": s, "checkpointed": second}
            if _dominated(points, b, s, second):
                deeper["status"] = "skipped_oom"
            elif memory_limit is not None and max(predicted_peak_bytes(points, b, s, second),
                                                  predicted_depth_peak_bytes(points, b, s, second, full)) > memory_limit:
                deeper["status"] = "predicted_oom"
            else:
                deeper.update(measure(b, s, second, settle=False))
            points.append(deeper)
            rank_zero_info(f"calibration {i + 1}/{len(grid)}: B={b} S={s} k={second} " + _point_line(deeper))
        return points

    # ---------------------------------------------------------------- fit, trust, warm-up

    def _fit_and_judge(self, trainer: Trainer, switch: BlockCheckpointing | None) -> None:
        """Rank 0 fits and judges; every rank gets the same models, verdicts and M_mem (or the same
        fallback), so none schedules differently or waits alone. The cost model and M_mem come from
        the points with every block checkpointed; with a switch the memory and depth models from all."""
        full = None if switch is None else switch.num_blocks
        at_full = [p for p in self.points if p.get("checkpointed") == full]
        feasible = [p for p in at_full if p["status"] == "ok"]
        infeasible = [p for p in at_full if p["status"] in INFEASIBLE]
        if self.m_mem is not None:
            self.measured_m_mem = int(self.m_mem)
        elif infeasible and feasible:
            self.measured_m_mem = max(1, math.floor(self.memory_margin * max(p["batch_size"] * p["seq_len"]
                                                                             for p in feasible)))
        else:
            self.measured_m_mem = None  # the grid never hit the memory limit: keep the DataModule's
        verdict = None
        if trainer.is_global_zero:
            model, error = fit_points(feasible, self.form)
            reasons = [error] if model is None else distrust_reasons(model, feasible, self.max_heldout_error,
                                                                     self.min_work_correlation)
            memory = depth = None
            memory_reasons = ["no cost model to build the depth model on"] if switch is not None else []
            if switch is not None and model is not None:
                memory, depth, why = fit_memory_models(self.points, full, model, self.optimizer_memory.state_bytes,
                                                       self.max_heldout_error)
                memory_reasons = [] if why is None else [why]
            verdict = (model, reasons, memory, depth, memory_reasons)
        (self.cost_model, self.distrust_reasons, self.memory_model, self.depth_cost_model,
         self.memory_distrust_reasons) = trainer.strategy.broadcast(verdict)
        self.trusted = not self.distrust_reasons

    def _measure_memory_terms(self, trainer: Trainer, runner: StepRunner) -> None:
        """The optimizer memory (the largest of the ranks', calibration/memory.py) and the device
        memory (the smallest of the ranks') the memory plan budgets with."""
        mine = optimizer_memory(trainer.optimizers)
        state, params, negative_device = runner.max_over_ranks(mine.state_bytes, mine.param_bytes,
                                                               -device_memory_bytes(runner.device))
        self.optimizer_memory = OptimizerMemory(int(state), int(params), mine.rule)
        self.device_memory_bytes = int(-negative_device)

    def _apply(self, datamodule, switch: BlockCheckpointing | None) -> None:
        """Hand the trusted fit to the DataModule: with the memory models, the cost model and the
        memory plan (the DataModule keeps its m_mem as the batches' token cap); else the cost model
        and M_mem, and every block stays checkpointed."""
        if switch is not None and self.memory_model is not None \
                and not callable(getattr(datamodule, "set_memory_plan", None)):
            self.memory_distrust_reasons = [f"{type(datamodule).__name__} has no set_memory_plan()"]
        self.memory_plan_used = switch is not None and not self.memory_distrust_reasons
        if not self.memory_plan_used:
            datamodule.set_cost_model(self.cost_model, self.measured_m_mem)
            if switch is not None:
                rank_zero_warn("CostModelCalibration: no memory plan (" + "; ".join(self.memory_distrust_reasons)
                               + f"); every step checkpoints all {switch.num_blocks} blocks")
            return
        datamodule.set_cost_model(self.cost_model, None)
        datamodule.set_memory_plan(self.depth_cost_model, self.memory_model, self.device_memory_bytes,
                                   self.max_memory_fraction)
        budget = self.max_memory_fraction * self.device_memory_bytes
        if self.optimizer_memory.step_bytes > budget:
            rank_zero_warn(f"CostModelCalibration: the optimizer step alone (parameters, gradients, optimizer state "
                           f"and a temporary copy: ~{self.optimizer_memory.step_bytes / 2**30:.2f} GiB per rank) "
                           f"exceeds the memory plan's budget of {budget / 2**30:.2f} GiB; training may run out of "
                           f"memory at the optimizer step (shard the model, or raise max_memory_fraction)")

    def _scheduled_shapes(self, datamodule) -> list:
        method = getattr(datamodule, "scheduled_batch_shapes", None)
        return list(method()) if callable(method) else []

    def _warm(self, runner: StepRunner, datamodule, switch: BlockCheckpointing | None) -> list[dict]:
        shapes = self._scheduled_shapes(datamodule)
        if not shapes:
            rank_zero_info(f"CostModelCalibration: no shape warm-up ({type(datamodule).__name__} does not list its "
                           "scheduled batch shapes: scheduled_batch_shapes())")
            return []
        spec = getattr(datamodule, "spec", None)
        predict = None
        if self.trusted and spec is not None:
            predict = self._warm_predictions(spec, None if switch is None else switch.num_blocks)
        at_depth = None
        if switch is not None:  # each shape at the depth training will run it (no plan: every block)
            at_depth = lambda k: switch.checkpointing(switch.num_blocks if k is None else k)  # noqa: E731
        warmed = warm_shapes(runner, datamodule.synthetic_batch, shapes, self.shape_warmup_budget_s, predict,
                             progress=rank_zero_info, at_depth=at_depth)
        oom = [w for w in warmed if w["status"] == "oom"]
        if oom:
            remedy = "lower max_memory_fraction" if self.memory_plan_used else "lower m_mem or max_seq_len"
            rank_zero_warn(f"CostModelCalibration: {len(oom)} scheduled batch shape(s) ran out of memory in the warm-up, "
                           f"e.g. B={oom[0]['batch_size']} latent {tuple(oom[0]['latent_shape'])}: training will "
                           f"fail on them; {remedy}")
        return warmed

    def _warm_predictions(self, spec, num_blocks: int | None):
        """What the models predict for a warmed shape: predicted_ms (its warm step time), and under a
        memory plan predicted_peak_bytes (the training peak: the optimizer state included, which the
        warm-up's measured peak_bytes lacks)."""
        def predict(shape: ScheduledShape) -> dict:
            s = spec.tokens_from_latent(*shape.latent_shape)
            if not self.memory_plan_used:
                return {"predicted_ms": float(self.cost_model.predict(shape.batch_size, s))}
            k = num_blocks if shape.checkpointed is None else shape.checkpointed
            return {"predicted_ms": float(self.depth_cost_model.predict(shape.batch_size, s, k)),
                    "predicted_peak_bytes": float(self.memory_model.predict(shape.batch_size, s, k))}
        return predict

    # ---------------------------------------------------------------- files, report

    def _key(self, trainer: Trainer, pl_module: LightningModule, grid, switch: BlockCheckpointing | None) -> dict:
        device = trainer.strategy.root_device
        return {
            "model": model_fingerprint(pl_module),
            "strategy": type(trainer.strategy).__name__,
            "precision": str(trainer.precision),
            "world_size": int(trainer.world_size),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "grid": [list(p) for p in grid],
            "depths": None if switch is None else [switch.num_blocks, switch.num_blocks // 2],
            "warmup": self.warmup,
            "repeats": self.repeats,
        }

    def _document(self, trainer: Trainer, key: dict, calibration_s: float, warmup_s: float, compiled: list[str],
                  recompile_limit: tuple[int, int] | None) -> dict:
        cm = self.cost_model
        datamodule = trainer.datamodule
        full = key["depths"][0] if key["depths"] else None
        return {
            "format": FORMAT,
            "version": VERSION,
            "key": key,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
            "seconds": round(calibration_s, 3),
            "source": self.source,
            "trusted": self.trusted,
            "distrust_reasons": self.distrust_reasons,
            "policy": getattr(datamodule, "policy", None),
            "m_mem": self.measured_m_mem,
            "peak_unit": ("bytes saved for backward (CPU estimate)" if key["device"] == "cpu"
                          else "bytes (CUDA max_memory_allocated)"),
            "cost_model": None if cm is None else cm.to_dict(),
            # `measurements` holds the feasible points the cost model is fitted to (every block
            # checkpointed), in the format cost_model.load_cost_model reads
            "measurements": [p for p in self.points if p["status"] == "ok" and p.get("checkpointed") == full],
            "points": self.points,
            "depths": key["depths"],
            "memory_plan": self._memory_document(),
            "compiled_regions": len(compiled),
            "recompile_limit": None if recompile_limit is None else recompile_limit[1],
            "warmup_seconds": round(warmup_s, 3),
            "warmed_shapes": self.warmed_shapes,
        }

    def _memory_document(self) -> dict | None:
        """The memory plan's part of calibration.json: None without PerBucketCheckpointing."""
        if self.optimizer_memory is None:
            return None
        om = self.optimizer_memory
        return {"used": self.memory_plan_used, "distrust_reasons": self.memory_distrust_reasons,
                "device_memory_bytes": self.device_memory_bytes, "max_memory_fraction": self.max_memory_fraction,
                "optimizer_memory": {"state_bytes": om.state_bytes, "param_bytes": om.param_bytes,
                                     "step_bytes": om.step_bytes, "rule": om.rule},
                "memory_model": None if self.memory_model is None else self.memory_model.to_dict(),
                "depth_cost_model": None if self.depth_cost_model is None else self.depth_cost_model.to_dict()}

    def _save_outputs(self, log_dir: Path, doc: dict) -> None:
        write_json(log_dir / "calibration.json", doc)
        if self.memory_model is not None:
            self.memory_model.to_json(log_dir / "calibration_memory_model.json")
            self.depth_cost_model.to_json(log_dir / "calibration_depth_cost_model.json")
        if self.cost_model is None:
            return
        self.cost_model.to_json(log_dir / "calibration_cost_model.json")
        feasible = doc["measurements"]
        if feasible:  # none for a cost model given as is
            b, s, t = ([p[k] for p in feasible] for k in ("batch_size", "seq_len", "time_ms"))
            plot_fit(self.cost_model, b, s, t, log_dir / "calibration_fit.png")

    def _report(self, trainer: Trainer, doc: dict, longest: int, datamodule) -> None:
        cm = self.cost_model
        full = doc["depths"][0] if doc["depths"] else None
        lines = [f"{'S':>8} {'B':>5} {'k':>4} {'time ms':>10} {'pred ms':>10} {'peak MiB':>10}  status"]
        for p in self.points:
            ok = p["status"] == "ok"
            k = p.get("checkpointed")
            predicted = f"{'':>10}"
            if ok and self.depth_cost_model is not None:
                predicted = f"{self.depth_cost_model.predict(p['batch_size'], p['seq_len'], k):>10.2f}"
            elif ok and cm is not None and k == full:
                predicted = f"{cm.predict(p['batch_size'], p['seq_len']):>10.2f}"
            lines.append(f"{p['seq_len']:>8} {p['batch_size']:>5} {'-' if k is None else k:>4} "
                         + (f"{p['time_ms']:>10.2f} {predicted} {p['peak_bytes'] / 2**20:>10.1f}" if ok
                            else f"{'':>10} {'':>10} {'':>10}")
                         + f"  {p['status']}")
        source = {"cache": " (from cache)", "checkpoint": " (from checkpoint)", "given": " (given)"}.get(self.source, "")
        if cm is not None:
            q = cm.quality
            lines.append(f"cost model {cm!r}; mean rel err {q['mean_rel_err']:.1%}, held-out "
                         f"{q['heldout_mean_rel_err']:.1%}; "
                         + ("trusted" if self.trusted else "NOT trusted: " + "; ".join(self.distrust_reasons)))
        else:
            lines.append("no cost model: " + "; ".join(self.distrust_reasons))
        lines.append(f"M_mem = {self.measured_m_mem or 'kept from the DataModule'}"
                     + (f", M_comp = {cm.m_comp(self.measured_m_mem, longest):.4g} (ref S = {longest})"
                        if self.measured_m_mem and self.trusted else "")
                     + f"; policy {doc['policy']}; {doc['seconds']:.1f} s{source}")
        if self.warmed_shapes:
            lines.append(_format_warmup(self.warmed_shapes, doc["warmup_seconds"]))
        rank_zero_info("CostModelCalibration\n" + "\n".join(lines))
        if callable(getattr(datamodule, "bucket_table", None)):
            rank_zero_info("bucket table after calibration\n" + datamodule.bucket_table().format())
        metrics = {"calibration/points": float(len(doc["measurements"])),
                   "calibration/infeasible": float(sum(p["status"] in INFEASIBLE for p in self.points)),
                   "calibration/seconds": doc["seconds"], "calibration/trusted": float(self.trusted),
                   "calibration/from_cache": float(self.source == "cache"),
                   "calibration/warmup_seconds": doc["warmup_seconds"],
                   "calibration/shapes_left_cold": float(sum(w["status"] != "warmed" for w in self.warmed_shapes))}
        if cm is not None:
            metrics["calibration/p"] = cm.p
            if math.isfinite(cm.quality["heldout_mean_rel_err"]):
                metrics["calibration/heldout_mean_rel_err"] = cm.quality["heldout_mean_rel_err"]
        if self.measured_m_mem:
            metrics["calibration/m_mem"] = float(self.measured_m_mem)
        for logger in trainer.loggers:  # self.log is not allowed in on_fit_start
            logger.log_metrics(metrics, step=0)


def _dominated(points: list[dict], b: int, s: int, checkpointed: int | None) -> bool:
    """Whether a point no larger in B and S at the same depth did not fit."""
    return any(p["status"] in ("oom", "predicted_oom", "skipped_oom") and p["batch_size"] <= b and p["seq_len"] <= s
               and p.get("checkpointed") == checkpointed for p in points)


def _point_line(point: dict) -> str:
    return f"{point['time_ms']:.2f} ms" if point["status"] == "ok" else point["status"]


def _checkpointing_switch(trainer: Trainer) -> BlockCheckpointing | None:
    """The switch of the trainer's PerBucketCheckpointing callback, or None without one."""
    found = [c for c in trainer.callbacks if isinstance(c, PerBucketCheckpointing)]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"CostModelCalibration found {len(found)} PerBucketCheckpointing callbacks; use one")
    callback = found[0]
    if callback.switch is None:
        raise ValueError("CostModelCalibration: PerBucketCheckpointing has not wrapped the model's blocks yet; list it "
                         "before CostModelCalibration in the trainer's callbacks")
    if callback.batch_key != DEPTH_BATCH_KEY:
        raise ValueError(f"CostModelCalibration plans memory through batch[{DEPTH_BATCH_KEY!r}], which the DataModule "
                         f"writes, but PerBucketCheckpointing reads batch[{callback.batch_key!r}]; leave its batch_key "
                         f"at the default")
    return callback.switch


def _format_warmup(warmed: list[dict], seconds: float) -> str:
    done = [w for w in warmed if w["status"] == "warmed"]
    excess = [w["cold_ms"] - w["predicted_ms"] for w in done if "predicted_ms" in w]
    line = f"shape warm-up: {len(done)} of {len(warmed)} scheduled (B, latent shape) warmed in {seconds:.1f} s"
    if excess:
        line += f"; first step over the cost model: mean {np.mean(excess):.1f} ms, max {np.max(excess):.1f} ms"
    cold = len(warmed) - len(done)
    if cold:
        line += f"; {cold} left cold ({sum(w['status'] == 'oom' for w in warmed)} out of memory)"
    return line
