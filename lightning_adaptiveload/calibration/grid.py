"""The (B, S) points calibration measures, in the order it measures them."""
from __future__ import annotations

import numpy as np

from lightning_adaptiveload.scheduling.verification import held_bytes

# Points the fit cannot do without: "floor_work", the richest form, has 5 parameters and needs
# 2 more points than parameters for its held-out error (CostModel.fit).
MIN_FIT_POINTS = 7


def seq_len_grid(bucket_seq_lens: np.ndarray, num_seq_lens: int) -> list[int]:
    """`num_seq_lens` distinct bucket lengths (tokens) evenly spaced in rank order over the
    sorted unique buckets: always the shortest and the longest, so the fit spans the range the
    sampler will schedule."""
    unique = np.unique(np.asarray(bucket_seq_lens, dtype=np.int64))
    if unique.size == 0 or unique[0] < 1:
        raise ValueError(f"bucket_seq_lens must be non-empty positive token counts, got {unique.tolist()}")
    picks = np.unique(np.linspace(0, unique.size - 1, min(num_seq_lens, unique.size)).round().astype(int))
    return [int(unique[i]) for i in picks]


def required_points(seq_lens: list[int], batch_sizes: list[int], max_tokens: int | None) -> list[tuple[int, int]]:
    """The points measured whatever the time budget: B = 1 at every S (the fit must span the
    scheduled lengths), then further batch sizes in increasing order at the shortest S, then at the
    next S, ... until MIN_FIT_POINTS points are reached (the fit must see B vary too; short S first
    because those points are the cheapest)."""
    points = [(1, s) for s in sorted(seq_lens)]
    for s in sorted(seq_lens):
        for b in sorted(set(batch_sizes) - {1}):
            if len(points) >= MIN_FIT_POINTS:
                return points
            if max_tokens is None or b * s <= max_tokens:
                points.append((b, s))
    return points


def calibration_grid(seq_lens: list[int], batch_sizes: list[int], max_tokens: int | None) -> list[tuple[int, int]]:
    """(B, S) points, B from `batch_sizes` with B*S <= max_tokens (B = 1 always kept). The
    `required_points` come first, so a time budget never leaves the fit without them; the rest
    follow ordered by B*S then S, so memory grows along the run and an early out-of-memory point
    prunes the larger ones."""
    required = required_points(seq_lens, batch_sizes, max_tokens)
    rest = [(b, s) for s in seq_lens for b in sorted(set(batch_sizes))
            if (b == 1 or max_tokens is None or b * s <= max_tokens) and (b, s) not in required]
    return required + sorted(rest, key=lambda p: (p[0] * p[1], p[1]))


def point_held_bytes(point: dict) -> float:
    """The memory (bytes) a measured point's steps held: `held_bytes` of its allocated peak
    ("peak_bytes") and its reserved peak ("reserved_bytes", absent in hand-made points: unknown).
    What a memory budget bounds, so what the memory model is fitted to and the forecasts use."""
    return held_bytes(point["peak_bytes"], point.get("reserved_bytes"))


def predicted_peak_bytes(points: list[dict], b: int, s: int, checkpointed: int | None = None) -> float:
    """Held memory (bytes, `point_held_bytes`) of (b, s) extrapolated linearly in B through the two
    largest measured batch sizes at the same S and checkpointing depth (points without
    "checkpointed" count as None); 0 when fewer than two were measured (nothing to extrapolate)."""
    same_s = sorted((p["batch_size"], point_held_bytes(p)) for p in points
                    if p["seq_len"] == s and p["status"] == "ok" and p.get("checkpointed") == checkpointed)
    if len(same_s) < 2:
        return 0.0
    (b0, m0), (b1, m1) = same_s[-2:]
    return m1 + (m1 - m0) / (b1 - b0) * (b - b1)


def predicted_depth_peak_bytes(points: list[dict], b: int, s: int, checkpointed: int, every_block: int) -> float:
    """Held memory (bytes) of (b, s) at depth `checkpointed` (k): its measured held memory at depth
    `every_block` (L) plus B*S times the largest extra bytes per token per extra live block of the pairs
    measured at L and at some k' < L - 1 so far. As in the memory model (docs/memory.md), n(k) =
    max(L - k, 1) blocks' activations are live at the peak (k = L - 1 peaks as k = L does), and each
    live block's grow with the tokens; 0 when no pair or no measurement at `every_block` exists yet."""
    def live(k: int) -> int:
        return max(every_block - k, 1)

    held = {(p["batch_size"], p["seq_len"], p.get("checkpointed")): point_held_bytes(p) for p in points
            if p["status"] == "ok"}
    base = held.get((b, s, every_block))
    per_block_token = [(peak - held[(pb, ps, every_block)]) / ((live(k) - 1) * pb * ps)
                       for (pb, ps, k), peak in held.items()
                       if k is not None and live(k) > 1 and (pb, ps, every_block) in held]
    if base is None or not per_block_token:
        return 0.0
    return base + max(per_block_token) * (live(checkpointed) - 1) * b * s


def forecast_held_bytes(points: list[dict], b: int, s: int, checkpointed: int, every_block: int) -> float:
    """The larger of the two forecasts of (b, s) at depth `checkpointed` (bytes): in B at that depth
    (`predicted_peak_bytes`) and across depths from `every_block` (`predicted_depth_peak_bytes`)."""
    return max(predicted_peak_bytes(points, b, s, checkpointed),
               predicted_depth_peak_bytes(points, b, s, checkpointed, every_block))


def lowest_fitting_depth(points: list[dict], b: int, s: int, every_block: int, below: int,
                         memory_limit: float | None) -> int | None:
    """The smallest depth k in [0, below) whose `forecast_held_bytes` at (b, s) is within
    `memory_limit` bytes (None: no limit, k = 0); None when no such k. The plan picks k = 0 for most
    buckets that fit, so calibration measures there too: the memory and time models then interpolate
    the depths the plan uses instead of extrapolating below the grid's depths."""
    for k in range(below):
        if memory_limit is None or forecast_held_bytes(points, b, s, k, every_block) <= memory_limit:
            return k
    return None
