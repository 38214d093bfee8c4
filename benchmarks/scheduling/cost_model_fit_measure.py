"""Measure DiT step times on a GPU: the fit grid (twice, for run-to-run noise) and the (B, S)
pairs that bucket tables schedule, so the cost model can be checked on shapes it never saw.

Model: `blocks` Wan-2.1 DiTBlocks from examples/video_dit (default: 4 blocks of Wan-1.3B, D=1536,
12 heads, FFN 8960) with 512 text tokens, bf16 weights, eager PyTorch, SDPA; one step is
forward + backward of the blocks (loss = sum(out * random)), timed with triton's do_bench
(median ms, gradients reset between runs).

Shapes: the (B, S) grid of --grid (default the shipped H200 curve), then for every m_mem in
--m-mems the dual-constraint schedule of --mix (M_comp = CostModel.m_comp with S_ref = longest
bucket, p from the power form fitted to --grid), then the grid again in reverse order.

    python benchmarks/scheduling/cost_model_fit_measure.py --out-dir benchmarks/results   # on a CUDA GPU
    python benchmarks/scheduling/cost_model_fit_measure.py --dry-run                      # list shapes only
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, run_meta, write_result  # noqa: E402
from examples.video_dit.model import DiTBlock, rope_3d  # noqa: E402
from lightning_adaptiveload.scheduling.cost_model import CostModel, read_measurements  # noqa: E402
from lightning_adaptiveload.scheduling.policies import batch_sizes  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl  # noqa: E402

DATA = REPO / "lightning_adaptiveload" / "data"


def scheduled_pairs(mix_path: str, m_mems: list[int], p_model: CostModel) -> list[tuple[int, int, int]]:
    """(m_mem, B, S) of every bucket of the mix under the dual-constraint rule, S_ref = longest."""
    tokens = np.unique(read_shapes_jsonl(mix_path).tokens)
    pairs = []
    for m_mem in m_mems:
        m_comp = p_model.m_comp(m_mem, int(tokens.max()))
        for b, s in zip(batch_sizes(tokens, "dual_constraint", m_mem, m_comp, p_model.p), tokens):
            pairs.append((m_mem, int(b), int(s)))
    return pairs


def step_time_ms(blocks: torch.nn.ModuleList, batch_size: int, seq_len: int, text_tokens: int,
                 generator: torch.Generator) -> tuple[float, float]:
    """(median ms of forward+backward, peak GiB) for one (B, S), random bf16 inputs."""
    from triton.testing import do_bench

    dim = blocks[0].norm1.normalized_shape[0]
    head_dim = dim // blocks[0].self_attn.num_heads
    dev = torch.device("cuda")

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device=dev, dtype=torch.float32).to(dtype)

    x, context = rand(batch_size, seq_len, dim), rand(batch_size, text_tokens, dim)
    e = rand(batch_size, 6, dim, dtype=torch.float32) * 0.1
    grad_out = rand(batch_size, seq_len, dim)
    rope = rope_3d((1, 1, seq_len), head_dim, dev)
    params = list(blocks.parameters())

    def step():
        h = x
        for block in blocks:
            h = block(h, e, context, rope)
        h.backward(grad_out)

    torch.cuda.reset_peak_memory_stats()
    ms = do_bench(step, warmup=25, rep=100, grad_to_none=params, return_mode="median")
    peak = torch.cuda.max_memory_allocated() / 2**30
    del x, context, e, grad_out, rope
    torch.cuda.empty_cache()
    return float(ms), float(peak)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default=str(DATA / "h200_dit_cost_curve.json"), help="measurements JSON: its (B, S)")
    parser.add_argument("--mix", default=str(DATA / "reference_mix.jsonl"))
    parser.add_argument("--m-mems", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn-dim", type=int, default=8960)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", default="h200", help="file names: cost_model_fit_<tag>_{grid,schedule}.json")
    parser.add_argument("--dry-run", action="store_true", help="print the shapes and exit")
    args = parser.parse_args(argv)

    grid_b, grid_s, _ = read_measurements(args.grid)
    grid = [(int(b), int(s)) for b, s in zip(grid_b, grid_s)]
    sched = scheduled_pairs(args.mix, args.m_mems, CostModel.fit(*read_measurements(args.grid), form="power"))
    print(f"{len(grid)} grid shapes (measured twice), {len(sched)} scheduled shapes "
          f"({len({(b, s) for _, b, s in sched})} distinct)")
    if args.dry_run:
        for m_mem, b, s in sched:
            print(f"m_mem={m_mem:7d} B={b:4d} S={s:6d} B*S={b * s:7d}")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("cost_model_fit_measure.py needs a CUDA GPU (use --dry-run to list the shapes)")

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(DiTBlock(args.dim, args.ffn_dim, args.heads) for _ in range(args.blocks))
    blocks = blocks.to(device="cuda", dtype=torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(0)
    jobs = ([("grid", None, b, s) for b, s in grid] + [("schedule", m, b, s) for m, b, s in sched]
            + [("grid_repeat", None, b, s) for b, s in reversed(grid)])
    times: dict[tuple, tuple[float, float]] = {}
    for kind, m_mem, b, s in tqdm(jobs, desc="shapes", mininterval=10):
        times[(kind, m_mem, b, s)] = step_time_ms(blocks, b, s, args.text_tokens, generator)
        tqdm.write(f"{kind} m_mem={m_mem} B={b} S={s}: {times[(kind, m_mem, b, s)][0]:.3f} ms")

    common = {
        **run_meta("cost_model_fit_measure", argv),
        "description": f"Forward+backward time of {args.blocks} Wan-2.1 DiTBlocks (examples/video_dit, D={args.dim}, "
                       f"{args.heads} heads, FFN {args.ffn_dim}, {args.text_tokens} text tokens, bf16, eager, SDPA), "
                       "median of triton do_bench.",
        "model": {"dim": args.dim, "heads": args.heads, "ffn_dim": args.ffn_dim, "text_tokens": args.text_tokens,
                  "blocks": args.blocks, "dtype": "bfloat16"},
    }
    grid_rows = [{"batch_size": b, "seq_len": s, "time_ms": times[("grid", None, b, s)][0],
                  "time_ms_repeat": times[("grid_repeat", None, b, s)][0],
                  "peak_gib": times[("grid", None, b, s)][1]} for b, s in grid]
    sched_rows = [{"batch_size": b, "seq_len": s, "m_mem": m, "time_ms": times[("schedule", m, b, s)][0],
                   "peak_gib": times[("schedule", m, b, s)][1]} for m, b, s in sched]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("grid", grid_rows), ("schedule", sched_rows)):
        path = out / f"cost_model_fit_{args.tag}_{name}.json"
        write_result(path, {**common, "set": name, "measurements": rows})
    rel = [abs(r["time_ms_repeat"] - r["time_ms"]) / r["time_ms"] for r in grid_rows]
    print(f"run-to-run: mean |t2 - t1| / t1 = {100 * np.mean(rel):.2f}%, max {100 * np.max(rel):.2f}%")
    print(f"{'B':>5} {'S':>6} {'ms':>9} {'repeat':>9} {'GiB':>6}")
    for r in grid_rows:
        print(f"{r['batch_size']:5d} {r['seq_len']:6d} {r['time_ms']:9.3f} {r['time_ms_repeat']:9.3f} {r['peak_gib']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
