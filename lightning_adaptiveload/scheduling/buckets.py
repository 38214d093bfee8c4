"""Buckets: which samples are scheduled together, and the one table of them everything prints.

A bucket is one scheduled token count. `schedule_keys` gives every distinct latent shape its own
count (a batch must hold one shape); `assign_buckets` maps per-sample token counts to buckets for
the epoch plan; `BucketTable.build` is the single place that turns shapes, tokens and counts into
the per-bucket batch size and predicted cost under a policy (used by the sampler, the
DataModule, the streaming schedule, `adaptiveload plan` and calibration's printed table); with a
`MemoryPlan` it also holds each bucket's checkpointing depth k and predicted peak memory, and with a
`Verification` the limits and measured step times of the shapes that ran before training.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from lightning_adaptiveload._validation import require_choice, require_int
from lightning_adaptiveload.scheduling.depth_choice import BucketDepthCosts, MemoryPlan
from lightning_adaptiveload.scheduling.policies import batch_sizes, resolve_compute_budget
from lightning_adaptiveload.scheduling.verification import Verification

OVERSIZE = ("drop", "resize")


def schedule_keys(shapes: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """(N,) int64 token count each row is scheduled at. shapes: (N, 3) latent (T, H, W), -1 where
    unknown; tokens: (N,) true tokens. The sampler buckets by token count, but a batch must hold one
    latent shape: where distinct shapes share a token count (480x832 and 832x480), all but the
    first (sorted by tokens, T, H, W) get the next free count above, so each bucket is one shape.
    Batch sizes computed at a count >= the true tokens stay memory-safe."""
    distinct, inverse = np.unique(np.column_stack([tokens, shapes]), axis=0, return_inverse=True)
    keys = distinct[:, 0].copy()
    for i in range(1, len(keys)):
        keys[i] = max(keys[i], keys[i - 1] + 1)
    return keys[inverse.reshape(-1)]


def assign_buckets(seq_lens: np.ndarray, max_seq_len: int, oversize: str = "drop") -> tuple[np.ndarray, np.ndarray]:
    """(bucket_of (N,) int32 with -1 for dropped samples, bucket_seq_len (K,) int64 sorted tokens).
    oversize="resize" puts samples above max_seq_len in the largest bucket <= max_seq_len."""
    require_choice("oversize", oversize, OVERSIZE)
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


class ScheduledShape(NamedTuple):
    """One batch shape a plan schedules: batch size, latent (T, H, W), how many batches of it an epoch
    runs over all ranks, and how many blocks its steps checkpoint (None: no memory plan, the run's
    own checkpointing)."""

    batch_size: int
    latent_shape: tuple[int, int, int]
    batches_per_epoch: int
    checkpointed: int | None = None


NO_DEPTH = -1  # BucketTable.checkpointed without a memory plan: the run's own checkpointing


@dataclass(frozen=True, eq=False)
class BucketTable:
    """One row per scheduled bucket, ascending by seq_len (numpy columns of equal length K).

    seq_len: (K,) int64 scheduled tokens per sample (the bucket key; >= the true tokens);
    latent_thw: (K, 3) int64 latent (T, H, W), -1 where only tokens are known;
    samples: (K,) int64 samples in the bucket (or the shapes mix's weight);
    batch_size: (K,) int64 batch size under `policy`;
    cost_ms: (K,) float64 predicted step time of one full batch (cost model ms, at the bucket's k
    with a memory plan), NaN without a model;
    checkpointed: (K,) int64 blocks a step of the bucket checkpoints (k), NO_DEPTH (-1) without a
    memory plan; peak_bytes: (K,) float64 predicted peak memory of a full batch, NaN without one.
    policy, m_mem (tokens), m_comp (tokens^p), p, max_seq_len (tokens): what the sizes were computed
    under (m_comp and p are None for token_equal, and for balanced under a memory plan, whose batch
    sizes come from the memory and time models). memory_plan: the MemoryPlan or None. Rows longer
    than max_seq_len are not scheduled and not in the table; under a memory plan max_seq_len is at
    most the longest sample that fits the device (MemoryPlan.max_seq_len); the epoch plan counts
    them (`dropped_oversize`). verification: what running the scheduled shapes found, or None: its
    limits bound each bucket's (B, k) and `step_cost_model` prices batches with its measured times.
    """

    seq_len: np.ndarray
    latent_thw: np.ndarray
    samples: np.ndarray
    batch_size: np.ndarray
    cost_ms: np.ndarray
    policy: str
    m_mem: int
    m_comp: float | None
    p: float | None
    max_seq_len: int
    checkpointed: np.ndarray
    peak_bytes: np.ndarray
    memory_plan: MemoryPlan | None = None
    verification: Verification | None = None

    @classmethod
    def build(cls, tokens, counts, latent_thw=None, *, policy: str, m_mem: int, m_comp: float | None = None,
              p: float | None = None, cost_model=None, max_seq_len: int | None = None,
              memory_plan: MemoryPlan | None = None, verification: Verification | None = None) -> "BucketTable":
        """The table of rows (N,) `tokens` (true tokens per sample) with (N,) `counts` and, where
        known, (N, 3) `latent_thw`: rows above max_seq_len (default m_mem) are left out, the rest
        keyed by `schedule_keys` and summed per key; m_comp and p come from `cost_model` unless given
        (resolved on the longest scheduled bucket).

        memory_plan: plan with measured memory (docs/memory.md): buckets longer than the longest that
        fits the device are left out too (max_seq_len lowered to it); policy "balanced" takes each
        bucket's (B, k) from `memory_plan.choose` with m_mem as the token cap (a bucket longer than
        m_mem runs at B = 1), and its predicted ms at that k; token_equal and dual_constraint keep
        their token-budget batch sizes at k = L (every block checkpointed), priced and with their
        predicted peak (which may exceed the budget: they are the baselines).

        verification: limits from running the scheduled shapes: balanced under a memory plan chooses
        within them (pinned buckets keep their verified (B, k)); any other policy caps each bucket's B at
        its max_batch_size; buckets above its max_seq_len are left out."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        thw = np.full((len(tokens), 3), -1, dtype=np.int64) if latent_thw is None \
            else np.asarray(latent_thw, dtype=np.int64).reshape(-1, 3)
        if not len(tokens) == len(counts) == len(thw) or not len(tokens):
            raise ValueError(f"tokens, counts and latent_thw need the same non-zero number of rows, got "
                             f"{len(tokens)}, {len(counts)}, {len(thw)}")
        if tokens.min() < 1 or counts.min() < 0:
            raise ValueError("tokens must be >= 1 and counts >= 0")
        m_mem = require_int("m_mem (tokens per batch)", m_mem)
        max_seq_len = require_int("max_seq_len (tokens)", m_mem if max_seq_len is None else max_seq_len)
        if memory_plan is not None:
            max_seq_len = memory_plan.limit_seq_len(max_seq_len, int(tokens.min()))
        if verification is not None and verification.max_seq_len is not None:
            max_seq_len = min(max_seq_len, verification.max_seq_len)
        fits = tokens <= max_seq_len
        if not fits.any():
            raise ValueError(f"every shape is longer than max_seq_len={max_seq_len} tokens")
        seq_len, first, inverse = np.unique(schedule_keys(thw[fits], tokens[fits]), return_index=True,
                                            return_inverse=True)
        samples = np.zeros(len(seq_len), dtype=np.int64)
        np.add.at(samples, inverse.reshape(-1), counts[fits])
        checkpointed = np.full(len(seq_len), NO_DEPTH, dtype=np.int64)
        peak = np.full(len(seq_len), np.nan)
        if memory_plan is not None and policy == "balanced":
            choice = memory_plan.choose(seq_len, max_tokens=m_mem,
                                        limits=None if verification is None else verification.limits)
            sizes, checkpointed, peak, cost_ms = choice.batch_size, choice.checkpointed, choice.peak_bytes, choice.time_ms
            m_comp = p = None
        else:
            if cost_model is None and memory_plan is not None:
                cost_model = memory_plan.cost_model.base
            m_comp, p = resolve_compute_budget(policy, m_mem, int(seq_len[-1]), m_comp, p, cost_model)
            sizes = batch_sizes(seq_len, policy, m_mem, m_comp, p)
            if verification is not None:
                sizes = np.array([b if (lim := verification.limit(s)) is None or lim.max_batch_size is None
                                  else min(b, lim.max_batch_size) for s, b in zip(seq_len, sizes)], dtype=np.int64)
            cost_ms = np.full(len(seq_len), np.nan) if cost_model is None \
                else np.asarray(cost_model.predict(sizes, seq_len), dtype=np.float64).reshape(-1)
            if memory_plan is not None:
                checkpointed = np.full(len(seq_len), memory_plan.num_blocks, dtype=np.int64)
                peak = np.asarray(memory_plan.memory_model.predict(sizes, seq_len), dtype=np.float64).reshape(-1)
        return cls(seq_len=seq_len.astype(np.int64), latent_thw=thw[fits][first], samples=samples,
                   batch_size=np.asarray(sizes, dtype=np.int64), cost_ms=np.asarray(cost_ms, dtype=np.float64),
                   policy=policy, m_mem=m_mem, m_comp=m_comp, p=p, max_seq_len=max_seq_len,
                   checkpointed=np.asarray(checkpointed, dtype=np.int64), peak_bytes=np.asarray(peak, dtype=np.float64),
                   memory_plan=memory_plan, verification=verification)

    def __len__(self) -> int:
        return len(self.seq_len)

    def step_cost_model(self, cost_model=None):
        """What prices a batch of this table by (B, S) (epoch plan, streaming classes, the monitor's
        load): under a memory plan its time model at each bucket's depth (`BucketDepthCosts`), else
        `cost_model`; with a verification, the measured step times where they exist
        (`MeasuredCosts`; None without any model)."""
        model = cost_model if self.memory_plan is None else \
            BucketDepthCosts(self.memory_plan.cost_model, self.seq_len, self.checkpointed)
        if self.verification is None or model is None:
            return model
        return self.verification.costs(model, self.checkpointed_of())

    def checkpointed_of(self) -> dict[int, int | None]:
        """seq_len -> k of each bucket (None without a memory plan)."""
        return {int(s): None if k == NO_DEPTH else int(k) for s, k in zip(self.seq_len, self.checkpointed)}

    def rows(self) -> list[dict]:
        """One dict per bucket: seq_len, latent_shape ((T, H, W) or None), samples, batch_size,
        cost_ms (None without a cost model), checkpointed and peak_bytes (None without a memory plan)."""
        return [{"seq_len": int(s), "latent_shape": None if thw[0] < 0 else tuple(int(v) for v in thw),
                 "samples": int(n), "batch_size": int(b), "cost_ms": None if np.isnan(c) else float(c),
                 "checkpointed": None if k == NO_DEPTH else int(k), "peak_bytes": None if np.isnan(m) else float(m)}
                for s, thw, n, b, c, k, m in zip(self.seq_len, self.latent_thw, self.samples, self.batch_size,
                                                 self.cost_ms, self.checkpointed, self.peak_bytes)]

    def to_dict(self) -> dict:
        """JSON-ready: the budgets and one list per column (null where unknown), and the memory plan's
        summary (null without one)."""
        return {"policy": self.policy, "m_mem": self.m_mem, "m_comp": self.m_comp, "p": self.p,
                "max_seq_len": self.max_seq_len, "seq_len": self.seq_len.tolist(),
                "latent_thw": self.latent_thw.tolist(), "samples": self.samples.tolist(),
                "batch_size": self.batch_size.tolist(),
                "cost_ms": [None if np.isnan(c) else float(c) for c in self.cost_ms],
                "checkpointed": [None if k == NO_DEPTH else int(k) for k in self.checkpointed],
                "peak_bytes": [None if np.isnan(m) else float(m) for m in self.peak_bytes],
                "memory_plan": None if self.memory_plan is None else self.memory_plan.summary()}

    def format(self) -> str:
        """The budgets in one line, then one aligned line per bucket (S, latent, samples, B, B*S,
        predicted ms of one batch; with a memory plan also k, the blocks checkpointed, and the
        predicted peak in MiB, marked where it exceeds the plan's budget; with a verification the
        full batch's measured warm ms and peak reserved MiB, or why it has none)."""
        budget = "" if self.m_comp is None else f", m_comp={self.m_comp:.4g} tokens^p, p={self.p:.4g}"
        plan = self.memory_plan
        lines = [f"policy {self.policy}: m_mem={self.m_mem} tokens{budget}, max_seq_len={self.max_seq_len} tokens"]
        if plan is not None:
            lines.append(f"memory plan: peak <= {_size(plan.budget_bytes)} ({plan.max_memory_fraction:g} of "
                         f"{_size(plan.device_memory_bytes)}), k of {plan.num_blocks} blocks checkpointed; "
                         f"longest sample that fits: {plan.max_seq_len} tokens")
        header = f"{'S':>8} {'latent (T, H, W)':>18} {'samples':>8} {'B':>5} {'B*S':>7} {'ms/batch':>9}"
        header += f" {'k':>4} {'peak MiB':>10}" if plan is not None else ""
        header += f" {'meas ms':>9} {'meas MiB':>10}" if self.verification is not None else ""
        lines.append(header)
        measured = {} if self.verification is None else {m.key: m for m in self.verification.shapes}
        depths = self.checkpointed_of()
        for row in self.rows():
            shape = "-" if row["latent_shape"] is None else str(row["latent_shape"])
            cost = "-" if row["cost_ms"] is None else f"{row['cost_ms']:.1f}"
            line = (f"{row['seq_len']:>8} {shape:>18} {row['samples']:>8} {row['batch_size']:>5} "
                    f"{row['batch_size'] * row['seq_len']:>7} {cost:>9}")
            if plan is not None:
                line += f" {row['checkpointed']:>4} {row['peak_bytes'] / 2**20:>10.1f}"
            m = measured.get((row["batch_size"], row["seq_len"], depths[row["seq_len"]]))
            if self.verification is not None:
                line += (f" {'-':>9} {'not run':>10}" if m is None else f" {'-':>9} {'bounded':>10}" if m.status == "bounded"
                         else f" {'-':>9} {'oom':>10}" if m.peak_bytes is None
                         else f" {m.warm_ms:>9.1f} {m.used_bytes / 2**20:>10.1f}")
            # a prediction over the budget matters unless the batch was measured to fit
            if plan is not None and row["peak_bytes"] > plan.budget_bytes and not (m is not None and m.fits):
                line += "  over budget"
            lines.append(line)
        return "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
