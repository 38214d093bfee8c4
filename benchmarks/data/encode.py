"""What `adaptiveload encode` costs per clip on one GPU: the Wan 2.1 VAE and the UMT5-XXL text encoder.

    python benchmarks/data/encode.py --out benchmarks/results/encode_h200.json        # one H200, under 4 minutes
    python benchmarks/data/encode.py --device cpu --tiny --out /tmp/encode_cpu.json   # smoke test (tiny models)
    python benchmarks/data/encode.py --dry-run                                        # the plan; builds and runs nothing

Models, random weights (the cost of a forward pass does not depend on the values): the VAE is
diffusers' `AutoencoderKLWan()` with its default config, which is Wan 2.1's (127 M parameters); the
text encoder is transformers' `UMT5EncoderModel` with UMT5-XXL's architecture (d_model 4096, 24
layers, d_ff 10240, 64 heads, vocab 256384: 5.7 B parameters), bf16 on the GPU as the encode
pipeline runs them. Both run through the pipeline's own `LatentEncoder` and `CaptionEncoder`
(encode/models.py), so what is timed is what `adaptiveload encode` does per window: uint8 frames
copied to the GPU, scaled to [-1, 1], VAE-encoded (720p in spatial tiles: frames above
`--tile-above` pixels), the posterior mean normalized with latents_mean/std; a caption tokenized,
padded to 512 tokens and encoded.

Per shape (default 81 x 480 x 832, and 81 x 720 x 1280 tiled), in stages, the result file
rewritten after each (a run cut short keeps what it measured; `--budget-s` skips the stages left
once it is spent):
1. the encoders alone: seconds per clip (median of `--repeats` after one warm-up), peak GPU
   memory, clips/s and latent tokens/s (TokenSpec, patch (1, 2, 2));
2. the CPU time to decode and resize the clip from an mpeg4 file (one process: how many
   DataLoader workers keep up);
3. `encode_videos` itself on `--pipeline-clips` such clips with `--num-workers` decoding workers:
   clips/s end to end and the decode wait share (time the GPU process waited for decoded frames
   over its wall time), peak memory;
4. the share of a training step's time that encoding the same sample on the fly would cost:
   encode / (encode + train), train being the step time per sample of the Wan 1.3B-shaped DiT at
   that token count on an H200, from the shipped lightning_adaptiveload/data/h200_dit_cost_curve.json
   (forward + backward of 4 DiT blocks at B = 1, scaled to Wan 2.1 1.3B's 30 blocks: a lower
   bound, no embedding, head or optimizer; at token counts it did not measure, its fitted
   CostModel, flagged when extrapolated) and from the committed benchmarks/results step times
   (each named in the output with its file and field).

Needs (beyond torch, numpy, transformers): diffusers and its requirements, PyAV, and the package's
own (lightning, scipy, braceexpand, tqdm); nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, RESULTS, run_meta, write_result  # noqa: E402

UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
                tie_word_embeddings=False)
UMT5_TINY = dict(vocab_size=1100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, relative_attention_max_distance=16)
VAE_TINY = dict(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
SHAPES = ["81x480x832", "81x720x1280"]
SHAPES_TINY = ["9x32x48", "9x48x80"]
TEXT_LEN = 512
CAPTION_WORDS = 120  # a long caption; the cost is the same for any length, padded to TEXT_LEN
# H200 step times of the Wan 1.3B-shaped DiT, per sample, by tokens (see training_step_refs)
COST_CURVE = REPO / "lightning_adaptiveload" / "data" / "h200_dit_cost_curve.json"
WAN_13B_BLOCKS = 30
MEMORY_PLAN = RESULTS / "memory_plan_h200.json"
SURGERY = RESULTS / "gpu_surgery" / "surgery_h200.json"


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        f, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be FRAMESxHEIGHTxWIDTH, got {text!r}") from None
    return f, h, w


def cost_curve_ref(tokens: int) -> dict:
    """Training time per sample at `tokens` from the shipped H200 cost curve: forward + backward
    of its 4 Wan-1.3B-shaped blocks at B = 1 (measured where the curve has `tokens`, else the
    CostModel fitted to the whole curve), times 30 / 4 for Wan 2.1 1.3B's 30 blocks."""
    from lightning_adaptiveload.scheduling.cost_model import load_cost_model

    doc = json.loads(COST_CURVE.read_text())
    measured = {m["seq_len"]: m["time_ms"] for m in doc["measurements"] if m["batch_size"] == 1}
    outside = not min(measured) <= tokens <= max(measured)
    if tokens in measured:
        blocks_ms, how = measured[tokens], "measurements[batch_size=1, seq_len].time_ms"
    else:
        blocks_ms = float(load_cost_model(COST_CURVE).predict(1, tokens))
        how = f"fitted CostModel at (1, {tokens})" + (
            f", extrapolated outside the measured seq_len {min(measured)}..{max(measured)}" if outside else "")
    blocks = doc["model"]["blocks"]
    per_sample = blocks_ms * WAN_13B_BLOCKS / blocks
    return {"source": str(COST_CURVE.relative_to(REPO)), "field": f"{how} x {WAN_13B_BLOCKS} / {blocks}",
            "model": f"{blocks} Wan-1.3B-shaped DiT blocks, {doc['model']['dtype']}, forward + backward, scaled "
                     f"to Wan 2.1 1.3B's {WAN_13B_BLOCKS} blocks (no embedding, head or optimizer: a lower bound)",
            "extrapolated": outside, "batch_size": 1, "step_ms": per_sample, "train_ms_per_sample": per_sample}


