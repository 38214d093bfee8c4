"""Attention backends on one GPU at the shipped shapes, and the whole training step under each of them.

    python benchmarks/kernel/attention.py --out benchmarks/results/attention_h200.json      # one H200, ~3 min
    python benchmarks/kernel/attention.py --smoke --out /tmp/attention_smoke.json           # CPU, tiny, seconds

Model: the example Wan-2.1-1.3B-shaped DiT (examples/video_dit, the shape of h200_fsdp.yaml: D = 1536,
12 heads of 128, FFN 8960, 30 blocks, text 512 x 4096), bf16 autocast, its SDPA calls recorded at two
probe batches and derived for every shape (lightning_adaptiveload.attention: record_sdpa_calls,
CallTemplate), so the kernels see the model's own layouts (strides).

1. Matmul rate: median ms of a bf16 8192^3 torch.matmul, rate = 2 * 8192^3 / time (the yardstick).
2. Kernels: for each shipped latent (T, H, W) at patch (1, 2, 2) (S = T * H/2 * W/2 tokens: image 256x256,
   image 720p, 33 frames 720p, 81 frames 480p, 81 frames 720p) and B = 1, each backend's forward+backward
   of one self-attention call (S x S) and one cross-attention call (S x 512 text tokens), timed and checked
   against the fp32 reference by the package's own `choose_backends` (what AttentionBackends(plan=
   "measure") runs); the backend torch picks by itself is its `torch_default`. Useful FLOPs of one call
   (SdpaCall.forward_flops): forward 4 * B * h * S_q * S_kv * d (two matmuls; S_kv = S or 512), backward
   2.5x forward, so forward+backward = 3.5 * 4 * B * h * S_q * S_kv * d; TFLOP/s = that / time.
3. Step: one optimizer step (forward, backward, fused AdamW) of the 30-block model on the 75,600-token
   sample (latent 21 x 90 x 160, B = 1) in eager under each backend (strict: only that kernel runs),
   with the fused AdaLN surgery when the CUDA op loads (else plain) and `--checkpointed` of the 30 blocks
   activation-checkpointed (default all: the only depth known to fit at this length without a memory
   plan), each checkpointed block keeping its attention's outputs or recomputing them (`--save-attention
   on off`: both, in that order, per backend; lightning_adaptiveload.checkpointing). Model FLOPs of a
   step (useful: the recomputation of checkpointed blocks is not counted):
       linears  6 * sum over nn.Linear and the Conv3d patch embedding of (weight entries x the rows it
                is applied to: video tokens, text tokens or samples), i.e. 6 * params * tokens per layer
                (counted by shape on fake tensors);
       attention 3.5 * sum over the step's SDPA calls of forward_flops x count (as in 2.).
   utilisation = model FLOPs / (step ms * the matmul rate measured in 1.).
`--budget-s` bounds the whole run: a backend's step is skipped (recorded) when the time left cannot hold
its steps, at the last step's duration; the backend torch picks runs first, then the fastest kernels.
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from examples.video_dit.model import DiTConfig, VideoDiT, flow_matching_loss  # noqa: E402
from lightning_adaptiveload.attention import (  # noqa: E402
    CallTemplate, Probe, SdpaCall, attention_backend, candidate_backends, choose_backends, external_status,
    record_sdpa_calls,
)
from lightning_adaptiveload.attention.choose import median_ms  # noqa: E402
from lightning_adaptiveload.checkpointing import BlockCheckpointing  # noqa: E402

BACKWARD_FACTOR = 2.5  # backward / forward FLOPs of attention (SdpaCall.forward_flops' docstring)
WAN_1_3B = dict(config=dict(in_channels=16, out_channels=16, dim=1536, num_layers=30, num_heads=12, ffn_dim=8960,
                            text_dim=4096, freq_dim=256, patch=(1, 2, 2)),
                text_len=512, matmul_n=8192,
                # shipped reference-mix latents: 256x256 image, 720p image, 33 x 720p, 81 x 480p, 81 x 720p
                latents=[(1, 32, 32), (1, 90, 160), (9, 90, 160), (21, 60, 104), (21, 90, 160)],
                step_latent=(21, 90, 160), probes=[(2, (1, 32, 32)), (3, (1, 64, 64))])
SMOKE = dict(config=dict(in_channels=4, out_channels=4, dim=64, num_layers=2, num_heads=4, ffn_dim=128, text_dim=32,
                         freq_dim=32, patch=(1, 2, 2)),
             text_len=8, matmul_n=256, latents=[(1, 8, 8), (2, 16, 16)], step_latent=(2, 16, 16),
             probes=[(2, (1, 8, 8)), (3, (1, 16, 16))])


def tokens_of(latent: tuple[int, int, int], patch: tuple[int, int, int]) -> int:
    return math.prod(n // p for n, p in zip(latent, patch))


def matmul_rate(n: int, device: torch.device, warmup: int, repeats: int) -> dict:
    """bf16 (n x n) @ (n x n): median ms and TFLOP/s at 2 n^3 FLOPs."""
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = median_ms(lambda: torch.matmul(a, b), device, warmup, repeats)
    return {"n": n, "dtype": "bfloat16", "ms": ms, "tflops": 2 * n ** 3 / (ms * 1e-3) / 1e12}


def make_inputs(config: DiTConfig, text_len: int, batch: int, latent: tuple, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    return {"latents": torch.randn(batch, config.in_channels, *latent, generator=g, device=device),
            "text": torch.randn(batch, text_len, config.text_dim, generator=g, device=device),
            "t": torch.rand(batch, generator=g, device=device),
            "noise": torch.randn(batch, config.in_channels, *latent, generator=g, device=device)}


def record(model: VideoDiT, config: DiTConfig, text_len: int, batch: int, latent: tuple, device) -> list[SdpaCall]:
    x = make_inputs(config, text_len, batch, latent, device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        return record_sdpa_calls(lambda: model(x["latents"], x["t"], x["text"]))


def linear_forward_flops(config: DiTConfig, text_len: int, batch: int, latent: tuple) -> float:
    """Forward FLOPs of every nn.Linear and nn.Conv3d of the model on one batch: 2 x weight entries x
    the rows each is applied to, counted by shape on fake tensors (nothing is computed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    total = 0

    def count(module, inputs, out):
        nonlocal total
        rows = out.numel() // (out.shape[1] if isinstance(module, torch.nn.Conv3d) else out.shape[-1])
        total += 2 * module.weight.numel() * rows

    with FakeTensorMode():
        model = VideoDiT(config)
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d)):
                module.register_forward_hook(count)
        latents = torch.empty(batch, config.in_channels, *latent)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(latents, torch.empty(batch), torch.empty(batch, text_len, config.text_dim))
    return float(total)


