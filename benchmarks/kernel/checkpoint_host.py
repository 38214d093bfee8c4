"""Host (CPU) time a checkpointed block adds to a training step: plain, recomputed whole, or recomputed with
its attention kept (selective checkpointing, lightning_adaptiveload.checkpointing).

    python benchmarks/kernel/checkpoint_host.py          # CPU, ~1 min

Where a step is launch-bound (short sequences on a GPU) its time is the host's: every op dispatched in
Python and C++. Selective checkpointing runs the checkpointed block's forward and recomputation under a
dispatch mode that sees every op, which costs host time per op; recomputing the block whole costs the
block's ops once more. This measures both on the CPU with tensors so small (B = 2, 16 tokens, D = 64) that
the arithmetic is negligible and the time is the dispatch: a 30-block stack of pre-norm attention + MLP
blocks (fused SDPA on 4 heads), forward + backward, one intra-op thread, CPU time (`time.process_time`),
the fastest of `--rounds` rounds of `--steps` steps (interleaved settings, so a busy machine slows all
alike), for every block checkpointed with the attention kept, recomputed, and no block checkpointed.
Writes benchmarks/results/checkpoint_host_cpu.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.checkpointing import BlockCheckpointing  # noqa: E402

BLOCKS, DIM, HEADS, BATCH, TOKENS = 30, 64, 4, 2, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.proj = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "checkpoint_host_cpu.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(*(Block() for _ in range(BLOCKS)))
    x = torch.randn(BATCH, TOKENS, DIM)
    settings = {"attention kept": (True, BLOCKS), "recomputed whole": (False, BLOCKS), "not checkpointed": (True, 0)}
    best = {name: float("inf") for name in settings}
    for _ in range(args.rounds):
        for name, (keep, k) in settings.items():
            BlockCheckpointing(list(net), save_attention=keep).set_checkpointed(k)
            for _ in range(2):
                net(x).sum().backward()
            begin = time.process_time()
            for _ in range(args.steps):
                net(x).sum().backward()
            best[name] = min(best[name], (time.process_time() - begin) / args.steps * 1e3)
    plain = best["not checkpointed"]
    rows = {name: {"step_ms": ms, "per_checkpointed_block_ms": None if name == "not checkpointed" else (ms - plain) / BLOCKS}
            for name, ms in best.items()}
    print(f"{'setting':>18} {'host ms/step':>13} {'ms per checkpointed block':>26}")
    for name, row in rows.items():
        per_block = "-" if row["per_checkpointed_block_ms"] is None else f"{row['per_checkpointed_block_ms']:.2f}"
        print(f"{name:>18} {row['step_ms']:13.2f} {per_block:>26}")
    doc = run_meta("checkpoint_host", argv) | {
        "description": __doc__.strip().splitlines()[0],
        "settings": {"blocks": BLOCKS, "dim": DIM, "heads": HEADS, "batch": BATCH, "tokens": TOKENS,
                     "steps": args.steps, "rounds": args.rounds, "threads": 1,
                     "timing": "time.process_time per forward+backward, fastest round"},
        "rows": rows}
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
