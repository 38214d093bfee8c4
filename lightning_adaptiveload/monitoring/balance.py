"""BalanceTracker: the arithmetic of LoadBalanceMonitor, free of Lightning.

The callback gathers every rank's rows of one log interval and hands them to `update`, which
returns the metrics to log and adds the interval to the run's summary; `summary()` and
`format_summary()` give the end-of-fit numbers and table. Every metric is a function of
scheduling/metrics.py; docs/monitoring.md defines each logged key.
"""
from __future__ import annotations

import collections

import numpy as np

from lightning_adaptiveload.monitoring.compile_counters import NAMES as COMPILE_NAMES
from lightning_adaptiveload.monitoring.per_rank_log import COLUMN, FIELDS, format_rank_table
from lightning_adaptiveload.scheduling import metrics
from lightning_adaptiveload.scheduling.verification import held_bytes

_PER_RANK_MEANS = ("samples", "tokens", "seq_len", "load", "step_time_ms")


class BalanceTracker:
    """Turns gathered per-rank rows into logged metrics and a run summary.

    world_size: ranks (the rows' second axis). window: steps of the rolling
    `balance/step_time_cv_temporal`. load_unit: text of the load's unit; loads in ms (a cost
    model) also give `balance/unpredicted_ms`. memory_budget_bytes: the memory a step may hold
    under the DataModule's plan (None: none known); steps whose peak (allocated or reserved, on any
    rank) exceeds it are counted.
    """

    def __init__(self, world_size: int, window: int = 50, load_unit: str = "ms (cost model)",
                 memory_budget_bytes: float | None = None):
        if int(window) < 2:
            raise ValueError(f"window must be >= 2 steps, got {window}")
        self.world_size = int(world_size)
        self.window = int(window)
        self.load_unit = load_unit
        self.load_in_ms = load_unit.startswith("ms")
        self._recent_step_ms: collections.deque = collections.deque(maxlen=self.window)
        # Per-step series for the run summary (one float per step each, not per rank): the keys of
        # update's per_step. Sums over steps and ranks come from _rank_sums instead.
        self._series: dict[str, list[np.ndarray]] = collections.defaultdict(list)
        self._rank_sums = np.zeros((self.world_size, len(FIELDS)))
        # busy_ms, comm_ms and the step's own step_time_ms, summed over the profiled steps
        self._busy_sums = np.zeros((self.world_size, 3))
        self._busy_steps = 0
        self._last = np.full((self.world_size, len(FIELDS)), np.nan)  # latest row of each rank
        self.memory_budget_bytes = memory_budget_bytes
        self._peak = np.full(2, np.nan)  # the run's largest peak allocated, reserved bytes of any rank
        self.steps_over_budget = 0
        self.steps = 0

    def update(self, rows: np.ndarray) -> dict[str, float]:
        """Metrics of one log interval from `rows (steps, ranks, len(FIELDS))` (per_rank_log.FIELDS
        order); adds the interval to the run summary."""
        rows = np.asarray(rows, dtype=np.float64)
        if rows.ndim != 3 or rows.shape[1:] != (self.world_size, len(FIELDS)) or rows.shape[0] == 0:
            raise ValueError(f"BalanceTracker.update needs rows of shape (steps >= 1, {self.world_size}, "
                             f"{len(FIELDS)}), got {rows.shape}")

        def col(name: str) -> np.ndarray:
            return rows[:, :, COLUMN[name]]

        load, step_ms, tokens = col("load"), col("step_time_ms"), col("tokens")
        per_step = {
            "load_cv": metrics.cv_across_ranks(load),
            "load_max_over_mean": metrics.max_over_mean(load),
            "load_max": metrics.step_time(load),
            "step_time_cv": metrics.cv_across_ranks(step_ms),
            "step_time_ms": metrics.step_time(step_ms),
        }
        self._recent_step_ms.extend(per_step["step_time_ms"].tolist())
        out = {
            "balance/load_cv": metrics.mean_over_steps(per_step["load_cv"]),
            "balance/load_max_over_mean": metrics.mean_over_steps(per_step["load_max_over_mean"]),
            "balance/bubble_frac": metrics.bubble_fraction(load),
            "balance/step_time_cv": metrics.mean_over_steps(per_step["step_time_cv"]),
            "balance/step_time_cv_temporal": metrics.temporal_cv(self._recent_step_ms),
            "throughput/tokens_per_s": metrics.measured_throughput(tokens, col("interval_ms")),
        }
        if self.load_in_ms:  # loads are predicted ms, comparable with step times
            per_step["unpredicted_ms"] = metrics.time_beyond_prediction_ms(load, step_ms)
            out["balance/unpredicted_ms"] = metrics.mean_over_steps(per_step["unpredicted_ms"])
        profiled = np.isfinite(col("busy_ms")).all(axis=1) & np.isfinite(col("comm_ms")).all(axis=1)
        n_profiled = int(profiled.sum())
        busy_sums = None
        if n_profiled:
            busy = col("busy_ms")[profiled]
            busy_sums = np.stack([busy.sum(axis=0), col("comm_ms")[profiled].sum(axis=0),
                                  step_ms[profiled].sum(axis=0)], axis=1)  # (ranks, 3)
            per_step["busy_cv"] = metrics.cv_across_ranks(busy)
            per_step["busy_max_over_mean"] = metrics.max_over_mean(busy)
            out["balance/busy_cv"] = metrics.mean_over_steps(per_step["busy_cv"])
            out["balance/busy_max_over_mean"] = metrics.mean_over_steps(per_step["busy_max_over_mean"])
            self._busy_sums += busy_sums
            self._busy_steps += n_profiled
        interval_sums = rows.sum(axis=0)  # (ranks, F): the run's sums take them too
        means = interval_sums / rows.shape[0]
        for r in range(self.world_size):
            for name in ("step_time_ms", "load", "tokens"):
                out[f"rank{r}/{name}"] = float(means[r, COLUMN[name]])
            if busy_sums is not None:
                out[f"rank{r}/busy_ms"], out[f"rank{r}/comm_ms"] = (busy_sums[r, :2] / n_profiled).tolist()
        out.update(self._memory(col("peak_allocated_bytes"), col("peak_reserved_bytes")))
        self._last = rows[-1]
        out.update({f"compile/{name}": value for name, value in self.compile_counts().items()
                    if name != "limit_hits" and value is not None})
        for name, values in per_step.items():
            self._series[name].append(values)
        self._rank_sums += interval_sums
        self.steps += rows.shape[0]
        return out

    def _memory(self, allocated: np.ndarray, reserved: np.ndarray) -> dict[str, float]:
        """memory/* metrics of one interval: the largest peak allocated and reserved GiB of any rank and
        step, and with a budget the steps whose peak exceeded it on some rank ({} off CUDA: NaN)."""
        if not np.isfinite(allocated).any():
            return {}
        peaks = np.array([np.nanmax(allocated), np.nanmax(reserved)])
        self._peak = np.fmax(self._peak, peaks)
        out = {"memory/peak_allocated_gib": float(peaks[0]) / 2**30, "memory/peak_reserved_gib": float(peaks[1]) / 2**30}
        if self.memory_budget_bytes is not None:
            over = int((held_bytes(allocated, reserved) > self.memory_budget_bytes).any(axis=1).sum())
            self.steps_over_budget += over
            out["memory/steps_over_budget"] = float(over)
        return out

    def compile_counts(self) -> dict[str, int | None]:
        """torch.compile counts since train start, the most of any rank, at the latest row:
        {"recompiles", "graph_breaks", "limit_hits"} (None where torch keeps no such counter)."""
        out = {}
        for name in COMPILE_NAMES:
            values = self._last[:, COLUMN[f"compile_{name}"]]
            out[name] = int(values.max()) if np.isfinite(values).all() else None
        return out

    def ranks_over_recompile_limit(self) -> list[int]:
        """Ranks on which dynamo refused a recompile at its limit since train start (latest row)."""
        return np.flatnonzero(self._last[:, COLUMN["compile_limit_hits"]] > 0).tolist()

    def summary(self, overhead_ms_per_step: float = 0.0) -> dict:
        """The run so far: means over every step of the per-step metrics (load CV also its max),
        the time-weighted bubble, step-time CV over the whole run, global tokens/s, busy time
        and compile counts; `overhead_ms_per_step` (the monitor's own time) as ms and as a
        fraction of the mean step time. {} before the first update."""
        if not self.steps:
            return {}
        run = {name: np.concatenate(parts) for name, parts in self._series.items()}
        totals = self._rank_sums[None]  # (1, ranks, F): the run as one step of per-rank sums
        # The ranks' mean of the per-rank sums: the sum over steps of each step's mean over ranks.
        load_mean_sum = float(metrics.rank_mean(totals[:, :, COLUMN["load"]])[0])
        step_ms_mean = float(metrics.rank_mean(totals[:, :, COLUMN["step_time_ms"]])[0]) / self.steps
        out = {
            "steps": self.steps,
            "world_size": self.world_size,
            "load_unit": self.load_unit,
            "load_cv_mean": metrics.mean_over_steps(run["load_cv"]),
            "load_cv_max": float(run["load_cv"].max()),
            "load_max_over_mean_mean": metrics.mean_over_steps(run["load_max_over_mean"]),
            "bubble_frac": metrics.idle_fraction(load_mean_sum, run["load_max"]),
            "step_time_cv_mean": metrics.mean_over_steps(run["step_time_cv"]),
            "step_time_cv_temporal_run": metrics.temporal_cv(run["step_time_ms"]),
            "step_time_ms_mean": step_ms_mean,
            "tokens_per_s": metrics.measured_throughput(totals[:, :, COLUMN["tokens"]],
                                                        totals[:, :, COLUMN["interval_ms"]]),
            "monitor_overhead_ms_per_step": overhead_ms_per_step,
            "monitor_overhead_frac": overhead_ms_per_step / step_ms_mean if step_ms_mean > 0 else 0.0,
        }
        if "unpredicted_ms" in run:
            out["unpredicted_ms_mean"] = metrics.mean_over_steps(run["unpredicted_ms"])
        if "busy_cv" in run:
            out.update({"busy_steps": self._busy_steps,
                        "busy_step_time_ms_mean": float(self._busy_sums[:, 2].mean()) / self._busy_steps,
                        "busy_cv_mean": metrics.mean_over_steps(run["busy_cv"]),
                        "busy_max_over_mean_mean": metrics.mean_over_steps(run["busy_max_over_mean"])})
        out.update({f"compile_{name}": value for name, value in self.compile_counts().items()})
        if np.isfinite(self._peak).all():
            out.update(peak_allocated_bytes=float(self._peak[0]), peak_reserved_bytes=float(self._peak[1]))
            if self.memory_budget_bytes is not None:
                out.update(memory_budget_bytes=float(self.memory_budget_bytes), steps_over_budget=self.steps_over_budget)
        return out

    def format_summary(self, summary: dict) -> str:
        """The end-of-fit table: one row per rank (means over the fit; busy and comm over the
        profiled steps), then the run's balance from `summary` (as returned by summary(); with
        `log_every_n_steps` and `busy_window_ms_per_step` in it, what made the monitor's overhead)."""
        means = self._rank_sums / max(self.steps, 1)
        busy = self._busy_sums / self._busy_steps if self._busy_steps else np.full_like(self._busy_sums, np.nan)
        lines = [f"LoadBalanceMonitor: {summary['steps']} steps x {summary['world_size']} ranks "
                 f"(load in {summary['load_unit']})"]
        lines += format_rank_table({name: means[:, COLUMN[name]] for name in _PER_RANK_MEANS}
                                   | {"busy_ms": busy[:, 0], "comm_ms": busy[:, 1]})
        if self._busy_steps:
            # A profiled step is one batch shape, slowed by the profiler: busy_ms compares with its
            # own step time and across ranks, not with step_ms, the mean over every step.
            lines.append(f"      busy_ms, comm_ms: the {self._busy_steps} profiled step(s) only, whose step_ms was "
                         f"{summary['busy_step_time_ms_mean']:.2f} (profiler on); step_ms: all {summary['steps']} steps")
        lines += [
            f"load CV (mean / max over steps):  {summary['load_cv_mean']:.4f} / {summary['load_cv_max']:.4f}",
            f"load max/mean (mean):             {summary['load_max_over_mean_mean']:.4f}",
            f"bubble fraction (time-weighted):  {summary['bubble_frac']:.4f}",
            f"step-time CV across ranks (mean): {summary['step_time_cv_mean']:.4f}",
            f"step-time CV over the run:        {summary['step_time_cv_temporal_run']:.4f}",
            f"global throughput:                {summary['tokens_per_s']:.1f} tokens/s",
        ]
        if "busy_cv_mean" in summary:
            lines.append(f"busy CV / max-over-mean (mean):   {summary['busy_cv_mean']:.4f} / "
                         f"{summary['busy_max_over_mean_mean']:.4f} over {summary['busy_steps']} profiled steps")
        if "unpredicted_ms_mean" in summary:
            lines.append(f"step time beyond the cost model:  {summary['unpredicted_ms_mean']:.2f} ms/step")
        if summary.get("compile_recompiles") or summary.get("compile_graph_breaks"):
            lines.append(f"torch.compile during training:    {summary['compile_recompiles']} recompiles, "
                         f"{summary['compile_graph_breaks']} graph breaks")
        if "peak_allocated_bytes" in summary:
            budget = summary.get("memory_budget_bytes")
            lines.append(f"peak memory (any rank):           {summary['peak_allocated_bytes'] / 2**30:.2f} GiB allocated, "
                         f"{summary['peak_reserved_bytes'] / 2**30:.2f} GiB reserved"
                         + ("" if budget is None else f"; budget {budget / 2**30:.2f} GiB, "
                            f"{summary['steps_over_budget']} step(s) over it"))
        lines.append(f"monitor overhead:                 {summary['monitor_overhead_ms_per_step']:.3f} ms/step "
                     f"({100 * summary['monitor_overhead_frac']:.2f}% of mean step time "
                     f"{summary['step_time_ms_mean']:.2f} ms)")
        if "log_every_n_steps" in summary:
            profiled = ""
            if "busy_window_ms_per_step" in summary:
                share = summary["busy_window_ms_per_step"] * summary["busy_steps"] / summary["steps"]
                profiled = (f", {summary['busy_steps']} profiled step(s) in {summary['steps']} "
                            f"({share:.3f} ms/step of it)")
            lines.append(f"                                  here: a gather and CSV append every "
                         f"{summary['log_every_n_steps']} steps{profiled}; "
                         f"less with a larger log_every_n_steps (docs/monitoring.md, Overhead)")
        return "\n".join(lines)
