"""Predicted load balance and throughput of the three policies on the reference mix with the H200
cost curve (simulation: the sampler's real plan priced by the fitted cost model).

    python benchmarks/scheduling/policies.py [--m-mem 65536] [--world-sizes 8 16 64] [--steps 2000]

Prints a table, checks the issue's targets, writes benchmarks/results/policies.json and
policies.png. Streaming rows simulate the streaming stage (each rank its own sample stream, no
communication) with several buffer bounds. Also sweeps dual_constraint's m_comp over every bucket as the reference, to show
whether any m_comp could reach the paper's CV reduction under random (Open-Sora) grouping.
"""
from __future__ import annotations

import argparse
import platform
import sys
from importlib.resources import files
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.scheduling.cost_model import load_cost_model  # noqa: E402
from lightning_adaptiveload.scheduling.policies import POLICIES  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl  # noqa: E402
from lightning_adaptiveload.scheduling.simulate import simulate, simulate_streaming  # noqa: E402


def main() -> None:
    data = files("lightning_adaptiveload") / "data"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=str(data / "reference_mix.jsonl"))
    parser.add_argument("--cost-model", default=str(data / "h200_dit_cost_curve.json"))
    parser.add_argument("--m-mem", type=int, default=65536)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-buffers", type=int, nargs="+", default=[256, 1024, 4096],
                        help="buffer bounds (samples) of the streaming stage to simulate")
    args = parser.parse_args()

    mix = read_shapes_jsonl(args.shapes)
    model = load_cost_model(args.cost_model)
    rows = []
    for world in tqdm(args.world_sizes, desc="world sizes"):
        for policy in POLICIES:
            r = simulate(mix, model, m_mem=args.m_mem, world_size=world, policy=policy, steps=args.steps, seed=args.seed)
            rows.append({k: v for k, v in r.items() if k != "buckets"})
        # Streaming stage: each rank reads its own stream, no communication.
        rows.append({k: v for k, v in simulate_streaming(mix, model, m_mem=args.m_mem, world_size=world,
                                                         policy="token_equal", steps=args.steps, seed=args.seed).items()})
        for buffer in args.stream_buffers:
            r = simulate_streaming(mix, model, m_mem=args.m_mem, world_size=world, policy="balanced", steps=args.steps,
                                   seed=args.seed, max_buffer_samples=buffer)
            rows.append({**r, "policy": f"streaming_balanced_buf{buffer}"})
        # Best case for dual_constraint: m_comp from each scheduled bucket as the reference.
        sweep = []
        for ref in [s for s in np.unique(mix.tokens).tolist() if s <= args.m_mem]:
            r = simulate(mix, model, m_mem=args.m_mem, world_size=world, policy="dual_constraint", steps=args.steps,
                         seed=args.seed, m_comp=model.m_comp(args.m_mem, ref))
            sweep.append({"ref_seq_len": ref, **{k: v for k, v in r.items() if k != "buckets"}})
        best = min(sweep, key=lambda x: x["load_cv_mean"])
        rows.append({**best, "policy": "dual_constraint_best_m_comp",
                     "sweep": [{k: x[k] for k in ("ref_seq_len", "m_comp", "load_cv_mean", "predicted_tokens_per_s")}
                               for x in sweep]})

    checks = []
    print(f"\n{'ranks':>5} {'policy':<28} {'load CV':>8} {'max/mean':>8} {'bubble':>7} {'step CV':>7} "
          f"{'tokens/s':>11} {'vs tok_eq':>9}")
    for world in args.world_sizes:
        by = {r["policy"]: r for r in rows if r["world_size"] == world}
        base = by["token_equal"]
        for name, r in by.items():
            gain = r["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
            r["throughput_vs_token_equal"] = gain
            r["load_cv_vs_token_equal"] = r["load_cv_mean"] / base["load_cv_mean"]
            print(f"{world:>5} {name:<28} {100 * r['load_cv_mean']:>7.2f}% {r['load_max_over_mean_mean']:>8.3f} "
                  f"{100 * r['bubble_frac']:>6.2f}% {100 * r['step_time_cv_temporal']:>6.1f}% "
                  f"{r['predicted_tokens_per_s']:>11.0f} {gain:>8.3f}x")
        bal, dual = by["balanced"], by["dual_constraint"]
        for name, r in by.items():
            if name.startswith("streaming_balanced"):
                r["throughput_vs_map_balanced"] = r["predicted_tokens_per_s"] / bal["predicted_tokens_per_s"]
        checks += [
            {"world_size": world, "target": "dual_constraint load CV <= 0.6 x token_equal",
             "value": dual["load_cv_vs_token_equal"], "passed": dual["load_cv_vs_token_equal"] <= 0.6},
            {"world_size": world, "target": "balanced load CV <= 3%", "value": bal["load_cv_mean"],
             "passed": bal["load_cv_mean"] <= 0.03},
            {"world_size": world, "target": "balanced max/mean <= 1.05", "value": bal["load_max_over_mean_mean"],
             "passed": bal["load_max_over_mean_mean"] <= 1.05},
            {"world_size": world, "target": "balanced throughput >= 1.25 x token_equal",
             "value": bal["throughput_vs_token_equal"], "passed": bal["throughput_vs_token_equal"] >= 1.25},
        ]
    print()
    for c in checks:
        print(f"{'PASS' if c['passed'] else 'MISS'}  {c['world_size']:>3} ranks  {c['target']:<45} {c['value']:.4f}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = run_meta("policies") | {
        "device": f"simulation on CPU ({platform.processor() or platform.machine()}); step times predicted "
                  f"by the cost model fitted to {Path(args.cost_model).name}",
        "cost_model": {"form": model.form, "params": model.params, "p": model.p, "quality": model.quality},
        "settings": {"shapes": Path(args.shapes).name, "m_mem": args.m_mem, "steps": args.steps, "seed": args.seed},
        "rows": rows,
        "checks": checks,
    }
    write_result(RESULTS / "policies.json", doc, announce=False)
    _plot(rows, args.world_sizes, RESULTS / "policies.png")
    print(f"\nwrote {RESULTS / 'policies.json'} and {RESULTS / 'policies.png'}")


def _plot(rows: list[dict], world_sizes: list[int], path: Path) -> None:
    names = ["token_equal", "dual_constraint", "balanced"]
    fig, (ax_cv, ax_tp) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.25
    for i, name in enumerate(names):
        sel = [next(r for r in rows if r["world_size"] == w and r["policy"] == name) for w in world_sizes]
        x = np.arange(len(world_sizes)) + (i - 1) * width
        ax_cv.bar(x, [100 * r["load_cv_mean"] for r in sel], width, label=name)
        ax_tp.bar(x, [r["throughput_vs_token_equal"] for r in sel], width, label=name)
    for ax in (ax_cv, ax_tp):
        ax.set_xticks(np.arange(len(world_sizes)), [f"{w} ranks" for w in world_sizes])
        ax.legend()
    ax_cv.legend(loc="center right")
    ax_cv.axhline(3, color="gray", ls="--", lw=0.8)
    ax_cv.set(ylabel="load CV across ranks, mean over steps (%)", title="per-step load imbalance (lower is better)")
    ax_tp.axhline(1.25, color="gray", ls="--", lw=0.8)
    ax_tp.set(ylabel="predicted tokens/s relative to token_equal", title="predicted throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
