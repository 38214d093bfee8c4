"""Batch size per bucket: the token-equal baseline and the paper's dual-constraint rule, the
compute budget they need, and the predicted cost of a batch.

S is the bucket's tokens per sample. `m_mem` bounds B*S (memory, tokens), `m_comp` bounds
B*S^p (compute, in units of tokens^p).
"""
from __future__ import annotations

import math

import numpy as np

from lightning_adaptiveload._validation import require_choice, require_number

POLICIES = ("token_equal", "dual_constraint", "balanced")


def keeps_partial_batches(policy: str) -> bool:
    """The default of drop_last=False for `policy`: balanced prices every batch and fills each step
    with batches of near-equal predicted cost, so a bucket's last, smaller batch costs no balance and
    keeping it trains every sample (on 200 reference-mix samples the token-budget habit of dropping
    it loses 88; benchmarks/scheduling/drop_last.py). token_equal and dual_constraint keep dropping it, as the
    trainers they stand for do."""
    return require_choice("policy", policy, POLICIES) == "balanced"


def token_equal_batch_size(seq_len: int, m_tokens: int) -> int:
    """Baseline: max(1, m_tokens // seq_len)."""
    require_number("seq_len", seq_len, positive=True)
    require_number("m_tokens", m_tokens, positive=True)
    return max(1, int(m_tokens) // int(seq_len))


def dual_constraint_batch_size(seq_len: int, m_mem: int, m_comp: float, p: float) -> int:
    """AdaptiveLoad: max(1, min(m_mem // seq_len, floor(m_comp / seq_len**p)))."""
    for name, value in (("seq_len", seq_len), ("m_mem", m_mem), ("m_comp", m_comp), ("p", p)):
        require_number(name, value, positive=True)
    by_compute = math.floor(m_comp / float(seq_len) ** p)
    return max(1, min(int(m_mem) // int(seq_len), by_compute))


def batch_sizes(seq_lens: np.ndarray, policy: str, m_mem: int, m_comp: float | None = None,
                p: float | None = None) -> np.ndarray:
    """Batch size for each entry of `seq_lens` (int64 array, tokens) under `policy`.

    token_equal uses m_mem as its token budget; dual_constraint and balanced need m_comp and p.
    """
    require_choice("policy", policy, POLICIES)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if policy == "token_equal":
        return np.array([token_equal_batch_size(int(s), m_mem) for s in seq_lens], dtype=np.int64)
    if m_comp is None or p is None:
        raise ValueError(f"policy {policy!r} needs m_comp and p (give them, or a cost model to derive them)")
    return np.array([dual_constraint_batch_size(int(s), m_mem, m_comp, p) for s in seq_lens], dtype=np.int64)


def resolve_compute_budget(policy: str, m_mem: int, longest_seq_len: int, m_comp: float | None = None,
                           p: float | None = None, cost_model=None) -> tuple[float | None, float | None]:
    """(m_comp, p) for `policy`: given values win; else from `cost_model` (its `.dual_p` and
    `m_comp(m_mem, longest_seq_len)`, tokens of the longest bucket that is scheduled).
    token_equal needs neither and gets (None, None)."""
    if require_choice("policy", policy, POLICIES) == "token_equal":
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