def kernel_rows(calls_by_latent: dict, backends: list[str], device, warmup: int, repeats: int) -> list[dict]:
    """Per latent and kind (self, cross): every backend's forward+backward ms and TFLOP/s of one call,
    its error against the fp32 reference, the fastest correct one and torch's own pick."""
    rows = []
    for kind in ("self", "cross"):
        one = {}
        for latent, calls in calls_by_latent.items():
            call = [c for c in calls if (c.k_shape[-2] == c.q_shape[-2]) == (kind == "self")]
            if len(call) != 1:
                raise RuntimeError(f"expected one {kind}-attention call at latent {latent}, recorded {calls}")
            one[call[0].q_shape[-2]] = (latent, replace(call[0], count=1))
        plan = choose_backends({s: [c] for s, (_, c) in one.items()}, backends=backends, device=device,
                               warmup=warmup, repeats=repeats)
        for s, (latent, call) in one.items():
            bucket = plan.buckets[s]
            flops = (1 + BACKWARD_FACTOR) * call.forward_flops
            results = {r.backend: {"ms": r.ms, "tflops": None if r.ms is None else flops / (r.ms * 1e-3) / 1e12,
                                   "max_rel_err": r.max_rel_err, "tolerance": r.tolerance, "error": r.error}
                       for r in bucket.results}
            rows.append({"kind": kind, "latent": list(latent), "seq_len": s, "seq_kv": call.k_shape[-2],
                         "batch_size": call.q_shape[0], "heads": call.q_shape[1], "head_dim": call.q_shape[-1],
                         "q_stride": list(call.q_stride), "k_stride": list(call.k_stride),
                         "fwd_bwd_flops": flops, "fastest_correct": bucket.backend,
                         "torch_default": bucket.torch_default, "backends": results})
            cells = "  ".join(f"{n} {r['ms']:.3g} ms {r['tflops']:.3g} TF/s" if r["ms"] is not None else f"{n} failed"
                              for n, r in results.items())
            print(f"  {kind:5s} S={s:>6} x {call.k_shape[-2]:>6}: {cells}  | fastest {bucket.backend}, "
                  f"torch picks {bucket.torch_default}", flush=True)
    return rows


