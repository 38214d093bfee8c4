"""Buckets: which samples are scheduled together, and the one table of them everything prints.

A bucket is one scheduled token count. `schedule_keys` gives every distinct latent shape its own
count (a batch must hold one shape); `assign_buckets` maps per-sample token counts to buckets for
the epoch plan; `BucketTable.build` is the single place that turns shapes, tokens and counts into
the per-bucket batch size and predicted cost under a policy (used by the sampler, the
DataModule, the streaming schedule, `adaptiveload plan` and calibration's printed table).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_adaptiveload._validation import require_choice, require_int
from lightning_adaptiveload.scheduling.policies import batch_sizes, resolve_compute_budget

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


@dataclass(frozen=True, eq=False)
class BucketTable:
    """One row per scheduled bucket, ascending by seq_len (numpy columns of equal length K).

    seq_len: (K,) int64 scheduled tokens per sample (the bucket key; >= the true tokens);
    latent_thw: (K, 3) int64 latent (T, H, W), -1 where only tokens are known;
    samples: (K,) int64 samples in the bucket (or the shapes mix's weight);
    batch_size: (K,) int64 batch size under `policy`;
    cost_ms: (K,) float64 predicted step time of one full batch (cost model ms), NaN without a model.
    policy, m_mem (tokens), m_comp (tokens^p), p, max_seq_len (tokens): what the sizes were computed
    under (m_comp and p are None for token_equal). Rows longer than max_seq_len are not scheduled
    and not in the table; the epoch plan counts them (`dropped_oversize`).
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

    @classmethod
    def build(cls, tokens, counts, latent_thw=None, *, policy: str, m_mem: int, m_comp: float | None = None,
              p: float | None = None, cost_model=None, max_seq_len: int | None = None) -> "BucketTable":
        """The table of rows (N,) `tokens` (true tokens per sample) with (N,) `counts` and, where
        known, (N, 3) `latent_thw`: rows above max_seq_len (default m_mem) are left out, the rest
        keyed by `schedule_keys` and summed per key; m_comp and p come from `cost_model` unless given
        (resolved on the longest scheduled bucket)."""
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
        fits = tokens <= max_seq_len
        if not fits.any():
            raise ValueError(f"every shape is longer than max_seq_len={max_seq_len} tokens")
        seq_len, first, inverse = np.unique(schedule_keys(thw[fits], tokens[fits]), return_index=True,
                                            return_inverse=True)
        samples = np.zeros(len(seq_len), dtype=np.int64)
        np.add.at(samples, inverse.reshape(-1), counts[fits])
        m_comp, p = resolve_compute_budget(policy, m_mem, int(seq_len[-1]), m_comp, p, cost_model)
        sizes = batch_sizes(seq_len, policy, m_mem, m_comp, p)
        cost_ms = np.full(len(seq_len), np.nan) if cost_model is None \
            else np.asarray(cost_model.predict(sizes, seq_len), dtype=np.float64).reshape(-1)
        return cls(seq_len=seq_len.astype(np.int64), latent_thw=thw[fits][first], samples=samples,
                   batch_size=sizes, cost_ms=cost_ms, policy=policy, m_mem=m_mem, m_comp=m_comp, p=p,
                   max_seq_len=max_seq_len)

    def __len__(self) -> int:
        return len(self.seq_len)

    def latent_shape(self, seq_len: int) -> tuple[int, int, int] | None:
        """Latent (T, H, W) of the bucket scheduled at `seq_len` tokens; None if there is no such
        bucket or its shape is unknown."""
        i = int(np.searchsorted(self.seq_len, seq_len))
        if i == len(self.seq_len) or self.seq_len[i] != seq_len or self.latent_thw[i, 0] < 0:
            return None
        return tuple(int(v) for v in self.latent_thw[i])

    def rows(self) -> list[dict]:
        """One dict per bucket: seq_len, latent_shape ((T, H, W) or None), samples, batch_size,
        cost_ms (None without a cost model)."""
        return [{"seq_len": int(s), "latent_shape": None if thw[0] < 0 else tuple(int(v) for v in thw),
                 "samples": int(n), "batch_size": int(b), "cost_ms": None if np.isnan(c) else float(c)}
                for s, thw, n, b, c in zip(self.seq_len, self.latent_thw, self.samples, self.batch_size,
                                           self.cost_ms)]

    def to_dict(self) -> dict:
        """JSON-ready: the budgets and one list per column (cost_ms null without a cost model)."""
        return {"policy": self.policy, "m_mem": self.m_mem, "m_comp": self.m_comp, "p": self.p,
                "max_seq_len": self.max_seq_len, "seq_len": self.seq_len.tolist(),
                "latent_thw": self.latent_thw.tolist(), "samples": self.samples.tolist(),
                "batch_size": self.batch_size.tolist(),
                "cost_ms": [None if np.isnan(c) else float(c) for c in self.cost_ms]}

    def format(self) -> str:
        """The budgets in one line, then one aligned line per bucket (S, latent, samples, B, B*S,
        predicted ms of one batch)."""
        budget = "" if self.m_comp is None else f", m_comp={self.m_comp:.4g} tokens^p, p={self.p:.4g}"
        lines = [f"policy {self.policy}: m_mem={self.m_mem} tokens{budget}, max_seq_len={self.max_seq_len} tokens",
                 f"{'S':>8} {'latent (T, H, W)':>18} {'samples':>8} {'B':>5} {'B*S':>7} {'ms/batch':>9}"]
        for row in self.rows():
            shape = "-" if row["latent_shape"] is None else str(row["latent_shape"])
            cost = "-" if row["cost_ms"] is None else f"{row['cost_ms']:.1f}"
            lines.append(f"{row['seq_len']:>8} {shape:>18} {row['samples']:>8} {row['batch_size']:>5} "
                         f"{row['batch_size'] * row['seq_len']:>7} {cost:>9}")
        return "\n".join(lines)
