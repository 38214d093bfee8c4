"""Fused-AdaLN surgery on Wan 2.1 1.3B: step time, memory, and the longest sequence in a budget.

Model: diffusers WanTransformer3DModel at the Wan 2.1 T2V-1.3B configuration (D=1536, 30 layers,
12 heads, FFN 8960, 16 latent channels, text_dim 4096, patch (1, 2, 2)), random weights, all
parameters bf16, train mode, one GPU. One step = forward + backward of loss = mean(out.float()^2)
for one sample: latents (1, 16, T, H, W) bf16, 512 text tokens, a random timestep. The reference
shape is 480x832 with 81 frames -> latent 21x60x104 -> S = 21*30*52 = 32,760 tokens.

Per variant (eager, then the same model after apply_fused_adaln):
- step time at the reference shape: CUDA events, `--warmup` steps then `--steps` timed steps;
- peak memory (torch.cuda.max_memory_allocated over a step) and its part above the weights;
- saved activations: memory allocated after the forward minus before it (what backward keeps);
- longest S that fits the budget: binary search over the latent width (steps of 2 = 30*T tokens)
  for the largest shape whose peak stays within the budget (an out-of-memory error counts as not
  fitting). The budget defaults to the eager peak at the reference shape ("equal peak memory",
  as in the paper's 48,000 -> 52,800 tokens); --budget-gib sets another.
Gradient checkpointing stays off unless the eager reference step runs out of memory (then it is
turned on for both variants and the JSON says so).

    python benchmarks/kernel/surgery.py --out benchmarks/results/surgery_h200.json     # H200, ~3 min

`--host` (CPU, no GPU needed) measures what surgery costs on the host instead, for the fingerprinted
patterns and the idiom recogniser: the time of `apply_fused_adaln` on Wan-1.3B-shaped models of 2
and 4 blocks (diffusers WanTransformer3DModel, and the example VideoDiT), and the Python time one
block forward/backward spends around the op, at a shape small enough that the op's own work is
negligible (example block, D = 64, 4 tokens, one thread; the variants interleaved round by round,
medians, and the idiom-minus-pattern overhead as the median of paired per-round differences).

    python benchmarks/kernel/surgery.py --host --out benchmarks/results/surgery_host_cpu.json   # ~2 min
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import run_meta, write_result  # noqa: E402
from lightning_adaptiveload import ops  # noqa: E402
from lightning_adaptiveload.surgery import apply_fused_adaln  # noqa: E402

WAN_1P3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30)
GIB = 2**30
# Two steps of the same shape can peak a few hundred KiB apart (0.5 MiB seen on H200), so the
# eager reference shape could miss its own peak; one width step moves the peak by ~2 GiB.
BUDGET_SLACK = 64 * 2**20
TARGETS = {"step_time": -0.05, "saved_activations": -0.10, "longest_tokens": +0.10}


def tokens(frames: int, height: int, width: int) -> int:
    return frames * (height // 2) * (width // 2)


def make_inputs(frames: int, height: int, width: int, text_tokens: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    latents = torch.randn(1, 16, frames, height, width, generator=gen, device="cuda", dtype=torch.bfloat16)
    timestep = torch.randint(0, 1000, (1,), generator=gen, device="cuda")
    text = torch.randn(1, text_tokens, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    return latents, timestep, text


def step(model: torch.nn.Module, inputs) -> dict:
    """One forward+backward: time (ms), peak bytes, bytes before the forward, bytes saved by the forward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    loss = model(*inputs).sample.float().square().mean()
    saved = torch.cuda.memory_allocated() - before
    loss.backward()
    end.record()
    torch.cuda.synchronize()
    return {"ms": start.elapsed_time(end), "peak": torch.cuda.max_memory_allocated(), "before": before, "saved": saved}


