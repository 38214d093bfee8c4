"""Distributed bucket batch sampler for map-style datasets whose per-sample token counts are known.

Every rank computes the same global plan from (seed, epoch, seq_lens) and takes its own column:

1. Samples longer than `max_seq_len` are dropped (or, with oversize="resize", scheduled in the
   largest allowed bucket). A bucket is one distinct token count.
2. Each bucket's samples are shuffled and cut into batches of the policy's batch size; a
   bucket's last partial batch is dropped when drop_last=True.
3. The batches are shuffled and `world_size` of them form one step. The last `n_batches %
   world_size` batches cannot fill a step: they are dropped (drop_last=True), or split into
   `world_size` smaller batches of the same buckets when they hold enough samples.
4. Policy "balanced" orders the batches by predicted cost before grouping, so each step holds
   `world_size` consecutive batches of the cost-sorted list, then shuffles the order of the steps.
   For one batch per rank per step this is the assignment that minimises the sum over steps of
   the slowest rank's time (sorted consecutive grouping minimises the sum of group maxima), i.e.
   the data-parallel bubble. "token_equal" and "dual_constraint" group batches at random, as
   Open-Sora does, so ranks run different buckets in one step.

Everything is numpy arrays over samples and batches (a 10M-sample epoch plans in seconds).
Everything left out is counted in `EpochPlan.stats` / `BucketBatchSampler.stats`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from lightning_adaptiveload.scheduling.policies import batch_sizes, check_policy, require_int

OVERSIZE = ("drop", "resize")
STATE_VERSION = 1
log = logging.getLogger(__name__)


def resolve_compute_budget(policy: str, m_mem: int, longest_seq_len: int, m_comp: float | None = None,
                           p: float | None = None, cost_model=None) -> tuple[float | None, float | None]:
    """(m_comp, p) for `policy`: given values win; else from `cost_model` (its `.dual_p` and
    `m_comp(m_mem, longest_seq_len)`, tokens of the longest bucket that is scheduled).
    token_equal needs neither and gets (None, None)."""
    if check_policy(policy) == "token_equal":
        return None, None
    if p is None and cost_model is not None:
        p = float(cost_model.dual_p)
    if m_comp is None and cost_model is not None:
        m_comp = float(cost_model.m_comp(int(m_mem), int(longest_seq_len)))
    if m_comp is None or p is None:
        raise ValueError(f"policy {policy!r} needs m_comp and p: pass them or a cost_model")
    return float(m_comp), float(p)


def batch_costs(batch_len: np.ndarray, batch_seq_len: np.ndarray, p: float | None, cost_model=None) -> np.ndarray:
    """Predicted cost of each batch: cost_model.predict(B, S) in ms, or B * S^p (tokens^p) without one."""
    if cost_model is not None:
        return np.asarray(cost_model.predict(batch_len, batch_seq_len), dtype=np.float64)
    if p is None:
        raise ValueError("batch costs need p or a cost_model")
    return batch_len.astype(np.float64) * batch_seq_len.astype(np.float64) ** p


@dataclass(frozen=True)
class EpochPlan:
    """The global plan of one epoch (or of the rest of one, after a resume).

    order: (n_in_batches,) int32 (int64 above 2^31 samples) dataset indices; batch i is order[batch_start[i]:][:batch_len[i]].
    batch_start, batch_len, batch_seq_len: (n_batches,) int64 (offset, samples, tokens per sample).
    steps: (n_steps, world_size) int64 batch id run by each rank at each step.
    stats: sample and batch counts, including everything left out (see plan_epoch).
    """

    order: np.ndarray
    batch_start: np.ndarray
    batch_len: np.ndarray
    batch_seq_len: np.ndarray
    steps: np.ndarray
    stats: dict

    def batch(self, step: int, rank: int) -> np.ndarray:
        """Dataset indices (int64) that `rank` runs at `step`."""
        b = self.steps[step, rank]
        return self.order[self.batch_start[b]: self.batch_start[b] + self.batch_len[b]]

    def step_indices(self, start: int, stop: int) -> np.ndarray:
        """All dataset indices of steps [start, stop) on all ranks, concatenated."""
        ids = self.steps[start:stop].ravel()
        return self.order[ranges_to_positions(self.batch_start[ids], self.batch_len[ids])]


def ranges_to_positions(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    ends = np.cumsum(lens)
    return np.repeat(starts - ends + lens, lens) + np.arange(int(ends[-1]) if len(ends) else 0)


def _split_into(starts: list[int], lens: list[int], parts: int) -> tuple[list[int], list[int]]:
    """Split batches (same-bucket slices) by halving the largest until there are `parts` of them."""
    starts, lens = list(starts), list(lens)
    while len(lens) < parts:
        i = int(np.argmax(lens))
        half = lens[i] // 2
        starts.append(starts[i] + lens[i] - half)
        lens.append(half)
        lens[i] -= half
    return starts, lens


def plan_epoch(bucket_of: np.ndarray, bucket_seq_len: np.ndarray, bucket_batch: np.ndarray, *,
               policy: str, world_size: int, seed: int, epoch: int, drop_last: bool = True,
               exclude: np.ndarray | None = None, segment: int = 0, p: float | None = None,
               cost_model=None, grouped: np.ndarray | None = None) -> EpochPlan:
    """Global plan of an epoch. bucket_of: (N,) int bucket of each sample, -1 = dropped (oversize);
    bucket_seq_len, bucket_batch: (K,) int64 tokens and batch size of each bucket; exclude: (N,) bool,
    samples already consumed (a resume); segment: which re-plan of the epoch this is (RNG stream);
    grouped: group_by_bucket(bucket_of), computed here when not given.

    stats keys: samples_total, samples_consumed_before (excluded), dropped_oversize,
    dropped_partial_batch (drop_last), dropped_step_remainder (batches that could not fill a
    last step), samples_scheduled, batches, steps, world_size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rng = np.random.default_rng([int(seed), int(epoch), int(segment)])
    n = len(bucket_of)
    keep = bucket_of >= 0
    dropped_oversize = int(n - keep.sum())
    consumed = 0
    if exclude is not None:
        consumed = int((exclude & keep).sum())
        keep &= ~exclude
    # Each bucket is a contiguous run of `order`, shuffled in place.
    grouped = group_by_bucket(bucket_of) if grouped is None else grouped
    order = grouped[keep[grouped]]
    bounds = np.searchsorted(bucket_of[order], np.arange(len(bucket_seq_len) + 1))  # `order` is bucket-sorted
    offsets, counts = bounds[:-1], np.diff(bounds)
    for k in np.flatnonzero(counts > 1):
        rng.shuffle(order[offsets[k]: offsets[k] + counts[k]])
    full = counts // bucket_batch
    partial = counts - full * bucket_batch

    bucket = np.repeat(np.arange(len(counts)), full)
    within = np.arange(len(bucket)) - np.repeat(np.cumsum(full) - full, full)
    batch_start = offsets[bucket] + within * bucket_batch[bucket]
    batch_len = bucket_batch[bucket]
    dropped_partial = 0
    if drop_last:
        dropped_partial = int(partial.sum())
    else:
        has = np.flatnonzero(partial > 0)
        bucket = np.concatenate([bucket, has])
        batch_start = np.concatenate([batch_start, offsets[has] + full[has] * bucket_batch[has]])
        batch_len = np.concatenate([batch_len, partial[has]])

    shuffled = rng.permutation(len(batch_len))
    n_steps, rest = divmod(len(shuffled), world_size)
    in_steps, leftover = shuffled[: n_steps * world_size], shuffled[n_steps * world_size:]
    if policy == "balanced":
        # full batches of a bucket share one cost: price K buckets plus the few partial batches
        costs = batch_costs(bucket_batch, bucket_seq_len, p, cost_model)[bucket[in_steps]]
        partial_ids = np.flatnonzero(batch_len[in_steps] != bucket_batch[bucket[in_steps]])
        costs[partial_ids] = batch_costs(batch_len[in_steps[partial_ids]], bucket_seq_len[bucket[in_steps[partial_ids]]],
                                         p, cost_model)
        in_steps = in_steps[np.argsort(costs, kind="stable")]  # ties keep their random order
    steps = in_steps.reshape(n_steps, world_size)
    if policy == "balanced":
        steps = rng.permuted(steps[rng.permutation(n_steps)], axis=1)

    dropped_remainder = int(batch_len[leftover].sum())
    if rest and not drop_last and dropped_remainder >= world_size:
        # Split the leftover batches into world_size smaller ones: one more step, no sample repeated.
        starts, lens = _split_into(batch_start[leftover].tolist(), batch_len[leftover].tolist(), world_size)
        parent = np.searchsorted(offsets + counts, np.asarray(starts), side="right")  # bucket of each piece
        first = len(batch_len)
        bucket = np.concatenate([bucket, parent])
        batch_start = np.concatenate([batch_start, starts])
        batch_len = np.concatenate([batch_len, lens])
        steps = np.concatenate([steps, np.arange(first, first + world_size)[None, :]])
        dropped_remainder = 0
    if exclude is None and len(steps) == 0:
        raise ValueError(f"world size {world_size} is larger than the number of batches an epoch can fill "
                         f"({len(batch_len)} batches from {int(keep.sum())} schedulable samples)")
    stats = {
        "samples_total": n,
        "samples_consumed_before": consumed,
        "dropped_oversize": dropped_oversize,
        "dropped_partial_batch": dropped_partial,
        "dropped_step_remainder": dropped_remainder,
        "samples_scheduled": int(batch_len[steps.ravel()].sum()),
        "batches": int(steps.size),
        "steps": int(len(steps)),
        "world_size": int(world_size),
    }
    return EpochPlan(order=order, batch_start=batch_start.astype(np.int64), batch_len=batch_len.astype(np.int64),
                     batch_seq_len=bucket_seq_len[bucket].astype(np.int64), steps=steps.astype(np.int64), stats=stats)


