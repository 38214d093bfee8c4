"""What keeping every sample costs: balanced with drop_last True against False (simulation).

    python benchmarks/scheduling/drop_last.py --out benchmarks/results/drop_last.json

For datasets of --samples samples drawn from the reference mix (seeded) and --world-sizes ranks, one
epoch of the balanced policy's real plan, each batch priced by the shipped H200 cost curve
(lightning_adaptiveload/data/h200_dit_cost_curve.json, at m_mem 65,536): samples trained (and left
out per reason), steps, predicted tokens/s (every rank's tokens over the sum of each step's slowest
rank) and load CV across ranks (mean over steps), with drop_last True (each bucket's last partial
batch dropped, and the batches that cannot fill a last step) and False (every sample trained, in
smaller batches, the same steps on every rank). Writes a table, the JSON and a PNG.
"""
from __future__ import annotations

import argparse
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import run_meta, write_result  # noqa: E402
from lightning_adaptiveload.scheduling.cost_model import load_cost_model  # noqa: E402
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl  # noqa: E402
from lightning_adaptiveload.scheduling.simulate import simulate  # noqa: E402

KEYS = ("samples_scheduled_frac", "steps_per_epoch", "dropped_oversize", "dropped_partial_batch",
        "dropped_step_remainder", "predicted_tokens_per_s", "load_cv_mean", "bubble_frac")


def one_epoch(mix, model, *, samples: int, world: int, drop_last: bool, m_mem: int, seed: int) -> dict | None:
    """simulate() over exactly the first epoch, or None when the ranks outnumber its batches."""
    rng = np.random.default_rng([seed, 1])  # simulate's own draw of num_samples samples
    seq_lens = rng.choice(mix.tokens, size=samples, p=mix.counts / mix.counts.sum())
    try:
        steps = BucketBatchSampler(seq_lens, policy="balanced", m_mem=m_mem, cost_model=model, num_replicas=world,
                                   rank=0, seed=seed, drop_last=drop_last).plan().stats["steps"]
        result = simulate(mix, model, m_mem=m_mem, world_size=world, policy="balanced", steps=steps, seed=seed,
                          num_samples=samples, drop_last=drop_last)
    except ValueError as e:  # world size above the batches an epoch can fill
        return {"error": str(e)}
    return {k: result[k] for k in KEYS}


def main(argv: list[str] | None = None) -> int:
    data = files("lightning_adaptiveload") / "data"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=str(data / "reference_mix.jsonl"))
    parser.add_argument("--cost-model", default=str(data / "h200_dit_cost_curve.json"))
    parser.add_argument("--m-mem", type=int, default=65536)
    parser.add_argument("--samples", type=int, nargs="+", default=[200, 2000, 20000])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    mix, model = read_shapes_jsonl(args.shapes), load_cost_model(args.cost_model)
    rows = []
    for samples in args.samples:
        for world in args.world_sizes:
            row = {"samples": samples, "world_size": world}
            for drop_last in (True, False):
                row["drop_last" if drop_last else "keep_all"] = one_epoch(
                    mix, model, samples=samples, world=world, drop_last=drop_last, m_mem=args.m_mem, seed=args.seed)
            rows.append(row)
    lines = [f"{'samples':>8} {'ranks':>5} | {'trained (drop)':>15} {'tok/s (drop)':>13} {'CV (drop)':>9} | "
             f"{'trained (keep)':>15} {'tok/s (keep)':>13} {'CV (keep)':>9} | {'tok/s keep/drop':>15}"]
    for row in rows:
        d, k = row["drop_last"], row["keep_all"]
        if "error" in d or "error" in k:
            lines.append(f"{row['samples']:>8} {row['world_size']:>5} | " + (d.get("error") or k.get("error"))[:80])
            continue
        lines.append(f"{row['samples']:>8} {row['world_size']:>5} | {d['samples_scheduled_frac']:>15.1%} "
                     f"{d['predicted_tokens_per_s']:>13.0f} {d['load_cv_mean']:>9.2%} | {k['samples_scheduled_frac']:>15.1%} "
                     f"{k['predicted_tokens_per_s']:>13.0f} {k['load_cv_mean']:>9.2%} | "
                     f"{k['predicted_tokens_per_s'] / d['predicted_tokens_per_s']:>15.3f}")
    print("\n".join(lines))
    write_result(args.out, {**run_meta("drop_last", argv), "args": vars(args), "rows": rows})
    _plot(rows, Path(args.out).with_suffix(".png"))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for world in sorted({r["world_size"] for r in rows}):
        ok = [r for r in rows if r["world_size"] == world and "error" not in r["drop_last"] and "error" not in r["keep_all"]]
        n = [r["samples"] for r in ok]
        left.plot(n, [r["drop_last"]["samples_scheduled_frac"] for r in ok], "o--", label=f"{world} ranks, drop_last")
        left.plot(n, [r["keep_all"]["samples_scheduled_frac"] for r in ok], "o-", label=f"{world} ranks, keep all")
        right.plot(n, [r["keep_all"]["predicted_tokens_per_s"] / r["drop_last"]["predicted_tokens_per_s"] for r in ok],
                   "o-", label=f"{world} ranks")
    left.set(xscale="log", xlabel="samples in the dataset", ylabel="share trained per epoch", title="samples trained")
    right.axhline(1.0, color="k", lw=0.8)
    right.set(xscale="log", xlabel="samples in the dataset", ylabel="tokens/s, keep all / drop_last",
              title="predicted throughput (balanced)")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
