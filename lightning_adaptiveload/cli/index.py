"""`adaptiveload index SHARDS -o index.jsonl`: scan shards once and write a sample index.

SHARDS: tar paths, brace patterns ("data/shard-{000000..000099}.tar") or folders. Each valid
sample becomes one JSONL line (key, shard, member byte offsets and sizes, latent shape,
tokens), each shard one record of what identifies its content (size, mtime, member table
digest); with an index the DataModule reads samples by random access (map-style), knows every
shape before training, and refuses shards that changed since. Bad samples are left out and
reported (reason counts, first few details; all of them with --bad FILE). A key seen before
(twice in a shard, or a shard copied under another name) keeps its first sample; the others
are left out as "duplicate_key" and summarized per shard, or with --duplicates error the run
fails and writes no index. Exit status 1 when no valid sample was found, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json

from lightning_adaptiveload.cli.plan import run_with_clear_errors

SHOW_BAD = 5


def register(subparsers) -> None:
    p = subparsers.add_parser("index", help="scan shards and write a sample index (JSONL)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", nargs="+", help="tar paths, brace patterns or folders")
    p.add_argument("-o", "--output", required=True, help="index JSONL to write")
    p.add_argument("--bad", default=None, help="also write every bad sample as JSONL here")
    p.add_argument("--patch", type=int, nargs=3, default=(1, 2, 2), metavar=("PT", "PH", "PW"),
                   help="DiT patch (tokens column of the index)")
    p.add_argument("--extra-tokens", type=int, default=0, help="constant tokens per sample (tokens column)")
    # data.index.DUPLICATES, spelled out so `--help` does not import the data layer (and torch)
    p.add_argument("--duplicates", choices=("first", "error"), default="first",
                   help="a key seen before: keep the first sample and report the rest (first, default), or fail "
                        "(error)")
    p.set_defaults(func=lambda args: run_with_clear_errors("index", run, args))


def run(args: argparse.Namespace) -> int:
    from lightning_adaptiveload.data.index import build_index, summarize_bad, summarize_duplicates
    from lightning_adaptiveload.data.shards import resolve_shards
    from lightning_adaptiveload.scheduling.shapes import TokenSpec

    shards = resolve_shards(args.shards)
    spec = TokenSpec(patch=tuple(args.patch), extra_tokens=args.extra_tokens)
    count, bad = build_index(shards, args.output, spec, duplicates=args.duplicates)
    print(f"indexed {count} samples from {len(shards)} shards -> {args.output}; bad samples: {len(bad)} "
          f"({summarize_bad(bad)})")
    repeated = summarize_duplicates(bad)
    if repeated:
        print("duplicate keys (first sample kept): " + "; ".join(repeated[:SHOW_BAD])
              + (f"; ... {len(repeated) - SHOW_BAD} more shards" if len(repeated) > SHOW_BAD else ""))
    for b in bad[:SHOW_BAD]:
        print(f"  {b['shard']} {b['key']}: {b['detail']}")
    if len(bad) > SHOW_BAD:
        print(f"  ... {len(bad) - SHOW_BAD} more" + (f" in {args.bad}" if args.bad else " (list them with --bad FILE)"))
    if args.bad:
        with open(args.bad, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(b) + "\n" for b in bad)
    return 0 if count else 1
