"""What the process's first step does to the memory model: the calibration records of GPU runs, fitted as
calibration fits them, with the first grid point as measured and with its reserved bytes as a later step
would hold them.

    python benchmarks/scheduling/first_step_memory.py          # CPU, seconds; reads committed records

The first grid point of a calibration is its process's first training step. It held 21.6 GiB reserved for
11.1 GiB allocated on an H100 (21.5 / 11.1 on an H200), while the later points held 0.3-0.7 GiB over
its allocations; the memory model is fitted on held bytes, max(allocated, reserved). For each record:
the memory model (`MemoryModel.fit`, calibration's fit of the ok points) with that point as measured, and
with its reserved bytes replaced by its allocated bytes plus the next point's reserved - allocated gap (the
same B and S one depth lower); its held-out mean relative error; and, for the shapes verification ran in
round 1, (measured held - predicted held) / budget, the prediction being the model plus the optimizer
state verification measured (what the plan adds to m0). Writes benchmarks/results/first_step_memory.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.calibration.grid import point_held_bytes  # noqa: E402
from lightning_adaptiveload.scheduling.memory_model import MemoryModel  # noqa: E402

RECORDS = {"H100 80GB, 2026-12-06": "gpu_session9/eager/calibration.json",
           "H200, 2026-12-03": "gpu_session8/eager/calibration.json"}


def analyse(doc: dict) -> dict:
    num_blocks = doc["depths"][0]
    verification = doc["verification"]
    state, budget = verification["optimizer_state"]["state_bytes"], verification["budget_bytes"]
    ok = [dict(p) for p in doc["points"] if p["status"] == "ok"]
    first, after = ok[0], ok[1]
    out = {"first_point": {k: first[k] for k in ("batch_size", "seq_len", "checkpointed", "peak_bytes", "reserved_bytes")},
           "next_point_gap_bytes": after["reserved_bytes"] - after["peak_bytes"]}
    for name, points in (("as_measured", ok),
                         ("first_point_without_its_one_time_bytes",
                          [{**first, "reserved_bytes": first["peak_bytes"] + out["next_point_gap_bytes"]}] + ok[1:])):
        b, s, k, held = (np.array(v, dtype=np.float64) for v in zip(*[
            (p["batch_size"], p["seq_len"], p["checkpointed"], point_held_bytes(p)) for p in points]))
        model = MemoryModel.fit(b, s, k, held, num_blocks)
        errors = [(max(m["peak_bytes"], m["reserved_bytes"] or 0.0)
                   - float(model.predict(m["batch_size"], m["seq_len"], m["checkpointed"])) - state) / budget
                  for m in verification["shapes"] if m["round"] == 1 and m["peak_bytes"]]
        out[name] = {"form": model.form, "heldout_mean_rel_err": model.quality["heldout_mean_rel_err"],
                     "round1_shapes": len(errors), "round1_held_minus_predicted_over_budget": {
                         "mean": float(np.mean(errors)), "max": float(np.max(errors)), "min": float(np.min(errors))}}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "first_step_memory.json")
    args = parser.parse_args(argv)
    doc = run_meta("first_step_memory", argv) | {"description": __doc__.strip().splitlines()[0], "records": {}}
    print(f"{'record':24} {'first point':>22} {'fit':>40} {'held-out':>9} {'round 1 (held - pred) / budget':>34}")
    for label, path in RECORDS.items():
        result = analyse(json.loads((RESULTS / path).read_text()))
        doc["records"][label] = {"file": f"benchmarks/results/{path}", **result}
        p = result["first_point"]
        for name in ("as_measured", "first_point_without_its_one_time_bytes"):
            r, e = result[name], result[name]["round1_held_minus_predicted_over_budget"]
            print(f"{label:24} {p['peak_bytes'] / 2**30:7.1f} / {p['reserved_bytes'] / 2**30:5.1f} GiB "
                  f"{name:>40} {r['heldout_mean_rel_err']:9.1%} "
                  f"mean {e['mean']:+.2%} max {e['max']:+.2%} min {e['min']:+.2%}")
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
