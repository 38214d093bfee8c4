"""Cost of the data integrity checks (docs/data.md, "What we verify") on a realistic shard set, and
of the index-wide ones at scale.

Shard set: `--n` samples drawn from the shipped reference mix (images to 21-frame videos; latents
at `--latent-scale`, float16, 16 channels), each with a (`--text-len`, `--text-dim`) float16 text
embedding, so a sample has the usual three members (json, latent.npy, text.npy); `--per-shard`
samples a shard, written to a temporary folder (page cache warm, local disk). Measured, each the
median of `--repeats` runs:

  index_build     build_index over the set: decode and validate every sample, member table
                  digest, duplicate keys (seconds per shard, for scale)
  scan_headers    iterate every shard's tar headers without reading data (ms per shard)
  table_digest    member_table_sha256 of every shard: the same scan plus the digest; what
                  check_shards pays for a shard whose mtime differs (ms per shard, us per member)
  check_shards    check_shards(index) with every shard unchanged: a stat and an access per shard
  read_plain      os.pread of each member's data, what read_members did before (us per sample)
  read_verified   read_members: per member a pread of its tar header, parse and check, then the data
  decode          decode_sample of the read bytes (validation included), for comparison

and on `--keys` synthetic keys ("sample%09d", default 1M):

  fingerprint     index_fingerprint(index, seq_lens): what building the train loader pays
  unique_keys     the duplicate-key check of an index parse: hash every key, sort, compare
                  equal hashes (parsing the same lines takes about 9 s per million)

    python benchmarks/data/integrity.py                     # defaults below
    python benchmarks/data/integrity.py --n 512 --keys 100000 --out /tmp/x.json

Prints a table and writes benchmarks/results/integrity.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.data.datamodule import REFERENCE_MIX  # noqa: E402
from lightning_adaptiveload.data.index import (SampleIndex, _check_unique_keys, build_index, check_shards,  # noqa: E402
                                               index_fingerprint, member_table_sha256, read_index, read_members,
                                               scan_shard)
from lightning_adaptiveload.data.shards import decode_sample, write_synthetic_shards  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import TokenSpec, read_shapes_jsonl  # noqa: E402


def median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def read_plain(index: SampleIndex) -> None:
    fds: dict[str, int] = {}
    for i in range(len(index)):
        path = index.shard_path(i)
        fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY))
        for offset, size, _ in index.members(i).values():
            os.pread(fd, size, offset)
    for fd in fds.values():
        os.close(fd)


def read_verified(index: SampleIndex) -> None:
    fds = OrderedDict()
    for i in range(len(index)):
        read_members(fds, index.shard_path(i), index.members(i), index.key(i))
    for fd in fds.values():
        os.close(fd)


def synthetic_keys(n: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    keys = [f"sample{i:09d}".encode() for i in range(n)]
    return keys, np.frombuffer(b"".join(keys), dtype=np.uint8), np.cumsum([len(k) for k in keys])


def key_index(key_blob: np.ndarray, key_end: np.ndarray) -> SampleIndex:
    """A SampleIndex holding only keys (the other columns zeros): what index_fingerprint reads."""
    n = len(key_end)
    zeros = np.zeros(n, dtype=np.int32)
    return SampleIndex(shard_paths=["x.tar"], shard=zeros, member_offset=np.zeros((n, 4), np.int64),
                       member_size=np.zeros((n, 4), np.int64), member_header=np.zeros((n, 4), np.int32),
                       latent_shape=np.zeros((n, 3), np.int32), channels=zeros, text_shape=np.zeros((n, 2), np.int32),
                       tokens=np.zeros(n, np.int64), key_blob=key_blob, key_end=key_end,
                       shard_size=np.zeros(1, np.int64), shard_mtime_ns=np.zeros(1, np.int64),
                       shard_sha256=np.zeros((1, 32), np.uint8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048, help="samples in the shard set")
    parser.add_argument("--per-shard", type=int, default=64)
    parser.add_argument("--latent-scale", type=float, default=0.5)
    parser.add_argument("--text-len", type=int, default=64)
    parser.add_argument("--text-dim", type=int, default=512)
    parser.add_argument("--keys", type=int, default=1_000_000, help="synthetic keys for fingerprint / unique_keys")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "integrity.json"))
    args = parser.parse_args()

    spec = TokenSpec()
    rows = []

    def record(name: str, seconds: float, runs: list[float], per: str, count: int, **extra) -> None:
        rows.append({"measure": name, "seconds": seconds, "runs": runs, "per": per, "count": count,
                     "us_per": seconds / count * 1e6, **extra})

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_synthetic_shards(read_shapes_jsonl(REFERENCE_MIX, spec), args.n, root / "shards", spec=spec,
                                       samples_per_shard=args.per_shard, latent_scale=args.latent_scale,
                                       text_len=args.text_len, text_dim=args.text_dim, progress=False)
        shards = [str(p) for p in paths]
        shard_bytes = sum(p.stat().st_size for p in paths)
        seconds, runs = median_seconds(lambda: build_index(shards, root / "index.jsonl", spec, progress=False),
                                       args.repeats)
        record("index_build", seconds, runs, "shard", len(shards))
        index = read_index(root / "index.jsonl", cache=False)
        members = int((index.member_offset >= 0).sum())
        seconds, runs = median_seconds(lambda: [list(scan_shard(p, read=set())) for p in shards], args.repeats)
        record("scan_headers", seconds, runs, "shard", len(shards))
        seconds, runs = median_seconds(lambda: [member_table_sha256(p) for p in shards], args.repeats)
        record("table_digest", seconds, runs, "shard", len(shards), us_per_member=seconds / members * 1e6)
        seconds, runs = median_seconds(lambda: check_shards(index, root / "index.jsonl"), args.repeats)
        record("check_shards", seconds, runs, "shard", len(shards))
        seconds, runs = median_seconds(lambda: read_plain(index), args.repeats)
        record("read_plain", seconds, runs, "sample", len(index))
        seconds, runs = median_seconds(lambda: read_verified(index), args.repeats)
        record("read_verified", seconds, runs, "sample", len(index))
        fds = OrderedDict()
        files = [read_members(fds, index.shard_path(i), index.members(i), index.key(i)) for i in range(len(index))]
        kwargs = dict(spec=spec, latent_channels=16, text_len=args.text_len, text_dim=args.text_dim, max_seq_len=None)
        seconds, runs = median_seconds(lambda: [decode_sample(index.key(i), f, **kwargs) for i, f in enumerate(files)],
                                       args.repeats)
        record("decode", seconds, runs, "sample", len(index))

    keys, key_blob, key_end = synthetic_keys(args.keys)
    big = key_index(key_blob, key_end)
    seq_lens = np.random.default_rng(0).integers(1, 75_600, size=args.keys)
    seconds, runs = median_seconds(lambda: index_fingerprint(big, seq_lens), args.repeats)
    record("fingerprint", seconds, runs, "key", args.keys)
    lines = np.arange(args.keys, dtype=np.int64)
    seconds, runs = median_seconds(lambda: _check_unique_keys(
        Path("index.jsonl"), np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)), lines, key_blob, key_end),
        args.repeats)
    record("unique_keys", seconds, runs, "key", args.keys)

    by = {r["measure"]: r for r in rows}
    extra = by["read_verified"]["us_per"] - by["read_plain"]["us_per"]
    print(f"{len(index)} samples ({members} members) in {len(shards)} shards, "
          f"{shard_bytes / 2**20:.0f} MiB; {args.keys} synthetic keys")
    print(f"{'measure':<15} {'seconds':>9} {'per':>7} {'us per':>11}")
    for r in rows:
        print(f"{r['measure']:<15} {r['seconds']:>9.4f} {r['per']:>7} {r['us_per']:>11.1f}")
    print(f"header check: +{extra:.0f} us per sample over plain reads, "
          f"{100 * extra / (by['read_plain']['us_per'] + by['decode']['us_per']):.1f}% of read + decode")
    doc = run_meta("integrity") | {
        "settings": vars(args), "shards": len(shards), "samples": len(index), "members": members,
        "shard_bytes": shard_bytes,
        "header_check_us_per_sample": extra,
        "header_check_fraction_of_read_and_decode": extra / (by["read_plain"]["us_per"] + by["decode"]["us_per"]),
        "notes": "Median of --repeats runs; us_per = seconds / count (count = shards, samples or keys, see 'per'). "
                 "Shards freshly written to local disk, so reads come from the page cache; on a network file "
                 "system the header pread adds a round trip only where the header's block is not cached with the "
                 "data's. table_digest minus scan_headers is the digest itself; check_shards is one stat + access "
                 "per shard.",
        "rows": rows,
    }
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
