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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload._validation import require_int

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
                           max_batch_size: int | None = None) -> DepthChoice:
    """(B, k) per bucket maximising predicted tokens/s under predicted peak <= max_memory_fraction *
    device_memory_bytes (module docstring).

    seq_lens: (n,) tokens per sample of each bucket (integers >= 1). cost_model: predicts ms from
    (B, S, k) and has the memory model's num_blocks. max_memory_fraction leaves room for what the
    model does not see: the allocator's reserve and fragmentation (reserved minus allocated memory),
    other processes, and the model's own error (a few %; docs/memory.md)."""
    seq_lens = np.asarray(seq_lens)
    if seq_lens.ndim != 1 or seq_lens.size == 0:
        raise ValueError(f"seq_lens must be a non-empty 1-D array, got shape {seq_lens.shape}")
    seq_lens = np.array([require_int("seq_lens[i]", s) for s in seq_lens], dtype=np.int64)
    if getattr(cost_model, "num_blocks", None) != memory_model.num_blocks:
        raise ValueError(f"cost_model.num_blocks ({getattr(cost_model, 'num_blocks', None)!r}) must equal "
                         f"memory_model.num_blocks ({memory_model.num_blocks})")
    if not (isinstance(device_memory_bytes, (int, float)) and device_memory_bytes > 0):
        raise ValueError(f"device_memory_bytes must be a number > 0, got {device_memory_bytes!r}")
    if not (isinstance(max_memory_fraction, (int, float)) and 0 < max_memory_fraction <= 1):
        raise ValueError(f"max_memory_fraction must be in (0, 1], got {max_memory_fraction!r}")
    budget = float(device_memory_bytes) * float(max_memory_fraction)
    cap = memory_model.max_batch_size(seq_lens, budget)  # largest B that fits at k = L (0: none)
    if max_tokens is not None:
        cap = np.minimum(cap, np.maximum(1, require_int("max_tokens", max_tokens) // seq_lens))
    if max_batch_size is not None:
        cap = np.minimum(cap, require_int("max_batch_size", max_batch_size))
    if cap.sum(dtype=np.float64) > MAX_CANDIDATES:
        raise ValueError(f"{cap.sum(dtype=np.float64):.3g} (bucket, batch size) candidates (the memory model sets "
                         f"no useful bound on B): give max_batch_size or max_tokens")

    n, num_blocks = len(seq_lens), memory_model.num_blocks
    batch = np.zeros(n, dtype=np.int64)
    depth = np.full(n, num_blocks, dtype=np.int64)
    time_ms = np.full(n, np.nan)
    fits = cap >= 1
    for i in np.flatnonzero(fits):
        b = np.arange(1, cap[i] + 1)
        # every candidate fits at some k: cap[i] <= the largest B that fits at k = L
        k, _ = memory_model.min_checkpointed(b, seq_lens[i], budget)
        t = np.asarray(cost_model.predict(b, seq_lens[i], k), dtype=np.float64)
        rate = b / t  # B*S/t up to the common factor S
        best = np.flatnonzero(rate == rate.max())[-1]
        batch[i], depth[i], time_ms[i] = b[best], k[best], t[best]
    peak = memory_model.predict(np.maximum(batch, 1), seq_lens, depth)
    return DepthChoice(seq_lens=seq_lens, batch_size=batch, checkpointed=depth, peak_bytes=np.asarray(peak),
                       time_ms=time_ms, fits=fits, num_blocks=num_blocks, budget_bytes=budget)
