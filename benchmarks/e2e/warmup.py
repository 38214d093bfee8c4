"""Cold shapes in training, and what the shape warm-up does about them (one GPU).

    python benchmarks/e2e/warmup.py --out benchmarks/results/warmup_h200.json            # one H200
    python benchmarks/e2e/warmup.py --device cpu --tiny --out /tmp/warmup_cpu.json       # smoke test

Three parts, each in fresh processes where the process's caches matter:

1. training: the example Wan-2.1-1.3B-shaped DiT (`--layers` blocks, bf16-mixed, AdamW) trains one
   epoch of synthetic reference-mix samples with the AdaptiveLoadDataModule (balanced policy),
   CostModelCalibration and LoadBalanceMonitor. A first process only calibrates (its cache is
   reused by the next two); then "cold" trains with the shape warm-up off and "warm" with it on,
   each in a fresh process, on the same batches. Per step: measured step time against the cost
   model's prediction; a step whose (B, latent shape) the process meets for the first time is a
   first occurrence. Reported: the first occurrences' time over the model and over the same
   shape's later steps, both runs' epoch time, and the warm-up's own time.
2. graph_cache: scaled_dot_product_attention forward + backward alone on `--cache-shapes` distinct
   sequence lengths, then the first of them again: is a shape still warm after hundreds of others
   (is cuDNN's attention graph cache bounded)?
3. blocks: the cold excess (first step minus the median of the next two) of the same three shapes on
   models of 1, 4, 8 and 16 blocks built one after the other in one process: the first model pays
   for the shapes' kernels; if the later ones pay nothing more, the graphs are per process and shared
   by blocks and models, so their cost does not grow with the number of blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402

WAN = dict(latent_channels=16, text_len=512, text_dim=4096, dim=1536, heads=12, ffn=8960, freq_dim=256,
           m_mem=65536, latent_scale=1.0, batch_sizes=[1, 2, 4, 8, 16, 32, 64])
TINY = dict(latent_channels=4, text_len=8, text_dim=32, dim=64, heads=4, ffn=128, freq_dim=32,
            m_mem=640, latent_scale=0.125, batch_sizes=[1, 2, 4, 8, 16])


# --------------------------------------------------------------------------- 1. training

def train(args: argparse.Namespace, run: str) -> None:
    """One Lightning fit in this process: run in ("calibrate", "cold", "warm")."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from examples.video_dit.module import VideoDiTModule
    from lightning_adaptiveload.callbacks import CostModelCalibration, LoadBalanceMonitor
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

    sc = TINY if args.tiny else WAN
    work = Path(args.workdir)
    L.seed_everything(0)
    datamodule = AdaptiveLoadDataModule(
        shards=str(work / "shards"), index=str(work / "index.jsonl"), policy="balanced", m_mem=sc["m_mem"],
        latent_channels=sc["latent_channels"], text_len=sc["text_len"], text_dim=sc["text_dim"],
        num_workers=4 if not args.tiny else 0, seed=0, synthesize=args.samples,
        synthesize_latent_scale=sc["latent_scale"])
    model = VideoDiTModule(in_channels=sc["latent_channels"], dim=sc["dim"], num_layers=args.layers,
                           num_heads=sc["heads"], ffn_dim=sc["ffn"], text_dim=sc["text_dim"], freq_dim=sc["freq_dim"])
    calibration = CostModelCalibration(num_seq_lens=5, batch_sizes=sc["batch_sizes"], max_tokens=sc["m_mem"],
                                       warmup=1, repeats=3, time_budget_s=args.calibration_budget_s, m_mem=sc["m_mem"],
                                       verify=run == "warm", cache_path=str(work / "calibration_cache.json"),
                                       # a launch-bound toy on a shared CPU can fail the trust check
                                       **({"max_heldout_error": float("inf"), "min_work_correlation": -1.0}
                                          if args.tiny else {}))
    cuda = args.device == "cuda"
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-mixed" if cuda else "32-true",
                        max_epochs=1, max_steps=1 if run == "calibrate" else -1, use_distributed_sampler=False,
                        log_every_n_steps=5, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[calibration, LoadBalanceMonitor(window=20)],
                        logger=CSVLogger(str(work), name=run, version=0), default_root_dir=str(work))
    begin = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    (work / f"{run}.json").write_text(json.dumps({"fit_s": time.perf_counter() - begin,
                                                  "log_dir": trainer.logger.log_dir}))


