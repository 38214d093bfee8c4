"""End to end under Lightning FSDP: token_equal vs dual_constraint vs balanced (+ fused AdaLN).

One configuration per process (Lightning's launcher re-runs this script for every rank):

    python benchmarks/e2e/e2e.py run --config balanced --workdir runs/e2e [--layers 8] [--samples 400] [--devices 2]
    python benchmarks/e2e/e2e.py report --workdir runs/e2e --out benchmarks/results/e2e/e2e_2xh200.json

`run` trains the example Wan-2.1-1.3B-shaped DiT (D=1536, 12 heads, FFN 8960, text 512x4096;
`--layers` of its 30 blocks, to fit the benchmark budget) for one epoch over the same synthetic
shards (drawn from the shipped reference mix, same seed for every configuration) with
`Trainer(strategy=FSDP, precision="bf16-mixed", devices=--devices)`, CostModelCalibration
(measured once, cached and reused by the unfused configurations) and LoadBalanceMonitor, and
writes `<workdir>/<config>.json`. `dual_constraint` first compares its epoch plan with
token_equal's under token_equal's calibrated cost model: when they are the same batches in the
same order it records that and does not train. `balanced_fused` schedules with the cost model the
`balanced` run fitted (run that first): the same batches, so the difference is the fused AdaLN
kernel (and a second calibration, which the patched blocks would otherwise need, stays out of the
time budget).
`report` reads those files and each run's `balance_per_rank.csv` (the monitor's per-rank rows; the
metrics follow docs/monitoring.md, over the batches after the first WARMUP_STEPS), simulates the
same policies at the run's rank count and at 8/16/64 ranks with the calibrated cost model, prints
a table, and writes the JSON and a PNG. Throughput is tokens of all ranks per second of epoch wall
time (the paper's measure; policies drop different samples, so samples/s is a poorer comparison).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import FSDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, run_meta, write_result  # noqa: E402
from examples.video_dit.model import DiTBlock  # noqa: E402
from examples.video_dit.module import VideoDiTModule  # noqa: E402
from lightning_adaptiveload.callbacks import CostModelCalibration, FusedAdaLNSurgery, LoadBalanceMonitor  # noqa: E402
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, read_per_rank_csv  # noqa: E402
from lightning_adaptiveload.scheduling import metrics  # noqa: E402
from lightning_adaptiveload.scheduling.cost_model import CostModel  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl  # noqa: E402
from lightning_adaptiveload.scheduling.simulate import simulate  # noqa: E402

CONFIGS = {  # name -> (policy, fused AdaLN surgery)
    "token_equal": ("token_equal", False),
    "dual_constraint": ("dual_constraint", False),
    "balanced": ("balanced", False),
    "balanced_fused": ("balanced", True),
}
# Model and data per scale. "h200": Wan-2.1-1.3B-shaped blocks on the reference mix (the benchmark);
# "cpu": a tiny model on tiny latents under 2-process DDP, to check this script without a GPU.
SCALES = {
    "h200": dict(m_mem=65536, latent_channels=16, text_len=512, text_dim=4096, latent_scale=1.0, dim=1536,
                 heads=12, ffn=8960, freq_dim=256, batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256]),
    "cpu": dict(m_mem=640, latent_channels=4, text_len=8, text_dim=32, latent_scale=0.125, dim=64,
                heads=4, ffn=128, freq_dim=64, batch_sizes=[1, 2, 4, 8, 16]),
}
SAME_BATCHES = {"balanced_fused": "balanced"}  # configuration -> one that trains the same batches
WARMUP_STEPS = 5  # train batches left out of the per-step metrics
LOSS_WINDOW = 64  # samples in the moving average of the loss curves (fewer for short runs)
SEQ_LEN_EDGES = (10_000, 30_000)  # tokens per sample: bands of unpredicted_by_seq_len


class RunRecorder(Callback):
    """Records what the monitor does not: epoch wall time, rank 0's loss and samples per step,
    peak memory per rank."""

    def __init__(self):
        self.losses, self.samples = [], []

    def on_train_epoch_start(self, trainer, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # "loss" is rescaled by this rank's share of the step's samples; the curves compare the
        # unscaled mean loss of the batch.
        self.losses.append(float(outputs["local_loss"]))
        self.samples.append(int(batch["latents"].shape[0]))

    def on_train_epoch_end(self, trainer, pl_module):
        cuda = pl_module.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        self.epoch_s = time.perf_counter() - self._t0
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")],
                            device=pl_module.device)
        self.peak_gib = trainer.strategy.all_gather(peak).reshape(-1).tolist()  # every rank calls it


def make_datamodule(args: argparse.Namespace, work: Path, policy: str, cost_model: str | None
                    ) -> AdaptiveLoadDataModule:
    """The benchmark's data: the same synthetic shards (written on first use) for every policy."""
    sc = SCALES[args.scale]
    return AdaptiveLoadDataModule(
        shards=str(work / "shards"), index=str(work / "index.jsonl"), policy=policy, m_mem=sc["m_mem"],
        latent_channels=sc["latent_channels"], text_len=sc["text_len"], text_dim=sc["text_dim"],
        num_workers=6 if args.scale == "h200" else 0, seed=0, synthesize=args.samples,
        synthesize_latent_scale=sc["latent_scale"], cost_model=cost_model)


