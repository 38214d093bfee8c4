"""CostModelCalibration: the Lightning hook of the calibration loop (calibration/loop.py).

Runs once in `on_fit_start`, after the strategy wrapped the model and the optimizers exist, before the
train loader is built: measure the (B, S) grid as real training steps, fit the step-time cost model
(and with `PerBucketCheckpointing` the memory and depth models), plan the DataModule's buckets with
them, and verify every scheduled batch shape under training's memory conditions, planning again the
buckets that do not fit. This module turns the trainer into the loop's parts (the step runner, the
checkpointing switch, the cache key), writes what the loop decided (rank 0) and logs it.
docs/lightning.md describes the grid, the trust check, the verification and the files written.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_adaptiveload.calibration.config import (DEFAULT_BATCH_SIZES, DEFAULT_MAX_HELDOUT_ERROR,
                                                       DEFAULT_MAX_MEMORY_HELDOUT_ERROR, DEFAULT_MIN_WORK_CORRELATION,
                                                       CalibrationConfig)
from lightning_adaptiveload.calibration.loop import Calibration, check_datamodule, grid_and_recompile_room
from lightning_adaptiveload.calibration.record import model_fingerprint
from lightning_adaptiveload.calibration.report import document, format_report, metrics, save_outputs
from lightning_adaptiveload.calibration.result import CalibrationResult
from lightning_adaptiveload.calibration.runner import StepRunner, agree
from lightning_adaptiveload.callbacks.checkpointing import PerBucketCheckpointing
from lightning_adaptiveload.checkpointing import BlockCheckpointing
from lightning_adaptiveload.compile_cache import device_name
from lightning_adaptiveload.monitoring.compile_counters import with_recompile_reasons
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.depth_choice import CHECKPOINTED_BATCH_KEY, PLAN_MARGIN
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.model_io import write_json
from lightning_adaptiveload.scheduling.verification import Verification


class CostModelCalibration(Callback):
    """Fit the step-time cost model t(B, S) on the real training step, hand it to the DataModule
    (`set_cost_model`), and verify every scheduled batch shape before training; with a
    `PerBucketCheckpointing` callback (listed before this one) also fit the memory and depth models
    and plan per-bucket (B, k) with them (`set_memory_plan`). The arguments are those of
    `calibration.config.CalibrationConfig` (one docstring per field there); `result` holds what the
    last fit's calibration decided.
    """

    def __init__(self, num_seq_lens: int = 4, batch_sizes: list[int] | None = None, max_tokens: int | None = None,
                 warmup: int = 1, repeats: int = 3, time_budget_s: float = 180.0, m_mem: int | None = None,
                 memory_margin: float = 0.9, max_memory_fraction: float = 0.85, plan_margin: float = PLAN_MARGIN,
                 form: str = "auto",
                 max_heldout_error: float = DEFAULT_MAX_HELDOUT_ERROR,
                 max_memory_heldout_error: float = DEFAULT_MAX_MEMORY_HELDOUT_ERROR,
                 min_work_correlation: float = DEFAULT_MIN_WORK_CORRELATION, verify: bool = True,
                 verify_rounds: int = 3, cache_path: str | None = None, cost_model_path: str | None = None):
        try:
            self.config = CalibrationConfig(
                num_seq_lens=num_seq_lens, batch_sizes=tuple(batch_sizes) if batch_sizes else DEFAULT_BATCH_SIZES,
                max_tokens=max_tokens, warmup=warmup, repeats=repeats, time_budget_s=time_budget_s, m_mem=m_mem,
                memory_margin=memory_margin, max_memory_fraction=max_memory_fraction, plan_margin=plan_margin, form=form,
                max_heldout_error=max_heldout_error, max_memory_heldout_error=max_memory_heldout_error,
                min_work_correlation=min_work_correlation, verify=verify, verify_rounds=verify_rounds,
                cache_path=cache_path, cost_model_path=cost_model_path)
        except ValueError as e:
            raise ValueError(f"CostModelCalibration: {e}") from None
        self.result: CalibrationResult | None = None
        self._restored: dict | None = None  # from a checkpoint, see load_state_dict

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = trainer.datamodule
        check_datamodule(datamodule)
        if not pl_module.automatic_optimization:  # same module on every rank: every rank raises
            raise TypeError(f"CostModelCalibration needs automatic optimization; {type(pl_module).__name__} "
                            "steps its optimizers inside training_step (manual optimization), which would "
                            "change the parameters during the benchmark")
        config = self.config
        switch = _checkpointing_switch(trainer)
        grid, compiled, recompile_limit = grid_and_recompile_room(config, datamodule, pl_module, switch is not None,
                                                                  rank_zero_info)
        key = _key(trainer, pl_module, grid, switch, config)
        cache_path = Path(config.cache_path or os.path.join(trainer.default_root_dir, "calibration_cache.json"))
        restored = self._restored or {}
        self._restored = None
        policy = getattr(datamodule, "policy", None)
        saved_measured = False

        def save_measured(result: CalibrationResult) -> None:
            """Rank 0 caches the calibration before verification (verification None in the file: a later
            run reuses the points and verifies in full); the file is rewritten with it after, or removed
            when verification leaves a bucket unresolved (such a calibration is never reused)."""
            nonlocal saved_measured
            if trainer.is_global_zero:
                try:
                    write_json(cache_path, document(result, key, policy))
                    saved_measured = True
                except OSError as e:  # the final write reports for every rank; this one is an extra
                    rank_zero_warn(f"CostModelCalibration: could not cache the measured points in {cache_path} "
                                   f"before verification: {e}")

        with StepRunner(trainer, pl_module) as runner:
            loop = Calibration(config, runner, datamodule, switch=switch, optimizers=trainer.optimizers, key=key,
                               cache_path=cache_path, restored_points=restored.get("points"),
                               restored_verification=restored.get("verification"),
                               restored_models=restored.get("models"), save=save_measured, info=rank_zero_info,
                               warn=rank_zero_warn,
                               # a compiled model's shape lines say which guard failed when a shape compiled again
                               progress=with_recompile_reasons(rank_zero_info) if compiled else None)
            self.result = result = loop.run(grid, compiled, recompile_limit)

        # trainer.log_dir is a collective (a broadcast): resolve it on every rank, not in rank 0 alone.
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        write_error = None
        if trainer.is_global_zero:
            try:
                doc = document(result, key, policy)
                if result.cacheable:
                    write_json(cache_path, doc)
                elif saved_measured:
                    cache_path.unlink(missing_ok=True)
                save_outputs(log_dir, result, doc)
                rank_zero_info("CostModelCalibration\n" + format_report(result, doc, max(s for _, s in grid)))
                if callable(getattr(datamodule, "bucket_table", None)):
                    rank_zero_info("bucket table after calibration\n" + datamodule.bucket_table().format())
                for logger in trainer.loggers:  # self.log is not allowed in on_fit_start
                    logger.log_metrics(metrics(result, doc), step=0)
            except Exception as e:  # raised below on every rank: the others must not train on alone
                write_error = e
        if agree(trainer.strategy, write_error is not None):
            detail = f": {type(write_error).__name__}: {write_error}" if write_error else ""
            raise RuntimeError(f"CostModelCalibration: rank 0 failed to write or report the calibration{detail}") \
                from write_error

    # A resumed fit must schedule with the calibration it started with: the sampler's resume state
    # holds the batch sizes and depths, which a new measurement (or a cache since overwritten) and a
    # new verification could change.
    def state_dict(self) -> dict:
        if self.result is None:
            return {}
        outcome, memory = self.result.verification, self.result.memory
        models = memory is not None and memory.used
        return {"points": self.result.points,
                "verification": None if outcome is None else outcome.verification.to_dict(),
                "memory_model": memory.memory_model.to_dict() if models else None,
                "depth_cost_model": memory.depth_cost_model.to_dict() if models else None}

    def load_state_dict(self, state_dict: dict) -> None:
        where = "CostModelCalibration checkpoint state"
        verification, memory, depth_model = (state_dict.get(k) for k in ("verification", "memory_model", "depth_cost_model"))
        self._restored = {
            "points": state_dict.get("points") or None,
            "verification": None if verification is None else Verification.from_dict(verification, where),
            "models": None if memory is None else (MemoryModel.from_dict(memory, f"{where}: memory_model"),
                                                   DepthCostModel.from_dict(depth_model, f"{where}: depth_cost_model"))}


DATA_KEYS = ("latent_channels", "text_len", "text_dim")  # DataModule attributes that shape every batch


def _key(trainer: Trainer, pl_module: LightningModule, grid, switch: BlockCheckpointing | None,
         config: CalibrationConfig) -> dict:
    """What decides the grid's step costs beyond the batch shape (calibration/record.py): the model,
    the strategy, precision, world size and device, the grid, its depths and what a checkpointed block
    keeps (its attention's outputs or its inputs only), steps per point, what
    every batch holds beside the latents (the DataModule's latent channels and text (L, D), None where
    it has no such attribute: a text context of another length changes every cross-attention), the
    gradient accumulation (training holds the accumulated gradients while later batches run), the
    torch version (its kernels and allocator), and on CPU the intra-op threads training runs with."""
    device = trainer.strategy.root_device
    datamodule = trainer.datamodule
    return {
        "model": model_fingerprint(pl_module),
        "strategy": type(trainer.strategy).__name__,
        "precision": str(trainer.precision),
        "world_size": int(trainer.world_size),
        "device": device_name(device),
        "grid": [list(p) for p in grid],
        "depths": None if switch is None else [switch.num_blocks, switch.num_blocks // 2],
        "save_attention": None if switch is None else switch.save_attention,
        "warmup": config.warmup,
        "repeats": config.repeats,
        "data": {name: getattr(datamodule, name, None) for name in DATA_KEYS},
        "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
    }


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
    if callback.batch_key != CHECKPOINTED_BATCH_KEY:
        raise ValueError(f"CostModelCalibration plans memory through batch[{CHECKPOINTED_BATCH_KEY!r}], which the DataModule "
                         f"writes, but PerBucketCheckpointing reads batch[{callback.batch_key!r}]; leave its batch_key "
                         f"at the default")
    return callback.switch
