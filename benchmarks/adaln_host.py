"""Host (Python/dispatch) time per call of `ops.adaln_modulate`, on CPU with the reference path.

Tiny tensors (B, N, D) = (1, 4, 8), so the arithmetic is a few microseconds and the time is the
Python layer: argument checks, the torch.library custom op and its autograd node. On the H200
this layer cost ~40 us per forward and ~0.35 ms per backward (docs/kernel.md); the same code
runs here, so before/after changes to it show up on CPU. Per variant: forward with autograd
recording (as in training), forward + backward (`torch.autograd.grad` to x and the (B, 6, D)
time embedding the shift/scale `chunk` views come from), backward = their difference, and the
reference arithmetic alone (ops/reference.py called directly: what no wrapper can save).
Times are us per call: the best of `--repeats` averages over `--calls` calls (one thread).

    python benchmarks/adaln_host.py --label after --out benchmarks/results/adaln_host_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from lightning_adaptiveload import ops
from lightning_adaptiveload.ops.reference import adaln_bwd_reference, adaln_fwd_reference

BATCH, SEQ, DIM = 1, 4, 8


def best_us_per_call(fn, calls: int, repeats: int) -> float:
    for _ in range(calls // 10 + 1):  # warm-up
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def make_case(x_dtype: torch.dtype, affine: bool) -> tuple:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen).to(x_dtype).requires_grad_()
    emb = torch.randn(BATCH, 6, DIM, generator=gen).requires_grad_()  # fp32, Wan-style
    weight = torch.randn(DIM, generator=gen).requires_grad_() if affine else None
    bias = torch.randn(DIM, generator=gen).requires_grad_() if affine else None
    dy = torch.randn(BATCH, SEQ, DIM, generator=gen).to(x_dtype)
    return x, emb, weight, bias, dy


def bench_case(name: str, x_dtype: torch.dtype, affine: bool, calls: int, repeats: int) -> dict:
    x, emb, weight, bias, dy = make_case(x_dtype, affine)
    leaves = [t for t in (x, emb, weight, bias) if t is not None]

    def forward():
        shift, scale = emb.chunk(6, dim=1)[:2]
        return ops.adaln_modulate(x, shift, scale, weight, bias)

    def forward_backward():
        torch.autograd.grad(forward(), leaves, dy)

    fwd = best_us_per_call(forward, calls, repeats)
    fwd_bwd = best_us_per_call(forward_backward, calls, repeats)
    with torch.no_grad():
        args = (x, emb[:, 0:1], emb[:, 1:2], weight, bias, 1e-6)
        _, mean, rstd = adaln_fwd_reference(*args)
        ref_fwd = best_us_per_call(lambda: adaln_fwd_reference(*args), calls, repeats)
        ref_bwd = best_us_per_call(lambda: adaln_bwd_reference(dy, x, emb[:, 1:2], weight, bias, mean, rstd), calls, repeats)
    return {"case": name, "fwd_us": round(fwd, 1), "fwd_bwd_us": round(fwd_bwd, 1), "bwd_us": round(fwd_bwd - fwd, 1),
            "reference_fwd_us": round(ref_fwd, 1), "reference_bwd_us": round(ref_bwd, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="name of this measurement, e.g. before / after")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/adaln_host_cpu.json"),
                        help="JSON file; runs with other labels already in it are kept")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [
        bench_case("bf16 x, fp32 (B,1,D) chunk views", torch.bfloat16, False, args.calls, args.repeats),
        bench_case("fp32 x, affine", torch.float32, True, args.calls, args.repeats),
    ]
    print(f"host time per call, us ({args.label}; CPU reference path, (B, N, D) = ({BATCH}, {SEQ}, {DIM}))")
    print(f"{'case':<34} {'fwd':>7} {'bwd':>7} {'fwd+bwd':>8} {'ref fwd':>8} {'ref bwd':>8}")
    for r in rows:
        print(f"{r['case']:<34} {r['fwd_us']:>7.1f} {r['bwd_us']:>7.1f} {r['fwd_bwd_us']:>8.1f}"
              f" {r['reference_fwd_us']:>8.1f} {r['reference_bwd_us']:>8.1f}")
    runs = json.loads(args.out.read_text())["runs"] if args.out.is_file() else {}
    runs[args.label] = {
        "device": f"CPU ({platform.processor() or platform.machine()}), 1 thread",
        "backend": ops.backend(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "timing": f"best of {args.repeats} averages over {args.calls} calls, time.perf_counter",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"description": __doc__.strip().splitlines()[0], "runs": runs}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
