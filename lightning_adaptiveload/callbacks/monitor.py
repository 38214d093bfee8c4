"""LoadBalanceMonitor: the Lightning hooks of the load-balance monitor.

Every train batch each rank records its samples, tokens, bucket seq_len, predicted compute load,
step time and, on CUDA, the step's peak allocated and reserved memory (and, on sampled steps, its
busy and communication time from a profiler window).
At each logged step (every `trainer.log_every_n_steps` optimizer steps) the rows buffered since
the last log go through one all_gather (a float64 tensor of shape (steps, len(FIELDS)) per rank);
rank 0 appends them to `balance_per_rank.csv` in the log dir (monitoring/per_rank_log.py) and logs
the metrics of monitoring/balance.py's BalanceTracker through the Trainer's loggers.
docs/monitoring.md defines each one. `startup/time_to_first_step_s` is the wall time from the start of
`fit` (this callback's `setup`) to the first training batch: model setup, calibration, verification and
the first batch's loading, what a user waits before training starts.
"""
from __future__ import annotations

import math
import os
import time
import warnings

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_adaptiveload.monitoring import per_rank_log
from lightning_adaptiveload.monitoring.balance import BalanceTracker
from lightning_adaptiveload.monitoring.busy import StepProfiler
from lightning_adaptiveload.monitoring.compile_counters import (NAMES as COMPILE_NAMES, CompileCounter, RecompileReasons,
                                                               describe_reasons)
from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, FIELDS
from lightning_adaptiveload.scheduling.cost_model import CostModel

PROXY_LOAD_UNIT = "tokens^2 (proxy B*S^2: no cost model)"
DEFAULT_BUSY_EVERY_N_LOGS = 8  # at log_every_n_steps=50: one profiled step in 400 (benchmarks/e2e/monitor_overhead.py)


def batch_samples_and_seq_len(batch) -> tuple[int, int, int]:
    """(samples, tokens, seq_len) of a batch dict with `latents (B, ...)` or `keys`, and `seq_len`.

    `seq_len` is tokens per sample: an int, a 0-d tensor, or one entry per sample; with unequal
    entries the batch counts as padded to the longest (seq_len = max, tokens = sum).
    """
    if not isinstance(batch, dict) or "seq_len" not in batch:
        got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise KeyError(f"LoadBalanceMonitor needs a batch dict with 'seq_len' (tokens per sample); got {got}")
    if "latents" in batch:
        samples = int(batch["latents"].shape[0])
    elif "keys" in batch:
        samples = len(batch["keys"])
    else:
        raise KeyError(f"LoadBalanceMonitor needs 'latents' (B, ...) or 'keys' in the batch; got {sorted(batch)}")
    seq_len = batch["seq_len"]
    per_sample = seq_len.reshape(-1).tolist() if isinstance(seq_len, torch.Tensor) else np.ravel(seq_len).tolist()
    if len(per_sample) == 1:
        return samples, samples * int(per_sample[0]), int(per_sample[0])
    if len(per_sample) != samples:
        raise ValueError(f"batch 'seq_len' has {len(per_sample)} entries for {samples} samples")
    return samples, int(sum(per_sample)), int(max(per_sample))


def gathered_rows(gathered: torch.Tensor, local_shape: torch.Size, world_size: int) -> np.ndarray:
    """`strategy.all_gather` of a (k, F) tensor as a (k, world_size, F) numpy array. Strategies
    differ in what they return: without a process group the local (k, F) itself, with one (also of
    size 1, e.g. FSDP or DDP on one device) (world, k, F); any of these reshapes to (world, k, F)."""
    rows = gathered.reshape(-1, *local_shape)
    if rows.shape[0] != world_size:
        raise RuntimeError(f"LoadBalanceMonitor: all_gather of a {tuple(local_shape)} tensor returned shape "
                           f"{tuple(gathered.shape)}, not {world_size} ranks' rows (trainer.world_size)")
    return rows.cpu().numpy().transpose(1, 0, 2)


