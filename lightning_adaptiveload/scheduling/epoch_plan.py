"""The epoch plan: every rank's batches of one epoch, computed identically on every rank from
(seed, epoch, buckets) with numpy arrays over samples and batches (a 10M-sample epoch plans in
seconds). `BucketBatchSampler` (sampler.py) runs its rank's column of it.

1. Samples longer than `max_seq_len` are dropped (or, with oversize="resize", scheduled in the
   largest allowed bucket; see buckets.assign_buckets). A bucket is one distinct token count.
2. Each bucket's samples are shuffled and cut into batches of the policy's batch size; a
   bucket's last partial batch is dropped when drop_last=True, kept as a smaller batch otherwise.
3. The batches are shuffled and `world_size` of them form one step. The last `n_batches %
   world_size` batches cannot fill a step: they are dropped (drop_last=True), or (drop_last=False)
   re-split, together with as few of the last steps as needed, into whole steps of smaller
   batches of the same buckets, so no sample is left out and every rank runs the same steps.
4. Policy "balanced" orders the batches by predicted cost before grouping, so each step holds
   `world_size` consecutive batches of the cost-sorted list, then shuffles the order of the steps.
   For one batch per rank per step this is the assignment that minimises the sum over steps of
   the slowest rank's time (sorted consecutive grouping minimises the sum of group maxima), i.e.
   the data-parallel bubble. "token_equal" and "dual_constraint" group batches at random, as
   Open-Sora does, so ranks run different buckets in one step.

Everything left out is counted in `EpochPlan.stats`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_adaptiveload._validation import require_int
from lightning_adaptiveload.scheduling.policies import batch_costs

# EpochPlan.stats keys of the samples an epoch leaves out, per reason (docs/data.md explains each).
DROP_COUNTERS = ("dropped_oversize", "dropped_partial_batch", "dropped_step_remainder")


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


def _steps_to_resplit(step_batch_len: np.ndarray, leftover_samples: int) -> int | None:
    """How many of the last steps to re-split together with the leftover batches (holding
    `leftover_samples` samples) so that the pool fills one more step of non-empty batches: 0 when the
    leftover alone has world_size samples, else the fewest last steps whose samples beyond one per
    batch make up the shortfall; None when even all steps cannot (nearly every batch holds one
    sample). step_batch_len: (n_steps, world_size) samples of each scheduled batch."""
    world_size = step_batch_len.shape[1]
    short = world_size - leftover_samples
    if short <= 0:
        return 0
    spare = np.cumsum(step_batch_len[::-1].sum(axis=1) - world_size)  # from the last step back
    redo = int(np.searchsorted(spare, short)) + 1
    return redo if redo <= len(step_batch_len) else None


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
    world_size = require_int("world_size", world_size)
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
    redo = _steps_to_resplit(batch_len[steps], dropped_remainder) if rest and not drop_last else None
    if redo is not None:
        # Split the leftover batches and the last `redo` steps' batches into (redo + 1) * world_size
        # smaller ones: one more step, no sample repeated or left out.
        pool = np.concatenate([steps[len(steps) - redo:].ravel(), leftover])
        parts = (redo + 1) * world_size
        starts, lens = _split_into(batch_start[pool].tolist(), batch_len[pool].tolist(), parts)
        starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
        parent = np.searchsorted(offsets + counts, starts, side="right")  # bucket of each piece
        ids = len(batch_len) + np.arange(parts)
        if policy == "balanced":
            ids = ids[np.argsort(batch_costs(lens, bucket_seq_len[parent], p, cost_model), kind="stable")]
            new_steps = rng.permuted(ids.reshape(redo + 1, world_size), axis=1)
        else:
            new_steps = rng.permutation(ids).reshape(redo + 1, world_size)
        bucket = np.concatenate([bucket, parent])
        batch_start = np.concatenate([batch_start, starts])
        batch_len = np.concatenate([batch_len, lens])
        steps = np.concatenate([steps[: len(steps) - redo], new_steps])
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
