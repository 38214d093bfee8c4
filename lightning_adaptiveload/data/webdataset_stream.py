"""The streaming path: an IterableDataset of batches per (rank, DataLoader worker).

Pipeline in each worker:
  shard order (explicit node + worker split, endlessly re-shuffled) -> webdataset tar reader
  -> decode + validate (bad samples skipped and counted) -> seeded shuffle buffer
  -> StreamingBucketBatcher (lightning_adaptiveload.scheduling.stream_batcher) -> collate
Every worker yields exactly its share of `steps_per_epoch`, so every rank yields the same
number of batches whatever its shards hold.
"""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset

from lightning_adaptiveload.data.shards import MEMBER_SUFFIXES, SKIPPED_KEY, BadSample, decode_sample
from lightning_adaptiveload.scheduling.stream_batcher import StreamingBucketBatcher, StreamSchedule

DRY_READS_PER_SHARD = 8


def shard_order(shards: list[str], *, rank: int, world_size: int, worker: int, num_workers: int,
                seed: int, epoch: int):
    """Endless shard paths for one (rank, worker). With at least world_size * num_workers shards
    each reader owns a disjoint slice (shards[g::readers], g = rank * num_workers + worker), read
    in a new random order each pass; with fewer, every reader samples all shards with replacement
    from its own seeded RNG (resampled shards), so no reader ever runs dry."""
    readers = world_size * num_workers
    reader = rank * num_workers + worker
    rng = random.Random(f"{seed}/{epoch}/{reader}")
    own = shards[reader::readers] if len(shards) >= readers else None
    while True:
        if own is None:
            yield rng.choice(shards)
        else:
            yield from rng.sample(own, len(own))


def sample_nbytes(sample: dict) -> int:
    """Bytes a buffered sample holds: tensors, arrays and bytes values (others count 0)."""
    total = 0
    for value in sample.values():
        if isinstance(value, torch.Tensor):
            total += value.element_size() * value.nelement()
        elif isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, (bytes, bytearray)):
            total += len(value)
    return total


class StreamingLatentDataset(IterableDataset):
    """Batches (already collated by `collate`) of one rank; `len()` is steps_per_epoch.

    Skip counts of this worker since its previous batch travel in each batch ("skipped");
    `steps_done` (set by the loader from a checkpoint) shortens the current epoch."""

    def __init__(self, shards: list[str], plan: StreamSchedule, *, keys: dict[tuple, int], decode_kwargs: dict, collate,
                 steps_per_epoch: int, rank: int, world_size: int, seed: int, shuffle_buffer: int,
                 max_buffer_samples: int, max_buffer_bytes: int):
        self.shards, self.plan, self.keys = shards, plan, keys
        self._planned_keys = set(keys.values())
        self.decode_kwargs, self.collate = decode_kwargs, collate
        self.steps_per_epoch, self.rank, self.world_size, self.seed = steps_per_epoch, rank, world_size, seed
        self.shuffle_buffer = shuffle_buffer
        self.max_buffer_samples, self.max_buffer_bytes = max_buffer_samples, max_buffer_bytes
        self.epoch = 0
        self.steps_done = 0  # steps of this epoch already trained (resume)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def schedule_key(self, thw: tuple[int, int, int], tokens: int) -> int:
        """Bucket key of a shape: its key in the planned table, else its tokens moved past the
        table's keys (so an unplanned shape never shares a bucket with a planned one)."""
        key = self.keys.get(thw)
        if key is None:
            key = tokens
            while key in self._planned_keys:
                key += 1
        return key

    def _decoded(self, raw, skipped: Counter, progress: Counter):
        for sample in raw:
            files = {s: sample[s] for s in MEMBER_SUFFIXES if s in sample}
            try:
                out = decode_sample(sample["__key__"], files, **self.decode_kwargs)
            except BadSample as e:
                skipped[e.reason] += 1
                continue
            progress["valid"] += 1
            out["tokens"] = out["seq_len"]
            out["seq_len"] = self.schedule_key(out["latent_shape"], out["tokens"])  # what the batcher buckets by
            yield out

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        skipped = Counter()

        def read_error(exn: Exception) -> bool:
            # webdataset reports one broken tar up to twice (member, then archive): count it once.
            # A tar cut inside a member header reads as a clean end; its partial sample is then
            # counted by decoding (missing_latent / missing_json).
            if progress["errored_read"] != progress["shards"]:
                skipped["read_error"] += 1
                progress["errored_read"] = progress["shards"]
            return True  # skip the broken shard remainder, keep streaming

        # A resumed epoch runs its remaining steps from a fresh RNG stream (segment = steps done).
        segment = f"{self.epoch}/{self.steps_done}"
        progress = Counter()  # shards: shard reads started, valid: samples decoded, errored_read: last bad read

        def urls():
            for url in shard_order(self.shards, rank=self.rank, world_size=self.world_size, worker=worker,
                                   num_workers=num_workers, seed=self.seed, epoch=segment):
                if not progress["valid"] and progress["shards"] > DRY_READS_PER_SHARD * (len(self.shards) + 1):
                    # Every sample of every shard read so far was decoded and none was usable:
                    # fail instead of spinning forever (with resampled shards, 8 reads per shard
                    # miss a given shard with probability ~e^-8).
                    raise RuntimeError(f"no valid sample in {progress['shards']} shard reads on rank {self.rank} "
                                       f"worker {worker} (skipped: {dict(skipped)})")
                progress["shards"] += 1
                yield {"url": url}

        # Decode before shuffling: validation keeps pace with reading (so the dry-stream check above
        # holds), and a decoded float16 latent takes no more memory than its raw bytes.
        raw = wds.tarfile_to_samples(handler=read_error)(urls())
        decoded = wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer,
                              rng=random.Random(f"{self.seed}/{segment}/{self.rank}/{worker}"))(
            self._decoded(raw, skipped, progress))
        batcher = StreamingBucketBatcher(self.plan, batches_per_epoch=self.steps_per_epoch - self.steps_done,
                                         seed=self.seed, max_buffer_samples=self.max_buffer_samples,
                                         max_buffer_bytes=self.max_buffer_bytes, nbytes=sample_nbytes, worker=worker,
                                         num_workers=num_workers)
        batcher.set_epoch(self.epoch)
        for samples in batcher(decoded):
            for sample in samples:
                sample["seq_len"] = sample.pop("tokens")  # batches report true tokens, not bucket keys
            batch = self.collate(samples)
            batch[SKIPPED_KEY] = dict(Counter(batch[SKIPPED_KEY]) + skipped)
            skipped.clear()
            yield batch
