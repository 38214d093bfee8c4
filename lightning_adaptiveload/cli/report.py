"""`adaptiveload report LOGDIR`: summarize a run's load balance and plot imbalance over steps.

Reads LoadBalanceMonitor's `balance_per_rank.csv` (every train batch, every rank); without it,
falls back to the `balance/*` columns of Lightning's CSVLogger `metrics.csv` (logged steps only).
Writes `imbalance.png` next to the file it read.
"""
from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np

from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, format_rank_table, read_meta, read_per_rank_csv
from lightning_adaptiveload.scheduling import metrics

PLOT_NAME = "imbalance.png"
METRIC_COLUMNS = ("balance/load_cv", "balance/load_max_over_mean", "balance/bubble_frac", "balance/step_time_cv",
                  "balance/step_time_cv_temporal", "balance/unpredicted_ms", "balance/busy_cv",
                  "balance/busy_max_over_mean", "throughput/tokens_per_s")
SUMMARY_ROWS = ("load_cv", "load_max_over_mean", "bubble_frac", "step_time_cv", "step_time_cv_temporal",
                "unpredicted_ms", "busy_cv", "busy_max_over_mean")


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


def per_step_series(cols: dict[str, np.ndarray], window: int, load_in_ms: bool = True) -> dict[str, np.ndarray]:
    """Per batch (n,), from the (batches, ranks) columns of read_per_rank_csv: step, load_cv,
    load_max_over_mean, bubble_frac (of the batch alone), step_time_cv (across ranks),
    step_time_cv_temporal (over the last `window` batches), busy_cv and busy_max_over_mean (NaN
    on batches not profiled), unpredicted_ms (loads in ms only, else NaN), and the slowest rank's
    predicted load and measured step time (load_max, step_time_max_ms). scheduling/metrics.py
    defines each."""
    load, step_ms, busy = cols["load"], cols["step_time_ms"], cols["busy_ms"]
    n = load.shape[0]
    slowest_ms = metrics.step_time(step_ms)  # step_time_cv_temporal of a window is temporal_cv of these
    rolling = np.array([metrics.temporal_cv(slowest_ms[max(0, i + 1 - window):i + 1]) for i in range(n)])
    profiled = np.isfinite(busy).all(axis=1)
    busy_cv, busy_mom = np.full(n, np.nan), np.full(n, np.nan)
    if profiled.any():
        busy_cv[profiled] = metrics.cv_across_ranks(busy[profiled])
        busy_mom[profiled] = metrics.max_over_mean(busy[profiled])
    unpredicted = metrics.time_beyond_prediction_ms(load, step_ms) if load_in_ms else np.full(n, np.nan)
    return {"step": cols["step"][:, 0], "load_cv": metrics.cv_across_ranks(load),
            "load_max_over_mean": metrics.max_over_mean(load), "bubble_frac": metrics.bubble_per_step(load),
            "step_time_cv": metrics.cv_across_ranks(step_ms), "step_time_cv_temporal": rolling,
            "busy_cv": busy_cv, "busy_max_over_mean": busy_mom, "unpredicted_ms": unpredicted,
            "load_max": metrics.step_time(load), "step_time_max_ms": slowest_ms}


def read_metrics_csv(path: str | Path) -> dict[str, np.ndarray]:
    """Rows of a CSVLogger metrics.csv that carry balance/* values: step and METRIC_COLUMNS (NaN
    where a row or the file lacks one)."""
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
    """mean / p50 / p95 / max over the points of each series that has finite values."""
    lines = [f"{'metric':<26} {'mean':>9} {'p50':>9} {'p95':>9} {'max':>9}"]
    for name in SUMMARY_ROWS:
        values = series.get(name)
        if values is not None and np.isfinite(values).any():
            lines.append(_describe(name, values[np.isfinite(values)]))
    return lines