def same_plan_as_token_equal(args: argparse.Namespace, work: Path) -> bool:
    """Whether dual_constraint's epoch plan (every batch, its samples and its rank and step) equals
    token_equal's under the cost model token_equal calibrated (the cache dual_constraint would
    reuse). False when token_equal has not run. With the documented M_comp rule the compute cap
    only bites through the rounding of m_mem // S_ref (CostModel.m_comp), so on the reference mix
    at m_mem = 65,536 the two plans are the same (docs/scheduling.md)."""
    cost_model = work / "token_equal" / "version_0" / "calibration_cost_model.json"
    if not cost_model.is_file():
        return False
    plans = []
    for policy in ("token_equal", "dual_constraint"):
        datamodule = make_datamodule(args, work, policy, str(cost_model))
        datamodule.setup("fit")
        plans.append(datamodule.build_sampler(num_replicas=args.devices, rank=0).plan())
    return all(np.array_equal(getattr(plans[0], f), getattr(plans[1], f))
               for f in ("order", "batch_start", "batch_len", "batch_seq_len", "steps"))


def run(args: argparse.Namespace) -> None:
    policy, fused = CONFIGS[args.config]
    sc = SCALES[args.scale]
    gpu = args.scale == "h200"
    work = Path(args.workdir)
    balanced_log_dir = work / "balanced" / "version_0"
    if fused and not (balanced_log_dir / "calibration_cost_model.json").is_file():
        raise SystemExit(f"e2e: {args.config} schedules with the balanced run's cost model; run --config balanced "
                         f"first (no {balanced_log_dir / 'calibration_cost_model.json'})")
    if policy == "dual_constraint" and same_plan_as_token_equal(args, work):
        # Identical batches in identical order: a second run would only measure run-to-run noise.
        write_result(work / f"{args.config}.json", {
            **run_meta("e2e run"), "config": args.config, "policy": policy, "same_plan_as": "token_equal"},
            announce=False)
        print(f"e2e {args.config}: same epoch plan as token_equal under its calibrated cost model; not re-run")
        return
    L.seed_everything(0)
    datamodule = make_datamodule(args, work, policy, None)
    model = VideoDiTModule(in_channels=sc["latent_channels"], dim=sc["dim"], num_layers=args.layers,
                           num_heads=sc["heads"], ffn_dim=sc["ffn"], text_dim=sc["text_dim"],
                           freq_dim=sc["freq_dim"], lr=1e-4, weight_decay=0.01)
    # Every configuration warms its scheduled shapes the same way; the fused one schedules with the
    # balanced run's cost model as given (the same batches: the difference is the kernel).
    calibration = CostModelCalibration(num_seq_lens=5, batch_sizes=sc["batch_sizes"], max_tokens=sc["m_mem"],
                                       warmup=1, repeats=3, time_budget_s=90, m_mem=sc["m_mem"],
                                       cache_path=str(work / "calibration_cache.json"),
                                       cost_model_path=str(balanced_log_dir / "calibration_cost_model.json")
                                       if fused else None)
    monitor = LoadBalanceMonitor(window=20)
    recorder = RunRecorder()
    surgery = [FusedAdaLNSurgery(extra_patterns=["examples.video_dit.surgery.VIDEO_DIT_PATTERNS"],
                                 require_replacement=True)] if fused else []
    callbacks = [*surgery, calibration, monitor, recorder]
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu", devices=args.devices,
        strategy=FSDPStrategy(auto_wrap_policy={DiTBlock}) if gpu else "ddp",
        precision="bf16-mixed" if gpu else "32-true", max_epochs=1, use_distributed_sampler=False, log_every_n_steps=5,
        enable_checkpointing=False, enable_progress_bar=False, callbacks=callbacks,
        logger=CSVLogger(str(work), name=args.config, version=0))
    fit_t0 = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_s = time.perf_counter() - fit_t0
    if trainer.global_rank != 0:
        return
    result = {
        **run_meta("e2e run"),
        "config": args.config, "policy": policy, "fused_adaln": fused, "layers": args.layers, "devices": args.devices,
        "scale": args.scale, "m_mem": sc["m_mem"], "samples_in_shards": args.samples,
        "epoch_wall_s": recorder.epoch_s, "fit_wall_s": fit_s, "peak_mem_gib_per_rank": recorder.peak_gib,
        "calibration": json.loads((Path(trainer.logger.log_dir) / "calibration.json").read_text()),
        "monitor_summary": monitor.summary,
        "losses_rank0": recorder.losses, "samples_rank0": recorder.samples,
        "log_dir": trainer.logger.log_dir,
        "gpus": torch.cuda.device_count(),
    }
    write_result(work / f"{args.config}.json", result, announce=False)
    print(f"e2e {args.config}: epoch {recorder.epoch_s:.1f} s")


