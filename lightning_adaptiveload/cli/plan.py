"""`adaptiveload plan`: the bucket table of a shapes file under a policy (batch size and predicted
step time per bucket; with a memory model, the checkpointing depth k and predicted peak memory per
bucket) and the epoch plan's summary for a world size (steps per epoch, samples scheduled, samples
dropped per reason)."""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from lightning_adaptiveload.scheduling.buckets import BucketTable, schedule_keys
from lightning_adaptiveload.scheduling.cost_model import load_cost_model
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan
from lightning_adaptiveload.scheduling.epoch_plan import DROP_COUNTERS
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.policies import POLICIES
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
from lightning_adaptiveload.scheduling.shapes import ShapeMix, read_shapes_jsonl


def add_planning_args(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by `plan` and `simulate`."""
    parser.add_argument("--shapes", required=True, help="shapes JSONL: {frames,height,width|tokens, count} a line")
    parser.add_argument("--cost-model", required=True,
                        help="fitted cost-model JSON, or a measurements JSON (fitted on the fly)")
    parser.add_argument("--m-mem", type=int, required=True, help="memory budget, tokens per batch (B*S <= m_mem)")
    parser.add_argument("--m-comp", type=float, default=None,
                        help="compute budget B*S^p (default: the cost model's rule on the longest scheduled bucket)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="longest sample scheduled, tokens (default: m_mem); longer samples are dropped")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run_with_clear_errors(name: str, func, args: argparse.Namespace) -> int:
    """Run func(args); a bad input prints one line naming it and returns 2, without a traceback."""
    try:
        return func(args)
    except (ValueError, OSError) as e:
        print(f"adaptiveload {name}: error: {e}", file=sys.stderr)
        return 2


def plan_summary(mix: ShapeMix, cost_model, *, policy: str, m_mem: int, m_comp: float | None = None,
                 max_seq_len: int | None = None, world_size: int = 1, seed: int = 0, drop_last: bool | None = None,
                 memory_plan: MemoryPlan | None = None) -> tuple[BucketTable, dict]:
    """(bucket table, epoch-0 plan stats) of the mix expanded to one entry per sample, planned for
    `world_size` ranks as the DataModule does: rows above max_seq_len (under `memory_plan`, also
    those longer than the device fits) never reach the sampler (counted here as dropped_oversize),
    the rest are scheduled at their bucket keys. drop_last None: the sampler's default for `policy`;
    the stats say which it used ("drop_last")."""
    table = BucketTable.build(mix.tokens, mix.counts, mix.latent_thw, policy=policy, m_mem=m_mem, m_comp=m_comp,
                              cost_model=cost_model, max_seq_len=max_seq_len, memory_plan=memory_plan)
    fits = mix.tokens <= table.max_seq_len
    keys = schedule_keys(mix.latent_thw[fits], mix.tokens[fits])
    sampler = BucketBatchSampler(np.repeat(keys, mix.counts[fits]), policy=policy, m_mem=m_mem, m_comp=table.m_comp,
                                 p=table.p, cost_model=cost_model, num_replicas=world_size, rank=0, seed=seed,
                                 drop_last=drop_last, max_seq_len=int(keys.max()), memory_plan=memory_plan)
    oversize = int(mix.counts[~fits].sum())
    stats = dict(sampler.plan().stats)
    stats["samples_total"] += oversize
    stats["dropped_oversize"] += oversize
    stats["drop_last"] = sampler.drop_last
    return table, stats


def format_summary(table: BucketTable, stats: dict, cost_model, seed: int) -> str:
    dropped = ", ".join(f"{key.removeprefix('dropped_')} {stats[key]}" for key in DROP_COUNTERS)
    return "\n".join([
        f"cost model: {cost_model!r}",
        table.format(),
        f"epoch plan on {stats['world_size']} rank(s) (seed {seed}, drop_last={stats['drop_last']}): "
        f"{stats['steps']} steps per epoch, {stats['samples_scheduled']} of {stats['samples_total']} samples "
        f"scheduled; dropped: {dropped}",
    ])


def memory_plan_from_args(args: argparse.Namespace) -> MemoryPlan | None:
    """The MemoryPlan of --memory-model, --cost-model (then a depth cost model JSON),
    --device-memory-gib and --max-memory-fraction; None without --memory-model."""
    if args.memory_model is None:
        if args.device_memory_gib is not None:
            raise ValueError("--device-memory-gib needs --memory-model")
        return None
    if args.device_memory_gib is None or not args.device_memory_gib > 0:
        raise ValueError(f"--memory-model needs --device-memory-gib > 0 (one rank's device memory), got "
                         f"{args.device_memory_gib}")
    try:
        time_model = DepthCostModel.from_json(args.cost_model)
    except ValueError as e:
        raise ValueError(f"with --memory-model, --cost-model must be a depth cost model (calibration writes "
                         f"calibration_depth_cost_model.json): {e}") from None
    return MemoryPlan(MemoryModel.from_json(args.memory_model), time_model, args.device_memory_gib * 2**30,
                      args.max_memory_fraction)


def _run(args: argparse.Namespace) -> int:
    mix = read_shapes_jsonl(args.shapes)
    memory_plan = memory_plan_from_args(args)
    cost_model = load_cost_model(args.cost_model) if memory_plan is None else memory_plan.cost_model.base
    # under a memory plan every sample is a candidate: the device, not m_mem, bounds the length
    max_seq_len = args.max_seq_len if args.max_seq_len is not None or memory_plan is None else int(mix.tokens.max())
    table, stats = plan_summary(mix, cost_model, policy=args.policy, m_mem=args.m_mem, m_comp=args.m_comp,
                                max_seq_len=max_seq_len, world_size=args.world_size, seed=args.seed,
                                drop_last=args.drop_last, memory_plan=memory_plan)
    shown = cost_model if memory_plan is None else memory_plan.cost_model
    if args.json:
        doc = {"cost_model": repr(shown), "bucket_table": table.to_dict(), "epoch_plan": stats}
        if memory_plan is not None:
            doc["memory_model"] = repr(memory_plan.memory_model)
        print(json.dumps(doc))
    else:
        if memory_plan is not None:
            print(f"memory model: {memory_plan.memory_model!r}")
        print(format_summary(table, stats, shown, args.seed))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="bucket table and epoch plan: batch sizes, predicted step times, "
                                                "steps per epoch and samples dropped")
    add_planning_args(parser)
    parser.add_argument("--policy", choices=POLICIES, default="balanced")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks of the epoch plan")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop-last", action=argparse.BooleanOptionalAction, default=None,
                        help="drop partial batches and the batches that cannot fill a last step (default: keep "
                             "them for balanced, drop them for token_equal and dual_constraint)")
    parser.add_argument("--memory-model", default=None,
                        help="memory model JSON (calibration_memory_model.json): plan with measured memory, per "
                             "bucket (B, k) for balanced; --cost-model is then the depth cost model JSON "
                             "(calibration_depth_cost_model.json) and --max-seq-len defaults to no bound")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="one rank's device memory in GiB (with --memory-model)")
    parser.add_argument("--max-memory-fraction", type=float, default=0.85,
                        help="share of the device memory a step may be predicted to use (with --memory-model)")
    parser.set_defaults(func=lambda args: run_with_clear_errors("plan", _run, args))
