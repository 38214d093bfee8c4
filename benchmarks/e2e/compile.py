"""Compiled mixed-shape training: eager vs regional torch.compile strategies, with and without the
fused AdaLN surgery, on a training-like sequence of the reference mix's batch shapes.

    python benchmarks/e2e/compile.py --out benchmarks/results/compile_h200.json            # one H200
    python benchmarks/e2e/compile.py --device cpu --tiny --m-mem 640 --out /tmp/compile_cpu.json   # smoke test
    python benchmarks/e2e/compile.py --combine a.json b.json --out c.json   # one table of earlier runs

The example Wan-2.1-1.3B-shaped DiT (`--layers` of its blocks), bf16 autocast, AdamW, flow-matching
loss: one optimizer step per batch. Batches: the full batch of `--buckets` buckets spread over the
shipped reference mix's bucket table (token-equal batch sizes at `--m-mem` tokens), visited in a
shuffled order `--passes` times (the same order for every mode). Pass 0 is the "first epoch":
every shape is new and pays its compilation; passes 1.. are the steady state.

Modes (each in a fresh process, so no compiled graph or cuDNN plan is shared between them):
  eager, eager+surgery                 no compilation
  static                               block.compile(dynamic=False): one graph per shape
                                       (recompile_limit raised to the number of shapes)
  auto                                 block.compile(): torch's default, static first, then
                                       dynamic after the first recompile
  dynamic, dynamic+surgery             block.compile(dynamic=True): dynamic from the first shape
Per mode: steady-state tokens/s (tokens over the sum of each shape's median steady step time),
first-pass time, compile time (first-pass step minus steady step, summed over shapes), graphs
compiled, recompiles and graph breaks after the first pass (dynamo's counters), peak memory; and per
mode against eager, after how many samples of the mix its extra first-pass time is paid back by its
steady-state saving (`amortisation`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, RESULTS, run_meta, write_result  # noqa: E402

MODES = ("eager", "eager+surgery", "static", "auto", "dynamic", "dynamic+surgery")
WAN_1_3B = dict(in_channels=16, dim=1536, num_heads=12, ffn_dim=8960, text_dim=4096, freq_dim=256, text_len=512)
TINY = dict(in_channels=4, dim=64, num_heads=4, ffn_dim=128, text_dim=32, freq_dim=32, text_len=8)


def batch_shapes(m_mem: int, buckets: int, latent_scale: float) -> list[tuple[int, tuple[int, int, int]]]:
    """(batch size, latent (T, H, W)) of `buckets` buckets evenly spread over the reference mix's
    bucket table (all of them if fewer), token-equal batch size at `m_mem` tokens."""
    from lightning_adaptiveload.data.shards import mix_latent_shapes
    from lightning_adaptiveload.scheduling.policies import token_equal_batch_size
    from lightning_adaptiveload.scheduling.shapes import TokenSpec, read_shapes_jsonl

    spec = TokenSpec()
    mix = read_shapes_jsonl(REPO / "lightning_adaptiveload" / "data" / "reference_mix.jsonl", spec)
    thw = mix_latent_shapes(mix, spec, latent_scale)
    table = {}
    for row in thw:
        tokens = spec.tokens_from_latent(*row)
        if tokens <= m_mem:
            table.setdefault(tokens, tuple(int(v) for v in row))
    keys = sorted(table)
    picks = sorted({keys[i] for i in np.linspace(0, len(keys) - 1, min(buckets, len(keys))).round().astype(int)})
    return [(token_equal_batch_size(s, m_mem), table[s]) for s in picks]


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process: build, optionally fuse and compile, run the passes, measure."""
    import torch
    from torch._dynamo.utils import counters

    from examples.video_dit.model import DiTConfig, VideoDiT, flow_matching_loss
    from examples.video_dit.surgery import VIDEO_DIT_PATTERNS
    from lightning_adaptiveload.scheduling.shapes import TokenSpec
    from lightning_adaptiveload.surgery import apply_fused_adaln

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    size = TINY if args.tiny else WAN_1_3B
    torch.manual_seed(0)
    model = VideoDiT(DiTConfig(num_layers=args.layers, in_channels=size["in_channels"], out_channels=size["in_channels"],
                               dim=size["dim"], num_heads=size["num_heads"], ffn_dim=size["ffn_dim"],
                               text_dim=size["text_dim"], freq_dim=size["freq_dim"])).to(device)
    surgery = None
    if args.mode.endswith("+surgery"):
        report = apply_fused_adaln(model, extra_patterns=VIDEO_DIT_PATTERNS)
        surgery = report.num_replaced
    shapes = batch_shapes(args.m_mem, args.buckets, 0.125 if args.tiny else 1.0)
    strategy = args.mode.split("+")[0]
    if strategy != "eager":
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(shapes) + 8)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                              4 * len(shapes) + 32)
        dynamic = {"static": False, "auto": None, "dynamic": True}[strategy]
        for block in model.blocks:
            block.compile(dynamic=dynamic, **({"backend": "aot_eager"} if not cuda else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    rng = np.random.default_rng(0)
    order = [int(i) for i in rng.permutation(len(shapes))]  # the same order in every mode
    gen = torch.Generator(device=device).manual_seed(0)

    def step(b: int, thw: tuple[int, int, int]) -> float:
        latents = torch.randn(b, size["in_channels"], *thw, device=device, generator=gen)
        text = torch.randn(b, size["text_len"], size["text_dim"], device=device, generator=gen)
        t = torch.rand(b, device=device, generator=gen)
        noise = torch.randn(latents.shape, device=device, generator=gen)
        if cuda:
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = flow_matching_loss(model, latents, text, t, noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - begin) * 1e3

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = {i: [] for i in range(len(shapes))}
    first_pass_s = None
    frames_after_first = graph_breaks_after_first = None
    start = time.perf_counter()
    for p in range(args.passes):
        for i in order:
            times[i].append(step(*shapes[i]))
        if p == 0:
            first_pass_s = time.perf_counter() - start
            frames_after_first = counters["frames"]["ok"]
            graph_breaks_after_first = sum(counters["graph_break"].values())
            print(f"{args.mode}: first pass {first_pass_s:.1f} s, {frames_after_first} graphs", flush=True)
    rows = []
    for i, (b, thw) in enumerate(shapes):
        tokens = b * TokenSpec().tokens_from_latent(*thw)
        steady = float(np.median(times[i][1:])) if len(times[i]) > 1 else float("nan")
        rows.append({"batch_size": b, "latent_shape": list(thw), "tokens": tokens, "first_ms": times[i][0],
                     "steady_ms": steady, "compile_ms": times[i][0] - steady})
    tokens = sum(r["tokens"] for r in rows)
    steady_s = sum(r["steady_ms"] for r in rows) / 1e3
    return {
        "mode": args.mode, "fused_modules": surgery, "shapes": rows,
        "steady_tokens_per_s": tokens / steady_s, "first_pass_s": first_pass_s,
        "compile_s": sum(max(r["compile_ms"], 0.0) for r in rows) / 1e3,
        "graphs_compiled": int(counters["frames"]["ok"]),
        "recompiles_after_first_pass": int(counters["frames"]["ok"] - frames_after_first),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "graph_breaks_after_first_pass": int(sum(counters["graph_break"].values()) - graph_breaks_after_first),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and tiny latents (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--buckets", type=int, default=6)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--m-mem", type=int, default=65536)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--combine", nargs="+", type=Path, default=None,
                        help="instead of running: one table of these earlier result files (written to --out)")
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # worker: run one mode, print JSON
    args = parser.parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out)
    if args.mode is not None:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return 0

    doc = run_meta("compile", argv) | {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "mode")},
        "batch_shapes": [[b, list(thw)] for b, thw in batch_shapes(args.m_mem, args.buckets,
                                                                   0.125 if args.tiny else 1.0)],
    }
    results, failed = [], {}

    def write() -> None:  # after every mode: a run cut short keeps the modes it finished
        write_result(args.out, doc | {"results": results, "failed": failed}, announce=False)

    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; known: {MODES}")
        cmd = [sys.executable, __file__, "--mode", mode, "--device", args.device, "--layers", str(args.layers),
               "--buckets", str(args.buckets), "--passes", str(args.passes), "--m-mem", str(args.m_mem)]
        cmd += ["--tiny"] if args.tiny else []
        begin = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            failed[mode] = proc.stderr[-3000:]
            print(f"{mode}: FAILED (exit {proc.returncode})\n{proc.stderr[-1500:]}", flush=True)
            write()
            continue
        result = json.loads(lines[-1][len("RESULT "):])
        result["process_s"] = time.perf_counter() - begin
        results.append(result)
        write()
        print(f"{mode}: {result['steady_tokens_per_s']:.0f} tokens/s steady, first pass {result['first_pass_s']:.1f} s, "
              f"compile {result['compile_s']:.1f} s, graphs {result['graphs_compiled']}, recompiles after pass 1 "
              f"{result['recompiles_after_first_pass']}", flush=True)
    doc["amortisation"] = report(results, args.m_mem)
    write()
    print(f"wrote {args.out}")
    return 1 if failed else 0


