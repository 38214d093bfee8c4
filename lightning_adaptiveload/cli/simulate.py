"""`adaptiveload simulate`: predicted load balance and throughput of a policy over K data-parallel steps."""
from __future__ import annotations

import argparse
import json

from lightning_adaptiveload.cli.plan import add_planning_args, run_with_clear_errors
from lightning_adaptiveload.scheduling.cost_model import load_cost_model
from lightning_adaptiveload.scheduling.policies import POLICIES
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl
from lightning_adaptiveload.scheduling.simulate import simulate


def _run(args: argparse.Namespace) -> int:
    mix = read_shapes_jsonl(args.shapes)
    cost_model = load_cost_model(args.cost_model)
    result = simulate(mix, cost_model, m_mem=args.m_mem, world_size=args.world_size, policy=args.policy,
                      steps=args.steps, seed=args.seed, m_comp=args.m_comp, max_seq_len=args.max_seq_len,
                      num_samples=args.num_samples, progress=True)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"policy {result['policy']} on {result['world_size']} ranks, {result['steps']} steps "
          f"({result['epochs_used']} epoch(s) of {result['steps_per_epoch']} steps)")
    for key in ("load_cv_mean", "load_max_over_mean_mean", "bubble_frac", "step_time_cv_temporal"):
        print(f"  {key:<26} {result[key]:.4f}")
    print(f"  {'step_time_mean_ms':<26} {result['step_time_mean_ms']:.1f}")
    print(f"  {'predicted_tokens_per_s':<26} {result['predicted_tokens_per_s']:.0f}")
    print(f"  {'predicted_samples_per_s':<26} {result['predicted_samples_per_s']:.2f}")
    print(f"  per epoch: {result['samples_per_epoch']} samples, dropped {result['dropped_oversize']} oversize, "
          f"{result['dropped_partial_batch']} in partial batches, {result['dropped_step_remainder']} in the last step")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("simulate", help="simulate data-parallel steps of a policy with the cost model")
    add_planning_args(parser)
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    parser.add_argument("--policy", choices=POLICIES, required=True)
    parser.add_argument("--steps", type=int, required=True, help="steps to simulate (spans epochs if needed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=None,
                        help="draw this many samples from the mix's distribution (default: the histogram itself)")
    parser.set_defaults(func=lambda args: run_with_clear_errors("simulate", _run, args))