def summarize_run(res: dict) -> dict:
    """One configuration's numbers from its result JSON and the monitor's per-rank CSV: totals over
    every train batch; balance metrics (scheduling/metrics.py, as docs/monitoring.md defines them:
    per-batch CVs and max/mean averaged over batches, the bubble time-weighted) over the batches
    after the first WARMUP_STEPS."""
    cols = read_per_rank_csv(Path(res["log_dir"]) / CSV_NAME)  # each (batches, world)
    batches = cols["load"].shape[0]
    if batches <= WARMUP_STEPS:
        raise SystemExit(f"e2e report: {res['config']} trained {batches} batches, not more than the "
                         f"{WARMUP_STEPS} warm-up batches; run with more --samples")
    keep = slice(WARMUP_STEPS, None)
    load, step_ms, busy = cols["load"][keep], cols["step_time_ms"][keep], metrics.finite_steps(cols["busy_ms"][keep])
    slowest_s = metrics.step_time(step_ms) / 1e3
    tokens, samples = float(cols["tokens"].sum()), float(cols["samples"].sum())
    # First occurrences of a (B, S) on some rank, reported apart from the steady state (the rest).
    first = metrics.first_occurrences(cols["samples"], cols["seq_len"])
    steady = ~first
    beyond = metrics.time_beyond_prediction_ms(cols["load"], cols["step_time_ms"])
    steady_s = float(metrics.step_time(cols["step_time_ms"][steady]).sum()) / 1e3
    return {
        "config": res["config"],
        "epoch_wall_s": res["epoch_wall_s"],
        "samples_consumed": int(samples),
        "tokens_consumed": int(tokens),
        "tokens_per_s_epoch": tokens / res["epoch_wall_s"],
        "samples_per_s_epoch": samples / res["epoch_wall_s"],
        "tokens_per_s_step_median": float(np.median(cols["tokens"][keep].sum(axis=1) / slowest_s)),
        "load_cv": metrics.mean_over_steps(metrics.cv_across_ranks(load)),
        "load_max_over_mean": metrics.mean_over_steps(metrics.max_over_mean(load)),
        "bubble_frac": metrics.bubble_fraction(load),
        "step_time_cv_ranks": metrics.mean_over_steps(metrics.cv_across_ranks(step_ms)),
        "step_time_cv_temporal": metrics.step_time_cv_temporal(step_ms),
        # Busy time of the profiled batches (NaN when none was profiled): docs/monitoring.md.
        "busy_cv": metrics.mean_over_steps(metrics.cv_across_ranks(busy)) if len(busy) else float("nan"),
        "busy_max_over_mean": metrics.mean_over_steps(metrics.max_over_mean(busy)) if len(busy) else float("nan"),
        "busy_steps": int(len(busy)),
        "peak_mem_gib_max": max(res["peak_mem_gib_per_rank"]),
        "longest_seq_trained": int(cols["seq_len"].max()),
        # The calibrated model's time for these exact batches (a step lasts as long as its slowest
        # rank) against the measured step times: what per-step costs the model leaves out.
        "predicted_step_sum_s": float(metrics.step_time(cols["load"]).sum() / 1e3),
        "measured_step_sum_s": float(metrics.rank_mean(cols["step_time_ms"]).sum() / 1e3),
        "unpredicted_ms_per_step": metrics.mean_over_steps(
            metrics.time_beyond_prediction_ms(cols["load"], cols["step_time_ms"])),
        "unpredicted_by_seq_len": unpredicted_by_seq_len(cols),
        # Outside the step (data loading, host work between batches): the slowest rank's, per batch.
        "between_steps_ms": float((cols["interval_ms"][keep] - cols["step_time_ms"][keep]).max(axis=1).mean()),
        "steps": batches,
        "first_occurrence_steps": int(first.sum()),
        "tokens_per_s_steady": float(cols["tokens"][steady].sum()) / steady_s if steady_s > 0 else float("nan"),
        "predicted_tokens_per_s_steady": metrics.predicted_throughput(cols["tokens"][steady], cols["load"][steady]),
        "predicted_tokens_per_s_epoch": metrics.predicted_throughput(cols["tokens"], cols["load"]),
        "unpredicted_ms_first_occurrences": float(beyond[first].mean()) if first.any() else float("nan"),
        "unpredicted_ms_steady": float(beyond[steady].mean()) if steady.any() else float("nan"),
        "calibration_s": res["calibration"]["seconds"],
        # runs before the shape warm-up existed recorded from_cache instead of source
        "calibration_source": res["calibration"].get("source")
        or ("cache" if res["calibration"].get("from_cache") else "measured"),
        # before verification (calibration.json version 4) the shapes ran once, as "warmed_shapes"
        "warmup_s": res["calibration"].get("verify_seconds", res["calibration"].get("warmup_seconds", 0.0)),
        "warmed_shapes": sum(m["status"] == "fits" for m in (res["calibration"].get("verification") or {}).get("shapes", []))
        + sum(w["status"] == "warmed" for w in res["calibration"].get("warmed_shapes", [])),
    }


