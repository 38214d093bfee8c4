"""The map-style source: every sample's shape is known from the index, the `BucketBatchSampler`
plans each epoch globally (balanced across ranks, resumable mid-epoch) and samples are read by
byte offset from the tars."""
from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from lightning_adaptiveload.data.index import SampleIndex, check_shards, index_fingerprint, read_index, read_members
from lightning_adaptiveload.data.shards import BadSample
from lightning_adaptiveload.data.source import SampleConfig, TrainLoader
from lightning_adaptiveload.scheduling.buckets import schedule_keys
from lightning_adaptiveload.scheduling.epoch_plan import DROP_COUNTERS
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
from lightning_adaptiveload.scheduling.shapes import ShapeMix


class IndexedShardDataset(Dataset):
    """Samples of an index, read by byte offset. Item i is `decode(key, member bytes)`, or
    {"key", "skip": reason, "detail"} when it fails to read or decode (counted by collation)."""

    def __init__(self, index: SampleIndex, decode: Callable[[str, dict[str, bytes]], dict]):
        self.index = index
        self.decode = decode
        self._fds: OrderedDict[str, int] = OrderedDict()  # opened lazily: each DataLoader worker has its own

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self) -> dict:
        # Spawned/forkserver DataLoader workers get a pickled copy: descriptor numbers opened here
        # would name other files (or none) there, so the copy starts with no open shards.
        return {**self.__dict__, "_fds": OrderedDict()}

    def __getitem__(self, i: int) -> dict:
        key = self.index.key(i)
        try:
            files = read_members(self._fds, self.index.shard_path(i), self.index.members(i), key)
            return self.decode(key, files)
        except BadSample as e:
            return {"key": key, "skip": e.reason, "detail": str(e)}


class MapStyleLoader(TrainLoader):
    """Train loader over a BucketBatchSampler. Its state is the sampler's, with the step count of
    batches this loader handed out (not those its sampler dispatched to workers ahead of time), so
    a resume neither repeats nor skips a sample."""

    def _start_epoch(self, epoch: int | None) -> int:
        sampler = self.batch_sampler
        if epoch is not None and epoch != sampler.epoch:
            sampler.set_epoch(epoch)
        stats = sampler.stats
        dropped = {key: stats[key] for key in DROP_COUNTERS if stats[key]}
        if dropped and sampler.rank == 0:  # the plan is the same on every rank: say it once
            left_out = ", ".join(f"{k}={v}" for k, v in dropped.items())
            rank_zero_info(f"adaptiveload data: epoch {sampler.epoch} trains {stats['samples_scheduled']} of "
                           f"{stats['samples_total'] - stats['samples_consumed_before']} samples in {stats['steps']} "
                           f"steps; left out: {left_out} (drop_last={sampler.drop_last})")
        return len(sampler.plan().steps) - len(sampler)

    def __len__(self) -> int:
        """Steps of the whole epoch, also after a resume (Lightning reads the length after
        restoring the state and counts the restored steps towards it)."""
        earlier = sum(k for _, k in self.batch_sampler.state_dict()["segments"][:-1])
        return earlier + len(self.batch_sampler.plan().steps)

    def drop_counts(self) -> dict[str, int]:
        stats = self.batch_sampler.stats
        return {key: int(stats[key]) for key in DROP_COUNTERS}

    def state_dict(self) -> dict:
        return self.batch_sampler.state_dict(steps_consumed=self.steps_taken)

    def load_state_dict(self, state: dict) -> None:
        if state.get("streaming"):
            raise ValueError("loader state was saved by the other data path (streaming, not map-style)")
        self.batch_sampler.load_state_dict(state)


