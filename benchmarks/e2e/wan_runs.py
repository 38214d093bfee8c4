"""The three Wan 2.1 1.3B runs of issue 30 on one GPU, as a user runs them, and their comparison.

    python benchmarks/e2e/wan_runs.py --run a --workdir /tmp/wan --cache-dir .wan_cache     # one device call each
    python benchmarks/e2e/wan_runs.py --run b --workdir /tmp/wan --cache-dir .wan_cache
    python benchmarks/e2e/wan_runs.py --run c --workdir /tmp/wan --cache-dir .wan_cache
    python benchmarks/e2e/wan_runs.py --compare wan_a.json wan_b.json wan_c.json --out benchmarks/results/wan_runs_h200.json
    python benchmarks/e2e/wan_runs.py --smoke          # all three on the CPU with the demo's tiny Wan (1-2 min)

On the GPU machine: `WAN_RUN=a bash benchmarks/gpu_session.sh setup wan` (benchmarks/gpu_session.sh).

  a  examples/configs/wan21_1.3b_baseline.yaml: FSDP1, every block checkpointed, eager, no surgery, no memory plan
  b  examples/configs/wan21_1.3b.yaml: FSDP1, everything on (surgery, per-bucket checkpointing, memory plan, compile)
  c  examples/configs/wan21_1.3b_fsdp2.yaml: the same under FSDP2 (ModelParallelStrategy)

Each run is `adaptiveload fit --config <workdir>/<run>/config.yaml` in a fresh process
(benchmarks/e2e/shipped_config.py's launch: the shipped YAML with `--trainer.devices 1`, its files
under the workdir, the same `--samples` synthetic samples of the reference mix, written once per
workdir from seed 0, and the same calibration `time_budget_s`, `warmup`, `repeats`), for the same
`--steps` optimizer steps in every run (max_epochs unbounded: a run whose epoch trains fewer
samples, (a) drops the samples over m_mem and each bucket's partial batch, goes on into its next
epoch), the loss logged every step. `--run` writes <workdir>/wan_<run>.json: the exit, wall time
and whether the output shows an out-of-memory error; shipped_config's summary of the log folder
(calibration and verification, tokens/s over all steps, per-bucket tokens and seconds, peak
memory); epoch 0's tokens/s where epoch 0 ended within the steps; how many of the model's
WanTransformerBlocks the surgery fused (fused_adaln_surgery.json); each step's loss (metrics.csv)
and batch (samples, S). The run's fit.log, config.yaml, metrics.csv, calibration.json and per-rank
CSV stay in <workdir>/<run>/.

A 30-block calibration takes about 5 minutes on an H200: a run stopped by `--run-timeout-s` after
it keeps its calibration cache in `--cache-dir` (<run>_calibration_cache.json), and a second call
with the same cache dir reuses it (measurements and verification) and trains; the per-run JSON of a
stopped run has `complete` false and what its logs hold so far.

`--smoke` runs a, b, c with smoke_config (wan21_demo.yaml's tiny model and data on the CPU; FSDP1
needs a GPU in Lightning, so (a) and (b) run without a strategy there) and compares them: a check
of the tooling, not a measurement.

`--compare` reads the three per-run JSONs and writes the result (run_meta header) and a PNG of the
loss curves beside it: per run tokens/s on the samples every run trains (shipped_config's
common_sample_speedup per bucket S), over all steps and over epoch 0, peak memory, out-of-memory,
the surgery's coverage; b over a (target >= 1.35) and c over b (target within 3%) on the common
samples, and the loss curves' agreement over the common steps.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, run_meta, write_result  # noqa: E402
from benchmarks.e2e.shipped_config import (as_benchmark_run, common_sample_speedup, launch,  # noqa: E402
                                           logged_metric, summarize_run)
from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, read_per_rank_csv  # noqa: E402
from lightning_adaptiveload.scheduling import metrics  # noqa: E402

CONFIGS = REPO / "examples" / "configs"
RUNS = {"a": "wan21_1.3b_baseline.yaml", "b": "wan21_1.3b.yaml", "c": "wan21_1.3b_fsdp2.yaml"}
SMOKE_CONFIG = CONFIGS / "wan21_demo.yaml"  # the tiny Wan, its data and calibration grid for --smoke
SPEEDUP_TARGET = 1.35  # b over a, tokens/s on the common samples (issue 30)
FSDP2_TOLERANCE = 0.03  # |c / b - 1|
LOSS_WINDOW = 5  # steps in the moving average the loss agreement compares (one step's batch is one shape)


def run_config(name: str, args: argparse.Namespace) -> dict:
    """The YAML of run `name`: its shipped config as shipped_config runs it, for `args.steps` steps
    logged every step; with `args.smoke` shrunk to the CPU demo (smoke_config)."""
    config = as_benchmark_run(yaml.safe_load((CONFIGS / RUNS[name]).read_text()), name, args)
    config["trainer"].update(max_epochs=-1, max_steps=args.steps, log_every_n_steps=1)
    return smoke_config(config) if args.smoke else config


def smoke_config(config: dict) -> dict:
    """`config` on the CPU at wan21_demo.yaml's size: its tiny transformer, recipe and data shapes,
    a smaller calibration grid up to its max_tokens (every fit trusted: CPU timings on a shared
    machine are noise), eager, fp32; the run's callbacks, policy, memory planning and drop_last are kept, and FSDP2. Lightning
    runs FSDP1 on GPUs only: (a) and (b) run without a strategy on the CPU, PerBucketCheckpointing
    given the blocks the strategy's checkpointing policy named, and (a) checkpoints no block."""
    demo = yaml.safe_load(SMOKE_CONFIG.read_text())
    trainer = config["trainer"]
    trainer.update(accelerator="cpu", precision="32-true")
    if trainer["strategy"]["class_path"].endswith("FSDPStrategy"):
        blocks = trainer.pop("strategy")["init_args"]["activation_checkpointing_policy"]
        for callback in trainer["callbacks"]:
            if callback["class_path"].endswith("PerBucketCheckpointing"):
                callback["init_args"] = {"block_classes": blocks}
    demo_calibration = next(c["init_args"] for c in demo["trainer"]["callbacks"]
                            if c["class_path"].endswith("CostModelCalibration"))
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("CostModelCalibration"):
            callback["init_args"].update(num_seq_lens=3, batch_sizes=[1, 2, 4, 8], max_tokens=demo_calibration["max_tokens"],
                                         max_heldout_error=float("inf"), min_work_correlation=-1.0,
                                         max_memory_heldout_error=float("inf"))
    config["model"]["init_args"].update(demo["model"]["init_args"], compile=None)
    if "fsdp2_param_dtype" in config["model"]["init_args"]:  # bf16 compute is slow on CPUs
        config["model"]["init_args"]["fsdp2_param_dtype"] = "float32"
    demo_data = demo["data"]["init_args"]
    config["data"]["init_args"].update({k: demo_data[k] for k in ("m_mem", "latent_channels", "text_len", "text_dim",
                                                                   "num_workers", "synthesize_shapes")})
    return config


