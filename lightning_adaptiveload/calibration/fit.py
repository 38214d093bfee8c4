"""Fit the cost model to the calibration points, and decide whether to trust it.

A fit is distrusted when its cross-validated (held-out) mean relative error exceeds a threshold,
or when the measured times do not grow with the work of the step: a noisy or shared machine, a
step dominated by something other than the batch (a lock, a data wait), or points cut short all
produce fits that look fine on their own points and schedule nonsense. The callback then
re-measures once with more repeats and, if the fit is still distrusted, falls back to the
token-equal rule (see docs/cost_model.md, "When calibration is not trusted").
"""
from __future__ import annotations

import warnings

import numpy as np
from scipy.stats import spearmanr

from lightning_adaptiveload.scheduling.cost_model import CostModel

DEFAULT_MAX_HELDOUT_ERROR = 0.15  # 15%: the shipped H200 curve fits to 5% held out (docs/cost_model.md)
# Spearman rank correlation of time with tokens B*S below which times "do not grow": a launch-bound
# model on a noisy CPU measures ~0.5, constant or falling times ~0 or below.
DEFAULT_MIN_WORK_CORRELATION = 0.2


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
