"""The shipped GPU config as a user runs it, against its baseline, on the same samples (one GPU).

    python benchmarks/e2e/shipped_config.py --runs baseline,compiled --out part1.json        # one H200
    python benchmarks/e2e/shipped_config.py --combine part1.json part2.json --out benchmarks/results/shipped_config_h200.json
    python benchmarks/e2e/shipped_config.py --tiny --runs baseline,eager --out /tmp/shipped_cpu.json   # CPU smoke run

Each run is `adaptiveload fit --config ...` in a fresh process with `--trainer.devices 1`, one epoch
(`max_epochs 1`, no step limit) over the same `--samples` synthetic samples of the reference mix
(written once per workdir: the shards are a function of the seed, so separate calls train on the same
samples), calibration `time_budget_s` the same in every run (`warmup`, `repeats` as each config ships
them unless given):

  baseline    examples/configs/h200_fsdp_baseline.yaml: every block checkpointed, eager, partial batches dropped
  eager       examples/configs/h200_fsdp.yaml as shipped (model.compile null, memory plan, budget 0.85)
  compiled    examples/configs/h200_fsdp.yaml with model.compile auto (budget 0.85)
  compiled95  the shipped config at max_memory_fraction 0.95
  eager_again, compiled_again   eager / compiled once more on the caches their first run left (same call,
              or --cache-dir): the time to the first step of a user's second start

From each run's log folder (calibration.json, balance_per_rank.csv) and its output: whether it ran out
of memory; calibration and verification seconds and what verification re-planned; per step the
batch, the price the plan balanced it at (the monitor's load: verified warm time) and the measured
step time and peak memory; the epoch's tokens/s (tokens over the sum of interval_ms, data waits
included), and apart from it the steps where a (B, S) ran first (their excess over the plan's price,
grouped by what verification did with the shape: run, bounded, not verified) and the steady tokens/s
without them; samples trained; every step's peak against the budget; per (B, S) the median of its
later steps over the plan's price (none for a shape the epoch ran once). Against the baseline: the
epoch's tokens/s, and the tokens/s on the samples
both train (`common_sample_speedup`: per bucket S, min(samples trained by either) samples at each run's
own measured tokens/s of that bucket; the run's time for them over the baseline's).
`--cache-dir` keeps each run's calibration cache and compile cache folder between calls (compiled and
compiled95 share a key).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, read_per_rank_csv  # noqa: E402
from lightning_adaptiveload.scheduling import metrics  # noqa: E402
from lightning_adaptiveload.scheduling.verification import NOT_RUN, held_bytes  # noqa: E402

RUNS = {
    "baseline": ("h200_fsdp_baseline.yaml", {}),
    "eager": ("h200_fsdp.yaml", {"compile": None}),
    "compiled": ("h200_fsdp.yaml", {"compile": "auto"}),
    "compiled95": ("h200_fsdp.yaml", {"compile": "auto", "max_memory_fraction": 0.95}),
    "eager_again": ("h200_fsdp.yaml", {"compile": None}),
    "compiled_again": ("h200_fsdp.yaml", {"compile": "auto"}),
    "dynamic": ("h200_fsdp.yaml", {"compile": "dynamic"}),
    "dynamic_again": ("h200_fsdp.yaml", {"compile": "dynamic"}),
}
# A second run of a config, on the first one's caches (calibration_cache.json, compile_cache/): what a
# user's next start of the same config waits
CACHES_OF = {"eager_again": "eager", "compiled_again": "compiled", "dynamic_again": "dynamic"}
TINY_MODEL = dict(in_channels=4, dim=64, num_layers=2, num_heads=4, ffn_dim=128, text_dim=32, freq_dim=64)
TINY_DATA = dict(m_mem=640, latent_channels=4, text_len=8, text_dim=32, num_workers=0,
                 synthesize_shapes=str(REPO / "examples" / "configs" / "demo_mix.jsonl"), synthesize_latent_scale=1.0)


def as_benchmark_run(config: dict, name: str, args: argparse.Namespace) -> dict:
    """`config` (a shipped YAML, loaded; changed in place and returned) as run `name` of a benchmark:
    one device, one epoch of at most `args.max_steps` steps (`args.again_max_steps` for a run on another's
    caches, when given), logged every `args.log_every`, its files
    under `args.workdir`/name (logger version 0, launch() keeps its calibration cache there), the
    calibration's `time_budget_s` (and `warmup`, `repeats` where given) from `args`, and the shards every run of the
    workdir shares (`args.samples` synthetic samples, seed 0: the same samples in every run)."""
    root = str(Path(args.workdir) / name)
    trainer = config["trainer"]
    max_steps = args.again_max_steps if name in CACHES_OF and args.again_max_steps is not None else args.max_steps
    trainer.update(devices=1, max_epochs=1, max_steps=max_steps, log_every_n_steps=args.log_every, default_root_dir=root,
                   enable_progress_bar=False)
    trainer["logger"]["init_args"].update(save_dir=root, name="logs", version=0)
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("CostModelCalibration"):
            given = {k: v for k, v in (("warmup", args.warmup), ("repeats", args.repeats)) if v is not None}
            callback["init_args"].update(time_budget_s=args.time_budget_s, **given,
                                         cache_path=str(Path(root) / "calibration_cache.json"))
    config["data"]["init_args"].update(shards=str(Path(args.workdir) / "shards"),
                                       index=str(Path(args.workdir) / "index.jsonl"), synthesize=args.samples, seed=0)
    return config


def run_config(name: str, args: argparse.Namespace) -> dict:
    """The YAML of run `name`: its base config with this benchmark's overrides."""
    base, changes = RUNS[name]
    config = as_benchmark_run(yaml.safe_load((REPO / "examples" / "configs" / base).read_text()), name, args)
    trainer = config["trainer"]
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("CostModelCalibration") and "max_memory_fraction" in changes:
            callback["init_args"]["max_memory_fraction"] = changes["max_memory_fraction"]
    model = config["model"]["init_args"]
    if "compile" in changes:
        model["compile"] = changes["compile"]
    if args.layers is not None:  # a diagnostic run (e.g. of what compiles, TORCH_LOGS=recompiles), not a result
        model["num_layers"] = args.layers
    data = config["data"]["init_args"]
    if args.tiny:  # the CPU smoke run: a toy model and the demo mix, no strategy, no compile
        trainer.update(accelerator="cpu", precision="32-true")
        trainer.pop("strategy")
        trainer["callbacks"] = [c for c in trainer["callbacks"] if not c["class_path"].endswith("FusedAdaLNSurgery")]
        for callback in trainer["callbacks"]:
            if callback["class_path"].endswith("PerBucketCheckpointing"):
                callback["init_args"] = {"block_classes": ["examples.video_dit.model.DiTBlock"]}
            if callback["class_path"].endswith("CostModelCalibration"):
                callback["init_args"].update(batch_sizes=[1, 2, 4, 8], max_tokens=1280, num_seq_lens=3,
                                             max_heldout_error=float("inf"), min_work_correlation=-1.0,
                                             max_memory_heldout_error=float("inf"))
        model.update(TINY_MODEL, compile=None)
        data.update(TINY_DATA)
    return config


