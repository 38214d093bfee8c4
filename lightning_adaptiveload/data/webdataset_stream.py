"""The streaming source: shards streamed through webdataset, batches formed as samples arrive,
a fixed `steps_per_epoch`. An IterableDataset of batches per (rank, DataLoader worker).

Pipeline in each worker:
  shard order (explicit node + worker split, endlessly re-shuffled) -> webdataset tar reader
  -> decode + validate (bad samples skipped and counted) -> seeded shuffle buffer
  -> StreamingBucketBatcher (lightning_adaptiveload.scheduling.stream_batcher) -> collate
Every worker yields exactly its share of `steps_per_epoch`, so every rank yields the same
number of batches whatever its shards hold. Nothing is dropped at the end of an epoch: a
bucket that cannot fill within the buffer bound is emitted as a partial batch.
"""
from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset

from lightning_adaptiveload._validation import require_int
from lightning_adaptiveload.data.collate import as_is
from lightning_adaptiveload.data.index import scan_shard
from lightning_adaptiveload.data.shards import (LATENT_SUFFIXES, MEMBER_SUFFIXES, SKIPPED_KEY, BadSample, decode_meta,
                                                inspect_sample, mix_latent_shapes)
from lightning_adaptiveload.data.source import SampleConfig, TrainLoader
from lightning_adaptiveload.scheduling.buckets import schedule_keys
from lightning_adaptiveload.scheduling.epoch_plan import DROP_COUNTERS
from lightning_adaptiveload.scheduling.shapes import ShapeMix, read_shapes_jsonl
from lightning_adaptiveload.scheduling.stream_batcher import (StreamingBucketBatcher, StreamSchedule,
                                                              make_stream_schedule)

