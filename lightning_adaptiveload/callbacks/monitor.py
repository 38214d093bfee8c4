"""LoadBalanceMonitor: per-rank load and step time, gathered and logged as imbalance metrics.

Every train batch each rank records its samples, tokens, bucket seq_len, predicted compute
load and step time. At each logged step (every `trainer.log_every_n_steps` optimizer steps) the
rows buffered since the last log go through one all_gather (a float64 tensor of shape
(steps, len(FIELDS)) per rank), rank 0 appends them to `balance_per_rank.csv` in the log dir
and logs the metrics below through the Trainer's loggers. docs/monitoring.md defines each one.
"""
from __future__ import annotations

import collections
import csv
import json
import os
import time

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_adaptiveload.scheduling.cost_model import CostModel

# One row per train batch and rank; the gathered tensor's last axis follows this order.
FIELDS = ("epoch", "step", "batch_idx", "samples", "tokens", "seq_len", "load", "step_time_ms", "interval_ms")
CSV_NAME = "balance_per_rank.csv"
CSV_HEADER = ("epoch", "step", "batch_idx", "rank") + FIELDS[3:]
META_NAME = "balance_meta.json"
PROXY_LOAD_UNIT = "tokens^2 (proxy B*S^2: no cost model)"
_COL = {name: i for i, name in enumerate(FIELDS)}


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


