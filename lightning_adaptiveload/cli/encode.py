"""`adaptiveload encode INPUT... --out DIR --model WAN_DIR`: videos and images with captions ->
latent shards and an index for AdaptiveLoadDataModule(shards=DIR, index=DIR/index.jsonl).

INPUT is a folder (videos mp4/webm/mov/mkv/avi and images jpg/jpeg/png/webp, each with its
caption in a .txt of the same name beside it; other files are counted as ignored), a JSONL
manifest ({"path": ..., "caption": ...} a line, paths relative to the manifest), WebDataset tars
(media + txt or json caption), or video/image files (a .txt caption beside each).

Each clip is resampled to --fps by timestamps, resized and center-cropped to the bucket of the
grid nearest its aspect ratio (--buckets; default: 1, 17, ..., 81 frames at landscape, portrait
and square sizes: 256x448, 448x256, 336x336, Wan's 480x832, 832x480, 720x1280, 1280x720, and
624x624, 960x960), the largest needing no upscaling on either axis; a source that would lose more
than --max-crop of its frame or be upscaled more than --max-upscale is a bad input. It is cut to
the largest frame bucket it fills (Wan's rule: F = 4k + 1 frames, latent T = 1 + (F - 1) / 4);
longer clips give several windows (--long windows) or their first (--long trim). Latents come
from the Wan VAE (diffusers AutoencoderKLWan, normalized with its latents_mean/std), captions
(cleaned as Wan's pipelines clean prompts) from UMT5 (transformers), weights from local folders
only; DIR/empty_prompt.text.npy holds the empty prompt's embedding (for caption dropout).

Bad inputs (missing file or caption, zero bytes, undecodable, too short, too small, far aspect,
no bucket, NaN latent) are skipped, counted by reason and listed in DIR/bad.jsonl; frames left
out, clips trimmed, inputs upscaled and ignored files are counted in the progress bar, the last
line and DIR/encode_summary.json. Rerun the same command to resume: shards already written are
checked (with --check full, every member's crc32) and kept, a damaged or half-written one is
rewritten. Several processes
(torchrun, or --rank/--world-size) each encode the inputs hashing to them into their own shards;
the last to finish builds DIR/index.jsonl (or run `adaptiveload encode --finalize --out DIR`).
Needs `pip install "lightning-adaptiveload[encode]"`. Exit status 1 if no sample was written,
2 on bad arguments or input.
"""
from __future__ import annotations

import argparse
import sys

from lightning_adaptiveload.cli.plan import run_with_clear_errors


