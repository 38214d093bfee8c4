"""Time and memory of planning one epoch of a 10M-sample dataset with BucketBatchSampler.

    python benchmarks/scheduling/sampler_plan.py [--samples 10000000] [--world-size 16]

Per policy: seconds to build the sampler (bucketing), to plan the epoch, and to re-plan after a
mid-epoch resume on another world size; peak traced allocations (tracemalloc: numpy arrays) of
each phase and the process's peak RSS. Writes benchmarks/results/sampler_plan.json.
Targets: planning <= 10 s and <= 1 GiB.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.scheduling.cost_model import load_cost_model  # noqa: E402
from lightning_adaptiveload.scheduling.policies import POLICIES  # noqa: E402
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl  # noqa: E402
GIB = 1 << 30


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measured(fn):
    """(result, seconds, peak traced bytes) of fn()."""
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, seconds, peak


def main() -> None:
    data = files("lightning_adaptiveload") / "data"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=str(data / "reference_mix.jsonl"))
    parser.add_argument("--cost-model", default=str(data / "h200_dit_cost_curve.json"))
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--world-size", type=int, default=16)
    parser.add_argument("--m-mem", type=int, default=65536)
    args = parser.parse_args()

    mix = read_shapes_jsonl(args.shapes)
    model = load_cost_model(args.cost_model)
    seq_lens = np.random.default_rng(0).choice(mix.tokens, size=args.samples, p=mix.counts / mix.counts.sum())
    rss_before = peak_rss_bytes()
    rows = []
    for policy in tqdm(POLICIES, desc="policies"):
        kw = dict(policy=policy, m_mem=args.m_mem, cost_model=model, num_replicas=args.world_size, rank=0)
        sampler, t_init, m_init = measured(lambda: BucketBatchSampler(seq_lens, **kw))
        plan, t_plan, m_plan = measured(sampler.plan)
        it = iter(sampler)
        _, t_iter, _ = measured(lambda: [next(it) for _ in range(1000)])
        state = sampler.state_dict(steps_consumed=len(plan.steps) // 2)
        other = BucketBatchSampler(seq_lens, **{**kw, "num_replicas": args.world_size // 2})
        other.load_state_dict(state)
        _, t_resume, m_resume = measured(other.plan)
        rows.append({"policy": policy, "init_s": t_init, "plan_s": t_plan, "first_1000_batches_s": t_iter,
                     "resume_replan_s": t_resume, "init_peak_traced_bytes": m_init, "plan_peak_traced_bytes": m_plan,
                     "resume_peak_traced_bytes": m_resume, "steps": plan.stats["steps"],
                     "batches": plan.stats["batches"]})
        del sampler, plan, it, other  # one policy's arrays alive at a time, as in training
    rss_peak = peak_rss_bytes()

    print(f"\n{args.samples} samples, {args.world_size} ranks ({len(np.unique(seq_lens))} buckets)")
    print(f"{'policy':<16} {'init s':>7} {'plan s':>7} {'resume s':>9} {'plan MiB':>9} {'resume MiB':>11} {'steps':>8}")
    for r in rows:
        print(f"{r['policy']:<16} {r['init_s']:>7.2f} {r['plan_s']:>7.2f} {r['resume_replan_s']:>9.2f} "
              f"{r['plan_peak_traced_bytes'] / 2**20:>9.0f} {r['resume_peak_traced_bytes'] / 2**20:>11.0f} {r['steps']:>8}")
    print(f"process peak RSS {rss_peak / 2**20:.0f} MiB (before planning: {rss_before / 2**20:.0f} MiB, "
          f"incl. torch and the {seq_lens.nbytes / 2**20:.0f} MiB seq_lens array)")
    worst_s = max(r["init_s"] + r["plan_s"] for r in rows)
    worst_bytes = max(max(r["init_peak_traced_bytes"], r["plan_peak_traced_bytes"]) for r in rows)
    # The process baseline (torch, the cost model, seq_lens) is not the planner's; its growth is.
    checks = {"plan_le_10s": worst_s <= 10, "plan_le_1GiB_traced": worst_bytes <= GIB,
              "peak_rss_growth_le_1GiB": rss_peak - rss_before <= GIB}
    print(f"worst init+plan {worst_s:.2f} s, worst traced peak {worst_bytes / 2**20:.0f} MiB: {checks}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = run_meta("sampler_plan", torch=torch.__version__) | {
        "settings": vars(args),
        "rows": rows,
        "process_peak_rss_bytes": rss_peak,
        "rss_before_planning_bytes": rss_before,
        "checks": checks,
    }
    write_result(RESULTS / "sampler_plan.json", doc)


if __name__ == "__main__":
    main()
