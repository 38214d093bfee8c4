"""Per-bucket activation checkpointing on one GPU: memory model, (B, k) choice, training-like steps.

The example Wan-2.1-1.3B-shaped DiT (examples/video_dit: D = 1536, 12 heads, FFN 8960, 512 x 4096
text; `--blocks` of its 30 blocks), fp32 weights, bf16 autocast, AdamW, no sharding, a plain training
loop (forward, backward, optimizer step), synthetic latents of the reference mix's shapes
(lightning_adaptiveload/data/reference_mix.jsonl). The blocks are wrapped by
lightning_adaptiveload.checkpointing.BlockCheckpointing, which checkpoints the first k per step.

  a) grid: peak memory and step time at k = L (all blocks checkpointed) for the token-equal batch and
     a quarter of it at --grid-buckets buckets spread over the mix, and at k = --second-depth for the
     quarter batches; fits MemoryModel (peak bytes) and DepthCostModel (ms) to them.
  b) choice: (B, k) per bucket (choose_batch_and_depth, token cap m_mem, --max-memory-fraction of the
     device memory).
  c) three configurations, every (B, S, k) they schedule run as training steps: one untimed warm-up pass
     over all of them in shuffled order (a new shape's first step is cold), then --repeats timed passes,
     each in a new shuffled order (consecutive steps change shape, as in bucketed training):
       token_equal_ac   B = max(1, m_mem // S), k = L; samples over m_mem dropped (the baseline as practiced)
       balanced_ac      the dual-constraint batch sizes balanced schedules (M_comp from the grid's cost
                        model at S_ref = the longest bucket <= m_mem), k = L; samples over m_mem dropped
       per_bucket       the (B, k) of b); only buckets that fit nowhere are dropped (its tokens/s is also
                        reported on the samples balanced_ac trains: the longer ones it adds are slower)
     A measurement is reused by every configuration that schedules the same (B, S, k).

Reported per configuration: epoch tokens/s of the mix (sum of n_b * S_b over sum of (n_b / B_b) * t_b,
n_b the mix's samples of bucket b, t_b the median measured step ms: the epoch's time estimated from
every bucket's measured step rather than from a short random sequence, whose few steps of each bucket
would dominate the error), the epoch's time and its first epoch's (the epoch plus every scheduled
point's first-step excess over its median: that step ran in the warm-up pass, cold where its (B, S)
was new to the process, `first_was_new_shape`, and warm where an earlier point had the same (B, S)),
fraction of the mix's samples trained, peak memory (allocated and
reserved) of each step, and predicted vs measured peak of every scheduled bucket. Out-of-memory steps
are caught and recorded. The script stops starting new steps after --deadline-s and writes what it has.

    python benchmarks/scheduling/memory_plan.py --out benchmarks/results/memory_plan_h200.json   # one GPU
    python benchmarks/scheduling/memory_plan.py --device cpu --tiny --out /tmp/memory_plan_cpu.json  # smoke test
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, RESULTS, run_meta, write_result  # noqa: E402
from examples.video_dit.model import DiTBlock, DiTConfig, VideoDiT, flow_matching_loss  # noqa: E402
from lightning_adaptiveload.calibration.runner import _SavedTensorBytes  # noqa: E402
from lightning_adaptiveload.checkpointing import BlockCheckpointing, find_blocks, select_instances  # noqa: E402
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel  # noqa: E402
from lightning_adaptiveload.scheduling.depth_choice import choose_batch_and_depth  # noqa: E402
from lightning_adaptiveload.scheduling.memory_model import MemoryModel  # noqa: E402
from lightning_adaptiveload.scheduling.policies import batch_sizes  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl  # noqa: E402

GiB = 2**30
# Model and data per scale: "full" is the Wan-1.3B shape on the reference mix; "tiny" a CPU toy on the
# demo mix, only to check that the script runs.
SCALES = {
    "full": dict(dim=1536, heads=12, ffn_dim=8960, text_dim=4096, freq_dim=256, channels=16, text_tokens=512,
                 mix=REPO / "lightning_adaptiveload" / "data" / "reference_mix.jsonl", m_mem=65536),
    "tiny": dict(dim=32, heads=2, ffn_dim=64, text_dim=32, freq_dim=32, channels=4, text_tokens=8,
                 mix=REPO / "examples" / "configs" / "demo_mix.jsonl", m_mem=256),
}
CONFIGS = ("token_equal_ac", "balanced_ac", "per_bucket")


@dataclass
class Measured:
    """Every step run at one (B, bucket, k): ms of the timed ones, peak bytes of all; the first (untimed
    warm-up) step's ms, and whether its (B, S) was new to the process then (cold cuDNN graphs)."""
    times_ms: list[float] = field(default_factory=list)
    first_ms: float | None = None
    first_was_new_shape: bool | None = None
    peaks: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    oom: bool = False

    @property
    def ok(self) -> bool:
        return not self.oom and bool(self.times_ms)