def _caches(folder: Path, prefix: str = "") -> tuple[Path, Path]:
    """A run's calibration cache file and compile cache folder in `folder` (names prefixed in --cache-dir)."""
    return folder / f"{prefix}calibration_cache.json", folder / f"{prefix}compile_cache"


def _copy_caches(source: tuple[Path, Path], target: tuple[Path, Path]) -> None:
    """Copy what of `source`'s caches exists over `target`'s (a compile cache folder merged into it)."""
    (calibration, compiled), (to_calibration, to_compiled) = source, target
    if calibration.exists():
        to_calibration.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(calibration, to_calibration)
    if compiled.is_dir():
        shutil.copytree(compiled, to_compiled, dirs_exist_ok=True)


def launch(name: str, args: argparse.Namespace, config: dict | None = None) -> dict:
    """Run `name` (its YAML `config`, default run_config(name, args)) in a fresh process,
    `adaptiveload fit --config <workdir>/<name>/config.yaml`; its exit ("timeout" past
    `args.run_timeout_s`), wall time and output. The calibration cache and the compile cache folder of
    an earlier call are copied in from `args.cache_dir` first and back there after (a run stopped by
    the timeout keeps what it wrote: the points cached before verification, torch's on-disk graphs)."""
    root = Path(args.workdir) / name
    root.mkdir(parents=True, exist_ok=True)
    cache = CACHES_OF.get(name, name)
    ours = _caches(root)
    first = _caches(Path(args.workdir) / cache)  # the first run's own folder, when it ran in this call
    kept = _caches(Path(args.cache_dir), f"{cache}_") if args.cache_dir else None
    if cache != name and first[0].exists():
        _copy_caches(first, ours)
    elif kept is not None:
        _copy_caches(kept, ours)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(run_config(name, args) if config is None else config, sort_keys=False))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    print(f"[{name}] adaptiveload fit --config {path}", flush=True)
    with open(root / "fit.log", "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run([sys.executable, "-m", "lightning_adaptiveload", "fit", "--config", str(path)], cwd=REPO,
                                  env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    text = (root / "fit.log").read_text(encoding="utf-8", errors="replace")
    if kept is not None:
        _copy_caches(ours, kept)
    print(f"[{name}] exit {rc} after {wall:.0f} s", flush=True)
    return {"exit": rc, "wall_s": wall, "out_of_memory": ran_out_of_memory(text), "log_tail": text[-3000:]}


def ran_out_of_memory(log_text: str) -> bool:
    """Whether a run's output shows a CUDA out-of-memory error that reached the user (verification's own,
    caught and re-planned, print no traceback)."""
    return "OutOfMemoryError" in log_text or "CUDA out of memory" in log_text


def summarize_run(log_dir: Path) -> dict:
    """What one run's files say (module docstring)."""
    calibration = json.loads((log_dir / "calibration.json").read_text())
    cols = read_per_rank_csv(log_dir / CSV_NAME)
    samples, seq_len = cols["samples"][:, 0], cols["seq_len"][:, 0]
    step_ms, load, interval = cols["step_time_ms"][:, 0], cols["load"][:, 0], cols["interval_ms"][:, 0]
    tokens = cols["tokens"][:, 0]
    peaks = held_bytes(cols["peak_allocated_bytes"][:, 0], cols["peak_reserved_bytes"][:, 0])
    verification = calibration.get("verification") or {}
    budget = verification.get("budget_bytes")
    over = verification.get("shapes") or []
    # each shape's first step is reported apart: one that verification did not run (bounded by a larger
    # shape, or a partial batch left cold) builds its kernels there, a one-time cost the plan's warm
    # price leaves out; a shape the epoch ran once has no steady time to judge the price by
    first = metrics.first_occurrences(cols["samples"], cols["seq_len"])
    shapes = {}
    for b, s in sorted({(int(b), int(s)) for b, s in zip(samples, seq_len)}):
        at = (samples == b) & (seq_len == s)
        later = at & ~first
        planned = float(np.median(load[at]))
        first_ms = float(step_ms[at & first][0])
        median = float(np.median(step_ms[later])) if later.any() else None
        shapes[f"{b}x{s}"] = {"batch_size": b, "seq_len": s, "steps": int(at.sum()),
                              "verification": _verified_as(over, b, s), "planned_ms": planned,
                              "first_step_ms": first_ms, "first_over_planned": first_ms / planned - 1,
                              "median_step_ms": median,
                              "median_over_planned": None if median is None else median / planned - 1}
    buckets = {}
    for s in sorted({int(v) for v in seq_len}):
        at = seq_len == s
        buckets[str(s)] = {"samples": int(samples[at].sum()), "tokens": float(tokens[at].sum()),
                           "step_s": float(step_ms[at].sum()) / 1e3}
    startup = _time_to_first_step(log_dir)
    over_verified = _peak_over_verified(over, samples, seq_len, cols["peak_allocated_bytes"][:, 0],
                                        cols["peak_reserved_bytes"][:, 0])
    return {
        "calibration_s": calibration["seconds"], "verify_s": calibration["verify_seconds"],
        # the process's first step, inside one of the two (a compiled model's first graphs): absent in older files
        "first_step_s": calibration.get("first_step_seconds"),
        "time_to_first_step_s": startup,
        "setup_and_first_batch_s": None if startup is None else startup - calibration["seconds"] - calibration["verify_seconds"],
        "calibration_source": calibration["source"], "trusted": calibration["trusted"],
        "memory_plan_used": bool((calibration.get("memory_plan") or {}).get("used")),
        "allocator": calibration.get("allocator"),
        "verification": {k: verification.get(k) for k in ("rounds", "converged", "settled", "unresolved", "left_cold")}
        | {"shapes": len(over), "run": sum(m["status"] not in ("bounded", "predicted_oom") for m in over),
           "bounded": sum(m["status"] == "bounded" for m in over),
           "replanned": sum(m["status"] not in ("fits", "bounded") for m in over),
           "out_of_memory": sum(m["status"] == "oom" for m in over),
           "optimizer_state": verification.get("optimizer_state")},
        "steps": int(len(samples)), "samples_trained": int(samples.sum()), "tokens": float(tokens.sum()),
        "epoch_s": float(interval.sum()) / 1e3, "tokens_per_s": float(tokens.sum() / (interval.sum() / 1e3)),
        "first_occurrence_steps": int(first.sum()),
        "first_occurrence_excess_ms": float((step_ms[first] - load[first]).sum()),
        "steady_tokens_per_s": float(tokens[~first].sum() / (interval[~first].sum() / 1e3)) if (~first).any() else None,
        "first_steps_by_verification": _first_steps_by_verification(shapes),
        "budget_bytes": budget,
        "peak_allocated_bytes": float(np.nanmax(cols["peak_allocated_bytes"])) if np.isfinite(peaks).any() else None,
        "peak_reserved_bytes": float(np.nanmax(cols["peak_reserved_bytes"])) if np.isfinite(peaks).any() else None,
        "steps_over_budget": None if budget is None or not np.isfinite(peaks).any() else int((peaks > budget).sum()),
        "step_peak_over_verified": over_verified,
        "shapes": shapes,
        "worst_shape_median_over_planned": max((abs(v["median_over_planned"]) for v in shapes.values()
                                                if v["median_over_planned"] is not None), default=None),
        "buckets": buckets,
    }


def _verified_as(shapes: list[dict], batch_size: int, seq_len: int) -> str:
    """What verification did with a trained (B, S): "run" (some step of it ran there), "bounded" (only
    bounded by a larger shape that ran), "not verified" (absent: e.g. a partial batch left cold)."""
    statuses = {m["status"] for m in shapes if (int(m["batch_size"]), int(m["seq_len"])) == (batch_size, seq_len)}
    if statuses - set(NOT_RUN):
        return "run"
    return "bounded" if "bounded" in statuses else "not verified"


def _first_steps_by_verification(shapes: dict) -> dict:
    """Per `_verified_as` class: how many shapes' first training steps, and their mean and largest
    excess over the plan's price (ms)."""
    out = {}
    for v in shapes.values():
        out.setdefault(v["verification"], []).append(v["first_step_ms"] - v["planned_ms"])
    return {k: {"shapes": len(x), "mean_excess_ms": float(np.mean(x)), "max_excess_ms": float(np.max(x))}
            for k, x in sorted(out.items())}


def _peak_over_verified(shapes: list[dict], samples: np.ndarray, seq_len: np.ndarray, allocated: np.ndarray,
                        reserved: np.ndarray) -> dict | None:
    """Each training step's peak over the peak verification measured for its (B, S) (the last fitting
    measurement of that shape: the one the plan pinned), allocated against allocated and held (max of
    allocated, reserved) against held: the largest ratio - 1 and the steps more than 1% over, per
    quantity. A step's reserved peak includes what the allocator kept cached from earlier, larger
    steps (verification measures each shape from an empty cache), so the held ratio of a small step
    after a large one says nothing about that step. A bounded shape (not run) is held to the peaks of
    the shape that bounds it. None without verified shapes or peaks."""
    verified, ran = {}, {}
    for m in sorted(shapes, key=lambda m: m["round"]):
        if m["status"] == "fits":
            peaks = (m["peak_bytes"], held_bytes(m["peak_bytes"], m.get("reserved_bytes")))
            ran[(int(m["batch_size"]), int(m["seq_len"]), m["checkpointed"])] = peaks
            verified[(int(m["batch_size"]), int(m["seq_len"]))] = peaks
    for m in shapes:
        if m["status"] == "bounded" and (int(m["batch_size"]), int(m["seq_len"])) not in verified:
            b, s, k = m["bound_by"]
            verified[(int(m["batch_size"]), int(m["seq_len"]))] = ran[(int(b), int(s), k)]
    rows = [(verified[(int(b), int(s))], a, held_bytes(a, r)) for b, s, a, r in zip(samples, seq_len, allocated, reserved)
            if (int(b), int(s)) in verified and np.isfinite(a)]
    if not rows:
        return None
    out = {"steps": len(rows)}
    for name, index in (("allocated", 0), ("held", 1)):
        ratios = [peaks[index] / ref[index] - 1 for ref, *peaks in rows]
        out[name] = {"max": float(max(ratios)), "steps_over_1pct": int(sum(r > 0.01 for r in ratios))}
    return out


def logged_metric(metrics_csv: Path, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows of a CSVLogger metrics.csv that logged `name` (empty lists when the
    file is absent)."""
    steps, values = [], []
    if not metrics_csv.exists():
        return steps, values
    with open(metrics_csv, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row.get(name):
                steps.append(int(row["step"]))
                values.append(float(row[name]))
    return steps, values


def _time_to_first_step(log_dir: Path) -> float | None:
    """LoadBalanceMonitor's startup/time_to_first_step_s from the run's metrics.csv (None if absent)."""
    values = logged_metric(log_dir / "metrics.csv", "startup/time_to_first_step_s")[1]
    return values[0] if values else None


def common_sample_speedup(baseline: dict, other: dict) -> dict:
    """Tokens/s of `other` over `baseline` on the samples both train: per bucket S, n = the fewer
    samples the two trained, timed at each run's own tokens/s of that bucket (its tokens over its
    steps' seconds); the baseline's total time over the other's."""
    time_base = time_other = tokens = 0.0
    for s, b in baseline.items():
        o = other.get(s)
        if o is None or not b["samples"] or not o["samples"]:
            continue
        n_tokens = min(b["samples"], o["samples"]) * int(s)
        tokens += n_tokens
        time_base += n_tokens / (b["tokens"] / b["step_s"])
        time_other += n_tokens / (o["tokens"] / o["step_s"])
    return {"tokens": tokens, "baseline_tokens_per_s": tokens / time_base if time_base else math.nan,
            "tokens_per_s": tokens / time_other if time_other else math.nan,
            "speedup": time_base / time_other if time_other else math.nan}


def compare(runs: dict) -> dict:
    """Every run against the baseline, where both ran to the end."""
    base = runs.get("baseline", {}).get("result")
    if base is None:
        return {}
    out = {}
    for name, run in runs.items():
        if name == "baseline" or run.get("result") is None:
            continue
        result = run["result"]
        out[name] = {"epoch_tokens_per_s_ratio": result["tokens_per_s"] / base["tokens_per_s"],
                     "samples_trained": (result["samples_trained"], base["samples_trained"]),
                     "common_samples": common_sample_speedup(base["buckets"], result["buckets"])}
    return out


def table(runs: dict, comparison: dict) -> str:
    lines = [f"{'run':<11} {'exit':>5} {'OOM':>4} {'1st step s':>10} {'calib s':>8} {'verify s':>9} {'replan':>6} {'samples':>8} "
             f"{'epoch s':>8} {'tokens/s':>9} {'peak GiB':>9} {'budget':>7} {'over':>5} {'worst shape':>11} "
             f"{'x base':>7} {'x common':>8}"]
    for name, run in runs.items():
        r = run.get("result")
        if r is None:
            lines.append(f"{name:<11} {str(run['exit']):>5} {str(run['out_of_memory']):>4}  (no result)")
            continue
        peak = max(r["peak_allocated_bytes"] or 0, r["peak_reserved_bytes"] or 0) / 2**30
        budget = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 2**30:.1f}"
        c = comparison.get(name, {})
        first = "-" if r.get("time_to_first_step_s") is None else f"{r['time_to_first_step_s']:.1f}"
        lines.append(f"{name:<11} {str(run['exit']):>5} {str(run['out_of_memory']):>4} {first:>10} {r['calibration_s']:>8.1f} "
                     f"{r['verify_s']:>9.1f} {r['verification']['replanned']:>6} {r['samples_trained']:>8} "
                     f"{r['epoch_s']:>8.1f} {r['tokens_per_s']:>9.0f} {peak:>9.1f} {budget:>7} "
                     f"{str(r['steps_over_budget']):>5} {100 * (r['worst_shape_median_over_planned'] or 0):>10.1f}% "
                     + (f"{c['epoch_tokens_per_s_ratio']:>7.3f} {c['common_samples']['speedup']:>8.3f}" if c else
                        f"{'-':>7} {'-':>8}"))
    return "\n".join(lines)


def plot(runs: dict, path: Path) -> None:
    """Measured median step time against the plan's price per (B, S), and tokens/s per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in runs.items():
        r = run.get("result")
        if r is None:
            continue
        steady = [v for v in r["shapes"].values() if v["median_step_ms"] is not None]
        once = [v for v in r["shapes"].values() if v["median_step_ms"] is None]
        dots = left.scatter([v["planned_ms"] for v in steady], [v["median_step_ms"] for v in steady], label=name, s=18)
        if once:  # shapes the epoch ran once: only a first step, kernel builds included
            left.scatter([v["planned_ms"] for v in once], [v["first_step_ms"] for v in once], s=18,
                         facecolors="none", edgecolors=dots.get_facecolor(), label=f"{name}: ran once (first step)")
    lim = left.get_xlim()
    left.plot(lim, lim, "k--", lw=0.8)
    left.set(xscale="log", yscale="log", xlabel="plan's price (ms)", ylabel="median later training step (ms)",
             title="per (B, S): measured vs planned")
    left.legend()
    names = [n for n, run in runs.items() if run.get("result")]
    right.bar(names, [runs[n]["result"]["tokens_per_s"] for n in names])
    right.set(ylabel="epoch tokens/s", title="one epoch, one GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="baseline,eager,compiled,compiled95")
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--workdir", default="/tmp/shipped_config")
    parser.add_argument("--cache-dir", default=None, help="keep each run's calibration cache here between calls")
    parser.add_argument("--time-budget-s", type=float, default=60.0)
    parser.add_argument("--warmup", type=int, default=None, help="calibration's warm-up steps (default: the config's)")
    parser.add_argument("--repeats", type=int, default=None, help="calibration's timed steps (default: the config's)")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop the epoch early (a short check, not a result)")
    parser.add_argument("--again-max-steps", type=int, default=None,
                        help="steps of a run on another's caches (eager_again, compiled_again): its result is the time "
                             "to the first step, its epoch was measured by the first run (default: --max-steps)")
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--tiny", action="store_true", help="a toy model on the CPU (smoke run)")
    parser.add_argument("--layers", type=int, default=None,
                        help="the model's blocks instead of the config's (a diagnostic run: which graphs compile, why)")
    parser.add_argument("--combine", nargs="+", default=None, help="result files of earlier calls: one table")
    parser.add_argument("--from-logs", nargs="+", default=None, metavar="NAME=DIR",
                        help="summarize runs whose calibration.json and per-rank CSV lie in DIR (e.g. committed logs of "
                             "runs stopped before their end) instead of running them")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.from_logs:
        runs = {}
        for item in args.from_logs:
            name, _, folder = item.partition("=")
            log = Path(folder) / "fit.log"
            runs[name] = {"exit": None, "from_logs": folder, "result": summarize_run(Path(folder)),
                          "out_of_memory": ran_out_of_memory(log.read_text(errors="replace")) if log.exists() else None}
        doc = {**run_meta("shipped_config"), "args": vars(args), "runs": runs, "comparison": compare(runs)}
    elif args.combine:
        parts = [json.loads(Path(p).read_text()) for p in args.combine]
        runs = {name: run for part in parts for name, run in part["runs"].items()}
        doc = {**run_meta("shipped_config", argv), "combined_from": [{"file": p, "command": part["command"], "date": part["date"],
                                                               "git_commit": part["git_commit"]}
                                                              for p, part in zip(args.combine, parts)],
               "args": parts[0]["args"], "runs": runs, "comparison": compare(runs)}
    else:
        runs = {}
        for name in args.runs.split(","):
            run = launch(name, args)
            log_dir = Path(args.workdir) / name / "logs" / "version_0"
            run["result"] = summarize_run(log_dir) if (log_dir / CSV_NAME).exists() and run["exit"] == 0 else None
            runs[name] = run
        doc = {**run_meta("shipped_config", argv), "args": vars(args), "runs": runs, "comparison": compare(runs)}
    print(table(doc["runs"], doc["comparison"]))
    write_result(args.out, doc)
    plot(doc["runs"], Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