def report(results: list[dict], m_mem: int) -> dict | None:
    """Print the table (each mode against the eager row of its own run: `source` where results of
    several runs are combined) and the amortisation lines; return the amortisation per run."""
    sources = list(dict.fromkeys(r.get("source") for r in results))
    eagers = {src: next((r for r in results if r["mode"] == "eager" and r.get("source") == src), None)
              for src in sources}
    print(f"\n{'mode':<16} {'tokens/s':>10} {'vs eager':>8} {'1st pass s':>10} {'compile s':>9} {'graphs':>6} "
          f"{'recomp.':>7} {'breaks':>6} {'peak GiB':>8}" + ("  run" if len(sources) > 1 else ""))
    for r in results:
        eager = eagers[r.get("source")]
        ratio = r["steady_tokens_per_s"] / eager["steady_tokens_per_s"] if eager else float("nan")
        peak = f"{r['peak_gib']:>8.2f}" if r["peak_gib"] is not None else f"{'-':>8}"
        print(f"{r['mode']:<16} {r['steady_tokens_per_s']:>10.0f} {ratio:>8.3f} {r['first_pass_s']:>10.1f} "
              f"{r['compile_s']:>9.1f} {r['graphs_compiled']:>6} {r['recompiles_after_first_pass']:>7} "
              f"{r['graph_breaks']:>6} {peak}" + (f"  {r.get('source')}" if len(sources) > 1 else ""))
    runs = {}
    for src, eager in eagers.items():
        if eager is None:
            continue
        runs[src] = amortisation([r for r in results if r.get("source") == src], eager, m_mem)
        for mode, a in runs[src]["modes"].items():
            print(f"{mode}: {a['extra_first_pass_s']:.1f} s more than eager's first pass, paid back after "
                  + (f"{a['break_even_samples']:.0f} samples ({100 * a['fraction_of_epoch']:.1f}% of a "
                     f"{EPOCH_SAMPLES}-sample epoch)" if a["break_even_samples"] is not None else "never (not faster)"))
    if not runs:
        return None
    return runs[None] if list(runs) == [None] else runs


