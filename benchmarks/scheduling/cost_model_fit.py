"""Fit every cost-model form to a measured step-time curve and report how well each predicts.

Error is reported on all measured points, cross-validated (held-out), and on the measured points
that matter for training: those of the shapes a bucket table schedules for a shape mix under the
dual-constraint rule (M_comp from CostModel.m_comp with S_ref = longest bucket):
  exact: measured points whose (B, S) equals a scheduled (B, S) pair;
  near:  measured points within a factor 2 in B and in S of some scheduled pair.
With --validate, also on a second measurements file the models never saw (e.g. the scheduled
shapes measured by benchmarks/scheduling/cost_model_fit_measure.py in the same session as the curve).

    python benchmarks/scheduling/cost_model_fit.py  # H200 curve and reference mix shipped with the package
    python benchmarks/scheduling/cost_model_fit.py --curve benchmarks/results/cost_model_fit_h200_grid.json \
        --validate benchmarks/results/cost_model_fit_h200_schedule.json \
        --out benchmarks/results/cost_model_fit_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import scipy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.calibration.plot import plot_fit  # noqa: E402
from lightning_adaptiveload.scheduling.cost_model import FORMS, CostModel, read_measurements  # noqa: E402
from lightning_adaptiveload.scheduling.policies import batch_sizes  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl  # noqa: E402

DATA = REPO / "lightning_adaptiveload" / "data"


def near_schedule(b: np.ndarray, s: np.ndarray, sched_b: np.ndarray, sched_s: np.ndarray,
                  factor: float) -> np.ndarray:
    """(n,) bool: measured point i is within `factor` in B and in S of some scheduled pair."""
    close_b = np.abs(np.log(b[:, None] / sched_b[None, :])) <= np.log(factor) + 1e-12
    close_s = np.abs(np.log(s[:, None] / sched_s[None, :])) <= np.log(factor) + 1e-12
    return np.any(close_b & close_s, axis=1)


def error_summary(rel: np.ndarray) -> dict:
    return {"n": int(rel.size), "mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())}


def repeat_noise(curve_path: str) -> dict | None:
    """|t_repeat - t| / t over a curve whose points carry a second timing "time_ms_repeat"."""
    rows = json.loads(Path(curve_path).read_text())["measurements"]
    if not all("time_ms_repeat" in r for r in rows):
        return None
    t = np.array([r["time_ms"] for r in rows])
    diff = np.abs(np.array([r["time_ms_repeat"] for r in rows]) - t) / t
    big = np.array([r["batch_size"] * r["seq_len"] >= 16384 for r in rows])
    return {"mean_rel_diff": float(diff.mean()), "max_rel_diff": float(diff.max()),
            "mean_rel_diff_bs_ge_16384": float(diff[big].mean())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curve", default=str(DATA / "h200_dit_cost_curve.json"), help="measurements JSON")
    parser.add_argument("--mix", default=str(DATA / "reference_mix.jsonl"), help="shapes JSONL to schedule")
    parser.add_argument("--m-mem", type=int, default=65536, help="memory budget B*S (tokens)")
    parser.add_argument("--validate", help="measurements JSON of unseen shapes to report error on")
    parser.add_argument("--out", default=str(RESULTS / "cost_model_fit.json"), help="result JSON; PNGs beside it")
    args = parser.parse_args(argv)

    b, s, t = read_measurements(args.curve)
    models = {form: CostModel.fit(b, s, t, form=form) for form in FORMS}
    auto = CostModel.fit(b, s, t, form="auto")

    # the schedule depends only on p (same for every form) and the mix
    mix = read_shapes_jsonl(args.mix)
    order = np.argsort(mix.tokens)
    bucket_s, bucket_count = mix.tokens[order], mix.counts[order]
    s_ref = int(bucket_s.max())
    m_comp = auto.m_comp(args.m_mem, s_ref)
    bucket_b = batch_sizes(bucket_s, "dual_constraint", args.m_mem, m_comp, auto.p)
    memory_b = batch_sizes(bucket_s, "token_equal", args.m_mem)
    exact = np.array([np.any((bucket_b == bi) & (bucket_s == si)) for bi, si in zip(b, s)])
    near = near_schedule(b, s, bucket_b.astype(np.float64), bucket_s.astype(np.float64), 2.0)

    if args.validate:
        vb, vs, vt = read_measurements(args.validate)
    rows = {}
    for form, model in models.items():
        rel = np.abs(model.predict(b, s) - t) / t
        rows[form] = {"params": model.params, "quality": model.quality,
                      "scheduled_exact": error_summary(rel[exact]), "scheduled_near": error_summary(rel[near])}
        if args.validate:
            rows[form]["validation"] = error_summary(np.abs(model.predict(vb, vs) - vt) / vt)

    header = (f"{'form':<17} {'R^2':>7} {'mean':>6} {'max':>6} {'cv mean':>8} {'cv max':>7} "
              f"{'exact mean':>10} {'exact max':>9} {'near mean':>9} {'near max':>8}  params")
    print(f"cost model fit on {args.curve} ({len(t)} points); relative errors in %;"
          f" cv = leave-one-out held-out; exact/near = measured points at/near the schedule of"
          f" {Path(args.mix).name} at m_mem={args.m_mem} (n={exact.sum()}/{near.sum()})")
    print(header)
    for form, row in rows.items():
        q, ex, nr = row["quality"], row["scheduled_exact"], row["scheduled_near"]
        params = ", ".join(f"{k}={v:.4g}" for k, v in row["params"].items())
        print(f"{form:<17} {q['r2']:7.4f} {100 * q['mean_rel_err']:6.1f} {100 * q['max_rel_err']:6.1f} "
              f"{100 * q['heldout_mean_rel_err']:8.1f} {100 * q['heldout_max_rel_err']:7.1f} "
              f"{100 * ex['mean_rel_err']:10.1f} {100 * ex['max_rel_err']:9.1f} "
              f"{100 * nr['mean_rel_err']:9.1f} {100 * nr['max_rel_err']:8.1f}  {params}")
    print(f"auto picks: {auto.form}; p (power form) = {auto.p:.4f}; M_comp = {m_comp:.4g} (S_ref = {s_ref})")
    if args.validate:
        print(f"\nunseen shapes of {args.validate} ({len(vt)} points), relative error in %:")
        for form, row in rows.items():
            v = row["validation"]
            print(f"{form:<17} mean {100 * v['mean_rel_err']:5.1f}  max {100 * v['max_rel_err']:5.1f}")
    run_to_run = repeat_noise(args.curve)
    if run_to_run:
        print(f"run-to-run noise of the curve (time_ms_repeat): mean {100 * run_to_run['mean_rel_diff']:.1f}%, "
              f"max {100 * run_to_run['max_rel_diff']:.1f}%; at B*S >= 16384: mean "
              f"{100 * run_to_run['mean_rel_diff_bs_ge_16384']:.1f}%")

    schedule = []
    print(f"\nschedule (dual-constraint, S_ref={s_ref}); ms predicted by {auto.form}")
    print(f"{'S':>7} {'samples':>8} {'B':>5} {'B*S':>7} {'bound':>8} {'ms':>8}")
    for si, ci, bi, mi in zip(bucket_s, bucket_count, bucket_b, memory_b):
        bound = "memory" if bi == mi else "compute"
        ms = auto.predict(int(bi), int(si))
        schedule.append({"seq_len": int(si), "samples": int(ci), "batch_size": int(bi), "bound": bound,
                         "predicted_ms": ms})
        print(f"{si:7d} {ci:8d} {bi:5d} {bi * si:7d} {bound:>8} {ms:8.1f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for form, model in models.items():
        png = out.with_name(f"{out.stem}_{form}.png")
        plot_fit(model, b, s, t, png)
        pngs[form] = png.name
    if args.validate:
        png = out.with_name(f"{out.stem}_{auto.form}_validation.png")
        plot_fit(auto, vb, vs, vt, png)
        pngs["validation"] = png.name
    curve_doc = json.loads(Path(args.curve).read_text())
    result = {
        **run_meta("cost_model_fit", argv, scipy=scipy.__version__),
        "device_note": "the fit runs on the host named in device; the curve was measured on curve.device",
        "curve": {"path": args.curve, "device": curve_doc.get("device"), "points": len(t)},
        "validate": args.validate,
        "run_to_run": run_to_run,
        "mix": args.mix,
        "m_mem": args.m_mem,
        "s_ref": s_ref,
        "m_comp": m_comp,
        "p": auto.p,
        "auto_form": auto.form,
        "heldout": "leave-one-out",
        "scheduled_sets": {"exact": "measured (B, S) equal to a scheduled pair",
                           "near": "measured points within a factor 2 in B and in S of a scheduled pair"},
        "forms": rows,
        "schedule": schedule,
        "plots": pngs,
    }
    write_result(out, result, announce=False)
    print(f"\nwrote {out} and {', '.join(pngs.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
