"""The (B, S) points calibration measures, in the order it measures them."""
from __future__ import annotations

import numpy as np

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


def predicted_peak_bytes(points: list[dict], b: int, s: int, checkpointed: int | None = None) -> float:
    """Peak memory (bytes) of (b, s) extrapolated linearly in B through the two largest measured
    batch sizes at the same S and checkpointing depth (points without "checkpointed" count as None);
    0 when fewer than two were measured (nothing to extrapolate)."""
    same_s = sorted((p["batch_size"], p["peak_bytes"]) for p in points
                    if p["seq_len"] == s and p["status"] == "ok" and p.get("checkpointed") == checkpointed)
    if len(same_s) < 2:
        return 0.0
    (b0, m0), (b1, m1) = same_s[-2:]
    return m1 + (m1 - m0) / (b1 - b0) * (b - b1)


def predicted_depth_peak_bytes(points: list[dict], b: int, s: int, checkpointed: int, every_block: int) -> float:
    """Peak memory (bytes) of (b, s) at depth `checkpointed`: its measured peak at depth `every_block` plus
    B*S times the largest extra bytes per token that the un-checkpointed blocks took in the pairs
    measured at both depths so far (memory beyond a checkpointed block's input grows with the
    tokens); 0 when no pair or no measurement at `every_block` exists yet."""
    peaks = {(p["batch_size"], p["seq_len"], p.get("checkpointed")): p["peak_bytes"] for p in points
             if p["status"] == "ok"}
    base = peaks.get((b, s, every_block))
    per_token = [(peak - peaks[(pb, ps, every_block)]) / (pb * ps) for (pb, ps, k), peak in peaks.items()
                 if k == checkpointed and (pb, ps, every_block) in peaks]
    if base is None or not per_token:
        return 0.0
    return base + max(per_token) * b * s