def fused_blocks(config: dict, log_dir: Path) -> dict:
    """How many of the model's WanTransformerBlocks the surgery fused: `blocks` (the config's
    num_layers), `fused` (fused_adaln_surgery.json's replaced blocks; 0 without the surgery),
    `every_block`."""
    from examples.wan.module import WAN21_T2V_1_3B
    from lightning_adaptiveload.surgery.wan import WAN_BLOCK

    blocks = int({**WAN21_T2V_1_3B, **(config["model"]["init_args"].get("transformer_config") or {})}["num_layers"])
    report = log_dir / "fused_adaln_surgery.json"
    fused = len(json.loads(report.read_text())["replaced"].get(WAN_BLOCK.name, [])) if report.exists() else 0
    return {"blocks": blocks, "fused": fused, "every_block": fused == blocks, "report": report.exists()}


def read_losses(metrics_csv: Path) -> dict:
    """train/loss per logged step of a CSVLogger metrics.csv: {"step": [...], "loss": [...]}."""
    steps, losses = logged_metric(metrics_csv, "train/loss")
    return {"step": steps, "loss": losses}


def epoch0(cols: dict[str, np.ndarray]) -> dict:
    """Epoch 0's steps, samples and tokens/s (metrics.measured_throughput: tokens over the summed
    intervals), where the run went past it (else `complete` false and no tokens/s)."""
    at = cols["epoch"][:, 0] == 0
    complete = bool((cols["epoch"][:, 0] > 0).any())
    return {"complete": complete, "steps": int(at.sum()), "samples": int(cols["samples"][at, 0].sum()),
            "tokens_per_s": metrics.measured_throughput(cols["tokens"][at], cols["interval_ms"][at]) if complete else None}


