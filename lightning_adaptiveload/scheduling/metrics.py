"""The one definition of every load-balance metric (numpy only).

Every function takes per-rank values as an array of shape (steps, ranks), the axis order of an
EpochPlan's `steps` (n_steps, world_size): row i holds what each rank had at step i. The
simulator (scheduling/simulate.py), LoadBalanceMonitor (monitoring/balance.py), `adaptiveload
report` and benchmarks/e2e/e2e.py all call these; nobody recomputes a metric inline.

CV is the population coefficient of variation, std / mean with std = sqrt(mean((x - mean)^2)).
A step lasts as long as its slowest rank, so the step time of step i is the max over ranks.

Which function gives which metric (docs/monitoring.md has the logged keys, the simulator's result
keys are in brackets):

- load CV `load_cv` [`load_cv_mean`]: mean_over_steps(cv_across_ranks(load))
- load max/mean `load_max_over_mean` [`load_max_over_mean_mean`]: mean_over_steps(max_over_mean(load))
- bubble fraction `bubble_frac` [`bubble_frac`]: bubble_fraction(load), time-weighted
- step-time CV across ranks `step_time_cv`: mean_over_steps(cv_across_ranks(measured step time))
- step-time CV over steps `step_time_cv_temporal` [`step_time_cv_temporal`]:
  step_time_cv_temporal(step times) = temporal_cv(step_time(step times))
- time beyond prediction `unpredicted_ms`: time_beyond_prediction_ms(load ms, measured step time)
- busy CV `busy_cv`, busy max/mean `busy_max_over_mean`: as load CV and load max/mean, on the
  measured busy ms of the profiled steps (finite_steps)
- throughput: measured_throughput (tokens over wall time) [predicted_throughput over predicted
  step times: `predicted_tokens_per_s`, `predicted_samples_per_s`]
"""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _per_rank(values: ArrayLike) -> np.ndarray:
    """`values` as a float64 (steps, ranks) array; a clear error for any other shape."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2:
        raise ValueError(f"balance metrics take per-rank values of shape (steps, ranks), got shape {array.shape}")
    return array


def step_time(values: ArrayLike) -> np.ndarray:
    """(steps,): the max over ranks. A synchronous data-parallel step lasts as long as its slowest
    rank (the others wait at the gradient collectives), so this is the step's time."""
    return _per_rank(values).max(axis=1)


def rank_mean(values: ArrayLike) -> np.ndarray:
    """(steps,): the mean over ranks."""
    return _per_rank(values).mean(axis=1)


