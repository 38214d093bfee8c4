"""Per bucket, the batch size B and checkpointing depth k that train fastest within device memory.

For a bucket of S tokens per sample, every B from 1 to a bound is a candidate; each gets the fewest
checkpointed blocks k whose predicted peak fits the memory budget (`MemoryModel.min_checkpointed`:
fewer checkpointed blocks means less recomputation, so for a fixed B that is the fastest depth),
and the candidate with the highest predicted tokens per second B*S / t(B, S, k) wins (ties: the
larger B, fewer steps). The bound on B is the smallest of `max_batch_size`, the token cap
max(1, max_tokens // S) (keeps batches comparable with a token-budget baseline such as
token_equal at m_mem) and the largest B that fits at k = L. A bucket longer than the token cap
still gets B = 1 when it fits: the cap limits how many samples share a step, it never drops a
sample that fits the device. A bucket that fits nowhere (not even B = 1 at k = L) is reported in
`DepthChoice.fits`, never silently dropped.

Pure numpy; the step-time model is anything with `predict(batch_size, seq_len, checkpointed)`
(ms, vectorised) and `num_blocks`, e.g. `cost_model.DepthCostModel`.

`MemoryPlan` bundles the two models and the memory budget, the one object the bucket table, the
sampler and the streaming schedule take to plan with measured memory (docs/memory.md); a batch then
carries its bucket's k under CHECKPOINTED_BATCH_KEY for `PerBucketCheckpointing`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from lightning_adaptiveload.scheduling.memory_model import NO_BOUND, MemoryModel
from lightning_adaptiveload.scheduling.verification import BucketLimit
from lightning_adaptiveload._validation import is_positive_number, require_int

# Batch entry holding how many of the model's blocks the step checkpoints (a Python int; absent: all).
CHECKPOINTED_BATCH_KEY = "ac_blocks"

UNLIMITED = BucketLimit()

# The share of the budget a bucket's first plan leaves unused (choose_batch_and_depth's plan_margin, as
# calibration sets it): the memory model's predictions of round-1 shapes came in 0.4-1.4% under what they
# held on average (-3.0% at worst) on three GPU records, and the plan puts shapes within that of the budget;
# with 1%, 4 of 7 and 3 of 4 of the shapes that held over it would have been planned deeper up front, for 1
# of 19 fitting shapes planned deeper than needed (benchmarks/results/round1_memory.json).
PLAN_MARGIN = 0.01

# More (bucket, B) candidates than this means a missing bound on B (a model that predicts almost
# no memory per sample and no cap): ask for max_batch_size rather than allocate without limit.
MAX_CANDIDATES = 20_000_000


@dataclass(frozen=True)
class DepthChoice:
    """The choice for n buckets, arrays of shape (n,) in the order of `seq_lens`.

    batch_size: int64 B (0 where the bucket fits nowhere); checkpointed: int64 k (L where it fits
    nowhere); peak_bytes: float64 predicted peak of (B, S, k) (of (1, S, L) where it fits nowhere,
    so the shortfall shows); time_ms: float64 predicted step time (NaN where it fits nowhere);
    fits: bool. budget_bytes: the memory budget the choice was made for.
    """

    seq_lens: np.ndarray
    batch_size: np.ndarray
    checkpointed: np.ndarray
    peak_bytes: np.ndarray
    time_ms: np.ndarray
    fits: np.ndarray
    num_blocks: int
    budget_bytes: float

    @property
    def tokens_per_s(self) -> np.ndarray:
        """Predicted B*S / t per bucket (0 where it fits nowhere)."""
        with np.errstate(invalid="ignore"):
            return np.where(self.fits, self.batch_size * self.seq_lens / (self.time_ms / 1e3), 0.0)

    @property
    def unfit_seq_lens(self) -> np.ndarray:
        """Token counts of the buckets that fit nowhere."""
        return self.seq_lens[~self.fits]

    def rows(self) -> list[dict]:
        """One dict per bucket (JSON-ready; time_ms None where it fits nowhere)."""
        return [{"seq_len": int(s), "batch_size": int(b), "checkpointed": int(k), "num_blocks": self.num_blocks,
                 "peak_bytes": float(p), "time_ms": float(t) if f else None, "fits": bool(f)}
                for s, b, k, p, t, f in zip(self.seq_lens, self.batch_size, self.checkpointed, self.peak_bytes,
                                            self.time_ms, self.fits)]


def choose_batch_and_depth(seq_lens, memory_model: MemoryModel, cost_model, *, device_memory_bytes: float,
                           max_memory_fraction: float = 0.85, max_tokens: int | None = None,
                           max_batch_size: int | None = None,
                           limits: Mapping[int, BucketLimit] | None = None, plan_margin: float = 0.0) -> DepthChoice:
    """(B, k) per bucket maximising predicted tokens/s under predicted peak <= max_memory_fraction *
    device_memory_bytes (module docstring).

    seq_lens: (n,) tokens per sample of each bucket (integers >= 1). cost_model: predicts ms from
    (B, S, k) and has the memory model's num_blocks. max_memory_fraction leaves room for what the
    model does not see: other processes and the model's own error (a few %; docs/memory.md); what the
    allocator reserves beyond its allocations is measured by verification, not budgeted here.
    limits: seq_len -> BucketLimit from verification (scheduling/verification.py): a pinned bucket
    keeps its verified (B, k); any other is chosen among the (B, k) its frontier does not rule out,
    each predicted by `BucketLimit.held` (the held memory: activations scaled, reserved gap added),
    and a (B, k) a measured fit proves is taken as fitting whatever the prediction; B <= its
    max_batch_size. A limited bucket that no prediction fits runs B = 1 with every block checkpointed
    unless a failure ruled that out (verification then measures it: the prediction is a model).
    plan_margin: a bucket without limits (not yet verified) is planned within (1 - plan_margin) of the
    budget, so a prediction a little under what the step will hold does not land it over (PLAN_MARGIN);
    one whose B = 1 with every block checkpointed fits only the whole budget keeps the whole budget (the
    margin never drops a sample). peak_bytes reports the corrected prediction; budget_bytes the budget."""
    seq_lens = np.asarray(seq_lens)
    if seq_lens.ndim != 1 or seq_lens.size == 0:
        raise ValueError(f"seq_lens must be a non-empty 1-D array, got shape {seq_lens.shape}")
    seq_lens = np.array([require_int("seq_lens[i]", s) for s in seq_lens], dtype=np.int64)
    budget = _budget(memory_model, cost_model, device_memory_bytes, max_memory_fraction)
    bucket_limits = [(limits or {}).get(int(s)) or UNLIMITED for s in seq_lens]
    n, num_blocks = len(seq_lens), memory_model.num_blocks
    static = np.asarray(memory_model.predict(np.zeros(n), seq_lens), dtype=np.float64)  # m0: no batch's memory
    check_plan_margin(plan_margin)
    model_budget = np.array([limit.model_budget(budget, m0) for limit, m0 in zip(bucket_limits, static)])
    if plan_margin:
        unverified = np.array([limit is UNLIMITED for limit in bucket_limits])
        within = np.where(unverified, model_budget * (1.0 - plan_margin), model_budget)
        model_budget = np.where(memory_model.max_batch_size(seq_lens, within) >= 1, within, model_budget)
    proven_b = np.array([max([b for b, _ in limit.fitted], default=0) for limit in bucket_limits])
    # largest B that fits at k = L, or that a measurement proved to fit (0: none)
    cap = np.maximum(memory_model.max_batch_size(seq_lens, model_budget), proven_b)
    if max_tokens is not None:
        cap = np.minimum(cap, np.maximum(1, require_int("max_tokens", max_tokens) // seq_lens))
    if max_batch_size is not None:
        cap = np.minimum(cap, require_int("max_batch_size", max_batch_size))
    cap = np.minimum(cap, [NO_BOUND if limit.max_batch_size is None else limit.max_batch_size
                           for limit in bucket_limits])
    pinned = np.array([limit.pinned is not None for limit in bucket_limits])
    if cap[~pinned].sum(dtype=np.float64) > MAX_CANDIDATES:
        raise ValueError(f"{cap.sum(dtype=np.float64):.3g} (bucket, batch size) candidates (the memory model sets "
                         f"no useful bound on B): give max_batch_size or max_tokens")

    batch = np.zeros(n, dtype=np.int64)
    checkpointed = np.full(n, num_blocks, dtype=np.int64)
    time_ms = np.full(n, np.nan)
    fits = pinned.copy()
    for i in range(n):
        limit = bucket_limits[i]
        if limit.pinned is not None:  # measured to fit: kept as it is, whatever the models say now
            b_pin, k_pin = limit.pinned
            batch[i], checkpointed[i] = b_pin, num_blocks if k_pin is None else min(k_pin, num_blocks)
            time_ms[i] = float(cost_model.predict(batch[i], seq_lens[i], checkpointed[i]))
            continue
        b = np.arange(1, max(cap[i], 0) + 1)
        k, predicted = memory_model.min_checkpointed(b, seq_lens[i], model_budget[i])
        k = np.where(predicted, k, num_blocks + 1)
        k = np.minimum(k, limit.proven_depth(b, num_blocks))
        k = np.maximum(k, limit.depth_floor(b, num_blocks))
        ok = k <= num_blocks
        if not ok.any():
            if limit is not UNLIMITED and limit.depth_floor(1, num_blocks) <= num_blocks:
                fits[i] = True
                batch[i], time_ms[i] = 1, float(cost_model.predict(1, seq_lens[i], num_blocks))
            continue
        b, k = b[ok], k[ok]
        t = np.asarray(cost_model.predict(b, seq_lens[i], k), dtype=np.float64)
        rate = b / t  # B*S/t up to the common factor S
        best = np.flatnonzero(rate == rate.max())[-1]
        fits[i] = True
        batch[i], checkpointed[i], time_ms[i] = b[best], k[best], t[best]
    raw = memory_model.predict(np.maximum(batch, 1), seq_lens, checkpointed)
    peak = np.array([limit.held(p, m0) for limit, p, m0 in zip(bucket_limits, np.atleast_1d(raw), static)])
    return DepthChoice(seq_lens=seq_lens, batch_size=batch, checkpointed=checkpointed, peak_bytes=peak,
                       time_ms=time_ms, fits=fits, num_blocks=num_blocks, budget_bytes=budget)


def _budget(memory_model: MemoryModel, cost_model, device_memory_bytes: float, max_memory_fraction: float) -> float:
    """max_memory_fraction * device_memory_bytes after checking both and that the models agree on L."""
    if getattr(cost_model, "num_blocks", None) != memory_model.num_blocks:
        raise ValueError(f"cost_model.num_blocks ({getattr(cost_model, 'num_blocks', None)!r}) must equal "
                         f"memory_model.num_blocks ({memory_model.num_blocks})")
    if not is_positive_number(device_memory_bytes):
        raise ValueError(f"device_memory_bytes must be a number > 0, got {device_memory_bytes!r}")
    if not (is_positive_number(max_memory_fraction) and max_memory_fraction <= 1):
        raise ValueError(f"max_memory_fraction must be in (0, 1], got {max_memory_fraction!r}")
    return float(device_memory_bytes) * float(max_memory_fraction)


def check_plan_margin(plan_margin: float) -> None:
    """ValueError naming plan_margin unless it is a number in [0, 1) (NaN and bools are not)."""
    if not (isinstance(plan_margin, (int, float)) and not isinstance(plan_margin, bool) and 0 <= plan_margin < 1):
        raise ValueError(f"plan_margin must be a number in [0, 1), got {plan_margin!r}")


@dataclass(frozen=True, eq=False)
class MemoryPlan:
    """Planning with measured memory: per bucket the (B, k) of `choose_batch_and_depth` (policy
    "balanced"), and no sample longer than the device allows.

    memory_model: peak bytes of (B, S, k). cost_model: step ms of (B, S, k) with the same num_blocks,
    a `DepthCostModel` (its `base` CostModel prices steps at k = L for the token-budget policies).
    device_memory_bytes: one rank's device memory; max_memory_fraction: the share of it a step may be
    predicted to use (why 0.85 by default: docs/memory.md, "Depth choice"); plan_margin: the share of
    that budget a bucket's first plan leaves unused (choose_batch_and_depth)."""

    memory_model: MemoryModel
    cost_model: object
    device_memory_bytes: float
    max_memory_fraction: float = 0.85
    plan_margin: float = 0.0

    def __post_init__(self):
        if not isinstance(self.memory_model, MemoryModel):
            raise ValueError(f"memory_model must be a MemoryModel, got {type(self.memory_model).__name__}")
        _budget(self.memory_model, self.cost_model, self.device_memory_bytes, self.max_memory_fraction)
        check_plan_margin(self.plan_margin)

    @property
    def budget_bytes(self) -> float:
        return float(self.device_memory_bytes) * float(self.max_memory_fraction)

    @property
    def num_blocks(self) -> int:
        return self.memory_model.num_blocks

    @property
    def max_seq_len(self) -> int:
        """Longest sample (tokens) that fits at B = 1 with every block checkpointed: a longer one fits
        no configuration (the peak grows with S, B and the un-checkpointed blocks). 0: none fits."""
        return self.memory_model.max_seq_len(self.budget_bytes, 1, self.num_blocks)

    def limit_seq_len(self, max_seq_len: int, shortest: int) -> int:
        """min(max_seq_len, self.max_seq_len): the longest sample to schedule; ValueError if even the
        shortest sample (tokens) fits no configuration of the device."""
        fitting = self.max_seq_len
        if fitting < shortest:
            raise ValueError(f"no sample fits the device: the shortest ({shortest} tokens) is predicted at "
                             f"{self.memory_model.predict(1, shortest) / 2**30:.3g} GiB at B = 1 with all "
                             f"{self.num_blocks} blocks checkpointed, over the budget of "
                             f"{self.budget_bytes / 2**30:.3g} GiB ({self.max_memory_fraction:g} of the device)")
        return min(int(max_seq_len), fitting)

    def choose(self, seq_lens, max_tokens: int | None = None,
               limits: Mapping[int, BucketLimit] | None = None) -> DepthChoice:
        """choose_batch_and_depth of `seq_lens` under this plan's models and budget, with the token cap
        `max_tokens` (the batches' m_mem: comparable with the token-budget policies' batches) and
        verification's per-bucket `limits`."""
        return choose_batch_and_depth(seq_lens, self.memory_model, self.cost_model,
                                      device_memory_bytes=self.device_memory_bytes,
                                      max_memory_fraction=self.max_memory_fraction, max_tokens=max_tokens,
                                      limits=limits, plan_margin=self.plan_margin)

    def summary(self) -> dict:
        """JSON-ready: the budget and the block count (the models have their own to_dict)."""
        return {"device_memory_bytes": float(self.device_memory_bytes),
                "max_memory_fraction": float(self.max_memory_fraction), "budget_bytes": self.budget_bytes,
                "plan_margin": float(self.plan_margin),
                "num_blocks": self.num_blocks, "max_seq_len": int(self.max_seq_len)}


class BucketDepthCosts:
    """A step-time model of (B, S) alone for code that prices batches without knowing a depth (the
    balanced epoch plan, the streaming cost classes): a batch of S tokens per sample runs at the k of
    the bucket scheduled at S, and at k = L (every block checkpointed) if no bucket is."""

    def __init__(self, cost_model, seq_lens: np.ndarray, checkpointed: np.ndarray):
        order = np.argsort(seq_lens)
        self.cost_model = cost_model
        self.num_blocks = cost_model.num_blocks
        self.seq_lens = np.asarray(seq_lens, dtype=np.int64)[order]
        self.checkpointed = np.asarray(checkpointed, dtype=np.int64)[order]

    def checkpointed_at(self, seq_len) -> np.ndarray:
        """k of each entry of `seq_len` (int64, broadcast)."""
        s = np.asarray(seq_len)
        i = np.clip(np.searchsorted(self.seq_lens, s), 0, len(self.seq_lens) - 1)
        return np.where(self.seq_lens[i] == s, self.checkpointed[i], self.num_blocks)

    def predict(self, batch_size, seq_len):
        """Step ms at each bucket's depth; scalars give a float, arrays broadcast."""
        return self.cost_model.predict(batch_size, seq_len, self.checkpointed_at(seq_len))
