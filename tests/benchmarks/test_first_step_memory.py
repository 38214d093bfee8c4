"""benchmarks/scheduling/first_step_memory.py on a synthetic calibration record: peaks drawn from a known
memory model (fp64), the first grid point inflated by one-time reserved bytes. Without them the fit recovers
the model and predicts the verified shapes exactly; with them it does not."""

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from benchmarks.scheduling import first_step_memory

GIB = 2**30


def test_the_first_points_one_time_bytes_are_what_the_corrected_fit_leaves_out():
    rng = np.random.default_rng(0)
    truth = MemoryModel("linear", {"m0": 10 * GIB, "c": 2e7, "a": 4e4, "c_k": 1e7, "b": 3e5}, 30)
    gap = 0.3 * GIB  # what every later step reserves beyond its allocations
    points = []
    for b, s in [(1, 256), (1, 3600), (1, 9408), (2, 256), (4, 256), (2, 3600), (4, 3600), (8, 256)]:
        for k in (30, 15, 0):
            allocated = float(truth.predict(b, s, k)) * (1 + 1e-4 * rng.standard_normal())
            points.append({"batch_size": b, "seq_len": s, "checkpointed": k, "status": "ok",
                           "peak_bytes": allocated, "reserved_bytes": allocated + gap})
    points[0]["reserved_bytes"] += 10 * GIB  # the process's first step
    state, budget = 5 * GIB, 100 * GIB
    shapes = [{"batch_size": b, "seq_len": s, "checkpointed": k, "round": 1,
               "peak_bytes": float(truth.predict(b, s, k)) + state, "reserved_bytes": float(truth.predict(b, s, k)) + state + gap}
              for b, s, k in [(3, 9408, 0), (6, 3600, 2), (1, 32000, 10)]]
    doc = {"depths": [30, 15], "points": points,
           "verification": {"optimizer_state": {"state_bytes": state}, "budget_bytes": budget, "shapes": shapes}}
    out = first_step_memory.analyse(doc)
    assert out["next_point_gap_bytes"] == pytest.approx(gap)
    corrected = out["first_point_without_its_one_time_bytes"]
    as_measured = out["as_measured"]
    # the corrected fit is the truth shifted by the gap: every verified shape's held is predicted to 1e-3 of budget
    errors = corrected["round1_held_minus_predicted_over_budget"]
    assert abs(errors["max"]) < 1e-3 and abs(errors["min"]) < 1e-3
    assert corrected["heldout_mean_rel_err"] < 0.01 < as_measured["heldout_mean_rel_err"]
    spread = as_measured["round1_held_minus_predicted_over_budget"]
    assert max(abs(spread["max"]), abs(spread["min"])) > 1e-2  # the one inflated point moves the fit
