"""Streaming bucket batcher: a webdataset pipeline stage for samples whose shapes are known only as
they arrive.

Samples (dicts with "seq_len", tokens) are buffered per bucket (one bucket per distinct token
count) and emitted as batches whose size the policy gives. No epoch plan exists here (shapes are
known only on arrival); what every rank agrees on beforehand is the `StreamSchedule`: batch sizes
and the cost classes of the expected mix. Buckets are grouped into equal-cost
classes: bins of the predicted batch cost (cost_model.predict(B, S) ms, or B*S^p) whose width is
a factor (1 + class_tolerance). With policy "balanced" every rank follows the same shared-seed
schedule of classes, so at step t all ranks run batches of nearly equal predicted cost without
any communication; each rank fills the class from its own buffer. The other policies emit the
first bucket that fills (the usual streaming bucketing, ranks independent).

When the scheduled class cannot be filled, the stage reads more samples until the buffer bound
(samples and bytes) is reached; then it emits a full batch of the nearest class by cost
("fallback_batches"), and if no bucket holds a full batch, the largest partial batch
("partial_batches"). Every worker emits exactly its share of `batches_per_epoch`, so every rank
yields the same number of batches; the input must not run dry (use resampled shards or
`.repeat()`), else a RuntimeError says so. Samples without a valid "seq_len", or longer than
max_seq_len, are skipped, counted in `stats` and logged.

Tensor-free: the caller passes its DataLoader worker id and count, and, for a byte bound on the
buffer, a function giving a sample's bytes (data/webdataset_stream.py does both).
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from lightning_adaptiveload._validation import require_int, require_number
from lightning_adaptiveload.scheduling.buckets import BucketTable
from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan
from lightning_adaptiveload.scheduling.verification import Verification
from lightning_adaptiveload.scheduling.policies import batch_costs, batch_sizes
from lightning_adaptiveload.scheduling.shapes import ShapeMix

log = logging.getLogger(__name__)
SCHEDULE_BLOCK = 256  # steps per schedule block; class frequencies are exact within each block


@dataclass(frozen=True)
class StreamSchedule:
    """What every rank agrees on before streaming: the policy's batch sizes and the cost classes
    the shared per-step class schedule (`class_schedule`) draws from. Costs are cost_model ms, or
    B*S^p without one.

    class_prob: (n_classes,) fraction of steps scheduled on each cost class (expected batches of
    the mix); cost_min: cost at the lower edge of class 0; log_width: log(1 + class_tolerance).
    memory_plan: with one, balanced batch sizes are the plan's choice (also for a bucket the mix did
    not list) and `cost_model` prices each planned bucket at its depth (BucketDepthCosts).
    """

    policy: str
    m_mem: int
    m_comp: float | None
    p: float | None
    max_seq_len: int
    cost_model: object
    cost_min: float
    log_width: float
    class_prob: np.ndarray
    memory_plan: MemoryPlan | None = None

    def batch_size(self, seq_len: int) -> int:
        if self.memory_plan is not None and self.policy == "balanced":
            return int(self.memory_plan.choose(np.array([seq_len]), max_tokens=self.m_mem).batch_size[0])
        return int(batch_sizes(np.array([seq_len]), self.policy, self.m_mem, self.m_comp, self.p)[0])

    def batch_class(self, seq_len: int, batch_size: int | None = None) -> int:
        """Cost class of a full batch of `seq_len` tokens (clipped to the schedule's classes);
        `batch_size`: its `batch_size(seq_len)` when the caller has it already (under a memory plan
        that is a depth choice, not a formula)."""
        batch_size = self.batch_size(seq_len) if batch_size is None else batch_size
        cost = float(batch_costs(np.array([batch_size]), np.array([seq_len]), self.p, self.cost_model)[0])
        c = math.floor(math.log(max(cost, self.cost_min) / self.cost_min) / self.log_width)
        return min(c, len(self.class_prob) - 1)


def make_stream_schedule(mix: ShapeMix, *, policy: str, m_mem: int, m_comp: float | None = None,
                         p: float | None = None, cost_model=None, max_seq_len: int | None = None,
                         class_tolerance: float = 0.1, memory_plan: MemoryPlan | None = None,
                         verification: Verification | None = None) -> StreamSchedule:
    """The schedule of the expected shape mix (e.g. the dataset index or a shapes file), by token
    count: its buckets are the BucketTable of the mix's tokens and counts (with `memory_plan` and
    `verification`, see BucketTable.build; samples longer than the device allows are skipped as
    oversize)."""
    class_tolerance = require_number("class_tolerance", class_tolerance, positive=True)
    if cost_model is None and memory_plan is not None:
        cost_model = memory_plan.cost_model.base
    table = BucketTable.build(mix.tokens, mix.counts, policy=policy, m_mem=m_mem, m_comp=m_comp, p=p,
                              cost_model=cost_model, max_seq_len=max_seq_len, memory_plan=memory_plan,
                              verification=verification)
    # token_equal (and balanced under a memory plan): classes still need a cost; without a cost model
    # use the attention-free exponent 1
    p = table.p if table.p is not None else float(cost_model.p) if cost_model is not None else 1.0
    cost_model = table.step_cost_model(cost_model)
    costs = batch_costs(table.batch_size, table.seq_len, p, cost_model)
    cost_min, log_width = float(costs.min()), math.log1p(class_tolerance)
    classes = np.floor(np.log(costs / cost_min) / log_width).astype(np.int64)
    expected_batches = np.bincount(classes, weights=table.samples / table.batch_size)
    return StreamSchedule(policy, table.m_mem, table.m_comp, p, table.max_seq_len, cost_model, cost_min, log_width,
                          expected_batches / expected_batches.sum(), memory_plan)


def class_schedule(schedule: StreamSchedule, seed: int, epoch: int, steps: int) -> np.ndarray:
    """(steps,) int64 cost class of each step, the same on every rank: blocks of SCHEDULE_BLOCK steps
    with class counts rounded from class_prob (largest remainder), shuffled by a shared-seed RNG."""
    out = np.empty(steps, dtype=np.int64)
    for block, start in enumerate(range(0, steps, SCHEDULE_BLOCK)):
        n = min(SCHEDULE_BLOCK, steps - start)
        rng = np.random.default_rng([int(seed), int(epoch), block])
        want = schedule.class_prob * n
        counts = np.floor(want).astype(np.int64)
        extra = n - counts.sum()
        # largest remainders, random among ties, so rare classes still get their share over blocks
        order = np.lexsort((rng.random(len(want)), -(want - counts)))
        counts[order[:extra]] += 1
        out[start: start + n] = rng.permutation(np.repeat(np.arange(len(counts)), counts))
    return out


class StreamingBucketBatcher:
    """Pipeline stage: `stage(samples) -> iterator of batches (lists of sample dicts)`.

    batches_per_epoch: batches this rank yields per epoch, split over DataLoader workers: worker
    `worker` of `num_workers` emits steps worker, worker + num_workers, ..., which the DataLoader's
    round-robin puts back in order (so build the stage where the worker is known, e.g. from
    torch.utils.data.get_worker_info() inside the worker; 0 and 1 without workers).
    Buffer bound: max_buffer_samples samples and, when both are given, max_buffer_bytes bytes as
    counted by `nbytes(sample)`; plus one sample read past the bound.
    """

    def __init__(self, schedule: StreamSchedule, *, batches_per_epoch: int, worker: int, num_workers: int,
                 seed: int = 0, max_buffer_samples: int = 4096, max_buffer_bytes: int | None = None,
                 nbytes: Callable[[dict], int] | None = None):
        if (max_buffer_bytes is None) != (nbytes is None):
            raise ValueError("max_buffer_bytes and nbytes go together: the byte bound needs a sample's bytes")
        self.schedule, self.seed = schedule, int(seed)
        self.batches_per_epoch = require_int("batches_per_epoch", batches_per_epoch)
        self.num_workers = require_int("num_workers", num_workers)
        self.worker = require_int("worker", worker, minimum=0)
        if self.worker >= self.num_workers:
            raise ValueError(f"worker must be < num_workers, got worker={worker!r}, num_workers={num_workers!r}")
        self.max_buffer_samples = require_int("max_buffer_samples", max_buffer_samples)
        self.max_buffer_bytes = math.inf if max_buffer_bytes is None else require_int("max_buffer_bytes",
                                                                                      max_buffer_bytes)
        self.nbytes = nbytes or _no_bytes
        self.epoch = 0
        self.stats: dict = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __call__(self, samples: Iterable[dict]) -> Iterator[list[dict]]:
        steps = range(self.worker, self.batches_per_epoch, self.num_workers)
        classes = class_schedule(self.schedule, self.seed, self.epoch, self.batches_per_epoch) \
            if self.schedule.policy == "balanced" else None
        state = _Buffer(self.schedule, iter(samples), self.max_buffer_samples, self.max_buffer_bytes, self.nbytes)
        self.stats = state.stats
        for step in steps:
            yield state.next_batch(None if classes is None else int(classes[step]), step)
        if state.stats["skipped_bad"]:
            log.warning("streaming batcher epoch %d worker %d: skipped %d samples without a valid integer 'seq_len'",
                        self.epoch, self.worker, state.stats["skipped_bad"])
        log.info("streaming batcher epoch %d worker %d: %s", self.epoch, self.worker, state.stats)


def _no_bytes(sample: dict) -> int:
    return 0


def _token_count(value) -> int | None:
    """`value` as a token count >= 1 (a Python or numpy integer, or any one-element integer array
    such as a tensor), else None."""
    if isinstance(value, bool):
        return None
    if not isinstance(value, (int, np.integer)):
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, RuntimeError):
            return None
        if array.size != 1 or not np.issubdtype(array.dtype, np.integer):
            return None
        value = array.item()
    return int(value) if value >= 1 else None


class _Buffer:
    """Per-bucket FIFO buffers of one worker's stream, and the batch-picking rules."""

    def __init__(self, schedule: StreamSchedule, source: Iterator[dict], max_samples: int, max_bytes: float, nbytes):
        self.schedule, self.source, self.nbytes = schedule, source, nbytes
        self.max_samples, self.max_bytes = max_samples, max_bytes
        self.queues: dict[int, deque] = {}  # seq_len -> deque of (sample, bytes)
        self.batch: dict[int, int] = {}     # seq_len -> batch size
        self.klass: dict[int, int] = {}     # seq_len -> cost class
        self.ready: dict[int, None] = {}    # buckets holding a full batch, in the order they filled
        self.samples = self.bytes = 0
        self.exhausted = False
        self.stats = {"samples_in": 0, "skipped_bad": 0, "skipped_oversize": 0, "batches": 0,
                      "fallback_batches": 0, "partial_batches": 0, "buffer_peak_samples": 0, "buffer_peak_bytes": 0}

    def _read(self) -> None:
        sample = next(self.source, None)
        if sample is None:
            self.exhausted = True
            return
        self.stats["samples_in"] += 1
        s = _token_count(sample.get("seq_len")) if isinstance(sample, dict) else None
        if s is None:
            self.stats["skipped_bad"] += 1
            return
        if s > self.schedule.max_seq_len:
            self.stats["skipped_oversize"] += 1
            return
        if s not in self.queues:
            self.queues[s] = deque()
            self.batch[s] = self.schedule.batch_size(s)
            self.klass[s] = self.schedule.batch_class(s, self.batch[s])
        size = int(self.nbytes(sample))
        self.queues[s].append((sample, size))
        self.samples += 1
        self.bytes += size
        self.stats["buffer_peak_samples"] = max(self.stats["buffer_peak_samples"], self.samples)
        self.stats["buffer_peak_bytes"] = max(self.stats["buffer_peak_bytes"], self.bytes)
        if len(self.queues[s]) >= self.batch[s]:
            self.ready.setdefault(s, None)

    def _pop(self, s: int, n: int) -> list[dict]:
        q = self.queues[s]
        out = [q.popleft() for _ in range(n)]
        self.samples -= n
        self.bytes -= sum(size for _, size in out)
        if len(q) < self.batch[s]:
            self.ready.pop(s, None)
        self.stats["batches"] += 1
        return [sample for sample, _ in out]

    def _pick(self, want: int | None) -> int | None:
        if want is None:
            return next(iter(self.ready), None)
        fits = [s for s in self.ready if self.klass[s] == want]
        return max(fits, key=lambda s: len(self.queues[s])) if fits else None

    def next_batch(self, want: int | None, step: int) -> list[dict]:
        while True:
            s = self._pick(want)
            if s is not None:
                return self._pop(s, self.batch[s])
            if self.exhausted or self.samples >= self.max_samples or self.bytes >= self.max_bytes:
                break
            self._read()
        if self.ready:  # buffer full (or input dry): nearest cost class that has a full batch
            self.stats["fallback_batches"] += 1
            s = min(self.ready, key=lambda s: (abs(self.klass[s] - (want or 0)), self.klass[s]))
            return self._pop(s, self.batch[s])
        if self.samples:
            self.stats["partial_batches"] += 1
            s = max(self.queues, key=lambda s: (len(self.queues[s]) / self.batch[s], -abs(self.klass[s] - (want or 0))))
            return self._pop(s, len(self.queues[s]))
        raise RuntimeError(f"streaming batcher: the input ran out before step {step} of the epoch could be filled; "
                           f"use resampled shards or .repeat() so every rank yields the same number of batches")