def run_one(name: str, args: argparse.Namespace) -> dict:
    """Launch run `name` and collect what its files say (module docstring); written to
    <workdir>/wan_<name>.json."""
    config = run_config(name, args)
    log_dir = Path(args.workdir) / name / "logs" / "version_0"
    # an earlier attempt's files (CSVLogger appends to metrics.csv); its calibration cache lies outside
    shutil.rmtree(log_dir, ignore_errors=True)
    run = launch(name, args, config)
    doc = {**run_meta("wan_runs"), "run": name, "config": RUNS[name], "smoke": args.smoke, "args": vars(args), **run,
           "complete": run["exit"] == 0, "log_dir": str(log_dir), "result": None, "epoch0": None, "batches": None,
           "surgery": fused_blocks(config, log_dir),
           "losses": read_losses(log_dir / "metrics.csv") if (log_dir / "metrics.csv").exists() else None}
    if (log_dir / CSV_NAME).exists() and (log_dir / "calibration.json").exists():
        # a run stopped early still reports what it trained (complete: false), unless the kill cut a file short
        try:
            doc["result"] = summarize_run(log_dir)
            cols = read_per_rank_csv(log_dir / CSV_NAME)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            doc["summary_error"] = f"{type(e).__name__}: {e}"
        else:
            doc["epoch0"] = epoch0(cols)
            doc["batches"] = {"samples": cols["samples"][:, 0].astype(int).tolist(),
                              "seq_len": cols["seq_len"][:, 0].astype(int).tolist()}
    write_result(Path(args.workdir) / f"wan_{name}.json", doc)
    return doc


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over `window` values (fewer at the start): (n,) -> (n,)."""
    cumulative = np.concatenate([[0.0], np.cumsum(values)])
    i = np.arange(1, len(values) + 1)
    lo = np.maximum(i - window, 0)
    return (cumulative[i] - cumulative[lo]) / (i - lo)


def loss_agreement(first: dict, second: dict) -> dict:
    """Two runs' losses over the steps both logged: the largest relative difference of their
    LOSS_WINDOW-step moving averages (over all common steps and the second half), the mean loss of
    each over the second half, and, where both trained the same batch at every step (same samples
    and S), the largest per-step relative difference."""
    a = dict(zip(first["losses"]["step"], first["losses"]["loss"]))
    b = dict(zip(second["losses"]["step"], second["losses"]["loss"]))
    steps = sorted(set(a) & set(b))
    if not steps:
        return {"steps": 0}
    la, lb = np.array([a[s] for s in steps]), np.array([b[s] for s in steps])
    sa, sb = moving_average(la, LOSS_WINDOW), moving_average(lb, LOSS_WINDOW)
    rel = np.abs(sb - sa) / np.abs(sa)
    late = slice(len(steps) // 2, None)
    out = {"steps": len(steps), "smoothed_max_rel_diff": float(rel.max()),
           "smoothed_max_rel_diff_second_half": float(rel[late].max()),
           "mean_loss_second_half": [float(la[late].mean()), float(lb[late].mean())]}
    same = first.get("batches") is not None and first.get("batches") == second.get("batches")
    out["same_batches"] = bool(same)
    if same:
        out["per_step_max_rel_diff"] = float((np.abs(lb - la) / np.abs(la)).max())
    return out


def summary(run: dict) -> dict:
    """One run's line of the comparison."""
    r = run.get("result")
    peak = None
    if r and (r["peak_allocated_bytes"] is not None or r["peak_reserved_bytes"] is not None):
        peak = max(r["peak_allocated_bytes"] or 0, r["peak_reserved_bytes"] or 0) / 2**30
    return {"config": run["config"], "exit": run["exit"], "complete": run["complete"], "wall_s": run["wall_s"],
            "out_of_memory": run["out_of_memory"],
            "verification_out_of_memory": None if r is None else r["verification"]["out_of_memory"],
            "calibration_source": None if r is None else r["calibration_source"],
            "steps": None if r is None else r["steps"], "samples_trained": None if r is None else r["samples_trained"],
            "tokens_per_s_all_steps": None if r is None else r["tokens_per_s"],
            "steady_tokens_per_s": None if r is None else r["steady_tokens_per_s"],
            "epoch0": run.get("epoch0"), "peak_memory_gib": peak, "surgery": run["surgery"]}


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def compare(runs: dict[str, dict]) -> dict:
    """The comparison of runs a, b, c (per-run JSONs): module docstring."""
    missing = sorted(set(RUNS) - set(runs))
    if missing:
        raise ValueError(f"--compare needs the per-run JSONs of runs a, b and c; missing: {', '.join(missing)}")
    lines = {name: summary(run) for name, run in runs.items()}
    out = {"runs": lines, "out_of_memory_runs": sum(bool(v["out_of_memory"]) for v in lines.values())}
    results = {name: run.get("result") for name, run in runs.items()}
    for label, base, other in (("b_over_a", "a", "b"), ("c_over_b", "b", "c")):
        if results[base] is None or results[other] is None:
            out[label] = None
            continue
        common = common_sample_speedup(results[base]["buckets"], results[other]["buckets"])
        e0 = [lines[n]["epoch0"]["tokens_per_s"] if lines[n]["epoch0"] else None for n in (other, base)]
        out[label] = {"common_samples": common,
                      "tokens_per_s_all_steps": ratio(lines[other]["tokens_per_s_all_steps"],
                                                      lines[base]["tokens_per_s_all_steps"]),
                      "epoch0_tokens_per_s": ratio(*e0),
                      "peak_memory": ratio(lines[other]["peak_memory_gib"], lines[base]["peak_memory_gib"]),
                      "loss": loss_agreement(runs[base], runs[other]) if runs[base].get("losses") and runs[other].get("losses")
                      else None}
    b_a, c_b = out["b_over_a"], out["c_over_b"]
    speedup = None if b_a is None else b_a["common_samples"]["speedup"]
    fsdp2 = None if c_b is None else c_b["common_samples"]["speedup"]
    out["targets"] = {
        "b_over_a_common_samples": speedup, "b_over_a_met": None if speedup is None else bool(speedup >= SPEEDUP_TARGET),
        "c_over_b_common_samples": fsdp2,
        "c_within_3pct_of_b": None if fsdp2 is None or math.isnan(fsdp2) else bool(abs(fsdp2 - 1) <= FSDP2_TOLERANCE),
        "no_out_of_memory": out["out_of_memory_runs"] == 0,
        "surgery_fused_every_block_b_c": all(lines[n]["surgery"]["every_block"] for n in ("b", "c")),
        "all_complete": all(v["complete"] for v in lines.values()),
    }
    return out