def cv_across_ranks(values: ArrayLike) -> np.ndarray:
    """(steps,): per step, population std / mean across ranks; 0 where the mean is 0 (no work
    anywhere is not imbalance)."""
    values = _per_rank(values)
    mean = values.mean(axis=1)
    return np.divide(values.std(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)


def max_over_mean(values: ArrayLike) -> np.ndarray:
    """(steps,): per step, max / mean across ranks (the LLM papers' imbalance ratio; 1 = balanced);
    1 where the mean is 0."""
    values = _per_rank(values)
    mean = values.mean(axis=1)
    return np.divide(values.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


def mean_over_steps(per_step: ArrayLike) -> float:
    """The mean over steps of a per-step metric (an unweighted mean: every step counts once)."""
    per_step = np.asarray(per_step, dtype=np.float64)
    if per_step.size == 0:
        raise ValueError("a mean over steps needs at least one step")
    return float(per_step.mean())


def idle_fraction(mean_per_step: ArrayLike, max_per_step: ArrayLike) -> float:
    """1 - sum over steps of the ranks' mean / sum over steps of the max: the fraction of rank-time
    spent waiting for the slowest rank, weighted by step time. 0 when every max is 0."""
    total_max = float(np.sum(max_per_step))
    return 1.0 - float(np.sum(mean_per_step)) / total_max if total_max > 0 else 0.0


def bubble_fraction(values: ArrayLike) -> float:
    """Bubble fraction of a set of steps, (steps, ranks) -> float: idle_fraction of the per-step
    mean and max over ranks. Time-weighted: a long step's idle time counts for more than a short
    one's. For one step it is 1 - mean / max."""
    return idle_fraction(rank_mean(values), step_time(values))


def bubble_per_step(values: ArrayLike) -> np.ndarray:
    """(steps,): the bubble fraction of each step alone, 1 - mean / max across ranks (0 where the
    max is 0); for plotting over steps. Over several steps use bubble_fraction (time-weighted)."""
    peak, mean = step_time(values), rank_mean(values)
    return 1.0 - np.divide(mean, peak, out=np.ones_like(peak), where=peak > 0)


def temporal_cv(series: ArrayLike) -> float:
    """Population std / mean of a 1-D sequence over steps (e.g. step_time of each step); 0 for
    fewer than 2 values or a mean <= 0."""
    values = np.asarray(series, dtype=np.float64).reshape(-1)
    if values.size < 2 or values.mean() <= 0:
        return 0.0
    return float(values.std() / values.mean())


def step_time_cv_temporal(step_times_ms: ArrayLike) -> float:
    """CV over steps of the step time, from per-rank step times (steps, ranks): temporal_cv of
    step_time (max over ranks). How much the step time moves from step to step."""
    return temporal_cv(step_time(step_times_ms))


def time_beyond_prediction_ms(load_ms: ArrayLike, step_time_ms: ArrayLike) -> np.ndarray:
    """(steps,): per step, the ranks' mean measured step time minus the predicted load of the
    slowest rank, both (steps, ranks) in ms: what the cost model leaves out (optimizer step,
    waits between ranks inside the step, model error)."""
    return rank_mean(step_time_ms) - step_time(load_ms)


def predicted_throughput(amount: ArrayLike, load_ms: ArrayLike) -> float:
    """Per second: all ranks' `amount` (tokens or samples, (steps, ranks)) over the sum of the
    predicted step times (step_time of the loads in ms). 0 when no time is predicted."""
    wall_s = float(step_time(load_ms).sum()) / 1e3
    return float(np.sum(amount)) / wall_s if wall_s > 0 else 0.0


def measured_throughput(amount: ArrayLike, interval_ms: ArrayLike) -> float:
    """Per second: all ranks' `amount` ((steps, ranks)) over the measured wall time, the largest
    over ranks of the summed intervals (each rank's time from the end of one batch to the end of
    the next, data loading included). 0 when no time passed."""
    wall_s = float(_per_rank(interval_ms).sum(axis=0).max()) / 1e3
    return float(np.sum(amount)) / wall_s if wall_s > 0 else 0.0


def finite_steps(values: ArrayLike) -> np.ndarray:
    """The rows (steps) of a (steps, ranks) array where every rank has a finite value: measured
    quantities that are only sampled on some steps (busy time) are NaN elsewhere."""
    values = _per_rank(values)
    return values[np.isfinite(values).all(axis=1)]


def first_occurrences(batch_size: ArrayLike, seq_len: ArrayLike) -> np.ndarray:
    """(steps,) bool: the steps where some rank runs a (batch size, seq_len) it has not run before
    in the run, from per-rank (steps, ranks) arrays. A new shape builds its kernels (cuDNN attention
    graphs, compiled graphs) in that step, so these steps are reported apart from the steady state
    (docs/cost_model.md, "Cold shapes")."""
    batch_size, seq_len = _per_rank(batch_size), _per_rank(seq_len)
    first = np.zeros(batch_size.shape[0], dtype=bool)
    for r in range(batch_size.shape[1]):
        seen = set()
        for i, key in enumerate(zip(batch_size[:, r].tolist(), seq_len[:, r].tolist())):
            if key not in seen:
                seen.add(key)
                first[i] = True
    return first