def step_rows(model: VideoDiT, config: DiTConfig, args, size: dict, calls: list[SdpaCall], order: list[str],
              rate_tflops: float, device, deadline: float) -> tuple[dict, list[dict]]:
    """The training step of the step latent at B = 1 under each backend of `order` (module docstring)."""
    latent, text_len = size["step_latent"], size["text_len"]
    linear = 3 * linear_forward_flops(config, text_len, 1, latent)
    attention = (1 + BACKWARD_FACTOR) * sum(c.forward_flops * c.count for c in calls)
    flops = {"latent": list(latent), "batch_size": 1, "tokens": tokens_of(latent, config.patch),
             "linear_fwd_bwd": linear, "attention_fwd_bwd": attention, "total": linear + attention,
             "attention_share": attention / (linear + attention)}
    print(f"step FLOPs: linears {linear / 1e12:.4g} T + attention {attention / 1e12:.4g} T "
          f"({flops['attention_share']:.0%} attention)", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = make_inputs(config, text_len, 1, latent, device, seed=1)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = flow_matching_loss(model, x["latents"], x["text"], x["t"], x["noise"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rows, last_ms = [], None
    for name, keep in ((name, keep) for name in order for keep in args.save_attention):
        BlockCheckpointing(model.blocks, save_attention=keep == "on").set_checkpointed(args.checkpointed)
        label = f"{name}, attention {'kept' if keep == 'on' else 'recomputed'}"
        steps = args.step_warmup + args.step_repeats
        left = deadline - time.perf_counter()
        if last_ms is not None and left < steps * last_ms / 1e3:
            rows.append({"backend": name, "save_attention": keep == "on", "ms": None,
                         "error": f"skipped: {left:.0f} s left of --budget-s, {steps} steps of ~{last_ms / 1e3:.1f} s needed"})
            print(f"  {label}: {rows[-1]['error']}", flush=True)
            continue
        row = {"backend": name, "save_attention": keep == "on", "ms": None, "error": None}
        try:
            with attention_backend(name, strict=True):
                begin = time.perf_counter()
                ms = median_ms(step, device, args.step_warmup, args.step_repeats)
                row["wall_s"] = time.perf_counter() - begin
            row |= {"ms": ms, "model_tflops": flops["total"] / (ms * 1e-3) / 1e12,
                    "utilisation": flops["total"] / (ms * 1e-3) / (rate_tflops * 1e12)}
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
                torch.cuda.reset_peak_memory_stats(device)
            last_ms = ms
            print(f"  {label}: step {ms:.1f} ms, {row['model_tflops']:.3g} TFLOP/s useful, "
                  f"{row['utilisation']:.1%} of the matmul rate", flush=True)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # a refused call, OOM: recorded, the others still run
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            print(f"  {label}: FAILED {row['error']}", flush=True)
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    return flops, rows


def plot(doc: dict, path: Path) -> None:
    """Left: self-attention TFLOP/s per backend and S, the matmul rate dashed; right: step utilisation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    rows = [r for r in doc["kernels"] if r["kind"] == "self"]
    names = doc["settings"]["backends"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [r["backends"][name]["tflops"] or 0.0 for r in rows]
        left.bar([j + i * width for j in range(len(rows))], values, width, label=name)
    left.axhline(doc["matmul"]["tflops"], color="gray", ls="--", label=f"bf16 matmul {doc['matmul']['tflops']:.0f}")
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"S={r['seq_len']:,}" for r in rows])
    left.set_ylabel("TFLOP/s (useful, fwd+bwd)")
    left.set_title("self-attention, one call, B=1")
    left.legend(fontsize=8)
    steps = [r for r in doc["step"]["backends"] if r["ms"] is not None]
    right.bar([r["backend"] + ("" if r.get("save_attention", True) else "\n(recompute)") for r in steps],
              [100 * r["utilisation"] for r in steps])
    for i, r in enumerate(steps):
        right.text(i, 100 * r["utilisation"], f"{r['ms'] / 1e3:.2f} s", ha="center", va="bottom", fontsize=8)
    right.axhline(60, color="gray", ls=":", label="60% (issue 29)")
    right.set_ylabel("% of the matmul rate (model FLOPs)")
    right.set_title(f"training step, S={doc['step']['flops']['tokens']:,}")
    right.legend(fontsize=8)
    fig.suptitle(doc["device"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "attention_h200.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model and shapes (tests the pipeline)")
    parser.add_argument("--budget-s", type=float, default=170.0, help="whole run; steps that would not fit are skipped")
    parser.add_argument("--checkpointed", type=int, default=None, help="blocks checkpointed in the step (default: all)")
    parser.add_argument("--save-attention", nargs="+", choices=["on", "off"], default=["on"],
                        help="checkpointed blocks keep their attention's outputs (on) or recompute them (off); both: on off")
    parser.add_argument("--kernel-warmup", type=int, default=2)
    parser.add_argument("--kernel-repeats", type=int, default=5)
    parser.add_argument("--step-warmup", type=int, default=1)
    parser.add_argument("--step-repeats", type=int, default=2)
    parser.add_argument("--no-step", action="store_true", help="kernels and matmul rate only")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget_s
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/kernel/attention.py needs a CUDA GPU (or --smoke on the CPU)")
    size = SMOKE if args.smoke else WAN_1_3B
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    # the CPU has one fused kernel; the smoke run adds the reference to have two to choose between
    backends = ["flash", "math"] if args.smoke else candidate_backends("cuda")
    config = DiTConfig(**size["config"])
    args.checkpointed = config.num_layers if args.checkpointed is None else args.checkpointed

    rate = matmul_rate(size["matmul_n"], device, warmup=5, repeats=20)
    print(f"bf16 matmul {rate['n']}^3: {rate['ms']:.3g} ms, {rate['tflops']:.3g} TFLOP/s", flush=True)

    torch.manual_seed(0)
    model = VideoDiT(config).to(device)
    surgery = "plain (the fused AdaLN op is not on CUDA here)"
    if device.type == "cuda":
        from examples.video_dit.surgery import VIDEO_DIT_PATTERNS
        from lightning_adaptiveload import ops
        from lightning_adaptiveload.surgery import apply_fused_adaln

        if ops.backend().startswith("cuda:"):
            surgery = f"fused AdaLN ({apply_fused_adaln(model, extra_patterns=VIDEO_DIT_PATTERNS).num_replaced} modules)"
        else:
            surgery = f"plain (fused AdaLN op backend: {ops.backend()})"
    probes = [Probe(b, tokens_of(latent, config.patch), tuple(record(model, config, size["text_len"], b, latent, device)))
              for b, latent in size["probes"]]
    template = CallTemplate.from_probes(*probes)
    calls_by_latent = {latent: template.instantiate(1, tokens_of(latent, config.patch)) for latent in size["latents"]}

    print(f"kernels ({', '.join(backends)}), forward+backward of one call, B=1:", flush=True)
    kernels = kernel_rows(calls_by_latent, backends, device, args.kernel_warmup, args.kernel_repeats)
    doc = run_meta("attention", argv) | {
        "description": __doc__.strip().splitlines()[0],
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "model": {k: list(v) if isinstance(v, tuple) else v for k, v in size["config"].items()},
                     "text_len": size["text_len"], "backends": backends, "surgery": surgery,
                     "external_backends": external_status(), "timing": "CUDA events around each call, median "
                     "(lightning_adaptiveload.attention.choose.median_ms); the wall clock on the CPU"},
        "flop_formulas": {
            "attention_call_fwd": "4 * B * heads * S_q * S_kv * head_dim (SdpaCall.forward_flops)",
            "attention_call_fwd_bwd": f"{1 + BACKWARD_FACTOR} * forward (backward = {BACKWARD_FACTOR} x forward)",
            "step_linears": "6 * sum over nn.Linear / Conv3d of weight entries x rows applied to (6 * params * tokens)",
            "step_attention": f"{1 + BACKWARD_FACTOR} * sum over the step's SDPA calls of forward_flops * count",
            "utilisation": "(step_linears + step_attention) / (step seconds * matmul FLOP/s); recomputation of "
                           "checkpointed blocks is not counted",
            "matmul": "2 * n^3 / median seconds of torch.matmul (n x n, bf16)"},
        "matmul": rate, "kernels": kernels, "step": None}
    write_result(args.out, doc, announce=False)  # kept if the step runs out of time or memory

    if not args.no_step:
        step_calls = calls_by_latent.get(size["step_latent"]) or template.instantiate(
            1, tokens_of(size["step_latent"], config.patch))
        step_s = tokens_of(size["step_latent"], config.patch)
        self_row = next(r for r in kernels if r["kind"] == "self" and r["seq_len"] == step_s)
        default = self_row["torch_default"]
        ran = sorted((n for n in backends if self_row["backends"][n]["ms"] is not None),
                     key=lambda n: self_row["backends"][n]["ms"])
        order = list(dict.fromkeys(([default] if default in backends else []) + ran
                                   + [n for n in backends if n not in ran]))
        print(f"training step, latent {size['step_latent']} (S={step_s}), B=1, {args.checkpointed} of "
              f"{config.num_layers} blocks checkpointed, {surgery}; torch picks {default}; attention kept: "
              f"{' / '.join(args.save_attention)}:", flush=True)
        flops, rows = step_rows(model, config, args, size, step_calls, order, rate["tflops"], device, deadline)
        doc["step"] = {"checkpointed": args.checkpointed, "num_blocks": config.num_layers, "surgery": surgery,
                       "optimizer": "AdamW (fused on CUDA)", "torch_default": default, "flops": flops,
                       "backends": rows}
    doc["wall_s"] = time.perf_counter() - start
    write_result(args.out, doc)
    if doc["step"] is not None:
        try:
            plot(doc, args.out.with_suffix(".png"))
            print(f"wrote {args.out.with_suffix('.png')}")
        except ImportError as e:
            print(f"plot skipped: {e}")
    print(f"done in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
