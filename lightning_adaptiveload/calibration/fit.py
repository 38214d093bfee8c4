"""Fit the cost model to the calibration points, and decide whether to trust it.

A fit is distrusted when its cross-validated (held-out) mean relative error exceeds a threshold,
or when the measured times do not grow with the work of the step: a noisy or shared machine, a
step dominated by something other than the batch (a lock, a data wait), or points cut short all
produce fits that look fine on their own points and schedule nonsense. The callback then
re-measures once with more repeats and, if the fit is still distrusted, falls back to the
token-equal rule (see docs/cost_model.md, "When calibration is not trusted").

With per-bucket activation checkpointing the same points, measured at two depths, also fit the
memory model peak(B, S, k) and the time model t(B, S, k) (`fit_memory_models`); when they cannot be
fitted or the memory model predicts its held-out points badly, training checkpoints every block.
"""
from __future__ import annotations

import warnings

import numpy as np
from scipy.stats import spearmanr

from lightning_adaptiveload.calibration.config import DEFAULT_MIN_WORK_CORRELATION
from lightning_adaptiveload.calibration.grid import point_held_bytes
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.verification import MeasuredShape


def fit_points(feasible: list[dict], form: str) -> tuple[CostModel | None, str | None]:
    """(model, None) or (None, why the fit failed); never raises (rank 0 fits and broadcasts the
    result, so an exception there would leave the other ranks waiting)."""
    b, s, t = (np.array([p[k] for p in feasible], dtype=np.float64) for k in ("batch_size", "seq_len", "time_ms"))
    try:
        return CostModel.fit(b, s, t, form=form), None
    except Exception as e:  # noqa: BLE001 - any error is reported, none escapes rank 0
        return None, f"cannot fit the cost model from {len(feasible)} feasible points ({type(e).__name__}: {e})"


def distrust_reasons(model: CostModel, feasible: list[dict], max_heldout_error: float,
                     min_work_correlation: float = DEFAULT_MIN_WORK_CORRELATION) -> list[str]:
    """Why the fit must not schedule training ([] if it can): held-out error above
    `max_heldout_error`, or times that do not grow with the tokens of the step (Spearman rank
    correlation of time with B*S below `min_work_correlation`; constant times have none and fail
    too; -1, the lowest correlation there is, turns the check off)."""
    reasons = []
    heldout = model.quality["heldout_mean_rel_err"]
    if not heldout <= max_heldout_error:  # NaN (too few points to hold any out) counts as too high
        reasons.append(f"held-out mean error {heldout:.1%} > {max_heldout_error:.0%}")
    tokens = np.array([p["batch_size"] * p["seq_len"] for p in feasible], dtype=np.float64)
    times = np.array([p["time_ms"] for p in feasible], dtype=np.float64)
    if min_work_correlation > -1:
        with warnings.catch_warnings():  # constant times: NaN, reported below rather than warned about
            warnings.simplefilter("ignore")
            rho = float(spearmanr(tokens, times).statistic)
        if not rho >= min_work_correlation:
            reasons.append(f"step time does not grow with tokens B*S (Spearman rank correlation {rho:.2f} "
                           f"< {min_work_correlation})")
    return reasons


def fit_memory_models(points: list[dict], num_blocks: int, base: CostModel, extra_bytes: int,
                      max_heldout_error: float, verified: list[MeasuredShape] = ()
                      ) -> tuple[MemoryModel | None, DepthCostModel | None, str | None]:
    """(memory model, time model, None), or (None, None, why not); never raises (rank 0 fits).

    points: the calibration points (those with status "ok" are used), each with "checkpointed" (k);
    the memory model is fitted on what each step held from the device, max(allocated, reserved)
    (grid.point_held_bytes, verification's measure of a shape's memory), so the plan budgets the
    quantity verification judges, the allocator's fragmentation included as measured per point;
    base: the trusted CostModel of the points at k = num_blocks, around which the time model is
    built; extra_bytes: memory every training step holds that calibration's steps do not (the
    optimizer state, calibration/memory.py), added to the memory model's m0. verified: shapes
    verification ran (calibration/verify.py) with a peak, under training's memory conditions: their
    held memory (MeasuredShape.used_bytes), less extra_bytes, and warm times join the points, so a
    refit sees the depths and batch sizes the plan chose. The memory model's quality describes the held bytes it was fitted to (without
    extra_bytes); a held-out mean relative error above `max_heldout_error` (the memory model's own
    threshold) is refused."""
    ok = [{**p, "held_bytes": point_held_bytes(p)} for p in points if p["status"] == "ok"]
    ok += [{"batch_size": m.batch_size, "seq_len": m.seq_len, "checkpointed": m.checkpointed,
            "time_ms": m.warm_ms, "held_bytes": m.used_bytes - extra_bytes} for m in verified
           if m.used_bytes is not None and m.checkpointed is not None and m.used_bytes > extra_bytes]
    try:
        b, s, k, t, held = (np.array([p[key] for p in ok], dtype=np.float64)
                            for key in ("batch_size", "seq_len", "checkpointed", "time_ms", "held_bytes"))
        memory = MemoryModel.fit(b, s, k, held, num_blocks)
        memory = MemoryModel(memory.form, {**memory.params, "m0": memory.params["m0"] + float(extra_bytes)},
                             num_blocks, memory.quality)
        time_model = DepthCostModel.fit(b, s, k, t, num_blocks, base=base)
    except Exception as e:  # noqa: BLE001 - any error is reported, none escapes rank 0
        return None, None, f"cannot fit the memory and depth models from {len(ok)} points ({type(e).__name__}: {e})"
    heldout = memory.quality["heldout_mean_rel_err"]
    if not heldout <= max_heldout_error:
        return None, None, f"memory model held-out mean error {heldout:.1%} > {max_heldout_error:.0%}"
    return memory, time_model, None