class MapStyleSource:
    """The samples of an index that fit `config`, and the loader of one rank over them."""

    def __init__(self, index_path: str, shard_paths: list[str], config: SampleConfig, *, num_workers: int,
                 seed: int, drop_last: bool | None, index_cache: bool):
        self.index_path, self.shard_paths, self.config = index_path, shard_paths, config
        self.num_workers, self.seed, self.drop_last, self.index_cache = num_workers, seed, drop_last, index_cache
        self.dataset: IndexedShardDataset | None = None
        self._rows: ShapeMix | None = None
        self._row_of_sample: np.ndarray | None = None  # (N,) row of self._rows of each dataset item
        # (keys, fingerprint) of the current rows: every sampler build needs them, and the fingerprint
        # hashes every key (~1 s per 10M samples)
        self._keyed: tuple[np.ndarray, str] | None = None

    def setup(self, count_skipped: Callable[[dict, str], None]) -> ShapeMix:
        """Read the index, check every row against the configuration (failures go to
        `count_skipped(reason -> count, where)`); return the kept samples' shapes (one row per
        distinct (C, T, H, W, D_text) that fits, with its sample count)."""
        index = read_index(self.index_path, cache=self.index_cache)
        if not len(index):
            raise ValueError(f"index {self.index_path!r} lists no samples")
        check_shards(index, self.index_path)  # missing or changed shards: a clear error before "outside `shards`"
        # realpath on both sides: the index resolves symlinks (its folder's), `shards` may not.
        known = {os.path.realpath(p) for p in self.shard_paths}
        foreign = np.flatnonzero([os.path.realpath(p) not in known for p in index.shard_paths])
        if len(foreign):
            raise ValueError(f"index {self.index_path!r} refers to {int(np.isin(index.shard, foreign).sum())} "
                             f"samples in shards outside `shards`, e.g. {index.shard_paths[foreign[0]]!r}")
        # The checks depend only on (C, T, H, W, D_text): run them once per distinct combination.
        combos, first, combo_of = np.unique(
            np.column_stack([index.channels, index.latent_shape, index.text_shape[:, 1]]), axis=0,
            return_index=True, return_inverse=True)
        combo_of = combo_of.reshape(-1)
        combo_size = np.bincount(combo_of, minlength=len(combos))
        fits = np.zeros(len(combos), dtype=bool)
        combo_thw, combo_tokens = np.zeros((len(combos), 3), np.int64), np.zeros(len(combos), np.int64)
        skipped = Counter()
        for c, (channels, t, h, w, text_dim) in enumerate(combos.tolist()):
            try:
                combo_thw[c], combo_tokens[c] = self.config.check(index.key(first[c]), channels, (t, h, w),
                                                                  None if text_dim < 0 else text_dim)
                fits[c] = True
            except BadSample as e:
                skipped[e.reason] += int(combo_size[c])
        count_skipped(skipped, f"index {self.index_path}")
        kept = np.flatnonzero(fits[combo_of])
        if not len(kept):
            raise ValueError(f"no sample of index {self.index_path!r} fits this configuration "
                             f"(skipped: {dict(skipped)})")
        row_of_combo = np.cumsum(fits) - 1
        self._rows = ShapeMix(tokens=combo_tokens[fits], counts=combo_size[fits].astype(np.int64),
                              latent_thw=combo_thw[fits])
        self._row_of_sample = row_of_combo[combo_of[kept]]
        self.dataset = IndexedShardDataset(index.take(kept) if len(kept) < len(index) else index, self.config.decode)
        self._keyed = None
        return self._rows

    def sample_keys(self) -> np.ndarray:
        """(N,) int64 token count each dataset item is scheduled at (buckets.schedule_keys)."""
        return schedule_keys(self._rows.latent_thw, self._rows.tokens)[self._row_of_sample]

    def sampler(self, scheduling: dict, num_replicas: int | None = None, rank: int | None = None
                ) -> BucketBatchSampler:
        """The batch sampler of `rank` under `scheduling` (policy, m_mem, m_comp, p, cost_model,
        memory_plan, and max_seq_len: the longest sample to schedule, true tokens)."""
        scheduling = dict(scheduling)
        if self._keyed is None:
            keys = self.sample_keys()
            keys.setflags(write=False)  # shared by every sampler built from it
            self._keyed = keys, index_fingerprint(self.dataset.index, keys)
        keys, fingerprint = self._keyed
        # The sampler compares bucket keys, which sit above true tokens by collision offsets; keys grow
        # with true tokens, so the largest key of a sample within the bound separates the two.
        tokens = self._rows.tokens[self._row_of_sample]
        within = tokens <= scheduling.pop("max_seq_len")
        if not within.any():
            raise ValueError(f"every sample is longer than the longest one scheduled ({int(tokens.min())} tokens and "
                             f"more); raise m_mem or max_seq_len")
        return BucketBatchSampler(keys, **scheduling, num_replicas=num_replicas, rank=rank, seed=self.seed,
                                  drop_last=self.drop_last, max_seq_len=int(keys[within].max()),
                                  dataset_fingerprint=fingerprint)

    def train_loader(self, scheduling: dict, num_replicas: int | None, rank: int | None,
                     epoch_fn: Callable[[], int] | None = None) -> MapStyleLoader:
        return MapStyleLoader(self.dataset, batch_sampler=self.sampler(scheduling, num_replicas, rank),
                              collate_fn=self.config.collate, num_workers=self.num_workers,
                              persistent_workers=self.num_workers > 0, pin_memory=torch.cuda.is_available(),
                              epoch_fn=epoch_fn)