def group_by_bucket(bucket_of: np.ndarray) -> np.ndarray:
    """Sample indices ordered by bucket (stable), int32 below 2^31 samples; the per-epoch plan only
    shuffles within buckets, so this sort runs once per sampler (int16 keys use a radix sort)."""
    keys = bucket_of.astype(np.int16) if bucket_of.max(initial=0) < 2**15 else bucket_of
    return np.argsort(keys, kind="stable").astype(np.int32 if len(bucket_of) < 2**31 else np.int64)


def assign_buckets(seq_lens: np.ndarray, max_seq_len: int, oversize: str = "drop") -> tuple[np.ndarray, np.ndarray]:
    """(bucket_of (N,) int32 with -1 for dropped samples, bucket_seq_len (K,) int64 sorted tokens).
    oversize="resize" puts samples above max_seq_len in the largest bucket <= max_seq_len."""
    if oversize not in OVERSIZE:
        raise ValueError(f"oversize must be one of {OVERSIZE}, got {oversize!r}")
    seq_lens = np.asarray(seq_lens)
    if seq_lens.ndim != 1 or seq_lens.size == 0:
        raise ValueError(f"seq_lens must be a non-empty 1-D array of tokens per sample, got shape {seq_lens.shape}")
    if not np.issubdtype(seq_lens.dtype, np.integer):
        raise ValueError(f"seq_lens must be integers (tokens per sample), got dtype {seq_lens.dtype}")
    if seq_lens.min() < 1:
        bad = int(np.flatnonzero(seq_lens < 1)[0])
        raise ValueError(f"seq_lens must be >= 1 token, got {int(seq_lens[bad])} at index {bad}")
    seq_lens = seq_lens.astype(np.int64, copy=False)
    fits = seq_lens <= max_seq_len
    if not fits.any():
        raise ValueError(f"every sample is longer than max_seq_len={max_seq_len} tokens "
                         f"(shortest has {int(seq_lens.min())})")
    # Unique values then searchsorted: cheaper than np.unique(return_inverse=True) on N samples.
    bucket_seq_len = np.unique(seq_lens[fits])
    bucket_of = np.searchsorted(bucket_seq_len, seq_lens).astype(np.int32)
    bucket_of[~fits] = len(bucket_seq_len) - 1 if oversize == "resize" else -1
    return bucket_of, bucket_seq_len