def cross_rank_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Per-step statistics over ranks of `values (world, steps)`: cv (population std / mean),
    max_over_mean and bubble (1 - mean / max); each (steps,); 0 where the mean is 0."""
    mean = values.mean(axis=0)
    peak = values.max(axis=0)
    safe_mean = np.where(mean > 0, mean, 1.0)
    safe_peak = np.where(peak > 0, peak, 1.0)
    return {
        "cv": np.where(mean > 0, values.std(axis=0) / safe_mean, 0.0),
        "max_over_mean": np.where(mean > 0, peak / safe_mean, 0.0),
        "bubble": np.where(peak > 0, 1.0 - mean / safe_peak, 0.0),
    }


def time_beyond_prediction_ms(load_ms: np.ndarray, step_time_ms: np.ndarray) -> np.ndarray:
    """Per step (steps,): the ranks' mean measured step time minus the predicted load of the
    slowest rank, from `load_ms` and `step_time_ms` of shape (world, steps): what the cost model
    leaves out (optimizer step, waits between ranks inside the step, model error)."""
    return step_time_ms.mean(axis=0) - load_ms.max(axis=0)


def temporal_cv(step_times_ms) -> float:
    """Population std / mean of a sequence of step times; 0 for fewer than 2 values."""
    values = np.asarray(step_times_ms, dtype=np.float64)
    if values.size < 2 or values.mean() <= 0:
        return 0.0
    return float(values.std() / values.mean())


class LoadBalanceMonitor(Callback):
    """Logs cross-rank load balance and step time of every train batch (see module docstring).

    cost_model: predicts a batch's compute time in ms from (B, S) (`CostModel.predict`); if None,
    `trainer.datamodule.cost_model` is used, else the proxy B * S^2 (tokens^2, the attention term).
    window: steps in the rolling window of `balance/step_time_cv_temporal`.
    sync_cuda: call torch.cuda.synchronize around each step on GPU so the wall time covers the
    step's kernels (it stops the host from running ahead of the GPU at the step boundary).
    verbose: print the load unit at the start and the summary table at the end (rank 0).
    """

    def __init__(self, cost_model: CostModel | None = None, window: int = 50, sync_cuda: bool = True,
                 verbose: bool = True):
        if int(window) < 2:
            raise ValueError(f"LoadBalanceMonitor window must be >= 2 steps, got {window}")
        self.cost_model = cost_model
        self.window = int(window)
        self.sync_cuda = sync_cuda
        self.verbose = verbose
        self.summary: dict = {}

    # ---- per-fit state -------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._active_cost_model = (self.cost_model if self.cost_model is not None
                                   else getattr(trainer.datamodule, "cost_model", None))
        self.load_unit = "ms (cost model)" if self._active_cost_model is not None else PROXY_LOAD_UNIT
        self._device = trainer.strategy.root_device
        self._sync = self.sync_cuda and self._device.type == "cuda"
        self._rows: list[tuple] = []
        self._recent_step_ms: collections.deque = collections.deque(maxlen=self.window)
        self._run: dict[str, list] = collections.defaultdict(list)  # per-interval arrays of per-step stats
        self._rank_sums = np.zeros((trainer.world_size, len(FIELDS)))  # per-rank field sums over the fit
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
                _drop_rows_from_step(self.csv_path, trainer.global_step)  # trained after the checkpoint
            with open(os.path.join(self.log_dir, META_NAME), "w", encoding="utf-8") as f:
                json.dump({"load_unit": self.load_unit, "world_size": trainer.world_size,
                           "window": self.window, "fields": list(FIELDS)}, f, indent=1)
            if self.verbose:
                rank_zero_info(f"LoadBalanceMonitor: load in {self.load_unit}; per-rank rows -> {self.csv_path}")

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Throughput counts training time only: restart the interval clock after validation.
        self._last_end = time.perf_counter()

    # ---- per batch -----------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        t0 = time.perf_counter()
        samples, tokens, seq_len = batch_samples_and_seq_len(batch)
        if self._active_cost_model is not None:
            load = float(self._active_cost_model.predict(samples, seq_len))
        else:
            load = float(samples) * float(seq_len) ** 2
        self._pending = (trainer.current_epoch, trainer.global_step, batch_idx, samples, tokens, seq_len, load)
        self._step_at_start = trainer.global_step
        if self._sync:
            torch.cuda.synchronize(self._device)
        self._start = time.perf_counter()
        self.overhead_ms += (self._start - t0) * 1e3

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._sync:
            torch.cuda.synchronize(self._device)
        end = time.perf_counter()
        since = self._last_end if self._last_end is not None else self._start
        self._rows.append(self._pending + ((end - self._start) * 1e3, (end - since) * 1e3))
        self._last_end = end
        self.steps_seen += 1
        n = trainer.log_every_n_steps
        stepped = trainer.global_step > self._step_at_start
        # global_step is equal on every rank, so every rank takes part in the same gathers.
        if n > 0 and stepped and trainer.global_step % n == 0:
            self._flush(trainer)
        self.overhead_ms += (time.perf_counter() - end) * 1e3

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        t0 = time.perf_counter()
        if self._rows:  # same count on every rank (equal batches per rank)
            self._flush(trainer)
        self.overhead_ms += (time.perf_counter() - t0) * 1e3
        self.summary = self._summarize(trainer.world_size)
        if trainer.is_global_zero and self.verbose and self.summary:
            print(format_summary(self.summary, self._rank_sums / max(self.summary["steps"], 1)))

    # ---- gather, log, write ---------------------------------------------------------------
    def _flush(self, trainer: Trainer) -> None:
        local = torch.tensor(self._rows, dtype=torch.float64, device=self._device)
        self._rows = []
        gathered = trainer.strategy.all_gather(local)
        if trainer.world_size == 1:
            gathered = gathered.unsqueeze(0)
        rows = gathered.cpu().numpy()  # (world, k, F)
        self._rank_sums += rows.sum(axis=1)
        metrics = self._metrics(rows, trainer)
        if trainer.is_global_zero:
            try:
                self._append_csv(rows)
            except OSError as e:  # rank 0 alone writes: raising would leave the others waiting in a gather
                rank_zero_warn(f"LoadBalanceMonitor: cannot append to {self.csv_path} ({e}); "
                               f"{rows.shape[1]} batches of per-rank rows are lost, training goes on")
            step = int(rows[0, -1, _COL["step"]])
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _metrics(self, rows: np.ndarray, trainer: Trainer) -> dict[str, float]:
        load = rows[:, :, _COL["load"]]
        step_ms = rows[:, :, _COL["step_time_ms"]]
        tokens = rows[:, :, _COL["tokens"]]
        load_stats = cross_rank_stats(load)
        time_stats = cross_rank_stats(step_ms)
        interval_s = rows[:, :, _COL["interval_ms"]].sum(axis=1).max() / 1e3
        self._recent_step_ms.extend(step_ms.mean(axis=0).tolist())
        run = self._run
        run["load_cv"].append(load_stats["cv"])
        run["load_max_over_mean"].append(load_stats["max_over_mean"])
        run["bubble_frac"].append(load_stats["bubble"])
        run["step_time_cv"].append(time_stats["cv"])
        run["mean_step_ms"].append(step_ms.mean(axis=0))
        run["tokens"].append(np.array([tokens.sum()]))
        run["interval_s"].append(np.array([interval_s]))
        metrics = {
            "balance/load_cv": float(load_stats["cv"].mean()),
            "balance/load_max_over_mean": float(load_stats["max_over_mean"].mean()),
            "balance/bubble_frac": float(load_stats["bubble"].mean()),
            "balance/step_time_cv": float(time_stats["cv"].mean()),
            "balance/step_time_cv_temporal": temporal_cv(self._recent_step_ms),
            "throughput/tokens_per_s": float(tokens.sum() / interval_s) if interval_s > 0 else 0.0,
        }
        if self._active_cost_model is not None:  # loads are predicted ms, comparable with step times
            unpredicted = time_beyond_prediction_ms(load, step_ms)
            run["unpredicted_ms"].append(unpredicted)
            metrics["balance/unpredicted_ms"] = float(unpredicted.mean())
        for r in range(rows.shape[0]):
            metrics[f"rank{r}/step_time_ms"] = float(step_ms[r].mean())
            metrics[f"rank{r}/load"] = float(load[r].mean())
            metrics[f"rank{r}/tokens"] = float(tokens[r].mean())
        skipped = getattr(trainer.datamodule, "skipped", None)
        if isinstance(skipped, dict):
            metrics["data/skipped"] = float(sum(skipped.values()))
            for reason, count in skipped.items():
                metrics[f"data/skipped/{reason}"] = float(count)
        return metrics

    def _append_csv(self, rows: np.ndarray) -> None:
        new_file = not os.path.exists(self.csv_path)
        with open(self.csv_path, "a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            if new_file:
                writer.writerow(CSV_HEADER)
            # floats as exact float64 text: `adaptiveload report` recomputes CVs of nearly equal loads
            for i in range(rows.shape[1]):
                for r in range(rows.shape[0]):
                    row = rows[r, i]
                    writer.writerow([int(row[0]), int(row[1]), int(row[2]), r]
                                    + [int(v) for v in row[3:6]] + [repr(float(v)) for v in row[6:]])

    def _summarize(self, world_size: int) -> dict:
        if not self._run["load_cv"]:
            return {}
        run = {name: np.concatenate(parts) for name, parts in self._run.items()}
        mean_step_ms = float(np.mean(run["mean_step_ms"]))
        interval_s = float(np.sum(run["interval_s"]))
        overhead_ms_per_step = self.overhead_ms / max(self.steps_seen, 1)
        unpredicted = {"unpredicted_ms_mean": float(np.mean(run["unpredicted_ms"]))} if "unpredicted_ms" in run else {}
        return {
            **unpredicted,
            "steps": len(run["load_cv"]),
            "world_size": world_size,
            "load_unit": self.load_unit,
            "load_cv_mean": float(np.mean(run["load_cv"])),
            "load_cv_max": float(np.max(run["load_cv"])),
            "load_max_over_mean_mean": float(np.mean(run["load_max_over_mean"])),
            "bubble_frac_mean": float(np.mean(run["bubble_frac"])),
            "step_time_cv_mean": float(np.mean(run["step_time_cv"])),
            "step_time_cv_temporal_run": temporal_cv(run["mean_step_ms"]),
            "step_time_ms_mean": mean_step_ms,
            "tokens_per_s": float(np.sum(run["tokens"]) / interval_s) if interval_s > 0 else 0.0,
            "monitor_overhead_ms_per_step": overhead_ms_per_step,
            "monitor_overhead_frac": overhead_ms_per_step / mean_step_ms if mean_step_ms > 0 else 0.0,
        }


def _drop_rows_from_step(csv_path: str, step: int) -> None:
    """Remove the rows of optimizer steps >= `step`: a fit resumed from the checkpoint at `step`
    trains them again, and the file must hold every batch once. Incomplete rows (a run killed
    while writing) go too; this runs on rank 0 alone, so it must not raise on them."""
    with open(csv_path, newline="", encoding="utf-8", errors="replace") as f:
        rows = list(csv.reader(f))
    kept = [list(CSV_HEADER)] + [row for row in rows[1:]
                                 if len(row) == len(CSV_HEADER) and row[1].isdigit() and int(row[1]) < step]
    if kept != rows:
        with open(csv_path, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(kept)


def format_summary(summary: dict, per_rank_means: np.ndarray) -> str:
    """The end-of-fit table: one row per rank (means over the fit), then the run's balance."""
    lines = [f"LoadBalanceMonitor: {summary['steps']} steps x {summary['world_size']} ranks "
             f"(load in {summary['load_unit']})",
             f"{'rank':>5} {'samples':>9} {'tokens':>10} {'seq_len':>9} {'load':>12} {'step_ms':>10}"]
    for r, means in enumerate(per_rank_means):
        lines.append(f"{r:>5} {means[_COL['samples']]:>9.2f} {means[_COL['tokens']]:>10.1f} "
                     f"{means[_COL['seq_len']]:>9.1f} {means[_COL['load']]:>12.4g} "
                     f"{means[_COL['step_time_ms']]:>10.2f}")
    lines += [
        f"load CV (mean / max over steps):  {summary['load_cv_mean']:.4f} / {summary['load_cv_max']:.4f}",
        f"load max/mean (mean):             {summary['load_max_over_mean_mean']:.4f}",
        f"bubble fraction (mean):           {summary['bubble_frac_mean']:.4f}",
        f"step-time CV across ranks (mean): {summary['step_time_cv_mean']:.4f}",
        f"step-time CV over the run:        {summary['step_time_cv_temporal_run']:.4f}",
        f"global throughput:                {summary['tokens_per_s']:.1f} tokens/s",
    ]
    if "unpredicted_ms_mean" in summary:
        lines.append(f"step time beyond the cost model:  {summary['unpredicted_ms_mean']:.2f} ms/step")
    lines.append(f"monitor overhead:                 {summary['monitor_overhead_ms_per_step']:.3f} ms/step "
                 f"({100 * summary['monitor_overhead_frac']:.2f}% of mean step time {summary['step_time_ms_mean']:.2f} ms)")
    return "\n".join(lines)
