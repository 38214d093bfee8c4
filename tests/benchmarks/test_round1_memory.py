"""benchmarks/scheduling/round1_memory.py on a synthetic calibration record: grid peaks drawn from a known
memory model (fp64, noise-free), so the grid's fit is that model; round-1 shapes held known fractions
more or less than it predicts. The errors, the over-budget counts and what each margin catches are then
the formulas' (independent of the fit), and a long point measured exactly as the model predicts leaves
the fit where it was."""

import numpy as np
import pytest

from benchmarks.scheduling import round1_memory
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.memory_model import MemoryModel

GIB = 2**30


def test_errors_and_margins_are_the_formulas_of_a_known_model():
    truth = MemoryModel("linear", {"m0": 10 * GIB, "c": 2e7, "a": 4e4, "c_k": 1e7, "b": 3e5}, 30)
    points = []
    for b, s in [(1, 256), (1, 3600), (1, 9408), (2, 256), (4, 256), (2, 3600), (4, 3600), (8, 256), (1, 32400)]:
        for k in (30, 15, 0):
            status = "predicted_oom" if (s == 32400 and k < 30) else "ok"
            point = {"batch_size": b, "seq_len": s, "checkpointed": k, "status": status}
            if status == "ok":
                held = float(truth.predict(b, s, k))
                point.update(peak_bytes=held, reserved_bytes=held, time_ms=50 + 1e-3 * b * s * (1 + (30 - k) / 300))
            points.append(point)
    base = CostModel.fit(*(np.array([p[key] for p in points if p["status"] == "ok" and p["checkpointed"] == 30],
                                    dtype=np.float64) for key in ("batch_size", "seq_len", "time_ms")))
    state = 5 * GIB
    # (B, S, k, held / predicted - 1): the first at the long (B, S) where half the blocks was not measured
    round1 = [(1, 32400, 20, 0.0), (3, 9408, 0, 0.015), (6, 3600, 2, 0.005), (2, 9408, 4, -0.01), (1, 20000, 8, 0.025)]
    shapes, predicted = [], []  # predicted: what the plan adds up, the optimizer state included
    for b, s, k, excess in round1:
        p = float(truth.predict(b, s, k)) + state
        predicted.append(p)
        shapes.append({"batch_size": b, "seq_len": s, "latent_shape": None, "checkpointed": k, "round": 1,
                       "status": "fits", "warm_ms": 1.0, "peak_bytes": p * (1 + excess), "reserved_bytes": p * (1 + excess)})
    budget = 1.01 * predicted[1]  # the shape that held 1.5% over its prediction holds over the budget
    doc = {"depths": [30, 15], "points": points, "cost_model": base.to_dict(),
           "verification": {"optimizer_state": {"state_bytes": state}, "budget_bytes": budget, "shapes": shapes}}
    out = round1_memory.analyse(doc)

    held = np.array([p * (1 + e) for p, (*_, e) in zip(predicted, round1)])
    rel = (np.array(predicted) - held) / held
    grid = out["grid_only"]
    assert grid["shapes"] == len(round1)
    assert grid["rel_err"]["mean"] == pytest.approx(rel.mean(), abs=1e-6)
    assert grid["rel_err"]["min"] == pytest.approx(rel.min(), abs=1e-6)
    over = held > budget
    assert 0 < grid["held_over_budget"] == over.sum() and grid["predicted_over_budget"] == 0
    assert over[1] and out["margins"][0]["over_budget_caught"] >= 1  # a 1% margin catches it: not a vacuous count
    for row in out["margins"]:
        flagged = np.array(predicted) > (1 - row["margin"]) * budget
        assert row["over_budget_caught"] == (flagged & over).sum()
        assert row["fitting_planned_deeper"] == (flagged & ~over).sum()
    assert out["half_depth_predicted_over_device_at"] == [(1, 32400)]
    [long] = out["with_a_long_point"]
    assert long["point"] == [1, 32400, 20] and long["shapes"] == len(round1) - 1
    assert long["rel_err"]["mean"] == pytest.approx(rel[1:].mean(), abs=1e-6)