def _dist_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class BucketBatchSampler(Sampler):
    """Yields this rank's batches (lists of dataset indices), the same number on every rank.

    seq_lens: (N,) tokens per sample. policy: "token_equal" | "dual_constraint" | "balanced".
    m_mem: memory budget, tokens per batch (B*S <= m_mem); m_comp, p: compute budget B*S^p <= m_comp,
    derived from `cost_model` when not given. max_seq_len: longest sample scheduled (tokens),
    default m_mem (one sample above the memory budget cannot run safely); longer ones are dropped
    (counted in `stats`) or, with oversize="resize", put in the largest allowed bucket
    (`target_seq_lens` says which; the dataset must resize them). num_replicas/rank default to
    torch.distributed's, else 1/0. dataset_fingerprint: an opaque string naming the dataset's
    samples in order (the DataModule's `index_fingerprint`); saved in the state and checked on load,
    so a resume never maps positions of one index onto another.

    With Lightning use `DataLoader(dataset, batch_sampler=sampler)` and
    `Trainer(use_distributed_sampler=False)`; Lightning calls `set_epoch` each epoch (through the
    `sampler` property).
    """

    def __init__(self, seq_lens, *, policy: str, m_mem: int, m_comp: float | None = None, p: float | None = None,
                 cost_model=None, num_replicas: int | None = None, rank: int | None = None, seed: int = 0,
                 drop_last: bool = True, max_seq_len: int | None = None, oversize: str = "drop",
                 dataset_fingerprint: str | None = None):
        check_policy(policy)
        m_mem = require_int("m_mem (tokens per batch)", m_mem)
        max_seq_len = require_int("max_seq_len (tokens)", m_mem if max_seq_len is None else max_seq_len)
        world, dist_rank = _dist_world()
        self.num_replicas = world if num_replicas is None else int(num_replicas)
        self.rank = dist_rank if rank is None else int(rank)
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {num_replicas=}, {rank=}")
        self.policy, self.m_mem, self.max_seq_len, self.oversize = policy, int(m_mem), int(max_seq_len), oversize
        self.seed, self.drop_last, self.cost_model = int(seed), bool(drop_last), cost_model
        self.dataset_fingerprint = dataset_fingerprint
        self.bucket_of, self.bucket_seq_len = assign_buckets(seq_lens, self.max_seq_len, oversize)
        self.m_comp, self.p = resolve_compute_budget(policy, self.m_mem, int(self.bucket_seq_len[-1]),
                                                     m_comp, p, cost_model)
        if policy == "balanced" and self.p is None:
            raise ValueError("policy 'balanced' needs p or a cost_model to predict batch costs")
        self.bucket_batch = batch_sizes(self.bucket_seq_len, policy, self.m_mem, self.m_comp, self.p)
        self._grouped = group_by_bucket(self.bucket_of)
        self.epoch = 0
        self._segments = [[self.num_replicas, 0]]  # [world_size, steps consumed] per (re-)plan of this epoch
        self._cache_key, self._cache_plan = None, None

    @property
    def target_seq_lens(self) -> np.ndarray:
        """(N,) int64 tokens each sample is scheduled at; -1 for dropped samples."""
        return np.where(self.bucket_of >= 0, self.bucket_seq_len[np.maximum(self.bucket_of, 0)], -1)

    def _plan(self, segments: list[list[int]], index: int, exclude: np.ndarray | None) -> EpochPlan:
        return plan_epoch(self.bucket_of, self.bucket_seq_len, self.bucket_batch, policy=self.policy,
                          world_size=segments[index][0], seed=self.seed, epoch=self.epoch,
                          drop_last=self.drop_last, exclude=exclude, segment=index, p=self.p,
                          cost_model=self.cost_model, grouped=self._grouped)

    def plan(self) -> EpochPlan:
        """The plan this sampler is on: the epoch's, or its re-plan after a resume with another
        world size (previous segments' consumed steps excluded)."""
        key = (self.epoch, tuple(tuple(s) for s in self._segments[:-1]), self._segments[-1][0])
        if key != self._cache_key:
            exclude = None
            for i in range(len(self._segments) - 1):
                done = self._plan(self._segments, i, exclude).step_indices(0, self._segments[i][1])
                exclude = np.zeros(len(self.bucket_of), dtype=bool) if exclude is None else exclude
                exclude[done] = True
            self._cache_key, self._cache_plan = key, self._plan(self._segments, len(self._segments) - 1, exclude)
        return self._cache_plan

    @property
    def stats(self) -> dict:
        """Counts of the current plan (see plan_epoch), plus steps consumed so far."""
        return {**self.plan().stats, "steps_consumed": self._segments[-1][1]}

    @property
    def sampler(self) -> "BucketBatchSampler":
        # Lightning calls set_epoch on `loader.batch_sampler.sampler`, not on the batch sampler itself.
        return self

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch `epoch`. The current epoch is kept as is (with its progress), so a call at the
        start of a resumed epoch does not restart it."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._segments = [[self.num_replicas, 0]]

    def _start(self) -> int:
        """First step to run; a finished epoch iterates again from its start, like DistributedSampler."""
        done = self._segments[-1][1]
        if done and done >= len(self.plan().steps):
            self._segments = [[self.num_replicas, 0]]
        return self._segments[-1][1]

    def __len__(self) -> int:
        start = self._start()
        return len(self.plan().steps) - start

    def __iter__(self) -> Iterator[list[int]]:
        start = self._start()
        plan = self.plan()
        for step in range(start, len(plan.steps)):
            self._segments[-1][1] = step + 1
            yield plan.batch(step, self.rank).tolist()

    def _config(self) -> dict:
        return {"policy": self.policy, "m_mem": self.m_mem, "m_comp": self.m_comp, "p": self.p,
                "max_seq_len": self.max_seq_len, "oversize": self.oversize, "drop_last": self.drop_last,
                "num_samples": len(self.bucket_of)}

    def state_dict(self, steps_consumed: int | None = None) -> dict:
        """Rank-independent resume state. steps_consumed overrides the count of steps of the
        current plan taken so far (pass the trainer's count: a DataLoader prefetches ahead)."""
        segments = [list(s) for s in self._segments]
        if steps_consumed is not None:
            segments[-1][1] = int(steps_consumed)
        return {"version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "segments": segments,
                "config": self._config(), "dataset_fingerprint": self.dataset_fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` stopped: the same plan if the world size is unchanged, else the
        rest of the epoch re-planned for this world size without the samples already consumed."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state must be a dict with version {STATE_VERSION}, got "
                             f"{state.get('version') if isinstance(state, dict) else type(state).__name__!r}")
        self._check_fingerprint(state.get("dataset_fingerprint"))
        saved = state.get("config") if isinstance(state.get("config"), dict) else {}
        changed = {k: (saved.get(k), v) for k, v in self._config().items() if saved.get(k) != v}
        if changed:
            raise ValueError(f"sampler state was saved with a different configuration (saved, now): {changed}")
        segments = [[int(w), int(k)] for w, k in state["segments"]]
        if not segments or any(w < 1 or k < 0 for w, k in segments):
            raise ValueError(f"sampler state has invalid segments {state['segments']!r}")
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        if segments[-1][0] != self.num_replicas:
            segments.append([self.num_replicas, 0])
        self._segments = segments

    def _check_fingerprint(self, saved: str | None) -> None:
        """Refuse a state saved for another dataset: its positions would name other samples, so the
        rest of the epoch would repeat some and skip others. A state or sampler without a
        fingerprint (older checkpoints) cannot be checked: one warning."""
        if saved == self.dataset_fingerprint:
            return
        if saved is None or self.dataset_fingerprint is None:
            log.warning("resuming a sampler state without checking its dataset (fingerprint of the state: %r, of "
                        "this sampler: %r)", saved, self.dataset_fingerprint)
            return
        raise ValueError(f"sampler state was saved for another dataset: its fingerprint is {saved!r}, this run's is "
                         f"{self.dataset_fingerprint!r} (the index was rebuilt, reordered or filtered differently). "
                         f"Resuming would repeat or skip samples of this epoch: resume with the index the checkpoint "
                         f"was made with, or leave out the loader state to restart the epoch (docs/data.md)")