log = logging.getLogger(__name__)
DRY_READS_PER_SHARD = 8
PROBE_SAMPLES = 256  # without a shapes file: valid samples read at setup to learn the mix


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

    keys: latent (T, H, W) -> scheduled token count of the shapes the schedule knows; decode:
    (key, member bytes) -> sample dict, raising BadSample. max_tokens: longest sample scheduled
    (true tokens; decoding admits up to max_seq_len, which a memory plan may lower): longer ones are
    skipped as "over_max_seq_len". Skip counts of this worker since its previous batch travel in each
    batch ("skipped"); `steps_done` (set by the loader from a checkpoint) shortens the current
    epoch."""

    def __init__(self, shards: list[str], schedule: StreamSchedule, *, keys: dict[tuple, int],
                 decode: Callable[[str, dict[str, bytes]], dict], collate: Callable[[list[dict]], dict],
                 steps_per_epoch: int, rank: int, world_size: int, seed: int, shuffle_buffer: int,
                 max_buffer_samples: int, max_buffer_bytes: int, max_tokens: int | None = None):
        self.shards, self.schedule, self.keys, self.max_tokens = shards, schedule, keys, max_tokens
        self._planned_keys = set(keys.values())
        self.decode, self.collate = decode, collate
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
                out = self.decode(sample["__key__"], files)
            except BadSample as e:
                skipped[e.reason] += 1
                continue
            progress["valid"] += 1
            if self.max_tokens is not None and out["seq_len"] > self.max_tokens:
                skipped["over_max_seq_len"] += 1
                continue
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
        batcher = StreamingBucketBatcher(self.schedule, batches_per_epoch=self.steps_per_epoch - self.steps_done,
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


class StreamingLoader(TrainLoader):
    """Train loader over a StreamingLatentDataset. Its state is (epoch, steps done): a resume runs
    the remaining steps of the epoch from a fresh position of the (resampled) stream."""

    def _start_epoch(self, epoch: int | None) -> int:
        data = self.dataset
        if epoch is not None and epoch != data.epoch:
            data.epoch, data.steps_done = epoch, 0
        elif data.steps_done >= data.steps_per_epoch:
            data.steps_done = 0
        return data.steps_done

    def _end_epoch(self) -> None:
        self.dataset.steps_done = 0

    def __len__(self) -> int:
        return self.dataset.steps_per_epoch

    def drop_counts(self) -> dict[str, int]:
        # Oversize samples are skipped when decoded (skipped/over_max_seq_len); partial batches are
        # emitted, not dropped; an epoch is a number of steps, so no remainder is left out.
        return dict.fromkeys(DROP_COUNTERS, 0)

    def state_dict(self) -> dict:
        return {"streaming": True, "epoch": self.dataset.epoch, "steps_done": self.steps_taken,
                "steps_per_epoch": self.dataset.steps_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("streaming"):
            raise ValueError("loader state was saved by the other data path (map-style, not streaming)")
        if state["steps_per_epoch"] != self.dataset.steps_per_epoch:
            raise ValueError(f"loader state has steps_per_epoch {state['steps_per_epoch']}, "
                             f"this run {self.dataset.steps_per_epoch}")
        self.dataset.epoch, self.dataset.steps_done = int(state["epoch"]), int(state["steps_done"])


class StreamingSource:
    """Shards streamed per (rank, worker); the bucket table comes from a shapes file (`mix_file`,
    latent H and W times `mix_scale`) or, without one, from the first PROBE_SAMPLES valid samples."""

    def __init__(self, shard_paths: list[str], config: SampleConfig, *, steps_per_epoch: int | None,
                 mix_file: str | None, mix_scale: float, num_workers: int, seed: int, shuffle_buffer: int,
                 max_buffer_samples: int, max_buffer_bytes: int):
        self.shard_paths, self.config, self.steps_per_epoch = shard_paths, config, steps_per_epoch
        self.mix_file, self.mix_scale = mix_file, mix_scale
        self.num_workers, self.seed, self.shuffle_buffer = num_workers, seed, shuffle_buffer
        self.max_buffer_samples, self.max_buffer_bytes = max_buffer_samples, max_buffer_bytes
        self._rows: ShapeMix | None = None

    def setup(self, count_skipped: Callable[[dict, str], None]) -> ShapeMix:
        """The expected shapes of the stream (one row per shape, with its weight). Samples read
        here are not counted as skipped: the stream reads and counts them again."""
        require_int("steps_per_epoch (needed on the streaming path, without an index)", self.steps_per_epoch)
        probed, probe_skipped = self._probe(1 if self.mix_file else PROBE_SAMPLES)
        if not probed:
            raise ValueError(f"no valid sample in the {len(self.shard_paths)} shards for this configuration "
                             f"(skipped: {dict(probe_skipped)})")
        if self.mix_file:
            mix = read_shapes_jsonl(self.mix_file, self.config.spec)
            rows = []
            for thw, count in zip(mix_latent_shapes(mix, self.config.spec, self.mix_scale), mix.counts):
                try:
                    thw, tokens = self.config.check("shapes mix", self.config.latent_channels,
                                                    tuple(int(v) for v in thw), None)
                except BadSample:
                    continue
                rows.append((*thw, tokens, int(count)))
            if not rows:
                raise ValueError(f"no shape of {self.mix_file!r} fits max_seq_len={self.config.max_seq_len} tokens")
        else:
            rows = [(*thw, tokens, n) for (thw, tokens), n in Counter(probed).items()]
        rows = np.asarray(rows, dtype=np.int64)
        self._rows = ShapeMix(tokens=rows[:, 3], counts=rows[:, 4], latent_thw=rows[:, :3])
        return self._rows

    def _probe(self, limit: int) -> tuple[list, Counter]:
        """Up to `limit` (latent (T, H, W), tokens) of valid samples from the first shards, and skip
        counts. Samples are decoded in full until one passes; after that only their JSON is read
        (the shapes estimate the mix; the stream validates every sample anyway)."""
        found, skipped = [], Counter()
        for shard in self.shard_paths:
            for key, spans, files, error in scan_shard(shard, read={"json"} if found else None):
                try:
                    if error is not None:
                        raise error
                    if found:
                        if not any(s in spans for s in LATENT_SUFFIXES):
                            raise BadSample("missing_latent", key)
                        thw = tuple(decode_meta(files.get("json"), key)["latent_shape"])
                        found.append(self.config.check(key, self.config.latent_channels, thw, None))
                    else:
                        _, latent, text = inspect_sample(key, files)
                        found.append(self.config.check(key, latent.shape[0], tuple(latent.shape[1:]),
                                                       None if text is None else text.shape[1]))
                except BadSample as e:
                    skipped[e.reason] += 1
                if len(found) >= limit:
                    return found, skipped
        return found, skipped

    def build_dataset(self, scheduling: dict, num_replicas: int = 1, rank: int = 0) -> StreamingLatentDataset:
        """The streaming dataset of `rank` under `scheduling` (policy, m_mem, m_comp, p, cost_model,
        memory_plan, and max_seq_len: the longest sample to schedule, true tokens)."""
        scheduling = dict(scheduling)
        max_tokens = scheduling.pop("max_seq_len")
        row_keys = schedule_keys(self._rows.latent_thw, self._rows.tokens)
        seq_lens, first = np.unique(row_keys, return_index=True)
        counts = np.zeros(len(seq_lens), dtype=np.int64)
        np.add.at(counts, np.searchsorted(seq_lens, row_keys), self._rows.counts)
        mix = ShapeMix(tokens=seq_lens, counts=counts, latent_thw=self._rows.latent_thw[first])
        # True tokens are checked against max_tokens after decoding; keys may sit above them by at
        # most the number of planned keys (collision offsets), which the batcher must accept.
        schedule = make_stream_schedule(mix, **scheduling,
                                        max_seq_len=max(max_tokens, int(seq_lens[-1])) + len(seq_lens))
        keys = {tuple(int(v) for v in thw): int(k) for thw, k in zip(self._rows.latent_thw, row_keys)}
        readers = num_replicas * max(1, self.num_workers)
        per_reader, rest = divmod(len(self.shard_paths), readers)
        if per_reader and rest:
            # Every reader yields the same number of batches, so a shorter slice is cycled faster.
            log.warning("adaptiveload data: %d shards over %d readers (ranks x workers): %d readers stream %d "
                        "shards and read each %.0f%% more often than the others' %d; use a multiple of %d shards "
                        "for an unbiased mix", len(self.shard_paths), readers, readers - rest, per_reader,
                        100 / per_reader, per_reader + 1, readers)
        return StreamingLatentDataset(self.shard_paths, schedule, keys=keys, decode=self.config.decode,
                                      collate=self.config.collate, steps_per_epoch=self.steps_per_epoch, rank=rank,
                                      world_size=num_replicas, seed=self.seed, shuffle_buffer=self.shuffle_buffer,
                                      max_buffer_samples=self.max_buffer_samples,
                                      max_buffer_bytes=self.max_buffer_bytes, max_tokens=max_tokens)

    def train_loader(self, scheduling: dict, num_replicas: int, rank: int,
                     epoch_fn: Callable[[], int] | None = None) -> StreamingLoader:
        # Workers restart each epoch so they see the dataset's new epoch (a fork copies it). Batches
        # come collated.
        return StreamingLoader(self.build_dataset(scheduling, num_replicas, rank), batch_size=None, collate_fn=as_is,
                               num_workers=self.num_workers, pin_memory=torch.cuda.is_available(), epoch_fn=epoch_fn)