def read_steps(log_dir: Path) -> list[dict]:
    """The monitor's per-rank rows of a one-rank run, one dict per train batch."""
    from lightning_adaptiveload.monitoring.per_rank_log import CSV_NAME, read_per_rank_csv

    cols = read_per_rank_csv(log_dir / CSV_NAME)
    names = ("step", "samples", "seq_len", "load", "step_time_ms")
    return [{k: float(cols[k][i, 0]) for k in names} for i in range(cols["step"].shape[0])]


def analyse(work: Path, run: str) -> dict:
    """First occurrences of each (B, S) against the cost model and against the same shape's later
    steps. S stands for the latent shape: the DataModule schedules one shape per token count."""
    log_dir = Path(json.loads((work / f"{run}.json").read_text())["log_dir"])
    steps = read_steps(log_dir)
    calibration = json.loads((log_dir / "calibration.json").read_text())
    from lightning_adaptiveload.scheduling import metrics

    marks = metrics.first_occurrences([[s["samples"]] for s in steps], [[s["seq_len"]] for s in steps])
    later = {}
    for s, first in zip(steps, marks.tolist()):
        s["first"] = first
        if not first:
            later.setdefault((int(s["samples"]), int(s["seq_len"])), []).append(s["step_time_ms"])
    first = [s for s in steps if s["first"]]
    over_model = [s["step_time_ms"] / s["load"] - 1 for s in first]
    over_repeat = [s["step_time_ms"] - float(np.median(later[(int(s["samples"]), int(s["seq_len"]))]))
                   for s in first if (int(s["samples"]), int(s["seq_len"])) in later]
    repeats = [s["step_time_ms"] / s["load"] - 1 for s in steps if not s["first"]]
    return {
        "run": run, "steps": len(steps), "distinct_shapes": int(marks.sum()),
        "epoch_step_time_s": sum(s["step_time_ms"] for s in steps) / 1e3,
        "first_occurrence_over_model_max": max(over_model), "first_occurrence_over_model_mean": float(np.mean(over_model)),
        "first_occurrences_over_5pct": int(sum(v > 0.05 for v in over_model)),
        "first_minus_later_ms_mean": float(np.mean(over_repeat)) if over_repeat else None,
        "first_minus_later_ms_max": float(np.max(over_repeat)) if over_repeat else None,
        "later_steps_over_model_mean": float(np.mean(repeats)) if repeats else None,
        "later_steps_over_model_abs_max": float(np.max(np.abs(repeats))) if repeats else None,
        "calibration_seconds": calibration["seconds"], "calibration_source": calibration["source"],
        "warmup_seconds": calibration["verify_seconds"],
        "warmed_shapes": len([m for m in (calibration["verification"] or {"shapes": []})["shapes"]
                              if m["status"] == "fits"]),
        "per_step": [{k: s[k] for k in ("step", "samples", "seq_len", "load", "step_time_ms", "first")} for s in steps],
    }


# --------------------------------------------------------------------------- 2. graph cache

