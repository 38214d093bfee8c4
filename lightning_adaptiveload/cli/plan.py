"""`adaptiveload plan`: the bucket table of a shapes file under each policy, with predicted step times."""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from lightning_adaptiveload.scheduling.cost_model import load_cost_model
from lightning_adaptiveload.scheduling.policies import batch_sizes, resolve_compute_budget
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


def bucket_table(mix: ShapeMix, cost_model, m_mem: int, m_comp: float | None = None,
                 max_seq_len: int | None = None) -> dict:
    """One row per distinct token count: tokens, samples, dropped (above max_seq_len), batch size
    and predicted step time (ms) of one batch under each policy; plus m_mem, m_comp, p."""
    max_seq_len = m_mem if max_seq_len is None else max_seq_len
    if m_mem < 1 or max_seq_len < 1:
        raise ValueError(f"m_mem and max_seq_len must be >= 1 token, got {m_mem} and {max_seq_len}")
    tokens, inverse = np.unique(mix.tokens, return_inverse=True)
    samples = np.bincount(inverse.reshape(-1), weights=mix.counts).astype(np.int64)
    scheduled = tokens <= max_seq_len
    if not scheduled.any():
        raise ValueError(f"every shape is longer than max_seq_len={max_seq_len} tokens")
    m_comp, p = resolve_compute_budget("dual_constraint", m_mem, int(tokens[scheduled].max()), m_comp,
                                       cost_model=cost_model)
    rows = []
    b_tok = batch_sizes(tokens, "token_equal", m_mem)
    b_dual = batch_sizes(tokens, "dual_constraint", m_mem, m_comp, p)
    for i, s in enumerate(tokens.tolist()):
        ok = bool(scheduled[i])
        rows.append({
            "tokens": s, "samples": int(samples[i]), "dropped": 0 if ok else int(samples[i]),
            "batch_size": {"token_equal": int(b_tok[i]) if ok else None,
                           "dual_constraint": int(b_dual[i]) if ok else None,
                           "balanced": int(b_dual[i]) if ok else None},
            "step_ms": {"token_equal": float(cost_model.predict(b_tok[i], s)) if ok else None,
                        "dual_constraint": float(cost_model.predict(b_dual[i], s)) if ok else None,
                        "balanced": float(cost_model.predict(b_dual[i], s)) if ok else None},
        })
    return {"m_mem": int(m_mem), "m_comp": m_comp, "p": p, "max_seq_len": int(max_seq_len),
            "samples": int(samples.sum()), "dropped_oversize": int(samples[~scheduled].sum()), "buckets": rows}


def format_table(table: dict, cost_model) -> str:
    lines = [
        f"cost model: {cost_model!r}",
        f"m_mem={table['m_mem']} tokens, m_comp={table['m_comp']:.4g} tokens^p, p={table['p']:.4g}, "
        f"max_seq_len={table['max_seq_len']} tokens ('balanced' uses the dual_constraint batch sizes)",
        f"{'tokens':>8} {'samples':>8} {'dropped':>8} {'B tok_eq':>8} {'B dual':>7} "
        f"{'ms tok_eq':>10} {'ms dual':>9}",
    ]
    for row in table["buckets"]:
        b, t = row["batch_size"], row["step_ms"]
        if b["token_equal"] is None:
            lines.append(f"{row['tokens']:>8} {row['samples']:>8} {row['dropped']:>8} {'-':>8} {'-':>7} {'-':>10} {'-':>9}")
        else:
            lines.append(f"{row['tokens']:>8} {row['samples']:>8} {row['dropped']:>8} {b['token_equal']:>8} "
                         f"{b['dual_constraint']:>7} {t['token_equal']:>10.1f} {t['dual_constraint']:>9.1f}")
    lines.append(f"{table['samples']} samples, {table['dropped_oversize']} dropped as longer than max_seq_len")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    mix = read_shapes_jsonl(args.shapes)
    cost_model = load_cost_model(args.cost_model)
    table = bucket_table(mix, cost_model, args.m_mem, args.m_comp, args.max_seq_len)
    print(json.dumps(table) if args.json else format_table(table, cost_model))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="bucket table: batch size and predicted step time per policy")
    add_planning_args(parser)
    parser.set_defaults(func=lambda args: run_with_clear_errors("plan", _run, args))
