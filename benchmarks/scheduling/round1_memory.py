"""What would have made round 1 of verification right: a grid point between every block and half the
blocks checkpointed at the longest sequence where half is predicted not to fit, or a planning margin?
The calibration records of GPU runs, refitted as calibration fits them.

    python benchmarks/scheduling/round1_memory.py          # CPU, seconds; reads committed records

Calibration measures each required (B, S) at k = L, then k = L/2 and the lowest k predicted to fit; when
k = L/2 is predicted over the device at a long S (the H100's S = 32,400 and 75,600, the H200's 75,600), no
point between L and L/2 is measured there, and the memory model's per-block term at long S comes from
shorter sequences. For each record: the memory and time models fitted as calibration fits them
(`calibration.fit.fit_memory_models`: the ok points, the optimizer state verification measured added
to m0) predict every round-1 shape verification ran; then the same fit with one more point, the
round-1 shape at that (B, S) (what such a grid point would have measured, at the depth the plan chose),
predicts the others. Per fit: (predicted - measured held) / measured held over the shapes (mean, min,
max) and, of the shapes that held more than the budget, how many the model predicted over it (the plan
would have chosen a deeper k for those up front). Then, with the grid's fit, a margin: the plan keeping
predictions under (1 - margin) * budget would have planned deeper, before running them, the over-budget
shapes predicted above that (caught) and the fitting ones predicted above it (planned deeper than they
needed: their batches run slower). Writes benchmarks/results/round1_memory.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.calibration.fit import fit_memory_models  # noqa: E402
from lightning_adaptiveload.scheduling.cost_model import CostModel  # noqa: E402
from lightning_adaptiveload.scheduling.verification import MeasuredShape  # noqa: E402

MARGINS = (0.01, 0.02, 0.03)
RECORDS = {"H100 80GB compiled (dynamic), 2026-12-07": "gpu_session14/call5_h100/calibration.json",
           "H100 80GB eager, 2026-12-06": "gpu_session9/eager/calibration.json",
           "H200 eager, 2026-12-03": "gpu_session8/eager/calibration.json"}


def _judge(model, shapes: list[MeasuredShape], budget: float) -> dict:
    errors = np.array([(float(model.predict(m.batch_size, m.seq_len, m.checkpointed)) - m.used_bytes) / m.used_bytes
                       for m in shapes])
    over = [m for m in shapes if m.used_bytes > budget]
    return {"shapes": len(shapes), "rel_err": {"mean": float(errors.mean()), "min": float(errors.min()),
                                               "max": float(errors.max())},
            "held_over_budget": len(over),
            "predicted_over_budget": sum(float(model.predict(m.batch_size, m.seq_len, m.checkpointed)) > budget
                                         for m in over)}


def analyse(doc: dict) -> dict:
    num_blocks = doc["depths"][0]
    verification = doc["verification"]
    state, budget = verification["optimizer_state"]["state_bytes"], verification["budget_bytes"]
    base = CostModel.from_dict(doc["cost_model"])
    round1 = [m for m in map(MeasuredShape.from_dict, verification["shapes"])
              if m.round == 1 and m.used_bytes is not None and m.checkpointed is not None]
    grid, _, why = fit_memory_models(doc["points"], num_blocks, base, state, float("inf"))
    if grid is None:
        raise ValueError(why)
    unmeasured = sorted({(p["batch_size"], p["seq_len"]) for p in doc["points"]
                         if p.get("checkpointed") not in (None, num_blocks) and p["status"] == "predicted_oom"})
    out = {"budget_bytes": budget, "half_depth_predicted_over_device_at": unmeasured,
           "grid_only": _judge(grid, round1, budget), "with_a_long_point": []}
    for m in round1:
        if (m.batch_size, m.seq_len) in unmeasured:
            model, _, why = fit_memory_models(doc["points"], num_blocks, base, state, float("inf"), verified=[m])
            if model is None:
                raise ValueError(why)
            out["with_a_long_point"].append({"point": [m.batch_size, m.seq_len, m.checkpointed],
                                             **_judge(model, [x for x in round1 if x is not m], budget)})
    predicted = {id(m): float(grid.predict(m.batch_size, m.seq_len, m.checkpointed)) for m in round1}
    out["margins"] = [{"margin": margin,
                       "over_budget_caught": sum(predicted[id(m)] > (1 - margin) * budget for m in round1
                                                 if m.used_bytes > budget),
                       "fitting_planned_deeper": sum(predicted[id(m)] > (1 - margin) * budget for m in round1
                                                     if m.used_bytes <= budget)} for margin in MARGINS]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "round1_memory.json")
    args = parser.parse_args(argv)
    doc = run_meta("round1_memory", argv) | {"description": __doc__.strip().splitlines()[0], "records": {}}
    print(f"{'record':42} {'fit':>26} {'shapes':>6} {'(pred - held) / held':>32} {'over budget / predicted over':>29}")
    for label, path in RECORDS.items():
        result = analyse(json.loads((RESULTS / path).read_text()))
        doc["records"][label] = {"file": f"benchmarks/results/{path}", **result}
        rows = [("grid only", result["grid_only"])] + [(f"+ (B, S, k) = {tuple(r['point'])}", r)
                                                       for r in result["with_a_long_point"]]
        for name, r in rows:
            e = r["rel_err"]
            print(f"{label:42} {name:>26} {r['shapes']:6d} mean {e['mean']:+.2%} min {e['min']:+.2%} max {e['max']:+.2%} "
                  f"{r['held_over_budget']:>14d} / {r['predicted_over_budget']}")
        for r in result["margins"]:
            print(f"{label:42} {'grid, margin ' + format(r['margin'], '.0%'):>26} {'':6} over budget caught "
                  f"{r['over_budget_caught']} of {result['grid_only']['held_over_budget']}, fitting planned deeper "
                  f"{r['fitting_planned_deeper']} of {result['grid_only']['shapes'] - result['grid_only']['held_over_budget']}")
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