def unpredicted_by_seq_len(cols: dict[str, np.ndarray], edges: tuple[int, ...] = SEQ_LEN_EDGES) -> list[dict]:
    """Where the cost model errs: the step time beyond it (time_beyond_prediction_ms, every batch)
    by the step's sample length (the ranks' mean seq_len, tokens), in bands split at `edges`. Per
    band with steps: their count, samples per rank, ms per step beyond the model, that as a
    fraction of the predicted step (the slowest rank's load), and how differently the ranks'
    batches were shaped ((max - min) / max of seq_len over the ranks)."""
    beyond = metrics.time_beyond_prediction_ms(cols["load"], cols["step_time_ms"])
    predicted = metrics.step_time(cols["load"])
    seq = cols["seq_len"].astype(np.float64)
    spread = (seq.max(axis=1) - seq.min(axis=1)) / seq.max(axis=1)
    band = np.searchsorted(np.asarray(edges), seq.mean(axis=1), side="right")
    bounds = [0, *edges, None]
    rows = []
    for i in range(len(edges) + 1):
        steps = band == i
        if steps.any():
            rows.append({"seq_len_from": bounds[i], "seq_len_to": bounds[i + 1], "steps": int(steps.sum()),
                         "samples_per_rank": float(cols["samples"][steps].mean()),
                         "unpredicted_ms_per_step": float(beyond[steps].mean()),
                         "unpredicted_frac_of_predicted": float((beyond[steps] / predicted[steps]).mean()),
                         "rank_seq_len_spread": float(spread[steps].mean())})
    return rows


def smoothed_loss_vs_samples(res: dict, grid: np.ndarray, window: int) -> np.ndarray:
    """Rank 0's loss, per-sample weighted moving average over `window` samples, at `grid` samples
    seen (grid values >= window)."""
    per_sample = np.repeat(res["losses_rank0"], res["samples_rank0"])
    if window > per_sample.size:
        raise ValueError(f"loss window {window} is longer than the {per_sample.size} samples of {res['config']}")
    smooth = np.convolve(per_sample, np.ones(window) / window, mode="valid")
    return np.interp(grid, np.arange(smooth.size) + window, smooth)


