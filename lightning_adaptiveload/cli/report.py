"""`adaptiveload report LOGDIR`: summarize a run's load balance and plot imbalance over steps.

Reads LoadBalanceMonitor's `balance_per_rank.csv` (every train batch, every rank); without it,
falls back to the `balance/*` columns of Lightning's CSVLogger `metrics.csv` (logged steps only).
Writes `imbalance.png` next to the file it read.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np

from lightning_adaptiveload.callbacks.monitor import CSV_NAME, META_NAME, cross_rank_stats, temporal_cv

PLOT_NAME = "imbalance.png"
PER_RANK_COLUMNS = ("step", "rank", "samples", "tokens", "seq_len", "load", "step_time_ms", "interval_ms")
METRIC_COLUMNS = ("balance/load_cv", "balance/load_max_over_mean", "balance/bubble_frac", "balance/step_time_cv",
                  "balance/step_time_cv_temporal", "throughput/tokens_per_s")


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="summarize load balance of a run and plot imbalance over steps",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logdir", help="run log dir (or a parent: the newest balance_per_rank.csv / metrics.csv under it)")
    p.add_argument("--window", type=int, default=None,
                   help="steps in the rolling step-time CV window (default: the monitor's, from balance_meta.json)")
    p.set_defaults(func=run)


def _newest(root: Path, name: str) -> Path | None:
    found = sorted(root.rglob(name), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def read_per_rank_csv(path: str | Path) -> dict[str, np.ndarray]:
    """Columns of balance_per_rank.csv reshaped to (batches, world) float64 arrays."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in PER_RANK_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a LoadBalanceMonitor CSV, missing columns {missing}")
        try:
            rows = [[float(r[c]) for c in PER_RANK_COLUMNS] for r in reader]
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: line {reader.line_num}: unreadable number ({e})") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    table = np.asarray(rows, dtype=np.float64)
    rank = table[:, PER_RANK_COLUMNS.index("rank")].astype(np.int64)
    world = int(rank.max()) + 1
    # The monitor writes each batch as `world` consecutive rows, rank 0 first.
    if len(rank) % world or not np.array_equal(rank, np.tile(np.arange(world), len(rank) // world)):
        raise ValueError(f"{path}: rows are not grouped as one row per rank per batch (ranks 0..{world - 1})")
    return {c: table[:, i].reshape(-1, world) for i, c in enumerate(PER_RANK_COLUMNS)}


def per_step_series(cols: dict[str, np.ndarray], window: int) -> dict[str, np.ndarray]:
    """Per batch (n,): step, load_cv, load_max_over_mean, bubble_frac, step_time_cv (across ranks),
    step_time_cv_temporal (CV of the rank-mean step time over the last `window` batches), and the
    slowest rank's predicted load and measured step time (load_max, step_time_max_ms)."""
    load = cross_rank_stats(cols["load"].T)
    step_time = cross_rank_stats(cols["step_time_ms"].T)
    mean_ms = cols["step_time_ms"].mean(axis=1)
    rolling = np.array([temporal_cv(mean_ms[max(0, i + 1 - window):i + 1]) for i in range(len(mean_ms))])
    return {"step": cols["step"][:, 0], "load_cv": load["cv"], "load_max_over_mean": load["max_over_mean"],
            "bubble_frac": load["bubble"], "step_time_cv": step_time["cv"], "step_time_cv_temporal": rolling,
            "load_max": cols["load"].max(axis=1), "step_time_max_ms": cols["step_time_ms"].max(axis=1)}


def read_metrics_csv(path: str | Path) -> dict[str, np.ndarray]:
    """Rows of a CSVLogger metrics.csv that carry balance/* values: step and METRIC_COLUMNS."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if "balance/load_cv" not in (reader.fieldnames or []):
            raise ValueError(f"{path}: no balance/load_cv column (was LoadBalanceMonitor in the callbacks?)")
        rows = [r for r in reader if r.get("balance/load_cv")]
    if not rows:
        raise ValueError(f"{path}: no rows with balance/* metrics")
    try:
        out = {"step": np.array([float(r["step"]) for r in rows])}
        for c in METRIC_COLUMNS:
            out[c.split("/")[1]] = np.array([float(r[c]) if r.get(c) else math.nan for r in rows])
    except ValueError as e:
        raise ValueError(f"{path}: unreadable number ({e})") from None
    return out


def _describe(name: str, values: np.ndarray) -> str:
    return (f"{name:<26} {np.mean(values):>9.4f} {np.percentile(values, 50):>9.4f} "
            f"{np.percentile(values, 95):>9.4f} {np.max(values):>9.4f}")


def summarize(series: dict[str, np.ndarray]) -> list[str]:
    lines = [f"{'metric':<26} {'mean':>9} {'p50':>9} {'p95':>9} {'max':>9}"]
    for name in ("load_cv", "load_max_over_mean", "bubble_frac", "step_time_cv", "step_time_cv_temporal"):
        values = series.get(name)
        if values is not None and np.isfinite(values).any():
            lines.append(_describe(name, values[np.isfinite(values)]))
    return lines


def skipped_counts(metrics_csv: str | Path) -> dict[str, float]:
    """Last logged value of each data/skipped* column of a CSVLogger metrics.csv."""
    last: dict[str, float] = {}
    with open(metrics_csv, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key.startswith("data/skipped") and value:
                    last[key] = float(value)
    return last


def prediction_check(series: dict[str, np.ndarray]) -> tuple[float, float]:
    """(Pearson R, median ratio) of the slowest rank's measured step time against its predicted
    load over all batches: how well the load predicts the step (ratio meaningful for ms loads)."""
    load, measured = series["load_max"], series["step_time_max_ms"]
    if load.size < 3 or np.std(load) == 0 or np.std(measured) == 0:
        return math.nan, float(np.median(measured / load))
    return float(np.corrcoef(load, measured)[0, 1]), float(np.median(measured / load))


def plot_imbalance(series: dict[str, np.ndarray], x: np.ndarray, xlabel: str, out_path: str | Path,
                   title: str, load_unit: str = "") -> None:
    """Panels over `x`: CVs (load, step time across ranks, step time over the rolling window),
    the bubble fraction and, with per-batch data, the slowest rank's measured step time against
    its predicted load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_batch = "step_time_max_ms" in series
    fig, axes = plt.subplots(3 if per_batch else 2, 1, figsize=(9, 8.5 if per_batch else 6), sharex=True)
    top, bottom = axes[0], axes[-1]
    for name, label in (("load_cv", "predicted-load CV across ranks"),
                        ("step_time_cv", "step-time CV across ranks"),
                        ("step_time_cv_temporal", "step-time CV over rolling window")):
        top.plot(x, series[name], label=label, lw=1)
    top.set_ylabel("coefficient of variation")
    top.legend(fontsize=8)
    top.set_title(title, fontsize=9)
    axes[1].plot(x, series["bubble_frac"], color="tab:red", lw=1)
    axes[1].set_ylabel("bubble fraction\n1 - mean/max load")
    if per_batch:
        bottom.plot(x, series["step_time_max_ms"], color="tab:blue", lw=1, label="measured step time (ms)")
        bottom.set_ylabel("slowest rank\nstep time (ms)")
        # A cost-model load is in ms like the step time: same axis; a proxy load gets its own.
        load_ax = bottom if load_unit.startswith("ms") else bottom.twinx()
        load_ax.plot(x, series["load_max"], color="tab:orange", lw=1, ls="--", label=f"predicted load ({load_unit})")
        if load_ax is not bottom:
            load_ax.set_ylabel("predicted load", fontsize=8)
        bottom.legend(handles=bottom.get_lines() + (load_ax.get_lines() if load_ax is not bottom else []), fontsize=8)
    bottom.set_xlabel(xlabel)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    root = Path(args.logdir)
    if not root.exists():
        raise SystemExit(f"adaptiveload report: LOGDIR {root} does not exist")
    if args.window is not None and args.window < 2:
        raise SystemExit(f"adaptiveload report: --window must be >= 2 steps, got {args.window}")
    per_rank = root / CSV_NAME if (root / CSV_NAME).is_file() else _newest(root, CSV_NAME)
    if per_rank is not None:
        meta_path = per_rank.parent / META_NAME
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
        window = args.window if args.window is not None else int(meta.get("window", 50))
        cols = read_per_rank_csv(per_rank)
        series = per_step_series(cols, window)
        n, world = cols["load"].shape
        wall_s = cols["interval_ms"].sum(axis=0).max() / 1e3
        print(f"{per_rank}: {n} train batches x {world} ranks; load in {meta.get('load_unit', 'unknown units')}")
        print(f"{'rank':>5} {'samples':>9} {'tokens':>10} {'load':>12} {'step_ms':>10}")
        for r in range(world):
            print(f"{r:>5} {cols['samples'][:, r].mean():>9.2f} {cols['tokens'][:, r].mean():>10.1f} "
                  f"{cols['load'][:, r].mean():>12.4g} {cols['step_time_ms'][:, r].mean():>10.2f}")
        print("\n".join(summarize(series)))
        if wall_s > 0:
            print(f"global throughput: {cols['tokens'].sum() / wall_s:.1f} tokens/s over {wall_s:.1f} s of training")
        r_value, ratio = prediction_check(series)
        print(f"slowest rank's step time vs predicted load: Pearson R = {r_value:.3f}, "
              f"median measured/predicted = {ratio:.3g}")
        source, x, xlabel = per_rank, np.arange(n), "train batch"
        title = f"{per_rank.parent.name}: {world} ranks, rolling window {window} steps"
        load_unit = meta.get("load_unit", "")
    else:
        metrics = root / "metrics.csv" if (root / "metrics.csv").is_file() else _newest(root, "metrics.csv")
        if metrics is None:
            raise SystemExit(f"adaptiveload report: no {CSV_NAME} or metrics.csv under {root}")
        series = read_metrics_csv(metrics)
        print(f"{metrics}: {len(series['step'])} logged steps (means over each log interval; "
              f"{CSV_NAME} not found, so no per-rank table)")
        print("\n".join(summarize(series)))
        source, x, xlabel = metrics, series["step"], "optimizer step (logged steps)"
        title = f"{metrics.parent.name}: logged balance metrics (means over each log interval)"
        load_unit = ""
    metrics_csv = source.parent / "metrics.csv"
    if metrics_csv.is_file():
        for key, value in skipped_counts(metrics_csv).items():
            print(f"{key}: {value:.0f}")
    out = source.parent / PLOT_NAME
    plot_imbalance(series, x, xlabel, out, title, load_unit)
    print(f"wrote {out}")
    return 0