def table(comparison: dict) -> str:
    lines = [f"{'run':<4} {'exit':>7} {'OOM':>5} {'calib':>8} {'steps':>5} {'samples':>7} {'tokens/s':>9} {'epoch0 t/s':>10} "
             f"{'peak GiB':>8} {'fused':>7}"]
    for name, v in comparison["runs"].items():
        e0 = (v["epoch0"] or {}).get("tokens_per_s")
        cells = [f"{name:<4}", f"{str(v['exit']):>7}", f"{str(v['out_of_memory']):>5}", f"{str(v['calibration_source']):>8}",
                 f"{str(v['steps']):>5}", f"{str(v['samples_trained']):>7}",
                 f"{v['tokens_per_s_all_steps'] or float('nan'):>9.0f}", f"{e0 or float('nan'):>10.0f}",
                 f"{v['peak_memory_gib'] or float('nan'):>8.1f}", f"{v['surgery']['fused']:>3}/{v['surgery']['blocks']:<3}"]
        lines.append(" ".join(cells))
    t = comparison["targets"]
    lines.append(f"b/a on common samples {t['b_over_a_common_samples']} (target >= {SPEEDUP_TARGET}: {t['b_over_a_met']}); "
                 f"c/b {t['c_over_b_common_samples']} (within {FSDP2_TOLERANCE:.0%}: {t['c_within_3pct_of_b']})")
    return "\n".join(lines)