class LoadBalanceMonitor(Callback):
    """Logs cross-rank load balance and step time of every train batch (see module docstring).

    cost_model: predicts a batch's compute time in ms from (B, S) (`CostModel.predict`); if None,
    the DataModule's `step_cost_model()` (what its schedule prices batches by; at each bucket's
    checkpointing depth under a memory plan) or its `cost_model` is used, else the proxy B * S^2
    (tokens^2, the attention term).
    window: steps in the rolling window of `balance/step_time_cv_temporal`.
    sync_cuda: call torch.cuda.synchronize around each step on GPU so the wall time covers the
    step's kernels (it stops the host from running ahead of the GPU at the step boundary).
    busy_every_n_logs: profile one training step on every rank (the last step before every Nth
    logged step) for per-rank busy and communication time (`balance/busy_cv`, ...); 0 turns it
    off. The default keeps the cost under 1% of training time (docs/monitoring.md).
    verbose: print the load unit at the start and the summary table at the end (rank 0).
    """

    def __init__(self, cost_model: CostModel | None = None, window: int = 50, sync_cuda: bool = True,
                 busy_every_n_logs: int = DEFAULT_BUSY_EVERY_N_LOGS, verbose: bool = True):
        if int(window) < 2:
            raise ValueError(f"LoadBalanceMonitor window must be >= 2 steps, got {window}")
        if int(busy_every_n_logs) < 0:
            raise ValueError(f"LoadBalanceMonitor busy_every_n_logs must be >= 0 (0: off), got {busy_every_n_logs}")
        self.cost_model = cost_model
        self.window = int(window)
        self.sync_cuda = sync_cuda
        self.busy_every_n_logs = int(busy_every_n_logs)
        self.verbose = verbose
        self.summary: dict = {}
        self._fit_start: float | None = None
        self.time_to_first_step_s: float | None = None

    # ---- per-fit state -------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._fit_start, self.time_to_first_step_s = time.perf_counter(), None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._active_cost_model = (self.cost_model if self.cost_model is not None
                                   else _scheduling_cost_model(trainer.datamodule))
        self.load_unit = "ms (cost model)" if self._active_cost_model is not None else PROXY_LOAD_UNIT
        self._device = trainer.strategy.root_device
        self._sync = self.sync_cuda and self._device.type == "cuda"
        self._cuda = self._device.type == "cuda"
        self.memory_budget_bytes = _memory_budget(trainer.datamodule) if self._cuda else None
        self.tracker = BalanceTracker(trainer.world_size, self.window, self.load_unit, self.memory_budget_bytes)
        self._warned_budget = False
        # No window if the fit ends before the first profiled step (short runs skip the warm-up).
        self._busy_period = self.busy_every_n_logs * trainer.log_every_n_steps
        profiles = self._busy_period > 0 and _steps_planned(trainer) >= self._busy_period
        self._profiler = StepProfiler(self._device.type) if profiles else None
        t0 = time.perf_counter()
        self._open_profiler(trainer, warm_up=True)
        self.busy_warm_up_ms = (time.perf_counter() - t0) * 1e3  # one-off, not in overhead_ms
        self.busy_window_ms = 0.0  # opening, closing and reading the profiled steps' windows (in overhead_ms)
        self._profiled_step = -1
        self._compile = CompileCounter()
        self._recompile_reasons = RecompileReasons()
        self._warned_limit = False
        self._rows: list[tuple] = []
        self._last_end = None
        self._step_at_start = 0
        self.overhead_ms = 0.0  # time inside the per-batch hooks and the flushes (not one-off setup)
        self.steps_seen = 0
        # trainer.log_dir is a collective (broadcast): resolve it here, on every rank.
        self.log_dir = trainer.log_dir or trainer.default_root_dir
        self.csv_path = os.path.join(self.log_dir, CSV_NAME)
        if trainer.is_global_zero:
            os.makedirs(self.log_dir, exist_ok=True)
            if trainer.global_step == 0 and os.path.exists(self.csv_path):
                os.remove(self.csv_path)  # a fresh fit; a resumed one appends
            elif os.path.exists(self.csv_path):
                per_rank_log.drop_rows_from_step(self.csv_path, trainer.global_step)  # trained after the checkpoint
            per_rank_log.write_meta(self.log_dir, load_unit=self.load_unit, world_size=trainer.world_size,
                                    window=self.window, busy_every_n_logs=self.busy_every_n_logs,
                                    log_every_n_steps=trainer.log_every_n_steps)
            if self.verbose:
                rank_zero_info(f"LoadBalanceMonitor: load in {self.load_unit}; per-rank rows -> {self.csv_path}")

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Throughput counts training time only: restart the interval clock after validation.
        self._last_end = time.perf_counter()

    # ---- per batch -----------------------------------------------------------------------
    def _profile_this_step(self, trainer: Trainer) -> bool:
        """The last step of every busy_every_n_logs-th log interval, once (its first micro-batch).
        Decided from global_step alone, so every rank profiles the same step."""
        step = trainer.global_step
        return (step + 1) % self._busy_period == 0 and step != self._profiled_step

    def _open_profiler(self, trainer: Trainer, warm_up: bool = False) -> None:
        """Start the busy-time window (or, at train start, open and close one to initialise the
        profiler). If torch refuses (e.g. another profiler is running) this rank's busy time stays
        NaN for the rest of the fit; no collective is involved, so the other ranks go on."""
        if self._profiler is None:
            return
        try:
            self._profiler.warm_up() if warm_up else self._profiler.start()
        except RuntimeError as e:
            warnings.warn(f"LoadBalanceMonitor (rank {trainer.global_rank}): cannot open a profiler window for "
                          f"busy time ({e}); busy time is off on this rank for this fit")
            self._profiler = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        t0 = time.perf_counter()
        if self.time_to_first_step_s is None and self._fit_start is not None:
            self.time_to_first_step_s = t0 - self._fit_start
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics({"startup/time_to_first_step_s": self.time_to_first_step_s},
                                       step=trainer.global_step)
        samples, tokens, seq_len = batch_samples_and_seq_len(batch)
        if self._active_cost_model is not None:
            load = float(self._active_cost_model.predict(samples, seq_len))
        else:
            load = float(samples) * float(seq_len) ** 2
        self._pending = (trainer.current_epoch, trainer.global_step, batch_idx, samples, tokens, seq_len, load)
        self._step_at_start = trainer.global_step
        if self._sync:
            torch.cuda.synchronize(self._device)
        if self._cuda:  # this step's peak, its optimizer step included (it runs before on_train_batch_end)
            torch.cuda.reset_peak_memory_stats(self._device)
        if self._profiler is not None and self._profile_this_step(trainer):
            self._profiled_step = trainer.global_step
            t_open = time.perf_counter()
            self._open_profiler(trainer)
            self.busy_window_ms += (time.perf_counter() - t_open) * 1e3
        self._start = time.perf_counter()
        self.overhead_ms += (self._start - t0) * 1e3

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._sync:
            torch.cuda.synchronize(self._device)
        end = time.perf_counter()
        busy_ms = comm_ms = math.nan
        if self._profiler is not None and self._profiler.active:
            busy_ms, comm_ms = self._profiler.stop()
            self.busy_window_ms += (time.perf_counter() - end) * 1e3
        counts = self._compile.read()
        reasons = self._recompile_reasons.read()
        if reasons:  # this rank's own: a step that compiled again in training says which guard failed
            _, step, _, samples, _, seq_len, _ = self._pending
            rank_zero_info(f"LoadBalanceMonitor: step {step} (B={samples} S={seq_len}) compiled again, guards failed: "
                           f"{describe_reasons(reasons)}")
        since = self._last_end if self._last_end is not None else self._start
        peaks = ((torch.cuda.max_memory_allocated(self._device), torch.cuda.max_memory_reserved(self._device))
                 if self._cuda else (math.nan, math.nan))
        self._rows.append(self._pending + ((end - self._start) * 1e3, (end - since) * 1e3, busy_ms, comm_ms)
                          + tuple(math.nan if counts[name] is None else counts[name] for name in COMPILE_NAMES) + peaks)
        self._last_end = end
        self.steps_seen += 1
        n = trainer.log_every_n_steps
        stepped = trainer.global_step > self._step_at_start
        # global_step is equal on every rank, so every rank takes part in the same gathers.
        if n > 0 and stepped and trainer.global_step % n == 0:
            self._flush(trainer)
        self.overhead_ms += (time.perf_counter() - end) * 1e3

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log_data_counters(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close_profiler()

    def _close_profiler(self) -> None:
        """Close a window left open by a step that never reached on_train_batch_end."""
        if getattr(self, "_profiler", None) is not None and self._profiler.active:
            self._profiler.stop()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_profiler()
        t0 = time.perf_counter()
        if self._rows:  # same count on every rank (equal batches per rank)
            self._flush(trainer)
        self.overhead_ms += (time.perf_counter() - t0) * 1e3
        self._log_data_counters(trainer)
        self.summary = self.tracker.summary(self.overhead_ms / max(self.steps_seen, 1))
        if self.summary:
            self.summary["log_every_n_steps"] = trainer.log_every_n_steps
        if "busy_steps" in self.summary:  # this rank's profiler cost: one-off warm-up, per window
            self.summary.update(busy_warm_up_ms=self.busy_warm_up_ms,
                                busy_window_ms_per_step=self.busy_window_ms / self.summary["busy_steps"])
        if self.summary and self.time_to_first_step_s is not None:
            self.summary["time_to_first_step_s"] = self.time_to_first_step_s
        if trainer.is_global_zero and self.verbose and self.summary:
            print(self.tracker.format_summary(self.summary))
            if "time_to_first_step_s" in self.summary:
                print(f"time to first step:               {self.summary['time_to_first_step_s']:.1f} s from the start "
                      f"of fit (setup, calibration, verification; calibration.json splits the last two)")

    # ---- gather, log, write ---------------------------------------------------------------
    def _flush(self, trainer: Trainer) -> None:
        local = torch.tensor(self._rows, dtype=torch.float64, device=self._device)
        self._rows = []
        rows = gathered_rows(trainer.strategy.all_gather(local), local.shape, trainer.world_size)  # (k, world, F)
        metrics = self.tracker.update(rows)
        if not trainer.is_global_zero:
            return
        try:
            per_rank_log.append_rows(self.csv_path, rows)
        except OSError as e:  # rank 0 alone writes: raising would leave the others waiting in a gather
            rank_zero_warn(f"LoadBalanceMonitor: cannot append to {self.csv_path} ({e}); "
                           f"{rows.shape[0]} batches of per-rank rows are lost, training goes on")
        metrics.update(self._legacy_skipped(trainer))
        step = int(rows[-1, 0, FIELDS.index("step")])
        if metrics.get("memory/steps_over_budget") and not self._warned_budget:
            self._warned_budget = True
            rank_zero_warn(f"LoadBalanceMonitor: {int(metrics['memory/steps_over_budget'])} step(s) up to step {step} "
                           f"held more device memory than the plan's budget of {self.memory_budget_bytes / 2**30:.2f} "
                           f"GiB (peak {metrics['memory/peak_allocated_gib']:.2f} GiB allocated, "
                           f"{metrics['memory/peak_reserved_gib']:.2f} GiB reserved): the plan did not verify what "
                           f"training runs (see peak_*_bytes in {self.csv_path})")
        over_limit = self.tracker.ranks_over_recompile_limit()
        if over_limit and not self._warned_limit:
            self._warned_limit = True
            rank_zero_warn(f"LoadBalanceMonitor: torch.compile hit dynamo's recompile limit on rank(s) {over_limit}: "
                           f"the code that hit it now runs eagerly (slower) for the rest of the run. Raise "
                           f"torch._dynamo.config.recompile_limit (now {_recompile_limit()}) or mark the varying "
                           f"dims dynamic; TORCH_LOGS=recompiles shows the reasons")
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @staticmethod
    def _legacy_skipped(trainer: Trainer) -> dict[str, float]:
        """A DataModule without counters() but with a `skipped` dict (reason -> count): its total
        and counts, as rank 0 holds them, at every logged step."""
        skipped = getattr(trainer.datamodule, "skipped", None)
        if callable(getattr(trainer.datamodule, "counters", None)) or not isinstance(skipped, dict):
            return {}
        return {"data/skipped": float(sum(skipped.values())),
                **{f"data/skipped/{reason}": float(count) for reason, count in skipped.items()}}

    def _log_data_counters(self, trainer: Trainer) -> None:
        """`trainer.datamodule.counters()` (name -> count) logged as data/<name> by rank 0, plus
        data/skipped, the sum of the skipped/* counts. Called on every rank: counters() may be a
        collective."""
        counters = getattr(trainer.datamodule, "counters", None)
        if not callable(counters):
            return
        values = counters()
        if not isinstance(values, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in values.items()):
            raise TypeError(f"LoadBalanceMonitor: {type(trainer.datamodule).__name__}.counters() must return a dict "
                            f"of str -> int, got {values!r}")
        if not trainer.is_global_zero or not values:
            return
        logged = {f"data/{name}": float(count) for name, count in values.items()}
        skipped = [count for name, count in values.items() if name.startswith("skipped/")]
        if skipped:
            logged["data/skipped"] = float(sum(skipped))
        for logger in trainer.loggers:
            logger.log_metrics(logged, step=max(trainer.global_step - 1, 0))


def _steps_planned(trainer: Trainer) -> float:
    """Optimizer steps this fit will take; inf where Lightning cannot tell (an iterable dataset
    without max_steps gives -1, changing gradient accumulation raises)."""
    try:
        steps = trainer.estimated_stepping_batches
    except MisconfigurationException:
        return math.inf
    return steps if steps >= 0 else math.inf


def _recompile_limit() -> str:
    import torch._dynamo

    config = torch._dynamo.config
    return str(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", "unknown")))


def _memory_budget(datamodule) -> float | None:
    """The memory a step may hold under the DataModule's plan (its `memory_budget_bytes()`; ours: the
    memory plan's or verification's budget), None where it says none."""
    budget = getattr(datamodule, "memory_budget_bytes", None)
    return budget() if callable(budget) else None


def _scheduling_cost_model(datamodule):
    """The model the DataModule schedules with: its `step_cost_model()` where it has one (ours), else
    its `cost_model` attribute (a user's DataModule that CostModelCalibration sets one on), else None."""
    step_cost_model = getattr(datamodule, "step_cost_model", None)
    return step_cost_model() if callable(step_cost_model) else getattr(datamodule, "cost_model", None)