def register(subparsers) -> None:
    p = subparsers.add_parser("encode", help="encode videos/images with captions into latent shards and an index",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="a folder, a JSONL manifest, or tar paths / brace patterns")
    p.add_argument("--out", required=True, help="output folder: shards, index.jsonl, bad.jsonl, encode-state/")
    models = p.add_argument_group("models (local folders; nothing is downloaded)")
    models.add_argument("--model", help="a Wan diffusers pipeline folder with vae/, text_encoder/, tokenizer/")
    models.add_argument("--vae", help="AutoencoderKLWan folder (default: MODEL/vae)")
    models.add_argument("--text-encoder", help="UMT5EncoderModel folder (default: MODEL/text_encoder)")
    models.add_argument("--tokenizer", help="tokenizer folder (default: MODEL/tokenizer, or the text encoder's)")
    models.add_argument("--no-text", action="store_true",
                        help="write no text embeddings (captions stay in each sample's JSON)")
    shape = p.add_argument_group("shapes")
    shape.add_argument("--buckets", help="bucket grid: shapes JSONL of frames/height/width rows (default: the "
                                         "reference mix)")
    shape.add_argument("--fps", type=float, default=16.0, help="target frame rate (default 16, Wan 2.1's); 0: keep "
                                                               "the source's frames")
    shape.add_argument("--long", choices=("windows", "trim"), default="windows",
                       help="clips longer than the largest frame bucket: consecutive windows (default) or the first")
    shape.add_argument("--max-crop", type=float, default=0.3,
                       help="a source whose nearest bucket would crop away more than this fraction of its frame is "
                            "a bad input, bad_aspect (default 0.3; 1: never)")
    shape.add_argument("--max-upscale", type=float, default=2.0,
                       help="a source that would be upscaled more than this factor to its bucket is a bad input, "
                            "too_small (default 2)")
    shape.add_argument("--patch", type=int, nargs=3, default=(1, 2, 2), metavar=("PT", "PH", "PW"),
                       help="DiT patch: buckets must be whole patches; tokens column of the index")
    enc = p.add_argument_group("encoding")
    enc.add_argument("--latent", choices=("mean", "sample"), default="mean",
                     help="store the VAE posterior's mean (default) or a seeded sample of it")
    enc.add_argument("--text-len", type=int, default=512, help="caption tokens, padded/truncated (default 512)")
    enc.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="stored arrays")
    enc.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                     help="encoders' dtype: auto = bf16 on GPU, fp32 on CPU")
    enc.add_argument("--device", help="default: cuda:LOCAL_RANK if a GPU is there, else cpu")
    enc.add_argument("--tile-above", type=int, default=480 * 832,
                     help="VAE-encode frames of more pixels than this in spatial tiles (default 480*832: 720p is "
                          "tiled, 480p is not)")
    enc.add_argument("--seed", type=int, default=0, help="seed of --latent sample")
    enc.add_argument("--num-workers", type=int, default=2, help="decoding worker processes (0: in this process)")
    run_ = p.add_argument_group("output, resume and ranks")
    run_.add_argument("--samples-per-shard", type=int, default=64)
    run_.add_argument("--check", choices=("full", "headers"), default="full",
                      help="resume: check every member's crc32 and decode and validate every sample of the shards "
                           "found (full), or check their size and tar headers only")
    run_.add_argument("--rank", type=int, help="this process's rank (default: $RANK, else 0)")
    run_.add_argument("--world-size", type=int, help="processes sharing the inputs (default: $WORLD_SIZE, else 1)")
    run_.add_argument("--no-finalize", action="store_true", help="do not build the index when all ranks are done")
    run_.add_argument("--finalize", action="store_true",
                      help="only build DIR/index.jsonl from every rank's shards (all ranks done); no models needed")
    run_.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=lambda args: run_with_clear_errors("encode", run, args))


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ImportError as e:  # an optional package missing: the message names the extra to install
        print(f"adaptiveload encode: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    # torch: imported here, not at --help
    from lightning_adaptiveload.encode.pipeline import encode_videos, finalize_encode, summary_line

    if args.finalize:
        summary = finalize_encode(args.out, check=args.check, progress=not args.no_progress)
        print(summary_line(summary))
        return 0 if summary["samples"] else 1
    if not args.inputs:
        raise ValueError("give the inputs to encode (a folder, a JSONL manifest or tars), or --finalize")
    vae = args.vae or (args.model and f"{args.model}/vae")
    if vae is None:
        raise ValueError("give --model (a Wan diffusers pipeline folder) or --vae")
    text_encoder = None if args.no_text else (args.text_encoder or (args.model and f"{args.model}/text_encoder"))
    if text_encoder is None and not args.no_text:
        raise ValueError("give --model or --text-encoder (or --no-text for latents only)")
    tokenizer = args.tokenizer or (args.model and f"{args.model}/tokenizer") if text_encoder else None
    result = encode_videos(args.inputs, args.out, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                           buckets=args.buckets, fps=args.fps or None, long=args.long, latent=args.latent,
                           text_len=args.text_len, samples_per_shard=args.samples_per_shard, dtype=args.dtype,
                           patch=tuple(args.patch), rank=args.rank, world_size=args.world_size,
                           finalize_index=not args.no_finalize, check=args.check, num_workers=args.num_workers,
                           device=args.device, precision=args.precision, tile_above=args.tile_above,
                           seed=args.seed, max_crop=args.max_crop, max_upscale=args.max_upscale,
                           progress=not args.no_progress)
    return 0 if result.samples + result.resumed else 1