def training_step_refs(tokens: int) -> list[dict]:
    """Training time per sample at `tokens` on an H200, each with its source: the shipped cost
    curve (`cost_curve_ref`), and where they ran this token count the committed
    memory_plan_h200.json (the example Wan-1.3B-width DiT, 12 of Wan 1.3B's 30 blocks, bf16
    autocast, AdamW; configurations.per_bucket: the bucket's measured step at its batch size and
    checkpointing depth) and gpu_surgery/surgery_h200.json (diffusers WanTransformer3DModel with
    the full Wan 2.1 1.3B config, 30 layers, bf16, B = 1, eager, no checkpointing; one shape)."""
    refs = [cost_curve_ref(tokens)]
    if MEMORY_PLAN.exists():
        doc = json.loads(MEMORY_PLAN.read_text())
        for row in doc["configurations"]["per_bucket"]["buckets"]:
            if row["seq_len"] == tokens and row["status"] == "ok":
                refs.append({"source": str(MEMORY_PLAN.relative_to(REPO)),
                             "field": f"configurations.per_bucket.buckets[seq_len={tokens}].measured_ms / batch_size",
                             "model": f"example Wan-1.3B-width DiT, {doc['model']['blocks']} blocks, "
                                      f"{doc['model']['dtype']}, {doc['model']['optimizer']}; "
                                      f"{row['checkpointed']} blocks checkpointed",
                             "batch_size": row["batch_size"], "step_ms": row["measured_ms"],
                             "train_ms_per_sample": row["measured_ms"] / row["batch_size"]})
    if SURGERY.exists():
        doc = json.loads(SURGERY.read_text())
        config = doc["config"]
        if config["tokens"] == tokens:
            refs.append({"source": str(SURGERY.relative_to(REPO)), "field": "results.eager.step_ms_mean",
                         "model": f"diffusers WanTransformer3DModel, Wan 2.1 1.3B config ({config['num_layers']} "
                                  f"layers), {config['dtype']}, eager",
                         "batch_size": config["batch_size"], "step_ms": doc["results"]["eager"]["step_ms_mean"],
                         "train_ms_per_sample": doc["results"]["eager"]["step_ms_mean"] / config["batch_size"]})
    return refs


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over `vocab_size` - 3 made-up words (ids 3..): tokenization is not
    what is measured, and UMT5's real tokenizer cannot be built without downloading it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(min(vocab_size, 1000) - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_models(args, device, dtype):
    """(VAE, UMT5 encoder), random weights, built on `device` in `dtype` (UMT5-XXL in fp32 on a CPU
    first would take 23 GB and minutes to initialize)."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**(VAE_TINY if args.tiny else {}))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            text = UMT5EncoderModel(UMT5Config(**(UMT5_TINY if args.tiny else UMT5_XXL)))
    finally:
        torch.set_default_dtype(previous)
    return vae, text


def _timed(fn, repeats: int, sync) -> tuple[list[float], object]:
    """One warm-up call, then `repeats` timed calls: (seconds each, last result)."""
    out = fn()
    sync()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - begin)
    return times, out


def write_clip(path: Path, shape: tuple[int, int, int]) -> None:
    """An mpeg4 clip of `shape`'s frame count at 16 fps, 10 % larger than the bucket on each axis
    (so the resize is a real one), frames of noise moving sideways (a hard case for the codec)."""
    import av

    f, h, w = shape
    src_h, src_w = h * 11 // 10 // 2 * 2, w * 11 // 10 // 2 * 2
    base = np.random.default_rng(0).integers(0, 256, (src_h, src_w, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=16)
        stream.height, stream.width, stream.pix_fmt, stream.bit_rate = src_h, src_w, "yuv420p", 20_000_000
        for i in range(f):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 8 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    path.with_suffix(".txt").write_text(" ".join(f"w{i % 997}" for i in range(CAPTION_WORDS)))


def decode_seconds(path: Path, shape: tuple[int, int, int], repeats: int) -> float:
    """CPU seconds to decode and resize the clip at `path` (`write_clip`) to `shape` with the
    pipeline's decoder, in this process (median of `repeats`)."""
    from lightning_adaptiveload.encode.decode import DecodePlan, Window, decode_item
    from lightning_adaptiveload.encode.grid import check_grid
    from lightning_adaptiveload.encode.inputs import InputItem

    f, h, w = shape
    item = InputItem(id=path.name, where=str(path), path=str(path), kind="video",
                     caption_path=str(path.with_suffix(".txt")))
    plan = DecodePlan(check_grid([(1, h, w), (f, h, w)]), fps=16)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        windows = [e for e in decode_item(item, plan) if isinstance(e, Window)]
        times.append(time.perf_counter() - begin)
    assert [tuple(win.frames.shape) for win in windows] == [(f, h, w, 3)], [win.frames.shape for win in windows]
    return float(np.median(times))