def graph_cache(args: argparse.Namespace) -> dict:
    """SDPA fwd+bwd on many new sequence lengths, then the first ones again."""
    import torch
    import torch.nn.functional as F

    device = torch.device(args.device)
    heads, head_dim = (12, 128) if not args.tiny else (2, 16)
    lens = [256 + 64 * i for i in range(args.cache_shapes)]

    def step(n: int) -> float:
        q, k, v = (torch.randn(1, heads, n, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - begin) * 1e3

    rss0 = _rss_bytes()
    cold = [step(n) for n in lens]
    rss1 = _rss_bytes()
    again = [step(n) for n in lens[:args.revisit]]
    warm = [step(n) for n in lens[:args.revisit]]
    return {"shapes": len(lens), "revisited": args.revisit, "seq_lens": lens,
            "cold_ms": cold, "revisit_ms": again, "warm_ms": warm,
            "cold_ms_median": float(np.median(cold[:args.revisit])),
            "revisit_ms_median": float(np.median(again)), "warm_ms_median": float(np.median(warm)),
            "host_rss_growth_bytes_per_shape": (rss1 - rss0) / len(lens)}


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------- 3. blocks

def blocks(args: argparse.Namespace) -> list[dict]:
    """Cold excess (first step minus second) of new shapes, per number of blocks."""
    import torch

    from examples.video_dit.model import DiTConfig, VideoDiT, flow_matching_loss

    sc = TINY if args.tiny else WAN
    device = torch.device(args.device)
    shapes = [(2, (5, 60, 104)), (1, (13, 60, 104)), (4, (1, 90, 160))] if not args.tiny else \
        [(2, (1, 8, 8)), (1, (2, 8, 12)), (4, (1, 4, 4))]
    rows = []
    for layers in args.block_counts:
        torch.manual_seed(0)
        model = VideoDiT(DiTConfig(num_layers=layers, in_channels=sc["latent_channels"], out_channels=sc["latent_channels"],
                                   dim=sc["dim"], num_heads=sc["heads"], ffn_dim=sc["ffn"], text_dim=sc["text_dim"],
                                   freq_dim=sc["freq_dim"])).to(device)
        for b, thw in shapes:
            times = []
            for _ in range(3):
                latents = torch.randn(b, sc["latent_channels"], *thw, device=device)
                text = torch.randn(b, sc["text_len"], sc["text_dim"], device=device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                begin = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    flow_matching_loss(model, latents, text, torch.rand(b, device=device), torch.randn_like(latents)).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - begin) * 1e3)
                model.zero_grad(set_to_none=True)
            rows.append({"layers": layers, "batch_size": b, "latent_shape": list(thw), "first_ms": times[0],
                         "warm_ms": float(np.median(times[1:])), "cold_excess_ms": times[0] - float(np.median(times[1:]))})
            print(f"blocks={layers} B={b} {thw}: cold excess {rows[-1]['cold_excess_ms']:.1f} ms", flush=True)
        del model
    return rows


# --------------------------------------------------------------------------- driver

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "warmup_h200.json")
    parser.add_argument("--workdir", default="/tmp/warmup_bench")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--cache-shapes", type=int, default=300)
    parser.add_argument("--revisit", type=int, default=20)
    parser.add_argument("--block-counts", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 8, 16])
    parser.add_argument("--parts", default="training,graph_cache,blocks")
    parser.add_argument("--calibration-budget-s", type=float, default=30.0,
                        help="CostModelCalibration.time_budget_s (optional grid points)")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # worker: one training run
    args = parser.parse_args(argv)
    if args.run is not None:
        train(args, args.run)
        return 0

    doc = run_meta("warmup", argv) | {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "run")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every part: a run cut short keeps the parts it finished
        write_result(args.out, doc, announce=False)

    parts = args.parts.split(",")
    status = 0
    if "training" in parts:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
        doc["training"] = {}
        for run in ("calibrate", "cold", "warm"):
            cmd = [sys.executable, __file__, "--run", run, "--workdir", args.workdir, "--device", args.device,
                   "--layers", str(args.layers), "--samples", str(args.samples),
                   "--calibration-budget-s", str(args.calibration_budget_s)] + (["--tiny"] if args.tiny else [])
            begin = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            (work / f"{run}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode:
                print(f"training {run}: FAILED (exit {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
                status = 1
                break
            print(f"training {run}: {time.perf_counter() - begin:.1f} s", flush=True)
        else:
            for run in ("cold", "warm"):
                doc["training"][run] = analyse(work, run)
                r = doc["training"][run]
                print(f"{run}: {r['steps']} steps, {r['distinct_shapes']} shapes, steps {r['epoch_step_time_s']:.1f} s; "
                      f"first occurrences over the model: max {100 * r['first_occurrence_over_model_max']:.1f}%, "
                      f"{r['first_occurrences_over_5pct']} over 5%; first minus later of the same shape: mean "
                      f"{r['first_minus_later_ms_mean']} ms; warm-up {r['warmup_seconds']:.1f} s "
                      f"(calibration {r['calibration_seconds']:.1f} s, {r['calibration_source']})", flush=True)
        write()
    if "graph_cache" in parts:
        doc["graph_cache"] = graph_cache(args)
        write()
        g = doc["graph_cache"]
        print(f"graph cache: {g['shapes']} shapes; first {g['revisited']}: cold {g['cold_ms_median']:.2f} ms, "
              f"revisited after all others {g['revisit_ms_median']:.2f} ms, warm {g['warm_ms_median']:.2f} ms; "
              f"host RSS {g['host_rss_growth_bytes_per_shape'] / 1024:.0f} KiB per shape", flush=True)
    if "blocks" in parts:
        doc["blocks"] = blocks(args)
        write()
    print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