def plot_losses(runs: dict[str, dict], path: Path) -> None:
    """Each run's loss per step (thin) and its LOSS_WINDOW-step moving average (thick), over the
    steps every run logged."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logged = {n: r["losses"] for n, r in runs.items() if r.get("losses") and r["losses"]["step"]}
    common = sorted(set.intersection(*(set(v["step"]) for v in logged.values()))) if logged else []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, losses in sorted(logged.items()):
        by_step = dict(zip(losses["step"], losses["loss"]))
        y = np.array([by_step[s] for s in common])
        line, = ax.plot(common, y, lw=0.7, alpha=0.4)
        ax.plot(common, moving_average(y, LOSS_WINDOW), lw=2, color=line.get_color(),
                label=f"({name}) {runs[name]['config']}")
    model = "the demo's tiny Wan on the CPU (smoke)" if any(r.get("smoke") for r in runs.values()) else "Wan 2.1 1.3B"
    ax.set(xlabel="optimizer step", ylabel="train/loss (flow matching MSE)",
           title=f"{model}, same data and recipe: loss per step, {LOSS_WINDOW}-step mean")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_comparison(paths: list[str], out: str, argv: list[str] | None) -> dict:
    """Read the per-run JSONs at `paths`, write the comparison to `out` and its loss PNG beside it."""
    runs, runs_from = {}, []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if doc.get("benchmark") != "wan_runs" or doc.get("run") not in RUNS:
            raise ValueError(f"{p}: not a per-run JSON of wan_runs.py --run (benchmark {doc.get('benchmark')!r}, "
                             f"run {doc.get('run')!r})")
        if doc["run"] in runs:
            raise ValueError(f"{p}: run {doc['run']!r} given twice")
        runs[doc["run"]] = doc
        runs_from.append({"file": p, **{k: doc[k] for k in ("run", "command", "date", "git_commit", "device")}})
    comparison = compare(runs)
    result = {**run_meta("wan_runs", argv), "runs_from": runs_from, **comparison,
              "losses": {n: r.get("losses") for n, r in sorted(runs.items())}}
    print(table(comparison))
    write_result(out, result)
    plot_losses(runs, Path(out).with_suffix(".png"))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--run", choices=sorted(RUNS), help="run one configuration (one device call)")
    mode.add_argument("--compare", nargs="+", metavar="WAN_RUN_JSON", help="the per-run JSONs of a, b and c")
    mode.add_argument("--smoke", action="store_true", help="a, b, c on the CPU with the demo's tiny Wan, then --compare")
    parser.add_argument("--samples", type=int, default=None, help="synthetic samples (default 80; smoke 40)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of every run (default 40; smoke 8)")
    parser.add_argument("--workdir", default=None, help="default /tmp/wan_runs (smoke: /tmp/wan_runs_smoke)")
    parser.add_argument("--cache-dir", default=None, help="keep each run's calibration cache here between calls")
    parser.add_argument("--time-budget-s", type=float, default=None, help="calibration's (default 60 s; smoke 15 s)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--run-timeout-s", type=float, default=480.0,
                        help="stop the fit after this long (its calibration cache is kept): under a 540 s stage")
    parser.add_argument("--out", default=None, help="--compare/--smoke: the comparison JSON "
                                                    "(default benchmarks/results/wan_runs_h200.json; smoke: in the workdir)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (8 if args.smoke else 40)
    args.samples = args.samples or (40 if args.smoke else 80)
    args.time_budget_s = args.time_budget_s or (15.0 if args.smoke else 60.0)
    args.workdir = args.workdir or ("/tmp/wan_runs_smoke" if args.smoke else "/tmp/wan_runs")
    args.log_every = 1
    args.max_steps = args.steps
    if args.compare:
        write_comparison(args.compare, args.out or str(REPO / "benchmarks" / "results" / "wan_runs_h200.json"), argv)
    elif args.run:
        doc = run_one(args.run, args)
        print(f"[{args.run}] exit {doc['exit']}, complete {doc['complete']}, surgery {doc['surgery']}")
    else:
        for name in RUNS:
            run_one(name, args)
        write_comparison([str(Path(args.workdir) / f"wan_{n}.json") for n in RUNS],
                         args.out or str(Path(args.workdir) / "wan_runs_smoke.json"), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