def run_summary(cols: dict[str, np.ndarray]) -> list[str]:
    """The whole run's lines: time-weighted bubble, step-time CV over every batch, throughput,
    and the torch.compile counts (the most on any rank) when the monitor recorded any."""
    lines = [f"bubble fraction over the run (time-weighted): {metrics.bubble_fraction(cols['load']):.4f}",
             f"step-time CV over the run: {metrics.step_time_cv_temporal(cols['step_time_ms']):.4f}"]
    wall_s = cols["interval_ms"].sum(axis=0).max() / 1e3
    if wall_s > 0:
        lines.append(f"global throughput: {metrics.measured_throughput(cols['tokens'], cols['interval_ms']):.1f} "
                     f"tokens/s over {wall_s:.1f} s of training")
    last = {name: cols[f"compile_{name}"][-1] for name in ("recompiles", "graph_breaks")}
    if all(np.isfinite(v).all() for v in last.values()) and any(v.max() > 0 for v in last.values()):
        lines.append(f"torch.compile during training: {int(last['recompiles'].max())} recompiles, "
                     f"{int(last['graph_breaks'].max())} graph breaks (the most on one rank)")
    return lines


def data_counters(metrics_csv: str | Path) -> dict[str, float]:
    """Last logged value of each data/* column of a CSVLogger metrics.csv."""
    last: dict[str, float] = {}
    with open(metrics_csv, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key and key.startswith("data/") and value:
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
    busy = np.isfinite(series.get("busy_cv", np.array([])))
    if busy.any():  # sampled steps only: points
        top.plot(x[busy], series["busy_cv"][busy], "o", ms=4, label="busy-time CV across ranks (profiled)")
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
        meta = read_meta(per_rank.parent)
        window = args.window if args.window is not None else int(meta.get("window", 50))
        load_unit = meta.get("load_unit", "")
        cols = read_per_rank_csv(per_rank)
        series = per_step_series(cols, window, load_in_ms=load_unit.startswith("ms"))
        n, world = cols["load"].shape
        profiled = np.isfinite(cols["busy_ms"]).all(axis=1)
        print(f"{per_rank}: {n} train batches x {world} ranks; load in {load_unit or 'unknown units'}"
              + (f"; busy time profiled on {int(profiled.sum())} batches" if profiled.any() else ""))
        means = {name: cols[name].mean(axis=0) for name in ("samples", "tokens", "seq_len", "load", "step_time_ms")}
        for name in ("busy_ms", "comm_ms"):  # over the profiled batches
            means[name] = cols[name][profiled].mean(axis=0) if profiled.any() else np.full(world, math.nan)
        print("\n".join(format_rank_table(means)))
        print("\n".join(summarize(series)))
        print("\n".join(run_summary(cols)))
        r_value, ratio = prediction_check(series)
        print(f"slowest rank's step time vs predicted load: Pearson R = {r_value:.3f}, "
              f"median measured/predicted = {ratio:.3g}")
        source, x, xlabel = per_rank, np.arange(n), "train batch"
        title = f"{per_rank.parent.name}: {world} ranks, rolling window {window} steps"
    else:
        metrics_path = root / "metrics.csv" if (root / "metrics.csv").is_file() else _newest(root, "metrics.csv")
        if metrics_path is None:
            raise SystemExit(f"adaptiveload report: no {CSV_NAME} or metrics.csv under {root}")
        series = read_metrics_csv(metrics_path)
        print(f"{metrics_path}: {len(series['step'])} logged steps (each value over its log interval; "
              f"{CSV_NAME} not found, so no per-rank table)")
        print("\n".join(summarize(series)))
        source, x, xlabel = metrics_path, series["step"], "optimizer step (logged steps)"
        title = f"{metrics_path.parent.name}: logged balance metrics (each over its log interval)"
        load_unit = ""
    metrics_csv = source.parent / "metrics.csv"
    if metrics_csv.is_file():
        for key, value in data_counters(metrics_csv).items():
            print(f"{key}: {value:.0f}")
    out = source.parent / PLOT_NAME
    plot_imbalance(series, x, xlabel, out, title, load_unit)
    print(f"wrote {out}")
    return 0
