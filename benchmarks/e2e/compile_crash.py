"""Where `compile: dynamic` fails at 75,600 tokens: each variant in its own process with
CUDA_LAUNCH_BLOCKING=1 (an illegal memory access poisons the CUDA context, and the blocking launch names
the kernel that faulted), on the example DiT with `--blocks` Wan-1.3B-shaped blocks (default 30, as
shipped), B = 1 at the latents of `--latents` (default 1x32x32 then 21x90x160: S = 256, 75,600 at patch
(1, 2, 2), the order calibration meets them), forward + backward, bf16 autocast.

    python benchmarks/e2e/compile_crash.py --out benchmarks/results/compile_crash_h200.json     # one H200, ~8 min

Variants (`--variants`, in order): eager or compiled with `dynamic=True` as VideoDiTModule does it
(`regional_compile.compile_blocks`: contiguous inputs of their own storage, plain tensor attributes
such as FSDP1's parameter views marked static; `_unmarked`: not marked, as before that fix) or, `_views`, by
`nn.Module.compile` alone, views reaching the compiled region (how the examples compiled when the
crash was seen, gpu_session6); with or without the fused AdaLN surgery, with the per-step
checkpointing switch at k of L blocks
checkpointed (BlockCheckpointing wraps each block's forward before it is compiled, as
PerBucketCheckpointing and configure_model order it, so torch.utils.checkpoint runs inside the
compiled region), under single-process FSDP1 (one unit per block, use_orig_params, Lightning's
bf16-mixed policy: parameters, reductions and buffers in bf16) or not, and with one SDPA backend forced.
Each shape's forward runs with the previous shape's gradients held, as under Lightning's automatic
optimization (zero_grad after training_step, before backward). Per variant and shape: ok or the error's
last lines and the generated-code line that launched the faulting kernel, and which SDPA aten op the
compiled graphs call (from the post-grad graphs: TORCH_LOGS=post_grad_graphs). The result file is
rewritten after each variant.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, run_meta, write_result  # noqa: E402

LATENTS = [(1, 32, 32), (21, 90, 160)]


def _variant(compile: bool, fused: bool = True, checkpointed: int | None = None, fsdp: bool = False,
             sdpa: str | None = None, views: bool = False, unmarked: bool = False) -> dict:
    return dict(compile=compile, fused=fused, checkpointed=checkpointed, fsdp=fsdp, sdpa=sdpa, views=views,
                unmarked=unmarked)


VARIANTS = {  # checkpointed: k blocks of --blocks (-1: all of them, -2: half)
    "dynamic_fused_ckpt_half": _variant(True, checkpointed=-2),
    "dynamic_fused_ckpt_half_views": _variant(True, checkpointed=-2, views=True),
    "dynamic_plain_ckpt_half": _variant(True, fused=False, checkpointed=-2),
    "dynamic_fused_ckpt_all": _variant(True, checkpointed=-1),
    "dynamic_fused_ckpt_all_views": _variant(True, checkpointed=-1, views=True),  # fits an 80 GB card
    "dynamic_fused_fsdp_ckpt_half": _variant(True, checkpointed=-2, fsdp=True),
    "dynamic_fused_fsdp_ckpt_all": _variant(True, checkpointed=-1, fsdp=True),
    "dynamic_fused_fsdp_ckpt_all_unmarked": _variant(True, checkpointed=-1, fsdp=True, unmarked=True),
    "dynamic_fused_fsdp_ckpt_all_views": _variant(True, checkpointed=-1, fsdp=True, views=True),  # as gpu_session6 crashed
    "dynamic_fused": _variant(True),
    "eager_fused_ckpt_half": _variant(False, checkpointed=-2),
    "dynamic_fused_ckpt_half_flash": _variant(True, checkpointed=-2, sdpa="FLASH_ATTENTION"),
    "dynamic_fused_ckpt_half_efficient": _variant(True, checkpointed=-2, sdpa="EFFICIENT_ATTENTION"),
}
SDPA_OPS = re.compile(r"aten\._scaled_dot_product_\w+")


def child(variant: str, blocks: int, latents: list[tuple[int, int, int]]) -> None:
    """One variant's shapes in order; prints one JSON line per shape (flushed before the next)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.e2e._fsdp import single_process_fsdp1
    from examples.video_dit.model import DiTConfig, VideoDiT, flow_matching_loss
    from examples.video_dit.surgery import VIDEO_DIT_PATTERNS
    from lightning_adaptiveload.checkpointing.switch import BlockCheckpointing
    from lightning_adaptiveload import regional_compile
    from lightning_adaptiveload.surgery import apply_fused_adaln

    spec = VARIANTS[variant]
    torch.manual_seed(0)
    model = VideoDiT(DiTConfig(num_layers=blocks)).cuda()
    if spec["fused"]:
        apply_fused_adaln(model, extra_patterns=VIDEO_DIT_PATTERNS)
    if spec["checkpointed"] is not None:
        k = {-1: blocks, -2: blocks // 2}.get(spec["checkpointed"], spec["checkpointed"])
        BlockCheckpointing(list(model.blocks)).set_checkpointed(k)
    if spec["compile"] and spec["views"]:
        for block in model.blocks:
            block.compile(dynamic=True)
    elif spec["compile"]:
        if spec["unmarked"]:  # FSDP1's parameter views left with symbolic sizes, as before the fix
            torch._dynamo.mark_static = lambda *args, **kwargs: None
        regional_compile.compile_blocks(model.blocks, "dynamic")
    network = single_process_fsdp1(model, "cuda") if spec["fsdp"] else model
    for thw in latents:
        latents_ = torch.randn(1, 16, *thw, device="cuda")
        text = torch.randn(1, 512, 4096, device="cuda")
        backend = sdpa_kernel([getattr(SDPBackend, spec["sdpa"])]) if spec["sdpa"] else None
        begin = time.perf_counter()
        try:
            with backend if backend is not None else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = flow_matching_loss(network, latents_, text, torch.rand(1, device="cuda"),
                                              torch.randn_like(latents_))
                network.zero_grad(set_to_none=True)  # Lightning's order: after the forward, before backward
                loss.backward()
            torch.cuda.synchronize()
            row = {"latent": thw, "status": "ok", "loss": float(loss), "seconds": round(time.perf_counter() - begin, 2),
                   "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
        except Exception as e:  # noqa: BLE001 - reported, then the process ends (a poisoned context)
            import traceback

            frames = [f for f in traceback.extract_tb(e.__traceback__) if "torchinductor" in f.filename]
            row = {"latent": thw, "status": "error", "error": f"{type(e).__name__}: {str(e)[:600]}",
                   "generated_line": None if not frames else f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}",
                   "traceback_tail": traceback.format_exc().splitlines()[-30:]}
            print(json.dumps(row), flush=True)
            return
        print(json.dumps(row), flush=True)


def _latent(text: str) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in text.split("x"))
    return t, h, w


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--latents", type=_latent, nargs="+", default=LATENTS, help="TxHxW, in order")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--child", choices=sorted(VARIANTS))
    parser.add_argument("--timeout-s", type=float, default=150.0, help="per variant")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="variants not started once it is spent")
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.blocks, args.latents)
    meta = run_meta("compile_crash", argv)  # before any variant runs: an environment that cannot describe itself fails in seconds
    start, results = time.perf_counter(), {}
    for variant in args.variants:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            results[variant] = {"rc": "not run: budget spent"}
            continue
        env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "TORCH_LOGS": "post_grad_graphs", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        command = [sys.executable, __file__, "--out", str(args.out), "--child", variant, "--blocks", str(args.blocks),
                   "--latents", *("x".join(map(str, thw)) for thw in args.latents)]
        begin = time.perf_counter()
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=min(args.timeout_s, left))
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            stdout, stderr, rc = decode(e.stdout), decode(e.stderr), "timeout"
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        results[variant] = {**VARIANTS[variant], "rc": rc, "seconds": round(time.perf_counter() - begin, 1), "shapes": rows,
                            "sdpa_ops": sorted(set(SDPA_OPS.findall(stderr))),
                            "stderr_tail": [line for line in stderr.splitlines() if not line.startswith(("V", "I", "    "))][-20:]}
        print(f"{variant:34s} rc={rc} {results[variant]['seconds']:6.1f}s "
              + " ".join(f"{tuple(r['latent'])}:{r['status']}" for r in rows) + f" sdpa={results[variant]['sdpa_ops']}",
              flush=True)
        write_result(args.out, {**meta, "blocks": args.blocks, "latents": args.latents,
                                "variants": results})


if __name__ == "__main__":
    main()
