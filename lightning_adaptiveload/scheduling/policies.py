"""Batch size per bucket: the token-equal baseline and the paper's dual-constraint rule.

S is the bucket's tokens per sample. `m_mem` bounds B*S (memory, tokens), `m_comp` bounds
B*S^p (compute, in units of tokens^p).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

POLICIES = ("token_equal", "dual_constraint", "balanced")


def check_policy(policy: str) -> str:
    """`policy`, or a ValueError listing POLICIES."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy


def require_int(name: str, value, minimum: int = 1) -> int:
    """`value` as an int; a ValueError naming `name` unless it is a whole number >= minimum
    (int, numpy integer or integral float; true/false are not numbers here)."""
    whole = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer())
    if isinstance(value, bool) or not whole or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_positive(name: str, value) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def token_equal_batch_size(seq_len: int, m_tokens: int) -> int:
    """Baseline: max(1, m_tokens // seq_len)."""
    _check_positive("seq_len", seq_len)
    _check_positive("m_tokens", m_tokens)
    return max(1, int(m_tokens) // int(seq_len))


def dual_constraint_batch_size(seq_len: int, m_mem: int, m_comp: float, p: float) -> int:
    """AdaptiveLoad: max(1, min(m_mem // seq_len, floor(m_comp / seq_len**p)))."""
    _check_positive("seq_len", seq_len)
    _check_positive("m_mem", m_mem)
    _check_positive("m_comp", m_comp)
    _check_positive("p", p)
    by_compute = math.floor(m_comp / float(seq_len) ** p)
    return max(1, min(int(m_mem) // int(seq_len), by_compute))


def batch_sizes(seq_lens: np.ndarray, policy: str, m_mem: int, m_comp: float | None = None,
                p: float | None = None) -> np.ndarray:
    """Batch size for each entry of `seq_lens` (int64 array, tokens) under `policy`.

    token_equal uses m_mem as its token budget; dual_constraint and balanced need m_comp and p.
    """
    check_policy(policy)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if policy == "token_equal":
        return np.array([token_equal_batch_size(int(s), m_mem) for s in seq_lens], dtype=np.int64)
    if m_comp is None or p is None:
        raise ValueError(f"policy {policy!r} needs m_comp and p (give them, or a cost model to derive them)")
    return np.array([dual_constraint_batch_size(int(s), m_mem, m_comp, p) for s in seq_lens], dtype=np.int64)
