"""scheduling/metrics.py against fp64 loops (statistics module) on random per-rank values."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from lightning_adaptiveload.scheduling import metrics

STEPS, RANKS = 23, 5


@pytest.fixture
def values() -> np.ndarray:
    return np.random.default_rng(11).uniform(0.5, 40.0, size=(STEPS, RANKS))


def _rows(values):
    return [[float(v) for v in row] for row in values]


def test_per_step_metrics_match_formulas(values):
    cv, mom = metrics.cv_across_ranks(values), metrics.max_over_mean(values)
    bubble, peak, mean = metrics.bubble_per_step(values), metrics.step_time(values), metrics.rank_mean(values)
    assert cv.shape == mom.shape == bubble.shape == peak.shape == mean.shape == (STEPS,)
    for i, row in enumerate(_rows(values)):
        m = statistics.fmean(row)
        assert cv[i] == pytest.approx(statistics.pstdev(row) / m, rel=1e-12)
        assert mom[i] == pytest.approx(max(row) / m, rel=1e-12)
        assert bubble[i] == pytest.approx(1 - m / max(row), rel=1e-12)
        assert (peak[i], mean[i]) == pytest.approx((max(row), m), rel=1e-12)
        assert metrics.bubble_fraction(values[i:i + 1]) == pytest.approx(bubble[i], rel=1e-12)  # one step


def test_aggregates_over_steps_match_formulas(values):
    rows = _rows(values)
    assert metrics.mean_over_steps(metrics.cv_across_ranks(values)) == pytest.approx(
        statistics.fmean(statistics.pstdev(r) / statistics.fmean(r) for r in rows), rel=1e-12)
    # time-weighted: idle rank-time over the steps' time, not the mean of per-step bubbles
    want = 1 - sum(statistics.fmean(r) for r in rows) / sum(max(r) for r in rows)
    assert metrics.bubble_fraction(values) == pytest.approx(want, rel=1e-12)
    assert metrics.bubble_fraction(values) != pytest.approx(metrics.bubble_per_step(values).mean(), rel=1e-6)
    slowest = [max(r) for r in rows]
    assert metrics.step_time_cv_temporal(values) == pytest.approx(
        statistics.pstdev(slowest) / statistics.fmean(slowest), rel=1e-12)
    assert metrics.temporal_cv(slowest) == pytest.approx(metrics.step_time_cv_temporal(values), rel=1e-12)


def test_time_beyond_prediction_and_throughputs(values):
    rng = np.random.default_rng(12)
    measured = values + rng.uniform(-2.0, 30.0, size=values.shape)
    tokens = rng.integers(10, 5000, size=values.shape)
    beyond = metrics.time_beyond_prediction_ms(values, measured)
    for i, (load, ms) in enumerate(zip(_rows(values), _rows(measured))):
        assert beyond[i] == pytest.approx(statistics.fmean(ms) - max(load), rel=1e-12)
    total = sum(int(t) for t in tokens.ravel())
    assert metrics.predicted_throughput(tokens, values) == pytest.approx(
        total / (sum(max(r) for r in _rows(values)) / 1e3), rel=1e-12)
    per_rank_wall = [sum(float(measured[i, r]) for i in range(STEPS)) for r in range(RANKS)]
    assert metrics.measured_throughput(tokens, measured) == pytest.approx(total / (max(per_rank_wall) / 1e3),
                                                                          rel=1e-12)


def test_degenerate_inputs():
    zeros = np.zeros((3, 4))
    assert np.all(metrics.cv_across_ranks(zeros) == 0) and np.all(metrics.max_over_mean(zeros) == 1)
    assert metrics.bubble_fraction(zeros) == 0 and np.all(metrics.bubble_per_step(zeros) == 0)
    assert metrics.predicted_throughput(zeros, zeros) == 0 and metrics.measured_throughput(zeros, zeros) == 0
    assert metrics.temporal_cv([4.0]) == 0.0 and metrics.temporal_cv([]) == 0.0
    one_rank = np.random.default_rng(0).uniform(1, 2, size=(6, 1))
    assert np.all(metrics.cv_across_ranks(one_rank) == 0) and metrics.bubble_fraction(one_rank) == 0
    with pytest.raises(ValueError, match=r"\(steps, ranks\), got shape \(4,\)"):
        metrics.cv_across_ranks(np.ones(4))
    with pytest.raises(ValueError, match="at least one step"):
        metrics.mean_over_steps(np.array([]))


def test_finite_steps_keeps_fully_measured_rows():
    busy = np.random.default_rng(2).uniform(1, 5, size=(7, 3))
    busy[[1, 4]] = np.nan
    busy[5, 2] = np.nan  # one rank missing: the step is not comparable across ranks
    kept = metrics.finite_steps(busy)
    assert np.array_equal(kept, busy[[0, 2, 3, 6]])


def test_first_occurrences_marks_steps_where_any_rank_meets_a_new_shape():
    rng = np.random.default_rng(5)
    b = rng.integers(1, 3, size=(40, 3))
    s = rng.choice([16, 32, 64], size=(40, 3))
    expected = np.zeros(40, dtype=bool)
    for r in range(3):  # reference: a plain loop over each rank's history
        for i in range(40):
            if not any(b[j, r] == b[i, r] and s[j, r] == s[i, r] for j in range(i)):
                expected[i] = True
    np.testing.assert_array_equal(metrics.first_occurrences(b, s), expected)
    assert metrics.first_occurrences(b, s)[0] and not metrics.first_occurrences(np.ones((5, 2)), np.ones((5, 2)))[1:].any()