def pipeline_run(clip: Path, shape: tuple[int, int, int], clips: int, args, vae, text_model, tokenizer, device,
                 tile_above: int) -> dict:
    """`encode_videos` on `clips` copies of `clip` (one bucket: `shape`) with `args.num_workers`
    decoding workers, the models given: end-to-end clips/s, the decode wait share (wait_s over the
    run's wall time) and peak memory, from the pipeline's own EncodeResult."""
    import torch

    from lightning_adaptiveload.encode.pipeline import encode_videos

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "in"
        folder.mkdir()
        for i in range(clips):
            (folder / f"clip{i:02d}.mp4").write_bytes(clip.read_bytes())
            (folder / f"clip{i:02d}.txt").write_text(clip.with_suffix(".txt").read_text())
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        result = encode_videos(folder, Path(tmp) / "out", vae=vae, text_encoder=text_model, tokenizer=tokenizer,
                               buckets=[shape], text_len=TEXT_LEN, num_workers=args.num_workers, device=device,
                               tile_above=tile_above, progress=False)
    assert result.samples == clips and not result.bad, (result.samples, result.bad)
    return {"clips": clips, "num_workers": args.num_workers, "seconds": result.seconds, "vae_s": result.vae_s,
            "text_s": result.text_s, "wait_s": result.wait_s, "clips_per_s": clips / result.seconds,
            "tokens_per_s": result.tokens / result.seconds, "decode_wait_share": result.wait_s / result.seconds,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS / "encode_h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny random VAE and UMT5, small shapes (CPU smoke test)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the step-time references; "
                                                               "build and run nothing, write nothing")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=None, metavar="FxHxW",
                        help=f"clip shapes (default {' '.join(SHAPES)}; --tiny: {' '.join(SHAPES_TINY)})")
    parser.add_argument("--tile-above", type=int, default=None,
                        help="tile frames above this many pixels (default: the pipeline's 480*832; --tiny 32*48)")
    parser.add_argument("--repeats", type=int, default=2, help="timed encoder runs per shape after one warm-up")
    parser.add_argument("--text-repeats", type=int, default=10)
    parser.add_argument("--no-decode", action="store_true", help="skip the CPU decode timing")
    parser.add_argument("--pipeline-clips", type=int, default=3,
                        help="clips per shape through encode_videos (0: skip that stage)")
    parser.add_argument("--num-workers", type=int, default=2, help="decoding workers of the encode_videos stage "
                                                                    "(default 2, the command's default)")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="skip the stages left once this many seconds have passed (default 200: the run ends "
                             "well within 4 minutes on an H200)")
    args = parser.parse_args(argv)
    shapes = args.shapes or [parse_shape(s) for s in (SHAPES_TINY if args.tiny else SHAPES)]

    from lightning_adaptiveload.encode.models import TILE_ABOVE
    from lightning_adaptiveload.scheduling.shapes import TokenSpec

    tile_above = args.tile_above if args.tile_above is not None else (32 * 48 if args.tiny else TILE_ABOVE)
    spec = TokenSpec()
    plan = []
    for f, h, w in shapes:
        tokens = spec.tokens_from_pixels(f, h, w)
        plan.append({"shape": f"{f}x{h}x{w}", "frames": f, "height": h, "width": w, "tiled": h * w > tile_above,
                     "latent_shape": [int(v) for v in spec.latent_from_pixels(f, h, w)], "tokens": tokens,
                     "training_refs": training_step_refs(tokens)})
    if args.dry_run:
        models = "tiny VAE and UMT5" if args.tiny else "Wan 2.1 VAE (AutoencoderKLWan default config), UMT5-XXL"
        print(f"models: {models}; device {args.device}; {args.repeats} timed runs per shape after one warm-up, "
              f"{args.pipeline_clips} clips per shape through encode_videos; budget {args.budget_s:.0f} s")
        for p in plan:
            refs = "; ".join(f"{r['train_ms_per_sample']:.0f} ms/sample ({r['source']}: {r['model']})"
                             for r in p["training_refs"])
            print(f"  {p['shape']}: latent {p['latent_shape']}, {p['tokens']} tokens, "
                  f"{'tiled' if p['tiled'] else 'not tiled'}; training: {refs}")
        return 0

    import torch

    from lightning_adaptiveload.encode.models import CaptionEncoder, LatentEncoder, compute_dtype

    begin = time.perf_counter()
    device = torch.device(args.device)
    dtype = compute_dtype(device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vae, text_model = build_models(args, device, dtype)
    tokenizer = word_tokenizer(text_model.config.vocab_size)
    latents = LatentEncoder(vae, device=device, dtype=dtype, tile_above=tile_above)
    captions = CaptionEncoder(text_model, tokenizer, device=device, dtype=dtype, text_len=TEXT_LEN)
    weights_bytes = torch.cuda.memory_allocated(device) if cuda else None
    built_s = time.perf_counter() - begin
    caption = " ".join(f"w{i % 997}" for i in range(CAPTION_WORDS))

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    text_times, embedding = _timed(lambda: captions.encode(caption), args.text_repeats, sync)
    text = {"seconds": text_times, "median_ms": 1e3 * float(np.median(text_times)), "tokens_padded": TEXT_LEN,
            "caption_tokens": int(embedding.shape[0]), "finite": bool(np.isfinite(embedding).all()),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
    rows = [{**p, "status": "not run"} for p in plan]
    doc = {**run_meta("encode", argv, diffusers=_version("diffusers"), transformers=_version("transformers"),
                      av=_version("av")),
           "settings": {"tiny": args.tiny, "repeats": args.repeats, "text_repeats": args.text_repeats,
                        "tile_above": tile_above, "dtype": str(dtype).removeprefix("torch."),
                        "pipeline_clips": args.pipeline_clips, "num_workers": args.num_workers,
                        "budget_s": args.budget_s},
           "models": {"vae": "diffusers AutoencoderKLWan" + (f"({VAE_TINY})" if args.tiny else "() default config "
                                                             "(Wan 2.1)"),
                      "vae_parameters": sum(t.numel() for t in vae.parameters()),
                      "text_encoder": {"class": "transformers UMT5EncoderModel",
                                       "config": UMT5_TINY if args.tiny else UMT5_XXL},
                      "text_parameters": sum(t.numel() for t in text_model.parameters()),
                      "weights_gib": weights_bytes / 2**30 if cuda else None, "build_s": built_s,
                      "weights": "random (the cost does not depend on them)"},
           "text": text, "shapes": rows, "skipped": [], "wall_s": None}

    def stage(name: str, row: dict, estimate_s: float = 0.0) -> bool:
        """Whether to run stage `name` of `row`'s shape: no (recorded) when the budget is spent or
        would be by the stage's `estimate_s`."""
        if time.perf_counter() - begin + estimate_s < args.budget_s:
            return True
        doc["skipped"].append(f"{row['shape']}: {name} (budget of {args.budget_s:.0f} s spent"
                              + (f" or short of its estimated {estimate_s:.0f} s)" if estimate_s else ")"))
        return False

    def save() -> None:
        doc["wall_s"] = time.perf_counter() - begin
        write_result(args.out, doc, announce=False)

    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:  # the encoders alone, both shapes first: the figures that matter most
            if not stage("encoders", row):
                continue
            frames = torch.from_numpy(np.random.default_rng(0).integers(
                0, 256, (row["frames"], row["height"], row["width"], 3), dtype=np.uint8))
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                frames = frames.pin_memory()
            try:
                times, latent = _timed(lambda: latents.encode(frames, "bench"), args.repeats, sync)
            except torch.cuda.OutOfMemoryError as e:  # recorded, and the other shapes still run
                row.update(status="oom", error=str(e).splitlines()[0])
                print(f"{row['shape']}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            vae_s = float(np.median(times))
            clip_s = vae_s + text["median_ms"] / 1e3  # one window per clip: one caption
            row.update(status="ok", vae_seconds=times, vae_s=vae_s, clip_s=clip_s, clips_per_s=1 / clip_s,
                       tokens_per_s=row["tokens"] / clip_s, latent_finite=bool(np.isfinite(latent).all()),
                       peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                       decode_cpu_s=None, pipeline=None)
            for ref in row["training_refs"]:
                train_s = ref["train_ms_per_sample"] / 1e3
                ref["encode_over_train"] = clip_s / train_s
                ref["encode_share_of_step"] = clip_s / (clip_s + train_s)
            print(f"{row['shape']}: VAE {vae_s:.2f} s a clip ({time.perf_counter() - begin:.0f} s in)", flush=True)
            save()
        for row in (r for r in rows if r["status"] == "ok"):
            clip = Path(tmp) / f"clip_{row['shape']}.mp4"
            shape = (row["frames"], row["height"], row["width"])
            if (not args.no_decode or args.pipeline_clips) and stage("clip", row):
                write_clip(clip, shape)
            if clip.exists() and not args.no_decode and stage("decode", row):
                row["decode_cpu_s"] = decode_seconds(clip, shape, 2)
            if clip.exists() and args.pipeline_clips and stage("pipeline", row, args.pipeline_clips * row["clip_s"]):
                row["pipeline"] = pipeline_run(clip, shape, args.pipeline_clips, args, vae, text_model, tokenizer,
                                               device, tile_above)
            print(f"{row['shape']}: decode and pipeline done ({time.perf_counter() - begin:.0f} s in)", flush=True)
            save()
    save()
    print(f"wrote {args.out}")
    _print_table(doc)
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _print_table(doc: dict) -> None:
    text = doc["text"]
    print(f"{doc['device']}; text encoder: {text['median_ms']:.1f} ms per caption ({text['tokens_padded']} tokens), "
          f"peak {_gib(text['peak_gib'])}; models built in {doc['models']['build_s']:.0f} s; run {doc['wall_s']:.0f} s")
    head = f"{'shape':>12} {'tiled':>5} {'VAE s':>7} {'clip s':>7} {'clips/s':>8} {'tokens':>7} {'tokens/s':>9} " \
           f"{'peak':>9} {'decode s':>9} {'e2e clips/s':>11} {'wait':>5}  training step -> encode share"
    print(head)
    for r in doc["shapes"]:
        if r["status"] != "ok":
            print(f"{r['shape']:>12} {'yes' if r['tiled'] else 'no':>5} {r['status']}")
            continue
        decode = "-" if r["decode_cpu_s"] is None else f"{r['decode_cpu_s']:.2f}"
        run = r["pipeline"]
        e2e, wait = ("-", "-") if run is None else (f"{run['clips_per_s']:.3f}",
                                                    f"{100 * run['decode_wait_share']:.0f}%")
        refs = "; ".join(f"{ref['train_ms_per_sample']:.0f} ms/sample [{Path(ref['source']).name}"
                         f"{', extrapolated' if ref.get('extrapolated') else ''}] -> "
                         f"{100 * ref['encode_share_of_step']:.0f}%" for ref in r["training_refs"])
        print(f"{r['shape']:>12} {'yes' if r['tiled'] else 'no':>5} {r['vae_s']:7.2f} {r['clip_s']:7.2f} "
              f"{r['clips_per_s']:8.3f} {r['tokens']:7d} {r['tokens_per_s']:9.0f} {_gib(r['peak_gib']):>9} "
              f"{decode:>9} {e2e:>11} {wait:>5}  {refs}")
    for line in doc["skipped"]:
        print(f"skipped: {line}")


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} GiB"


if __name__ == "__main__":
    sys.exit(main())
