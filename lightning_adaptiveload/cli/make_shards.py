"""`adaptiveload make-shards --shapes MIX.jsonl --n N --out DIR`: synthetic latent shards.

Draws N sample shapes from a shapes file (by its counts: images to long videos), fills each
(C, T, H, W) latent with N(0, 1) values and writes WebDataset tars DIR/shard-000000.tar, ...
in the sample format of docs/data.md. For demos, tests and benchmarks: the data is random.
"""
from __future__ import annotations

import argparse

from lightning_adaptiveload.cli.plan import run_with_clear_errors


def register(subparsers) -> None:
    p = subparsers.add_parser("make-shards", help="write synthetic mixed-shape latent shards",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", required=True, help="shapes JSONL (pixel, latent or token rows with counts)")
    p.add_argument("--n", type=int, required=True, help="number of samples to write")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--samples-per-shard", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latent-scale", type=float, default=1.0,
                   help="multiply latent H and W by this (e.g. 0.25 for a small CPU demo); T is kept")
    p.add_argument("--latent-channels", type=int, default=16, help="C of each latent (Wan 2.1 VAE: 16)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    p.add_argument("--text-len", type=int, default=0, help="with --text-dim: write a random (L, D) .text.npy")
    p.add_argument("--text-dim", type=int, default=0)
    p.add_argument("--vae-stride-t", type=int, default=4)
    p.add_argument("--vae-stride-s", type=int, default=8)
    p.add_argument("--patch", type=int, nargs=3, default=(1, 2, 2), metavar=("PT", "PH", "PW"))
    p.set_defaults(func=lambda args: run_with_clear_errors("make-shards", run, args))


def run(args: argparse.Namespace) -> int:
    from lightning_adaptiveload.data.shards import write_synthetic_shards  # imports torch: not at `--help`
    from lightning_adaptiveload.scheduling.shapes import TokenSpec, read_shapes_jsonl

    spec = TokenSpec(vae_stride_t=args.vae_stride_t, vae_stride_s=args.vae_stride_s, patch=tuple(args.patch))
    mix = read_shapes_jsonl(args.shapes, spec)
    paths = write_synthetic_shards(mix, args.n, args.out, spec=spec, samples_per_shard=args.samples_per_shard,
                                   seed=args.seed, latent_channels=args.latent_channels,
                                   latent_scale=args.latent_scale, text_len=args.text_len,
                                   text_dim=args.text_dim, dtype=args.dtype)
    print(f"wrote {args.n} samples in {len(paths)} shards to {args.out}")
    return 0