def peak_or_none(model: torch.nn.Module, inputs) -> int | None:
    """Peak bytes of one step, or None when it runs out of memory."""
    try:
        return step(model, inputs)["peak"]
    except torch.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def longest_width(model, args, budget: int, probes: list) -> int:
    """Largest even latent width whose step peak is <= budget + BUDGET_SLACK (binary search, steps of 2)."""

    def fits(width: int) -> bool:
        peak = peak_or_none(model, make_inputs(args.frames, args.height, width, args.text_tokens))
        probes.append({"width": width, "tokens": tokens(args.frames, args.height, width), "peak": peak})
        return peak is not None and peak <= budget + BUDGET_SLACK

    lo, hi = args.width, args.max_width
    if not fits(lo):
        lo, hi = 2, lo
    elif fits(hi):
        return hi  # the search range is exhausted; the JSON flags it
    while hi - lo > 2:
        mid = (lo + hi) // 4 * 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def measure(model, args, budget: int | None, label: str) -> dict:
    inputs = make_inputs(args.frames, args.height, args.width, args.text_tokens)
    runs = [step(model, inputs) for _ in tqdm(range(args.warmup + args.steps), desc=f"{label}: steps", leave=False)]
    timed = runs[args.warmup:]
    ms = torch.tensor([r["ms"] for r in timed], dtype=torch.float64)
    result = {
        "step_ms_mean": float(ms.mean()),
        "step_ms_std": float(ms.std()) if len(ms) > 1 else 0.0,
        "step_ms": [r["ms"] for r in timed],
        "peak_bytes": max(r["peak"] for r in timed),
        "peak_above_weights_bytes": max(r["peak"] - r["before"] for r in timed),
        "saved_activations_bytes": max(r["saved"] for r in timed),
    }
    budget = result["peak_bytes"] if budget is None else budget
    del inputs, runs  # the probes allocate their own inputs; these would count twice against the budget
    probes: list = []
    width = longest_width(model, args, budget, probes)
    result.update(longest_width=width, longest_tokens=tokens(args.frames, args.height, width),
                  search_exhausted=width >= args.max_width, probes=probes)
    return result


