"""DataModule throughput: samples/s and tokens/s, per DataLoader worker, map-style and streaming.

Writes synthetic shards drawn from a shape mix (default: the shipped reference mix, images to
21-latent-frame 720p videos, 16 latent channels, float16), indexes them, then for each path and
worker count reads `--batches` batches of the train loader (token_equal policy: batch sizes
need no cost model) and times them, worker start-up included.
Text: the stand-in embedding (text_len x text_dim), as for a dataset without .text.npy members.

    python benchmarks/data/datamodule_throughput.py                      # defaults below
    python benchmarks/data/datamodule_throughput.py --latent-scale 1.0 --n 400 --workers 0 1 2

Each configuration runs --repeats times (median reported, all runs in the JSON). Prints a table
and writes benchmarks/results/datamodule_throughput.json.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import webdataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import RESULTS, run_meta, write_result  # noqa: E402
from lightning_adaptiveload.data.datamodule import REFERENCE_MIX, AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.data.index import build_index  # noqa: E402
from lightning_adaptiveload.data.shards import resolve_shards, write_synthetic_shards  # noqa: E402
from lightning_adaptiveload.scheduling.shapes import TokenSpec, read_shapes_jsonl  # noqa: E402

NOTES = ("workers=0 decodes in the main process with all intra-op threads (2 here); each DataLoader worker "
         "runs with 1 thread, so per-worker rates are per core. MB/s counts latent bytes as stored (float16). "
         "Times include worker start-up. Each row is the median of --repeats runs by tokens/s.")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def run_one(root: Path, path: str, workers: int, args) -> dict:
    """Time `args.batches` batches of one train loader; returns the measured row."""
    dm = AdaptiveLoadDataModule(shards=str(root / "shards"), index=str(root / "index.jsonl") if path == "map" else None,
                                policy="token_equal", m_mem=args.m_mem, max_seq_len=args.m_mem,
                                latent_channels=16, text_len=args.text_len, text_dim=args.text_dim,
                                num_workers=workers, seed=0, steps_per_epoch=args.batches,
                                shuffle_buffer=args.shuffle_buffer)
    dm.setup("fit")
    loader = dm.build_train_loader(1, 0)
    samples = tokens = nbytes = batches = 0
    start = time.perf_counter()
    first = None
    for batch in loader:
        batch = dm.on_before_batch_transfer(batch, 0)
        if first is None:
            first = time.perf_counter() - start
        samples += len(batch["keys"])
        tokens += len(batch["keys"]) * batch["seq_len"]
        nbytes += batch["latents"].numel() * 2  # float16 on disk
        batches += 1
        if batches >= args.batches:
            break
    seconds = time.perf_counter() - start
    del loader  # stop the workers before the next configuration
    per = max(1, workers)
    return {"path": path, "workers": workers, "batches": batches, "samples": samples, "tokens": tokens,
            "seconds": seconds, "first_batch_s": first, "samples_per_s": samples / seconds,
            "tokens_per_s": tokens / seconds, "latent_mb_per_s": nbytes / seconds / 1e6,
            "samples_per_s_per_worker": samples / seconds / per, "tokens_per_s_per_worker": tokens / seconds / per,
            "skipped": dict(dm.skipped)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=REFERENCE_MIX)
    parser.add_argument("--n", type=int, default=600, help="samples written")
    parser.add_argument("--latent-scale", type=float, default=0.5, help="latent H, W scale of the mix shapes")
    parser.add_argument("--samples-per-shard", type=int, default=50)
    parser.add_argument("--m-mem", type=int, default=32768, help="tokens per batch (token_equal)")
    parser.add_argument("--batches", type=int, default=40, help="batches timed per configuration")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median is reported")
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--text-dim", type=int, default=4096)
    parser.add_argument("--shuffle-buffer", type=int, default=64)
    parser.add_argument("--workdir", default=None, help="where to write shards (default: a temp dir)")
    parser.add_argument("--out", default=str(RESULTS / "datamodule_throughput.json"))
    args = parser.parse_args()

    root = Path(args.workdir or tempfile.mkdtemp(prefix="adaptiveload-bench-"))
    spec = TokenSpec()
    if not (root / "shards").exists():
        write_synthetic_shards(read_shapes_jsonl(args.shapes, spec), args.n, root / "shards", spec=spec,
                               samples_per_shard=args.samples_per_shard, latent_scale=args.latent_scale)
    build_index(resolve_shards(str(root / "shards")), root / "index.jsonl", spec)
    shard_bytes = sum(os.path.getsize(p) for p in resolve_shards(str(root / "shards")))

    rows = []
    for path in ("map", "stream"):
        for workers in args.workers:
            runs = [run_one(root, path, workers, args) for _ in range(args.repeats)]
            # the median run by tokens/s, with the spread of all runs (a shared machine is noisy)
            r = sorted(runs, key=lambda x: x["tokens_per_s"])[len(runs) // 2]
            r["tokens_per_s_all_runs"] = [x["tokens_per_s"] for x in runs]
            r["samples_per_s_all_runs"] = [x["samples_per_s"] for x in runs]
            rows.append(r)
            print(f"{path:6s} workers={workers}: {r['samples_per_s']:.1f} samples/s, {r['tokens_per_s']:.0f} tokens/s",
                  file=sys.stderr)

    print(NOTES)
    header = f"{'path':6s} {'workers':>7s} {'batches':>7s} {'samples/s':>10s} {'tokens/s':>10s} {'lat MB/s':>8s} " \
             f"{'samples/s/w':>11s} {'tokens/s/w':>10s} {'1st batch s':>11s}"
    print(header)
    for r in rows:
        print(f"{r['path']:6s} {r['workers']:7d} {r['batches']:7d} {r['samples_per_s']:10.1f} "
              f"{r['tokens_per_s']:10.0f} "
              f"{r['latent_mb_per_s']:8.1f} {r['samples_per_s_per_worker']:11.1f} {r['tokens_per_s_per_worker']:10.0f} "
              f"{r['first_batch_s']:11.2f}")
    result = {
        **run_meta("datamodule_throughput", webdataset=webdataset.__version__),
        "cpu": {"name": cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                "note": "2-core CI-class VM shared with other jobs"},
        "notes": NOTES,
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "shard_bytes": shard_bytes},
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
