"""Simulated: token_equal with every block checkpointed, balanced with every block checkpointed, and
balanced with per-bucket (B, k) from the memory plan, on the reference mix at 8, 16 and 64 ranks.

    python benchmarks/scheduling/memory_policies.py [--steps 2000] [--out benchmarks/results/memory_policies.json]

Models: fitted to the shipped H200 activation-checkpointing measurements
(lightning_adaptiveload/data/h200_ac_measurements.json: the example Wan-1.3B-shaped DiT, 30 blocks,
one H200): `MemoryModel` peak(B, S, k) and `DepthCostModel` t(B, S, k) (its base: the cost model at
k = 30). Step times are the models' predictions, so this says what the plan is worth if the models
hold; the GPU benchmark (benchmarks/scheduling/memory_plan.py) measures it. Every policy gets m_mem = 65,536
tokens as its token budget; token_equal and balanced drop the samples longer than it (the 81-frame
720p ones, 8% of the mix), the plan keeps every sample that fits the device at B = 1; the last
configuration runs the plan on the token budget's samples only, so its gain is the depths' alone
(the long samples cost the most per token and lower tokens/s where they are trained).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel  # noqa: E402
from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan  # noqa: E402
from lightning_adaptiveload.scheduling.memory_model import MemoryModel  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl  # noqa: E402
from lightning_adaptiveload.scheduling.simulate import simulate  # noqa: E402

DATA = REPO / "lightning_adaptiveload" / "data"
CONFIGS = ("token_equal, AC everywhere", "balanced, AC everywhere", "balanced, per-bucket (B, k)",
           "balanced, (B, k), budget samples")


def fit_models(path: Path) -> tuple[MemoryModel, DepthCostModel, dict]:
    doc = json.loads(path.read_text())
    m = doc["measurements"]
    b, s, k, t, peak = (np.array([row[key] for row in m], dtype=np.float64)
                        for key in ("batch_size", "seq_len", "checkpointed", "time_ms", "peak_bytes"))
    memory = MemoryModel.fit(b, s, k, peak, num_blocks=doc["num_blocks"])
    depth = DepthCostModel.fit(b, s, k, t, num_blocks=doc["num_blocks"])
    return memory, depth, doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--m-mem", type=int, default=65536)
    parser.add_argument("--device-memory-gib", type=float, default=139.8, help="one H200 as torch reports it")
    parser.add_argument("--max-memory-fraction", type=float, default=0.85)
    parser.add_argument("--world-sizes", default="8,16,64")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory_policies.json")
    args = parser.parse_args(argv)
    memory, depth, data = fit_models(DATA / "h200_ac_measurements.json")
    plan = MemoryPlan(memory, depth, args.device_memory_gib * 2**30, args.max_memory_fraction)
    mix = read_shapes_jsonl(DATA / "reference_mix.jsonl")
    print(f"memory model {memory!r}; held-out mean error {memory.quality['heldout_mean_rel_err']:.1%}")
    print(f"depth cost model {depth!r}")
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        runs = {
            # without a plan every block is checkpointed: the time model at k = L is the depth model's base
            CONFIGS[0]: simulate(mix, depth.base, m_mem=args.m_mem, world_size=world, policy="token_equal",
                                 steps=args.steps),
            CONFIGS[1]: simulate(mix, depth.base, m_mem=args.m_mem, world_size=world, policy="balanced",
                                 steps=args.steps),
            CONFIGS[2]: simulate(mix, depth, m_mem=args.m_mem, world_size=world, policy="balanced", steps=args.steps,
                                 memory_plan=plan, max_seq_len=plan.max_seq_len),
            # the plan on the samples the token budget admits: the gain of the depths alone
            CONFIGS[3]: simulate(mix, depth, m_mem=args.m_mem, world_size=world, policy="balanced", steps=args.steps,
                                 memory_plan=plan, max_seq_len=args.m_mem),
        }
        base = runs[CONFIGS[0]]["predicted_tokens_per_s"]
        for name, r in runs.items():
            rows.append({"world_size": world, "config": name, "load_cv": r["load_cv_mean"],
                         "load_max_over_mean": r["load_max_over_mean_mean"], "bubble_frac": r["bubble_frac"],
                         "predicted_tokens_per_s": r["predicted_tokens_per_s"],
                         "vs_token_equal": r["predicted_tokens_per_s"] / base,
                         "mix_trained_frac": r["samples_scheduled_frac"], "buckets": r["buckets"]})
    print(f"\n{'ranks':>5}  {'configuration':<34} {'load CV':>8} {'max/mean':>8} {'bubble':>7} "
          f"{'tokens/s':>10} {'vs TE':>6} {'mix trained':>11}")
    for r in rows:
        print(f"{r['world_size']:>5}  {r['config']:<34} {100 * r['load_cv']:>7.2f}% {r['load_max_over_mean']:>8.3f} "
              f"{100 * r['bubble_frac']:>6.2f}% {r['predicted_tokens_per_s']:>10.0f} {r['vs_token_equal']:>5.2f}x "
              f"{100 * r['mix_trained_frac']:>10.1f}%")
    doc = run_meta("memory_policies", argv) | {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "data": data["source"],
        "memory_model": memory.to_dict(), "depth_cost_model": depth.to_dict(),
        "device": "simulation on CPU; step times predicted by the models above",
        "rows": rows,
    }
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