def plot(results: dict, budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, res in results.items():
        pts = sorted((p["tokens"], p["peak"] / GIB) for p in res["probes"] if p["peak"] is not None)
        ax.plot([t for t, _ in pts], [g for _, g in pts], "o-", label=f"{label} (longest {res['longest_tokens']:,})")
    ax.axhline(budget / GIB, color="gray", ls="--", label=f"budget {budget / GIB:.1f} GiB")
    ax.set_xlabel("tokens per sample (S)")
    ax.set_ylabel("peak memory of fwd+bwd (GiB)")
    ax.set_title("Wan 2.1 1.3B, bf16, 1 GPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _interleaved_ms(fns: dict, calls: int, rounds: int) -> dict[str, list[float]]:
    """Per function, the mean wall time (ms) of `calls` calls in each of `rounds` rounds; every round
    runs all functions back to back, so paired differences cancel most of the shared machine's load."""
    import time

    times: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[label].append((time.perf_counter() - start) / calls * 1e3)
    return times


def host_costs(args: argparse.Namespace) -> None:
    """--host: surgery time and per-call Python overhead on the CPU (see the module docstring)."""
    import copy
    import time

    import diffusers
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    from examples.video_dit import surgery as video_dit
    from examples.video_dit.model import DiTConfig, VideoDiT, rope_3d

    torch.set_num_threads(1)
    example_1p3b = dict(in_channels=16, dim=1536, num_heads=12, ffn_dim=8960, text_dim=4096, freq_dim=256)
    builders = {
        "diffusers Wan, patterns": (lambda n: WanTransformer3DModel(**{**WAN_1P3B, "num_layers": n}), {}),
        "diffusers Wan, idioms": (lambda n: WanTransformer3DModel(**{**WAN_1P3B, "num_layers": n}), {"patterns": []}),
        "example VideoDiT, patterns": (lambda n: VideoDiT(DiTConfig(**example_1p3b, num_layers=n)),
                                       {"extra_patterns": video_dit.VIDEO_DIT_PATTERNS}),
        "example VideoDiT, idioms": (lambda n: VideoDiT(DiTConfig(**example_1p3b, num_layers=n)), {}),
    }
    surgery_s = {}
    for label, (build, kwargs) in builders.items():
        surgery_s[label] = {}
        for layers in (2, 4):
            torch.manual_seed(0)
            model = build(layers)
            start = time.perf_counter()
            report = apply_fused_adaln(model, **kwargs)
            surgery_s[label][layers] = time.perf_counter() - start
            assert report.num_replaced >= layers, str(report)
            del model

    dim = 64
    torch.manual_seed(0)
    block = VideoDiT(DiTConfig(in_channels=4, out_channels=4, dim=dim, num_layers=1, num_heads=4, ffn_dim=64,
                               text_dim=16, freq_dim=16)).blocks[0]
    x, e, context = torch.randn(1, 4, dim), torch.randn(1, 6, dim), torch.randn(1, 2, dim)
    rope = rope_3d((1, 2, 2), dim // 4, torch.device("cpu"))
    variants = {"eager (original forward)": block,
                "pattern (video_dit.DiTBlock)": copy.deepcopy(block),
                "idiom (rewritten forward)": copy.deepcopy(block)}
    apply_fused_adaln(variants["pattern (video_dit.DiTBlock)"], extra_patterns=video_dit.VIDEO_DIT_PATTERNS)
    apply_fused_adaln(variants["idiom (rewritten forward)"], example_inputs=(x, e, context, rope))
    x_grad = x.clone().requires_grad_(True)

    def forward(module):
        with torch.no_grad():
            module(x, e, context, rope)

    def forward_backward(module):
        module(x_grad, e, context, rope).sum().backward()

    import statistics

    per_call, overhead_us = {}, {}
    for kind, run in (("forward_ms", forward), ("forward_backward_ms", forward_backward)):
        times = _interleaved_ms({label: (lambda m=m, run=run: run(m)) for label, m in variants.items()}, args.host_calls,
                                args.host_rounds)
        for label, t in times.items():
            per_call.setdefault(label, {})[kind] = statistics.median(t)
        paired = [(i - p) * 1e3 / 2 for i, p in zip(times["idiom (rewritten forward)"],
                                                   times["pattern (video_dit.DiTBlock)"])]  # two AdaLN sites per block
        overhead_us[kind] = statistics.median(paired)

    print(f"apply_fused_adaln wall time on the CPU, Wan-1.3B-shaped blocks (s)\n{'model, path':<28} {'2 blocks':>9} {'4 blocks':>9}")
    for label, times in surgery_s.items():
        print(f"{label:<28} {times[2]:>9.2f} {times[4]:>9.2f}")
    print(f"\nexample DiTBlock, D = {dim}, 4 tokens, 1 thread (median ms per call)\n"
          f"{'variant':<30} {'forward':>9} {'fwd+bwd':>9}")
    for label, r in per_call.items():
        print(f"{label:<30} {r['forward_ms']:>9.3f} {r['forward_backward_ms']:>9.3f}")
    print(f"idiom - pattern, per AdaLN site (median of {args.host_rounds} paired rounds): "
          f"forward {overhead_us['forward_ms']:+.1f} us, fwd+bwd {overhead_us['forward_backward_ms']:+.1f} us")
    out = {**run_meta("fused AdaLN surgery: host costs on the CPU", diffusers=diffusers.__version__),
           "threads": 1, "surgery_seconds": surgery_s,
           "per_call_ms_median": per_call, "calls_per_round": args.host_calls, "rounds": args.host_rounds,
           "idiom_minus_pattern_us_per_site": overhead_us,
           "per_call_shape": {"x": [1, 4, dim], "adaln_sites_per_block": 2}}
    write_result(args.out, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=21, help="latent frames (81 video frames)")
    parser.add_argument("--height", type=int, default=60, help="latent height (480 px)")
    parser.add_argument("--width", type=int, default=104, help="latent width (832 px); the reference shape")
    parser.add_argument("--max-width", type=int, default=160, help="upper end of the width search")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-gib", type=float, default=None, help="default: eager peak at the reference shape")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/surgery.json"))
    parser.add_argument("--host", action="store_true", help="CPU: surgery time and per-call host overhead")
    parser.add_argument("--host-calls", type=int, default=100, help="--host: calls per variant and round")
    parser.add_argument("--host-rounds", type=int, default=21, help="--host: interleaved rounds")
    args = parser.parse_args()
    if args.host:
        return host_costs(args)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel/surgery.py needs a CUDA GPU")
    import diffusers
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WanTransformer3DModel(**WAN_1P3B).to(torch.bfloat16).train()
    budget = None if args.budget_gib is None else int(args.budget_gib * GIB)
    checkpointing = False
    try:
        eager = measure(model, args, budget, "eager")
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        model.enable_gradient_checkpointing()
        checkpointing = True
        eager = measure(model, args, budget, "eager")
    budget = eager["peak_bytes"] if budget is None else budget
    report = apply_fused_adaln(model)
    print(report)
    fused = measure(model, args, budget, "fused")
    results = {"eager": eager, "fused": fused}

    def change(key: str) -> float:
        return fused[key] / eager[key] - 1.0

    deltas = {"step_time": change("step_ms_mean"), "peak": change("peak_bytes"),
              "peak_above_weights": change("peak_above_weights_bytes"),
              "saved_activations": change("saved_activations_bytes"), "longest_tokens": change("longest_tokens")}
    met = {k: (deltas[k] <= t if t < 0 else deltas[k] >= t) for k, t in TARGETS.items()}
    ref_tokens = tokens(args.frames, args.height, args.width)
    print(f"\nWan 2.1 1.3B, bf16, fwd+bwd, 1 sample of S = {ref_tokens:,} tokens; budget {budget / GIB:.2f} GiB"
          f"{' (gradient checkpointing ON)' if checkpointing else ''}")
    header = f"{'variant':<8} {'step ms':>16} {'peak GiB':>9} {'above weights':>14} {'saved act. GiB':>15} {'longest S':>10}"
    print(header)
    for label, r in results.items():
        print(f"{label:<8} {r['step_ms_mean']:>9.1f} ± {r['step_ms_std']:>4.1f} {r['peak_bytes'] / GIB:>9.2f} "
              f"{r['peak_above_weights_bytes'] / GIB:>14.2f} {r['saved_activations_bytes'] / GIB:>15.2f} "
              f"{r['longest_tokens']:>10,}")
    print(f"{'change':<8} {deltas['step_time']:>+16.1%} {deltas['peak']:>+9.1%} {deltas['peak_above_weights']:>+14.1%} "
          f"{deltas['saved_activations']:>+15.1%} {deltas['longest_tokens']:>+10.1%}")
    print("targets: " + ", ".join(f"{k} {TARGETS[k]:+.0%}: {'met' if ok else 'NOT met'}" for k, ok in met.items()))

    out = {
        **run_meta("fused AdaLN surgery, diffusers WanTransformer3DModel (Wan 2.1 1.3B config, random weights)",
                   diffusers=diffusers.__version__),
        "op_backend": ops.backend(),
        "config": {**WAN_1P3B, "latent": [args.frames, args.height, args.width], "tokens": ref_tokens,
                   "text_tokens": args.text_tokens, "dtype": "bf16 parameters and activations", "batch_size": 1,
                   "warmup": args.warmup, "steps": args.steps, "gradient_checkpointing": checkpointing},
        "budget_bytes": budget,
        "budget_source": "eager peak at the reference shape" if args.budget_gib is None else "--budget-gib",
        "budget_slack_bytes": BUDGET_SLACK,
        "surgery": report.to_dict(),
        "results": results,
        "deltas": deltas,
        "targets": TARGETS,
        "targets_met": met,
    }
    write_result(args.out, out, announce=False)
    plot(results, budget, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
