"""Map-style sample index in memory: load time and memory for a synthetic N-line index (default 1M).

Writes an index JSONL with shapes drawn from the reference mix (keys, member offsets and text
shapes as `adaptiveload index` writes them) over `--shards` empty tar files: nothing here reads
sample bytes, so no real shards are needed. Then, each in a fresh Python process:

  read    read_index(path): seconds, resident memory the result keeps (RSS growth after
          gc), and the peak RSS growth while loading
  setup   AdaptiveLoadDataModule(index=...).setup(): the same, for the whole map-style setup
          (read, per-sample configuration checks, scheduling keys)
  worker  after read_index, a forked child (as a DataLoader worker is) reads every sample's key,
          shard and member spans the way IndexedShardDataset does; its private dirty memory
          growth is the part of the index copied into that worker (copy-on-write)

with the binary cache off (`cache=False`, `index_cache=False`), and for this checkout also:

  hash          file_fingerprint(path): stat + sha256 of the index, what every cached load pays
  cache_write   read_index(path) without a cache: parse, hash, write <index>.npz
  cached        read_index(path) with a valid cache: hash, load the npz
  cached_setup  AdaptiveLoadDataModule.setup() with a valid cache

for this checkout and, with `--baseline <commit>`, for that commit's package (`git archive`), so
the table compares the columnar index with the list of dicts it replaced.

    python benchmarks/data/index_load.py --baseline 39cb5d7          # 1M lines
    python benchmarks/data/index_load.py --lines 100000 --out /tmp/x.json

Prints a table and writes benchmarks/results/index_load.json.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

# The repository root, put on sys.path by the driver only (main, after the child branch): a measured
# child imports the package its PYTHONPATH names (this checkout's or a baseline commit's), so this
# script must not put the checkout first there (see benchmarks/_meta.py).
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
PHASES = ("read", "setup", "worker")
CACHE_PHASES = ("hash", "cache_write", "cached", "cached_setup")  # this checkout only, in this order


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def private_dirty_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Private_Dirty in /proc/self/smaps_rollup")


def write_index(folder: Path, lines: int, shards: int, seed: int, legacy: bool = False) -> Path:
    """`lines` index lines over `shards` empty tars in `folder`; returns the index path. Index format
    version 2: a header line and a record before each shard's samples, each tar extended (sparse) to
    the end of its last member so the records' sizes hold; with `legacy`, version 1 (no header, no
    records, [offset, size] spans) for a --baseline package older than version 2."""
    from lightning_adaptiveload.data.datamodule import REFERENCE_MIX
    from lightning_adaptiveload.data.index import INDEX_FORMAT, INDEX_VERSION, member_table_sha256, shard_record
    from lightning_adaptiveload.data.shards import mix_latent_shapes
    from lightning_adaptiveload.scheduling.shapes import TokenSpec, read_shapes_jsonl

    spec = TokenSpec()
    mix = read_shapes_jsonl(REFERENCE_MIX, spec)
    shapes = mix_latent_shapes(mix, spec)
    rng = np.random.default_rng(seed)
    drawn = shapes[rng.choice(len(shapes), size=lines, p=mix.counts / mix.counts.sum())]
    tokens = spec.tokens_from_latent(drawn[:, 0], drawn[:, 1], drawn[:, 2])
    latent_bytes = 128 + 2 * 16 * drawn.prod(axis=1)  # float16 (16, T, H, W) .npy
    has_text = rng.random(lines) < 0.5
    per_shard = -(-lines // shards)
    path = folder / "index.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        if not legacy:
            out.write(json.dumps({"format": INDEX_FORMAT, "version": INDEX_VERSION}) + "\n")
        for s in range(shards):
            shard, rows, offset = f"shard-{s:06d}.tar", [], 512
            for i in range(s * per_shard, min(lines, (s + 1) * per_shard)):
                t, h, w = (int(v) for v in drawn[i])
                members = {"json": [offset, 60], "latent.npy": [offset + 1024, int(latent_bytes[i])]}
                offset += 1536 + int(latent_bytes[i]) // 512 * 512
                if has_text[i]:
                    members["text.npy"] = [offset, 128 + 2 * 512 * 4096]
                    offset += 4_194_816
                if not legacy:  # the header offset: one 512-byte header before each member's data
                    members = {suffix: [at, size, at - 512] for suffix, (at, size) in members.items()}
                rows.append({"key": f"sample{i:09d}", "shard": shard, "members": members, "latent_shape": [t, h, w],
                             "channels": 16, "text_shape": [512, 4096] if has_text[i] else None,
                             "tokens": int(tokens[i])})
            with tarfile.open(folder / shard, "w"):
                pass
            if not legacy:
                os.truncate(folder / shard, max(offset, (folder / shard).stat().st_size))
                st = (folder / shard).stat()
                out.write(json.dumps(shard_record(shard, st, member_table_sha256(folder / shard))) + "\n")
            out.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def touch_every_sample(index) -> None:
    """What a DataLoader worker reads of each sample before its positioned reads."""
    if hasattr(index, "members"):  # columnar SampleIndex
        for i in range(len(index)):
            index.key(i), index.shard_path(i), index.members(i)
    else:  # list of dicts
        for row in index:
            row["key"], row["shard"], list(row["members"].items())


def child(phase: str, folder: Path) -> dict:
    """One measurement in this (fresh) process; the package is whichever PYTHONPATH gives."""
    import lightning_adaptiveload.data.datamodule as datamodule
    from lightning_adaptiveload.data.index import read_index

    # phases without "cache" in their name parse; a baseline older than the cache has no such switch
    use_cache = "cache" in phase
    has_cache = "cache" in inspect.signature(read_index).parameters
    gc.collect()
    before = rss_bytes()
    start = time.perf_counter()
    if phase in ("setup", "cached_setup"):
        dm = datamodule.AdaptiveLoadDataModule(shards=str(folder), index=str(folder / "index.jsonl"),
                                               policy="token_equal", m_mem=1 << 17, num_workers=0,
                                               **({"index_cache": use_cache} if has_cache else {}))
        dm.setup("fit")
        held = dm
    elif phase == "hash":
        from lightning_adaptiveload.data.index import file_fingerprint
        held = file_fingerprint(folder / "index.jsonl")
    else:
        held = read_index(folder / "index.jsonl", **({"cache": use_cache} if has_cache else {}))
    seconds = time.perf_counter() - start
    gc.collect()
    result = {"phase": phase, "module": datamodule.__file__, "seconds": seconds,
              "retained_bytes": rss_bytes() - before, "peak_growth_bytes": peak_rss_bytes() - before}
    # the DataModule keeps the index in its map-style source (before the split: in `dataset`)
    data = getattr(held, "source", held)
    index = data.dataset.index if phase.endswith("setup") and hasattr(data.dataset, "index") else held
    if hasattr(index, "key_blob"):  # columnar: the exact size of its arrays
        result["array_bytes"] = sum(v.nbytes for v in vars(index).values() if isinstance(v, np.ndarray))
    if phase == "worker":
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            dirty = private_dirty_bytes()
            touch_every_sample(held)
            os.write(write_end, str(private_dirty_bytes() - dirty).encode())
            os._exit(0)
        os.close(write_end)
        result["worker_copied_bytes"] = int(os.read(read_end, 64))
        os.waitpid(pid, 0)
    del held
    return result


def run_child(phase: str, folder: Path, package_root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    out = subprocess.run([sys.executable, __file__, "--child", phase, "--folder", str(folder)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", help="git commit whose package to measure as well (e.g. the list-of-dicts index)")
    parser.add_argument("--out", default=str(RESULTS / "index_load.json"))
    parser.add_argument("--child", choices=PHASES + CACHE_PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Path(args.folder))))
        return

    from tqdm import tqdm

    sys.path.insert(0, str(REPO))  # the repository root: only here, not in the measured children
    from benchmarks._meta import run_meta, write_result  # imports the package
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "data").mkdir()
        start = time.perf_counter()
        index_path = write_index(tmp / "data", args.lines, args.shards, args.seed)
        print(f"wrote {args.lines} index lines ({index_path.stat().st_size / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - start:.1f} s")
        versions = {"this checkout": (REPO, tmp / "data")}
        if args.baseline:
            old = tmp / "baseline"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "lightning_adaptiveload"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            index_module = (old / "lightning_adaptiveload" / "data" / "index.py").read_text()
            legacy = "INDEX_VERSION" not in index_module  # older than index format version 2
            (tmp / "baseline_data").mkdir()
            write_index(tmp / "baseline_data", args.lines, args.shards, args.seed, legacy=legacy)
            versions = {f"baseline {args.baseline}": (old, tmp / "baseline_data"), **versions}
        runs = [(v, p) for v in versions.items() for p in PHASES] + [
            (("this checkout", versions["this checkout"]), p) for p in CACHE_PHASES]
        rows, cache_path = [], index_path.with_name(index_path.name + ".npz")
        for (name, (root, data)), phase in tqdm(runs, desc="measure"):
            if phase == "cache_write":
                cache_path.unlink(missing_ok=True)
            written = cache_path.stat().st_ino if phase.startswith("cached") else None
            result = run_child(phase, data, root)
            if written is not None and cache_path.stat().st_ino != written:
                raise RuntimeError(f"{phase}: the cache was rewritten, so this run parsed instead of loading it")
            if not result["module"].startswith(str(root)):
                raise RuntimeError(f"{name}: measured {result['module']}, not the package under {root}")
            rows.append({"version": name, **result, "module": str(Path(result["module"]).relative_to(root))})
        index_bytes, cache_bytes = index_path.stat().st_size, cache_path.stat().st_size

    print(f"\n{args.lines} index lines ({index_bytes / 2**20:.0f} MiB), {args.shards} shards, "
          f"cache {cache_bytes / 2**20:.0f} MiB")
    print(f"{'version':<22} {'phase':<12} {'seconds':>8} {'kept MiB':>9} {'B/sample':>9} {'peak MiB':>9} "
          f"{'worker copy MiB':>16} {'arrays B/sample':>16}")
    for r in rows:
        copied = f"{r['worker_copied_bytes'] / 2**20:>16.0f}" if "worker_copied_bytes" in r else f"{'':>16}"
        arrays = f"{r['array_bytes'] / args.lines:>16.0f}" if "array_bytes" in r else f"{'':>16}"
        print(f"{r['version']:<22} {r['phase']:<12} {r['seconds']:>8.2f} {r['retained_bytes'] / 2**20:>9.0f} "
              f"{r['retained_bytes'] / args.lines:>9.0f} {r['peak_growth_bytes'] / 2**20:>9.0f} {copied} {arrays}")
    doc = run_meta("index_load") | {
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "folder")},
        "index_file_bytes": index_bytes,
        "cache_file_bytes": cache_bytes,
        "notes": "retained = RSS growth after gc (what the process keeps), peak = VmHWM growth while loading, "
                 "worker copy = private dirty growth of a forked child reading every sample's key, shard and "
                 "member spans (pages copied from the parent by reference counting), arrays = nbytes of the columnar "
                 "index's numpy arrays (setup: of the samples kept). Each row is one fresh process. read/setup/worker "
                 "run with the index cache off; hash = stat + sha256 of the index file alone; cache_write = "
                 "read_index without a cache (parse + hash + write <index>.npz); cached / cached_setup = read_index / "
                 "DataModule.setup() with a valid cache (hash + npz load).",
        "rows": rows,
    }
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