def loss_grid(runs: dict) -> tuple[np.ndarray, int]:
    """20 points of samples seen by rank 0, up to the shortest run, and the smoothing window."""
    n = min(sum(r["samples_rank0"]) for r in runs.values())
    window = max(1, min(LOSS_WINDOW, n // 4))
    return np.linspace(window, n, 20), window


def report(args: argparse.Namespace) -> None:
    work = Path(args.workdir)
    found = {name: json.loads((work / f"{name}.json").read_text()) for name in CONFIGS if (work / f"{name}.json").exists()}
    if "token_equal" not in found:
        raise SystemExit(f"e2e report: no {work / 'token_equal.json'} (the baseline); found {sorted(found)}")
    # A configuration with the same epoch plan as a measured one was not re-run: its row repeats
    # that run's numbers, marked, and it is left out of the loss and balance curves.
    runs = {name: r for name, r in found.items() if "same_plan_as" not in r}
    rows = [summarize_run(r) for r in runs.values()]
    for name, r in found.items():
        if "same_plan_as" in r:
            twin = next(row for row in rows if row["config"] == r["same_plan_as"])
            rows.append({**twin, "config": name, "same_plan_as": r["same_plan_as"]})
    base = next(r for r in rows if r["config"] == "token_equal")
    for r in rows:
        r["throughput_vs_token_equal"] = r["tokens_per_s_epoch"] / base["tokens_per_s_epoch"]
    cols = ["config", "epoch_wall_s", "samples_consumed", "tokens_consumed", "tokens_per_s_epoch",
            "tokens_per_s_step_median", "load_cv", "load_max_over_mean", "step_time_cv_ranks", "step_time_cv_temporal",
            "bubble_frac", "busy_cv", "busy_max_over_mean", "peak_mem_gib_max", "longest_seq_trained",
            "throughput_vs_token_equal"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    print("first epoch and steady state (steps after each rank has seen its (B, S) once), measured | predicted:")
    for r in rows:
        print(f"  {r['config']:>16}: epoch {r['tokens_per_s_epoch']:.0f} | {r['predicted_tokens_per_s_epoch']:.0f} "
              f"tokens/s; steady {r['tokens_per_s_steady']:.0f} | {r['predicted_tokens_per_s_steady']:.0f}; "
              f"{r['first_occurrence_steps']} first-occurrence steps, beyond the model "
              f"{r['unpredicted_ms_first_occurrences']:.0f} ms there, {r['unpredicted_ms_steady']:.0f} ms steady; "
              f"warm-up {r['warmup_s']:.1f} s ({r['warmed_shapes']} shapes)")
    print("step time beyond the cost model by sample length (tokens): ms per step (fraction of the predicted step)")
    for r in rows:
        print(f"  {r['config']:>16}: " + ", ".join(
            f"{b['seq_len_from']}-{b['seq_len_to'] or ''} {b['unpredicted_ms_per_step']:.0f} ms "
            f"({b['unpredicted_frac_of_predicted']:+.1%}, {b['steps']} steps)" for b in r["unpredicted_by_seq_len"]))

    # Loss congruence. Against token_equal (another data order): the smoothed loss vs samples
    # seen, over the whole epoch and over its second half (after the transient from random
    # initialisation, where the order of the first batches dominates). Against the run with the
    # same batches (balanced_fused vs balanced): batch by batch.
    grid, window = loss_grid(runs)
    ref = smoothed_loss_vs_samples(runs["token_equal"], grid, window)
    late = grid >= grid[-1] / 2
    for r in rows:
        cur = smoothed_loss_vs_samples(runs[r.get("same_plan_as", r["config"])], grid, window)
        rel = np.abs(cur - ref) / ref
        r["smoothed_loss_max_rel_diff_vs_token_equal"] = float(rel.max())
        r["smoothed_loss_max_rel_diff_vs_token_equal_second_half"] = float(rel[late].max())
        twin = SAME_BATCHES.get(r["config"])
        if twin in runs:
            a, b = (np.asarray(runs[c]["losses_rank0"]) for c in (r["config"], twin))
            if a.shape == b.shape:
                r[f"batch_loss_max_rel_diff_vs_{twin}"] = float(np.max(np.abs(a - b) / np.abs(b)))

    model = CostModel.from_json(Path(runs["token_equal"]["log_dir"]) / "calibration_cost_model.json")
    mix = read_shapes_jsonl(REPO / "lightning_adaptiveload/data/reference_mix.jsonl")
    m_mem = runs["token_equal"]["m_mem"]
    simulated = [simulate(mix, model, m_mem=m_mem, world_size=w, policy=p, steps=1000, seed=0)
                 for w in sorted({runs["token_equal"]["devices"], 8, 16, 64})
                 for p in ("token_equal", "dual_constraint", "balanced")]
    meta = run_meta("e2e")
    doc = {**meta, "runs": rows, "simulated_with_calibrated_cost_model": simulated,
           "simulator_check": simulator_check(rows, simulated, runs["token_equal"]["devices"]),
           "paper": {"throughput_8gpu_tokens_per_s": [14383, 18069], "throughput_16gpu_tokens_per_s": [30170, 38372],
                     "compute_load_cv": [0.39, 0.189], "step_time_cv_16gpu": [0.187, 0.104]},
           "meta": {k: runs["token_equal"][k] for k in ("versions", "device", "devices", "date", "layers", "m_mem",
                                                         "scale", "samples_in_shards")},
           # each run's own command (its file has its header), then this report's
           "commands": [r["command"] for r in found.values()] + [meta["command"]]}
    write_result(args.out, doc)
    for s in simulated:
        print(f"simulated {s['policy']:>16} x{s['world_size']:<3} load CV {s['load_cv_mean']:.3f} "
              f"tokens/s {s['predicted_tokens_per_s']:.0f}")
    print("balanced / token_equal tokens/s:", ", ".join(f"{k} {v:.3f}" for k, v in doc["simulator_check"].items()
                                                        if k != "world_size"))
    plot(runs, rows, grid, window, Path(args.out).with_suffix(".png"))


def simulator_check(rows: list[dict], simulated: list[dict], world_size: int) -> dict:
    """balanced / token_equal tokens/s three ways at the run's world size: simulated (1000 steps of
    the mix), predicted for the run's own batches (the cost model's step times, no overheads) and
    measured (epoch wall time)."""
    by_config = {r["config"]: r for r in rows}
    if "balanced" not in by_config:
        return {}
    sim = {s["policy"]: s["predicted_tokens_per_s"] for s in simulated if s["world_size"] == world_size}
    base, bal = by_config["token_equal"], by_config["balanced"]
    planned = ((bal["tokens_consumed"] / bal["predicted_step_sum_s"])
               / (base["tokens_consumed"] / base["predicted_step_sum_s"]))
    return {"world_size": world_size, "simulated": sim["balanced"] / sim["token_equal"],
            "predicted_for_these_batches": planned, "measured": bal["throughput_vs_token_equal"]}


def plot(runs: dict, rows: list[dict], grid: np.ndarray, window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = [r["config"] + (f"\n(= {r['same_plan_as']})" if "same_plan_as" in r else "") for r in rows]
    axes[0].bar(names, [r["tokens_per_s_epoch"] for r in rows])
    axes[0].set_ylabel("tokens/s over the epoch (all ranks)")
    for name, res in runs.items():
        load = read_per_rank_csv(Path(res["log_dir"]) / CSV_NAME)["load"]
        axes[1].plot(metrics.cv_across_ranks(load), label=name)
        axes[2].plot(grid, smoothed_loss_vs_samples(res, grid, window), label=name)
    axes[1].set_xlabel("train batch")
    axes[1].set_ylabel("predicted-load CV across ranks")
    axes[2].set_xlabel("samples seen (rank 0)")
    axes[2].set_ylabel(f"loss, moving average over {window} samples")
    for ax in axes[1:]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("--config", choices=sorted(CONFIGS), required=True)
    p_run.add_argument("--workdir", default="runs/e2e")
    p_run.add_argument("--layers", type=int, default=8)
    p_run.add_argument("--scale", choices=sorted(SCALES), default="h200")
    p_run.add_argument("--samples", type=int, default=400)
    p_run.add_argument("--devices", type=int, default=2, help="GPUs (or CPU processes at --scale cpu)")
    p_rep = sub.add_parser("report")
    p_rep.add_argument("--workdir", default="runs/e2e")
    p_rep.add_argument("--out", default="benchmarks/results/e2e/e2e_2xh200.json")
    args = parser.parse_args()
    run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    main()
