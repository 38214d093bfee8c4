"""How verification prices a bucket it did not run: the committed GPU records, one bucket held out at a time.

    python benchmarks/scheduling/unmeasured_price.py          # CPU, seconds; reads committed records

Verification prices a batch at its measured warm time where that (B, S) ran, else at the time model's
prediction times a correction measured on the bucket (`MeasuredCosts`). A bucket none of whose shapes ran
(each bounded by a larger shape that fit, so never stepped) has no correction of its own. For each record
and each bucket S with measured fits: its shapes are priced by `Verification.costs` from every *other*
bucket's fits, with the recorded prediction of each shape (`predicted_ms`) as the model, and compared with
their measured warm times, against the raw prediction (what an unmeasured bucket got before the
correction was interpolated). Reports per record the mean and largest |price / measured - 1|, and the
same for the two records' bounded shapes that trained, priced from all measured fits, against the median
of their later training steps (balance_per_rank.csv). Writes benchmarks/results/unmeasured_price.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, read_per_rank_csv  # noqa: E402
from lightning_adaptiveload.scheduling import metrics  # noqa: E402
from lightning_adaptiveload.scheduling.verification import Verification  # noqa: E402

RECORDS = {"H100 80GB, 2026-12-06, first run": "gpu_session9/eager",
           "H100 80GB, 2026-12-06, cached run": "gpu_session9/eager_again",
           "H200, 2026-12-03, first run": "gpu_session8/eager",
           "H200, 2026-12-02, first run": "gpu_session7/eager"}


class RecordedPredictions:
    """The time model as the record saw it: (B, S) -> the `predicted_ms` verification stored."""

    def __init__(self, predicted: dict[tuple[int, int], float]):
        self.predicted = predicted

    def predict(self, batch_size, seq_len):
        b, s = np.broadcast_arrays(np.asarray(batch_size), np.asarray(seq_len))
        out = np.array([self.predicted[(int(x), int(y))] for x, y in zip(b.reshape(-1), s.reshape(-1))])
        return float(out[0]) if b.ndim == 0 else out.reshape(b.shape)


def _depths(shapes) -> dict[int, int | None]:
    """seq_len -> k of each bucket's last measured fit: the depth its table priced at (what
    `Verification.costs` is given in training)."""
    return {m.seq_len: m.checkpointed for m in sorted(shapes, key=lambda m: m.round) if m.measured_fit}


def held_out(shapes) -> dict:
    """Each measured bucket priced from the others (module docstring), through `Verification.costs`
    as the balanced plan prices batches."""
    verification, depths = Verification(tuple(shapes)), _depths(shapes)
    fits = [m for m in shapes if m.measured_fit and depths[m.seq_len] == m.checkpointed]
    model = RecordedPredictions({(m.batch_size, m.seq_len): m.predicted_ms for m in fits})
    rows = []
    for s in sorted(depths):
        costs = verification.costs(model, {k: v for k, v in depths.items() if k != s})
        for m in (m for m in fits if m.seq_len == s):
            rows.append({"batch_size": m.batch_size, "seq_len": s, "measured_ms": m.warm_ms, "predicted_ms": m.predicted_ms,
                         "interpolated_ms": float(costs.predict(m.batch_size, s))})
    return {"shapes": rows} | _errors(rows, "measured_ms")


def _errors(rows: list[dict], truth: str) -> dict:
    out = {}
    for name in ("predicted_ms", "interpolated_ms"):
        err = np.abs([r[name] / r[truth] - 1 for r in rows])
        out[name] = {"mean_abs_rel_err": float(err.mean()), "max_abs_rel_err": float(err.max())} if len(rows) else None
    return out


def bounded_in_training(shapes, log_dir: Path) -> dict:
    """The bounded shapes that trained more than once, priced from every measured fit, against the
    median of their later training steps."""
    depths = _depths(shapes)
    fits = {(m.batch_size, m.seq_len): m.predicted_ms for m in shapes if m.measured_fit and depths[m.seq_len] == m.checkpointed}
    bounded = {(m.batch_size, m.seq_len): m.predicted_ms for m in shapes if m.status == "bounded"}
    costs = Verification(tuple(shapes)).costs(RecordedPredictions(fits | bounded), depths)
    cols = read_per_rank_csv(log_dir / CSV_NAME)
    samples, seq_len, step_ms = cols["samples"][:, 0], cols["seq_len"][:, 0], cols["step_time_ms"][:, 0]
    later = ~metrics.first_occurrences(cols["samples"], cols["seq_len"])
    rows = []
    for (b, s), predicted in sorted(bounded.items()):
        at = (samples == b) & (seq_len == s) & later
        if (b, s) in costs.measured or not at.any():
            continue
        rows.append({"batch_size": b, "seq_len": s, "later_steps": int(at.sum()), "median_step_ms": float(np.median(step_ms[at])),
                     "predicted_ms": predicted, "interpolated_ms": float(costs.predict(b, s))})
    return {"shapes": rows} | _errors(rows, "median_step_ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "unmeasured_price.json")
    args = parser.parse_args(argv)
    doc = run_meta("unmeasured_price", argv) | {"description": __doc__.strip().splitlines()[0], "records": {}}
    print(f"{'record':36} {'what':>26} {'shapes':>6} {'raw model: mean / max':>22} {'interpolated: mean / max':>25}")
    for label, folder in RECORDS.items():
        calibration = json.loads((RESULTS / folder / "calibration.json").read_text())
        shapes = Verification.from_dict({k: calibration["verification"][k] for k in
                                         ("shapes", "limits", "max_seq_len", "budget_bytes")}).shapes
        result = {"held_out_buckets": held_out(shapes),
                  "bounded_in_training": bounded_in_training(shapes, RESULTS / folder)}
        doc["records"][label] = {"folder": f"benchmarks/results/{folder}"} | result
        for what, r in result.items():
            if not r["shapes"]:
                print(f"{label:36} {what:>26} {0:>6}")
                continue
            raw, new = r["predicted_ms"], r["interpolated_ms"]
            print(f"{label:36} {what:>26} {len(r['shapes']):>6} {raw['mean_abs_rel_err']:>10.1%} / {raw['max_abs_rel_err']:>7.1%}"
                  f" {new['mean_abs_rel_err']:>12.1%} / {new['max_abs_rel_err']:>8.1%}")
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
