"""What the fitted models of scheduling/ share about fitting: their measurements' checks, the
held-out folds of cross-validation, relative error and the quality record."""
from __future__ import annotations

import numpy as np

QUALITY_KEYS = ("r2", "mean_rel_err", "max_rel_err", "heldout_mean_rel_err", "heldout_max_rel_err")
MAX_LOO_POINTS = 64  # above this, cross-validation uses K_FOLDS folds instead of leave-one-out
K_FOLDS = 16


def folds(n: int, b: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
    """Held-out index sets: leave-one-out for n <= MAX_LOO_POINTS, else K_FOLDS folds where the
    point of rank r in (S, B) order goes to fold r % K_FOLDS (deterministic, input-order free)."""
    if n <= MAX_LOO_POINTS:
        return [np.array([i]) for i in range(n)]
    rank = np.empty(n, dtype=np.int64)
    rank[np.lexsort((b, s))] = np.arange(n)
    return [np.flatnonzero(rank % K_FOLDS == f) for f in range(K_FOLDS)]


def rel_err(pred: np.ndarray, t: np.ndarray) -> np.ndarray:
    """|pred - t| / t, elementwise."""
    return np.abs(pred - t) / t


def fit_quality(pred: np.ndarray, measured: np.ndarray, heldout_rel_err: np.ndarray) -> dict:
    """QUALITY_KEYS of a fit: r2 and relative errors of `pred` against `measured` on the fit points,
    mean and max of the cross-validated relative errors `heldout_rel_err`."""
    ss_tot = float(np.sum((measured - measured.mean()) ** 2))
    rel = rel_err(pred, measured)
    return {
        "r2": 1.0 - float(np.sum((pred - measured) ** 2)) / ss_tot if ss_tot > 0 else float("nan"),
        "mean_rel_err": float(rel.mean()),
        "max_rel_err": float(rel.max()),
        "heldout_mean_rel_err": float(heldout_rel_err.mean()),
        "heldout_max_rel_err": float(heldout_rel_err.max()),
    }


def positive_1d(name: str, values) -> np.ndarray:
    """`values` as a 1-D float64 array of finite numbers > 0 (measurements of the models); a
    ValueError naming `name` otherwise."""
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    bad = ~(np.isfinite(a) & (a > 0))
    if bad.any():
        raise ValueError(f"{name} must be finite and > 0, got {a[bad][:3].tolist()}")
    return a


def check_measurements(batch_sizes, seq_lens, times_ms) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, S, ms) as positive 1-D float64 arrays of equal length."""
    b, s, t = (positive_1d(name, values) for name, values in
               (("batch_sizes", batch_sizes), ("seq_lens", seq_lens), ("times_ms", times_ms)))
    if not len(b) == len(s) == len(t):
        raise ValueError(f"batch_sizes, seq_lens, times_ms must have equal length, got {len(b)}, {len(s)}, {len(t)}")
    return b, s, t


def check_checkpointed(checkpointed, num_blocks: int, name: str = "checkpointed") -> np.ndarray:
    """`checkpointed` (k, blocks under activation checkpointing) as a float64 array; ValueError
    naming `name` unless every entry is a whole number in [0, num_blocks]."""
    k = np.asarray(checkpointed, dtype=np.float64)
    bad = ~(np.isfinite(k) & (k == np.round(k)) & (k >= 0) & (k <= num_blocks))
    if np.any(bad):
        raise ValueError(f"{name} must be whole numbers in [0, num_blocks={num_blocks}], got {k[bad][:3].tolist()}")
    return k