class Bench:
    """The model, its optimizer, the checkpointing switch and every measured step."""

    def __init__(self, args, scale: dict):
        self.args, self.scale = args, scale
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        torch.manual_seed(args.seed)
        config = DiTConfig(in_channels=scale["channels"], out_channels=scale["channels"], dim=scale["dim"],
                           num_layers=args.blocks, num_heads=scale["heads"], ffn_dim=scale["ffn_dim"],
                           text_dim=scale["text_dim"], freq_dim=scale["freq_dim"])
        self.model = VideoDiT(config).to(self.device)
        self.switch = BlockCheckpointing(find_blocks(self.model, select_instances([DiTBlock])))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.generator = torch.Generator(device=self.device).manual_seed(args.seed)
        self.results: dict[tuple[int, int, int], Measured] = {}
        self.deadline = time.monotonic() + args.deadline_s
        self.steps_run = 0
        self.shapes_seen: set[tuple[int, int]] = set()

    def _inputs(self, batch: int, thw: tuple[int, int, int]):
        def randn(*shape):
            return torch.randn(*shape, generator=self.generator, device=self.device)
        latents = randn(batch, self.scale["channels"], *thw)
        text = randn(batch, self.scale["text_tokens"], self.scale["text_dim"])
        t = torch.rand(batch, generator=self.generator, device=self.device)
        return latents, text, t, randn(*latents.shape)

    def step(self, batch: int, thw: tuple[int, int, int], k: int) -> tuple[float, int, int]:
        """One training step (forward, backward, AdamW step): (ms, peak bytes, reserved bytes). Peak on
        CUDA: max_memory_allocated over the step, inputs included; on CPU: bytes autograd keeps for
        backward (no allocator statistics there)."""
        self.switch.set_checkpointed(k)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        inputs = self._inputs(batch, thw)
        saved = _SavedTensorBytes()
        forward_context = (torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda
                           else torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x))
        if self.cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        with forward_context:
            loss = flow_matching_loss(self.model, *inputs)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - begin) * 1e3
        if self.cuda:
            return elapsed, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        return elapsed, saved.total, 0

    def run(self, points: list[tuple[int, int, int]], shapes: dict[int, tuple], passes: int, seed: int) -> None:
        """One untimed warm-up pass and `passes` timed passes over the (B, S, k) points, each pass in its own
        shuffled order; an out-of-memory point is not run again."""
        rng = np.random.default_rng(seed)
        for timed in [False] + [True] * passes:
            for i in rng.permutation(len(points)):
                key = points[i]
                record = self.results.setdefault(key, Measured())
                if record.oom or time.monotonic() > self.deadline:
                    continue
                batch, seq_len, k = key
                out_of_memory = False
                try:
                    ms, peak, reserved = self.step(batch, shapes[seq_len], k)
                except torch.OutOfMemoryError:
                    out_of_memory = True
                self.steps_run += 1
                if out_of_memory:  # outside the except block: the traceback no longer pins activations
                    record.oom = True
                    self.optimizer.zero_grad(set_to_none=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                    print(f"  OOM at B={batch} S={seq_len} k={k}", flush=True)
                    continue
                record.peaks.append(peak)
                record.reserved.append(reserved)
                if timed:
                    record.times_ms.append(ms)
                elif record.first_ms is None:
                    record.first_ms = ms
                    record.first_was_new_shape = (batch, seq_len) not in self.shapes_seen
                self.shapes_seen.add((batch, seq_len))

    def median_ms(self, key) -> float:
        return float(np.median(self.results[key].times_ms))


def grid_points(tokens: np.ndarray, m_mem: int, num_blocks: int, second_depth: int, grid_buckets: int):
    """(B, S, k) of the fit grid: at k = L the token-equal batch and a quarter of it at `grid_buckets`
    buckets evenly spread in rank order over the mix's buckets <= m_mem (so B and S both vary); the quarter
    batches again at k = second_depth (smaller batches: a partly checkpointed model needs more memory)."""
    fitting = np.unique(tokens[tokens <= m_mem])
    picks = fitting[np.unique(np.linspace(0, fitting.size - 1, min(grid_buckets, fitting.size)).round().astype(int))]
    full, second = [], []
    for s in picks:
        b = max(1, m_mem // int(s))
        full += [(b, int(s), num_blocks), (max(1, b // 4), int(s), num_blocks)]
        second.append((max(1, b // 4), int(s), second_depth))
    return sorted(set(full)), sorted(set(second))


def fit_models(bench: Bench, points: list[tuple[int, int, int]], num_blocks: int):
    """MemoryModel and DepthCostModel of the measured grid points (a point below k = L only where its
    (B, S) also ran at k = L: the recompute fraction is fitted to such pairs)."""
    ok = [p for p in points if bench.results[p].ok]
    ok = [(b, s, k) for b, s, k in ok if k == num_blocks or (b, s, num_blocks) in ok]
    b, s, k = (np.array([p[i] for p in ok], dtype=np.float64) for i in range(3))
    peak = np.array([max(bench.results[p].peaks) for p in ok], dtype=np.float64)
    ms = np.array([bench.median_ms(p) for p in ok])
    return MemoryModel.fit(b, s, k, peak, num_blocks), DepthCostModel.fit(b, s, k, ms, num_blocks)


def schedules(tokens, m_mem, choice, cost, num_blocks) -> dict[str, dict[int, tuple[int, int]]]:
    """configuration -> {bucket seq_len: (B, k)} of the buckets it trains."""
    fitting = tokens[tokens <= m_mem]
    m_comp = cost.base.m_comp(m_mem, int(fitting.max()))
    balanced = batch_sizes(fitting, "dual_constraint", m_mem, m_comp, cost.base.dual_p)
    return {
        "token_equal_ac": {int(s): (max(1, m_mem // int(s)), num_blocks) for s in fitting},
        "balanced_ac": {int(s): (int(b), num_blocks) for s, b in zip(fitting, balanced)},
        "per_bucket": {int(s): (int(b), int(k)) for s, b, k, f in zip(choice.seq_lens, choice.batch_size,
                                                                        choice.checkpointed, choice.fits) if f},
    }


def summarise(bench: Bench, plan: dict[int, tuple[int, int]], counts: dict[int, int], memory, cost) -> dict:
    rows, epoch_tokens, epoch_s, first_excess_s, trained, peaks, reserved = [], 0.0, 0.0, 0.0, 0, [], []
    for s, (b, k) in sorted(plan.items()):
        record = bench.results.get((b, s, k), Measured())
        predicted = memory.predict(b, s, k)
        row = {"seq_len": s, "batch_size": b, "checkpointed": k, "samples_in_mix": counts[s],
               "status": "oom" if record.oom else ("ok" if record.ok else "not_run"),
               "predicted_peak_gib": predicted / GiB, "predicted_ms": cost.predict(b, s, k)}
        if record.peaks:
            peak = max(record.peaks)
            row |= {"measured_peak_gib": peak / GiB, "peak_rel_err": (predicted - peak) / peak,
                    "reserved_gib": max(record.reserved) / GiB}
            peaks.append(peak)
            reserved.append(max(record.reserved))
        if record.ok:
            ms = bench.median_ms((b, s, k))
            row |= {"measured_ms": ms, "time_rel_err": (row["predicted_ms"] - ms) / ms, "timed_steps": record.times_ms,
                    "first_ms": record.first_ms, "first_was_new_shape": record.first_was_new_shape}
            epoch_tokens += counts[s] * s
            epoch_s += counts[s] / b * ms / 1e3
            first_excess_s += (record.first_ms - ms) / 1e3
            trained += counts[s]
        rows.append(row)
    errors = [abs(r["peak_rel_err"]) for r in rows if "peak_rel_err" in r]
    return {
        "buckets": rows,
        "epoch_tokens_per_s": epoch_tokens / epoch_s if epoch_s else None,
        "epoch_s": epoch_s,
        "first_epoch_s": epoch_s + first_excess_s,
        "fraction_of_mix_trained": trained / sum(counts.values()),
        "buckets_oom": [r["seq_len"] for r in rows if r["status"] == "oom"],
        "buckets_not_run": [r["seq_len"] for r in rows if r["status"] == "not_run"],
        "max_peak_gib": max(peaks) / GiB if peaks else None,
        "max_reserved_gib": max(reserved) / GiB if reserved else None,
        "peak_rel_err_max": max(errors) if errors else None,
        "peak_rel_err_mean": float(np.mean(errors)) if errors else None,
    }


def grid_row(bench: Bench, key: tuple[int, int, int]) -> dict:
    record = bench.results[key]
    return {"batch_size": key[0], "seq_len": key[1], "checkpointed": key[2],
            "status": "oom" if record.oom else "ok" if record.ok else "not_run",
            "peak_gib": max(record.peaks) / GiB if record.peaks else None,
            "time_ms": bench.median_ms(key) if record.ok else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a toy model on the demo mix (CPU smoke test)")
    parser.add_argument("--blocks", type=int, default=None, help="DiT blocks (default 12; tiny: 4)")
    parser.add_argument("--m-mem", type=int, default=None, help="token cap per batch (default 65536; tiny: 256)")
    parser.add_argument("--grid-buckets", type=int, default=5, help="buckets in the fit grid")
    parser.add_argument("--second-depth", type=int, default=None, help="second checkpointing depth (default L // 2)")
    parser.add_argument("--grid-repeats", type=int, default=1, help="timed passes over the grid")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes over the configurations' steps")
    parser.add_argument("--max-memory-fraction", type=float, default=0.85)
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="memory the choice plans for (default: the GPU's; CPU: 4x the token_equal peak)")
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--deadline-s", type=float, default=210.0, help="start no step after this many seconds")
    parser.add_argument("--allocator-conf", default="expandable_segments:True",
                        help="PYTORCH_CUDA_ALLOC_CONF unless already set: expandable segments keep changing "
                             "shapes from fragmenting memory, which matters once the plan fills the device")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "memory_plan_h200.json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    scale = SCALES["tiny" if args.tiny else "full"]
    args.blocks = args.blocks or (4 if args.tiny else 12)
    args.m_mem = args.m_mem or scale["m_mem"]
    second_depth = args.blocks // 2 if args.second_depth is None else args.second_depth
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", args.allocator_conf)  # read when CUDA first allocates
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("memory_plan.py: no CUDA device (use --device cpu --tiny for the smoke test)")
    if args.device == "cpu":
        torch.set_num_threads(1)  # the shared CPU machine; timings mean nothing here anyway

    mix = read_shapes_jsonl(scale["mix"])
    tokens = mix.tokens
    if len(np.unique(tokens)) != len(tokens):
        raise SystemExit(f"{scale['mix']}: two shapes with the same token count; this benchmark keys buckets by S")
    shapes = {int(s): tuple(int(v) for v in thw) for s, thw in zip(tokens, mix.latent_thw)}
    counts = {int(s): int(c) for s, c in zip(tokens, mix.counts)}
    bench = Bench(args, scale)
    L = bench.switch.num_blocks
    print(f"{L} blocks, {len(tokens)} buckets, m_mem {args.m_mem}, device {args.device}", flush=True)
    smallest = int(tokens.min())
    bench.step(max(1, args.m_mem // smallest), shapes[smallest], L)  # creates AdamW's state before any peak

    full, second = grid_points(tokens, args.m_mem, L, second_depth, args.grid_buckets)
    bench.run(full + second, shapes, args.grid_repeats, seed=args.seed)
    memory, cost = fit_models(bench, full + second, L)
    print(f"grid: {bench.steps_run} steps, {time.monotonic() - started:.0f} s\n  {memory}\n  quality "
          f"{ {k: round(v, 4) for k, v in memory.quality.items()} }\n  {cost}\n  time-with-k quality "
          f"{ {k: round(v, 4) for k, v in cost.quality.items()} }", flush=True)

    if args.device_memory_gib is not None:
        device_bytes = args.device_memory_gib * GiB
    elif bench.cuda:
        device_bytes = float(torch.cuda.get_device_properties(0).total_memory)
    else:
        te = np.maximum(1, args.m_mem // tokens)
        device_bytes = 4.0 * float(np.max(memory.predict(te, tokens, L)))  # room for some k < L
    choice = choose_batch_and_depth(tokens, memory, cost, device_memory_bytes=device_bytes,
                                    max_memory_fraction=args.max_memory_fraction, max_tokens=args.m_mem,
                                    max_batch_size=args.max_batch_size)
    plans = schedules(tokens, args.m_mem, choice, cost, L)
    steps = sorted({(b, s, k) for plan in plans.values() for s, (b, k) in plan.items()} - set(bench.results))
    print(f"choice done; {len(steps)} more (B, S, k) to run", flush=True)
    bench.run(steps, shapes, args.repeats, seed=args.seed + 1)

    results = {name: summarise(bench, plans[name], counts, memory, cost) for name in CONFIGS}
    rate = {name: results[name]["epoch_tokens_per_s"] for name in CONFIGS}
    # per_bucket also trains the samples over m_mem that the others drop; on the same samples alone:
    same = summarise(bench, {s: v for s, v in plans["per_bucket"].items() if s in plans["balanced_ac"]}, counts,
                     memory, cost)["epoch_tokens_per_s"]
    summary = {
        "per_bucket_vs_balanced_ac_same_samples": same / rate["balanced_ac"] - 1 if same and rate["balanced_ac"]
        else None,
        "per_bucket_vs_balanced_ac": rate["per_bucket"] / rate["balanced_ac"] - 1
        if rate["per_bucket"] and rate["balanced_ac"] else None,
        "per_bucket_vs_token_equal_ac": rate["per_bucket"] / rate["token_equal_ac"] - 1
        if rate["per_bucket"] and rate["token_equal_ac"] else None,
        "unfit_buckets": choice.unfit_seq_lens.tolist(),
        "incomplete": any(results[n]["buckets_not_run"] for n in CONFIGS),
        "device_memory_gib": device_bytes / GiB,
        "budget_gib": choice.budget_bytes / GiB,
        "wall_s": time.monotonic() - started,
        "steps_run": bench.steps_run,
    }
    doc = {**run_meta("memory_plan", argv), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                         for k, v in vars(args).items()},
           "model": {**{k: v for k, v in scale.items() if k != "mix"}, "blocks": L, "mix": str(scale["mix"].name),
                     "dtype": "fp32 weights, bf16 autocast" if bench.cuda else "fp32", "optimizer": "AdamW",
                     "PYTORCH_CUDA_ALLOC_CONF": os.environ["PYTORCH_CUDA_ALLOC_CONF"]},
           "memory_model": {"form": memory.form, "params": memory.params, "quality": memory.quality},
           "time_model": {"base_form": cost.base.form, "base_params": cost.base.params,
                          "base_quality": cost.base.quality, "recompute_fraction": cost.recompute_fraction,
                          "quality": cost.quality},
           "grid": [grid_row(bench, p) for p in full + second],
           "choice": choice.rows(), "configurations": results, "summary": summary}
    write_result(args.out, _plain(doc), announce=False, allow_nan=False)

    print_tables(results, summary, choice.budget_bytes, L)
    print(f"wrote {args.out}")
    return 0


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(scale * value, spec)


def print_tables(results: dict, summary: dict, budget_bytes: float, num_blocks: int) -> None:
    print(f"\n{'configuration':16s} {'tokens/s':>10s} {'epoch s':>8s} {'1st epoch s':>11s} {'mix trained':>11s} "
          f"{'peak GiB':>9s} {'reserved':>9s} {'peak err max %':>14s} {'OOM':>4s}")
    for name in CONFIGS:
        r = results[name]
        print(f"{name:16s} {_fmt(r['epoch_tokens_per_s'], '10.0f')} {r['epoch_s']:8.0f} {r['first_epoch_s']:11.0f} "
              f"{_fmt(r['fraction_of_mix_trained'], '10.1f', 100)}% "
              f"{_fmt(r['max_peak_gib'], '9.2f')} {_fmt(r['max_reserved_gib'], '9.2f')} "
              f"{_fmt(r['peak_rel_err_max'], '14.1f', 100)} {len(r['buckets_oom']):4d}")
    print(f"\nper_bucket, {num_blocks} blocks, budget {budget_bytes / GiB:.1f} GiB:")
    print(f"{'S':>6s} {'B':>4s} {'k':>3s} {'pred GiB':>9s} {'meas GiB':>9s} {'err %':>6s} {'pred ms':>8s} "
          f"{'meas ms':>8s}")
    for row in results["per_bucket"]["buckets"]:
        print(f"{row['seq_len']:6d} {row['batch_size']:4d} {row['checkpointed']:3d} "
              f"{row['predicted_peak_gib']:9.2f} {_fmt(row.get('measured_peak_gib'), '9.2f')} "
              f"{_fmt(row.get('peak_rel_err'), '6.1f', 100)} {row['predicted_ms']:8.1f} "
              f"{_fmt(row.get('measured_ms'), '8.1f')}")
    print(f"\nper_bucket tokens/s vs balanced_ac: {_fmt(summary['per_bucket_vs_balanced_ac'], '+.1f', 100)}% "
          f"({_fmt(summary['per_bucket_vs_balanced_ac_same_samples'], '+.1f', 100)}% on the samples both train), "
          f"vs token_equal_ac: {_fmt(summary['per_bucket_vs_token_equal_ac'], '+.1f', 100)}%; "
          f"{summary['steps_run']} steps in {summary['wall_s']:.0f} s"
          + (" (INCOMPLETE: deadline reached)" if summary["incomplete"] else ""))


def _plain(value):
    """JSON-ready: numpy scalars as Python numbers, NaN (unknown, e.g. a held-out error of one pair) as null."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


if __name__ == "__main__":
    raise SystemExit(main())
