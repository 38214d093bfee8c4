"""benchmarks/scheduling/unmeasured_price.py on a synthetic record: step times drawn from a model whose error
is linear in log S (fp64), so a held-out interior bucket is priced exactly by the interpolation and off by
the model's own error by the raw prediction; a bounded shape that trained is priced against its later steps."""
import csv

import numpy as np
import pytest

from lightning_adaptiveload.monitoring.per_rank_log import CSV_HEADER, CSV_NAME
from lightning_adaptiveload.scheduling.verification import MeasuredShape
from benchmarks.scheduling import unmeasured_price


def error(s: float) -> float:
    """The model's error (measured / predicted), linear in log S from 1.1 at 1,000 tokens to 1.6 at 64,000."""
    return 1.1 + 0.5 * np.log(s / 1000) / np.log(64)


def record(rng):
    buckets = [1000, 2000, 4000, 8000, 16000, 32000, 64000]
    shapes = []
    for s in buckets:
        b = max(1, 16000 // s)
        predicted = float(rng.uniform(100, 5000))
        shapes.append(MeasuredShape(b, s, (1, 1, s), 0, "fits", warm_ms=predicted * error(s), cold_ms=predicted * error(s),
                                    peak_bytes=1e9, predicted_ms=predicted, round=2))
    # a failed first try at another depth: not what the bucket is priced from
    shapes.append(MeasuredShape(1, 8000, (1, 1, 8000), 0, "over_budget", warm_ms=1.0, cold_ms=1.0, peak_bytes=1e12,
                                predicted_ms=1.0, round=1))
    bounded = MeasuredShape(1, 5000, (1, 1, 5000), 0, "bounded", predicted_ms=300.0, bound_by=(1, 8000, 0))
    return shapes + [bounded]


def test_interior_buckets_are_priced_exactly_and_the_raw_model_by_its_error(tmp_path):
    rng = np.random.default_rng(3)
    shapes = record(rng)
    out = unmeasured_price.held_out(shapes)
    rows = {r["seq_len"]: r for r in out["shapes"]}
    assert sorted(rows) == [1000, 2000, 4000, 8000, 16000, 32000, 64000]
    for s, r in rows.items():
        assert r["predicted_ms"] / r["measured_ms"] - 1 == pytest.approx(1 / error(s) - 1, rel=1e-9)
        if s not in (1000, 64000):  # interior: its neighbours' errors interpolate to its own
            assert r["interpolated_ms"] == pytest.approx(r["measured_ms"], rel=1e-9)
        else:  # an end takes its neighbour's error
            neighbour = 2000 if s == 1000 else 32000
            assert r["interpolated_ms"] == pytest.approx(r["predicted_ms"] * error(neighbour), rel=1e-9)
    assert out["interpolated_ms"]["mean_abs_rel_err"] < out["predicted_ms"]["mean_abs_rel_err"]
    assert out["predicted_ms"]["max_abs_rel_err"] == pytest.approx(1 - 1 / error(64000), rel=1e-9)

    # the bounded 1 x 5000 trained three times: its first step is left out, the median of the later two kept
    steps = [(1, 8000, 900.0), (1, 5000, 700.0), (1, 5000, 410.0), (1, 5000, 430.0), (2, 4000, 500.0)]
    with open(tmp_path / CSV_NAME, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_HEADER)
        w.writeheader()
        for i, (b, s, ms) in enumerate(steps):
            w.writerow({c: 0 for c in CSV_HEADER} | {"step": i, "batch_idx": i, "samples": b, "tokens": b * s, "seq_len": s,
                                                      "step_time_ms": ms, "interval_ms": ms})
    trained = unmeasured_price.bounded_in_training(shapes, tmp_path)
    (row,) = trained["shapes"]
    assert (row["batch_size"], row["seq_len"], row["later_steps"], row["median_step_ms"]) == (1, 5000, 2, 420.0)
    assert row["predicted_ms"] == 300.0
    assert row["interpolated_ms"] == pytest.approx(300.0 * error(5000), rel=1e-9)
