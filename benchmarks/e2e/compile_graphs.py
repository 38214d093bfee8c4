"""How many graphs a mixed-shape run of regionally compiled blocks compiles, and why each one.

    python benchmarks/e2e/compile_graphs.py --out benchmarks/results/compile_graphs_cpu.json     # CPU, ~10 min
    python benchmarks/e2e/compile_graphs.py --device cuda --dim 1536 --heads 12 --ffn 8960 --text-dim 4096 \\
        --out benchmarks/results/compile_graphs_h200.json                                          # one GPU
    python benchmarks/e2e/compile_graphs.py --device cuda --backend aot_eager --modes dynamic --ways contiguous \\
        --shapes grid --dim 1536 --heads 12 --ffn 8960 --text-dim 4096 --text-len 512 \\
        --out benchmarks/results/compile_graphs_grid_h200.json                                     # the shipped grid

The example DiT (`--blocks` blocks) with the per-step checkpointing switch (selective, as shipped),
forward + backward over SHAPES in order: (B, T, H, W, blocks checkpointed) of mixed batch sizes (1 and
more), images and clips, every block, some and none checkpointed, as calibration and verification
meet them; `--shapes grid`: the shipped config's calibration grid at its real latent sizes, in the order
calibration runs it (on the GPU, where `dynamic` compiled more graphs than the CPU count below,
benchmarks/results/gpu_session14). Per compile mode (`dynamic`, `auto`) and per way of compiling (`contiguous`:
`regional_compile.compile_blocks`; `plain`: `nn.Module.compile` alone, what the examples did before),
each in a fresh process with an empty inductor cache: per shape the graphs dynamo compiled, the
seconds the step took and the guard failures that made it recompile (dynamo's record, monitoring/compile_counters.RecompileReasons).
The graph count is dynamo's and does not depend on the tensor sizes (`--backend eager` counts the
same graphs in seconds: tests/benchmarks/test_compile_graphs.py); the seconds are inductor's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, run_meta, write_result  # noqa: E402

# (B, T, H, W, blocks checkpointed of 3; scaled to --blocks): B = 1 and B > 1, images and clips
SHAPES = [(1, 1, 8, 8, 3), (1, 5, 8, 8, 3), (4, 1, 8, 8, 3), (2, 5, 8, 8, 1), (1, 9, 12, 12, 2), (1, 9, 12, 12, 0),
          (3, 1, 12, 12, 0), (7, 1, 8, 8, 0), (2, 5, 12, 12, 0), (1, 13, 12, 16, 1), (5, 1, 8, 12, 0), (2, 5, 8, 8, 1)]
# the shipped config's calibration grid in the order calibration runs it (`--shapes grid`): B = 1 at each
# sequence length with every, half and no block checkpointed, then the larger batches (S = T H W / 4 tokens)
GRID = [(1, 1, 32, 32, 3), (1, 1, 32, 32, 1.5), (1, 1, 32, 32, 0), (1, 1, 90, 160, 3), (1, 1, 90, 160, 1.5),
        (1, 1, 90, 160, 0), (1, 21, 32, 56, 3), (1, 21, 32, 56, 1.5), (1, 21, 32, 56, 0), (1, 9, 90, 160, 3),
        (1, 21, 90, 160, 3), (2, 1, 32, 32, 3), (2, 1, 32, 32, 1.5), (2, 1, 32, 32, 0), (4, 1, 32, 32, 3),
        (8, 1, 32, 32, 3), (16, 1, 32, 32, 3), (2, 1, 90, 160, 3), (32, 1, 32, 32, 3), (4, 1, 90, 160, 3),
        (2, 21, 32, 56, 3), (7, 1, 64, 64, 1.5), (7, 1, 32, 32, 1.5)]
SHAPE_SETS = {"mixed": SHAPES, "grid": GRID}
WAYS = ("contiguous", "plain")


def run_shapes(mode: str, way: str, device: str = "cpu", backend: str = "inductor", blocks: int = 3, dim: int = 32,
               heads: int = 2, ffn: int = 64, text_dim: int = 16, text_len: int = 7, shapes: str = "mixed",
               fsdp: bool = False, on_shape=None) -> list[dict]:
    """SHAPE_SETS[`shapes`] (default SHAPES) through a fresh seed-0 model compiled by `way` in `mode`: per shape a dict of the shape,
    the graphs compiled, the step's seconds, its loss and the guard failures logged during it. fsdp: the
    compiled model under one-process FSDP1 as the shipped config trains it (benchmarks/e2e/_fsdp.py),
    under bf16 autocast, each step's gradients kept through the next forward (Lightning zeroes them after
    the forward, before backward)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from examples.video_dit.model import DiTConfig, VideoDiT, flow_matching_loss
    from lightning_adaptiveload.checkpointing.switch import BlockCheckpointing
    from lightning_adaptiveload.monitoring.compile_counters import RecompileReasons
    from lightning_adaptiveload.regional_compile import COMPILE_MODES, compile_blocks

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = VideoDiT(DiTConfig(in_channels=4, out_channels=4, dim=dim, num_layers=blocks, num_heads=heads, ffn_dim=ffn,
                               text_dim=text_dim, freq_dim=32, patch=(1, 2, 2))).to(device)
    switch = BlockCheckpointing(list(model.blocks))
    if way == "contiguous":
        compile_blocks(model.blocks, mode, backend=backend)
    else:
        for block in model.blocks:
            block.compile(dynamic=COMPILE_MODES[mode], backend=backend)
    network = model
    if fsdp:
        from benchmarks.e2e._fsdp import single_process_fsdp1

        network = single_process_fsdp1(model, device)
    reasons = RecompileReasons()
    rows = []
    for b, t, h, w, k in SHAPE_SETS[shapes]:
        switch.set_checkpointed(round(k * blocks / 3))
        g = torch.Generator().manual_seed(b * 1000 + t * 100 + h + w)
        latents = torch.randn(b, 4, t, h, w, generator=g).to(device)
        text = torch.randn(b, text_len, text_dim, generator=g).to(device)
        before = counters["stats"]["unique_graphs"]
        begin = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" or fsdp):
            loss = flow_matching_loss(network, latents, text, torch.rand(b, generator=g).to(device),
                                      torch.randn(latents.shape, generator=g).to(device))
        if fsdp:
            network.zero_grad(set_to_none=True)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        failures = sorted({r.split(": ", 1)[-1][:200] for r in reasons.read()})
        rows.append({"batch_size": b, "latent": [t, h, w], "checkpointed": switch.checkpointed,
                     "new_graphs": counters["stats"]["unique_graphs"] - before,
                     "seconds": round(time.perf_counter() - begin, 3), "loss": float(loss), "guard_failures": failures})
        if on_shape is not None:
            on_shape(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--modes", nargs="+", default=["dynamic", "auto"], choices=["dynamic", "auto"])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--text-dim", type=int, default=16)
    parser.add_argument("--text-len", type=int, default=7)
    parser.add_argument("--shapes", default="mixed", choices=sorted(SHAPE_SETS),
                        help="mixed: 12 small shapes of every kind; grid: the shipped calibration grid, in its order")
    parser.add_argument("--fsdp", action="store_true",
                        help="the model under one-process FSDP1 (gloo on the CPU), as the shipped config trains it")
    parser.add_argument("--child-timeout-s", type=float, default=None,
                        help="stop each mode/way's process after this long and keep the shapes it finished")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = dict(device=args.device, backend=args.backend, blocks=args.blocks, dim=args.dim, heads=args.heads,
                 ffn=args.ffn, text_dim=args.text_dim, text_len=args.text_len, shapes=args.shapes, fsdp=args.fsdp)
    if args.child:
        run_shapes(*args.child, **sizes, on_shape=lambda row: print(json.dumps(row), flush=True))
        return 0
    doc = run_meta("compile_graphs", argv) | {"description": __doc__.strip().splitlines()[0], "sizes": sizes,
                                              "shapes": SHAPE_SETS[args.shapes], "runs": {}}
    for mode in args.modes:
        for way in args.ways:
            with tempfile.TemporaryDirectory() as cache:  # an empty inductor cache: every graph compiles
                command = [sys.executable, __file__, "--out", str(args.out), "--child", mode, way,
                           *[f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in sizes.items()
                             if v is not False]]
                try:
                    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                          env=os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache}, timeout=args.child_timeout_s)
                    code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
                except subprocess.TimeoutExpired as stopped:  # keep the shapes it finished (captured output is bytes)
                    code = "timeout"
                    stdout, stderr = ((b or b"").decode(errors="replace") for b in (stopped.stdout, stopped.stderr))
            rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            doc["runs"][f"{mode}/{way}"] = {"exit": code, "graphs": sum(r["new_graphs"] for r in rows),
                                            "compile_steps_s": round(sum(r["seconds"] for r in rows if r["new_graphs"]), 1),
                                            "shapes": rows, "stderr_tail": stderr[-2000:] if code else ""}
            run = doc["runs"][f"{mode}/{way}"]
            print(f"{mode:8} {way:11} exit {code}  shapes {len(rows)}/{len(SHAPE_SETS[args.shapes])}  "
                  f"graphs {run['graphs']}  steps that compiled: {run['compile_steps_s']} s", flush=True)
            for row in rows:
                print(f"  B={row['batch_size']:<3} latent {row['latent']} k={row['checkpointed']}: {row['new_graphs']} graphs "
                      f"{row['seconds']:8.2f} s  {'; '.join(row['guard_failures'])[:300]}", flush=True)
            write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