def combine(paths: list[Path], out: Path) -> int:
    """One table of earlier runs' result files (e.g. a run cut short and the modes it left, run
    again): every mode is compared with the eager row of its own run, which each file must have."""
    docs = {path.name: json.loads(path.read_text()) for path in paths}
    m_mem = {doc["settings"]["m_mem"] for doc in docs.values()}
    if len(m_mem) != 1:
        raise SystemExit(f"--combine: the runs differ in m_mem ({sorted(m_mem)}); their tokens are not comparable")
    missing = [name for name, doc in docs.items() if not any(r["mode"] == "eager" for r in doc["results"])]
    if missing:
        raise SystemExit(f"--combine: {missing} have no eager row to compare their modes with")
    results = [r | {"source": name} for name, doc in docs.items() for r in doc["results"]]
    combined = run_meta("compile (combined)") | {
        "runs": {name: {k: doc[k] for k in ("command", "date", "git_commit", "device", "versions", "settings",
                                            "batch_shapes")} | {"failed": sorted(doc.get("failed", {}))}
                 for name, doc in docs.items()},
        "results": results}
    combined["amortisation"] = report(results, m_mem.pop())
    write_result(out, combined)
    return 0


EPOCH_SAMPLES = 100_000


def amortisation(results: list[dict], eager: dict, m_mem: int) -> dict:
    """When does each mode's extra first-pass time (its first pass minus eager's: compilation, net of
    the cold cuDNN graphs eager pays too) pay for itself through its faster steady state? In samples of
    the reference mix (those <= m_mem, at the mix's mean tokens per sample), against an epoch of
    EPOCH_SAMPLES. Regional compilation compiles one graph per shape for all blocks, so the compile
    time barely grows with the number of blocks while the saving does: a model with more blocks than
    this run's pays back sooner."""
    from lightning_adaptiveload.scheduling.shapes import TokenSpec, read_shapes_jsonl

    mix = read_shapes_jsonl(REPO / "lightning_adaptiveload" / "data" / "reference_mix.jsonl", TokenSpec())
    kept = mix.tokens <= m_mem
    tokens_per_sample = float(np.average(mix.tokens[kept], weights=mix.counts[kept]))
    modes = {}
    for r in results:
        if r is eager:
            continue
        saved_s_per_token = 1 / eager["steady_tokens_per_s"] - 1 / r["steady_tokens_per_s"]
        extra_s = r["first_pass_s"] - eager["first_pass_s"]
        samples = max(extra_s, 0.0) / saved_s_per_token / tokens_per_sample if saved_s_per_token > 0 else None
        modes[r["mode"]] = {"extra_first_pass_s": extra_s, "saved_ms_per_sample": 1e3 * saved_s_per_token
                            * tokens_per_sample, "break_even_samples": samples,
                            "fraction_of_epoch": samples / EPOCH_SAMPLES if samples is not None else None}
    return {"epoch_samples": EPOCH_SAMPLES, "mix_tokens_per_sample": tokens_per_sample, "modes": modes}


if __name__ == "__main__":
    sys.exit(main())
