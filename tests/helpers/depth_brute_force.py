"""An independent reference for the (B, k) a memory plan gives a bucket: every batch size up to the
token cap at every checkpointing depth, evaluated through the models' predictions, the best kept.
It shares no code with scheduling/depth_choice.py (no max_batch_size or min_checkpointed closed
forms, no per-B search of k): the tests of the bucket table, the streaming schedule and the
DataModule compare the plan's choice with it rather than with choose_batch_and_depth itself."""
import numpy as np


def best_batch_and_depth(seq_len: int, memory, cost, budget: float, max_tokens: int) -> tuple[int, int] | None:
    """(B, k) of one bucket of `seq_len` tokens: among B in [1, max(1, max_tokens // seq_len)] and
    k in [0, L] whose predicted peak memory.predict(B, S, k) <= budget, the most tokens per ms
    B * S / cost.predict(B, S, k); ties: the larger B, then the fewer checkpointed blocks. None when
    no (B, k) fits."""
    b = np.arange(1, max(1, max_tokens // seq_len) + 1, dtype=np.int64)[:, None]
    k = np.arange(memory.num_blocks + 1, dtype=np.int64)[None, :]
    b, k = np.broadcast_arrays(b, k)
    fits = np.asarray(memory.predict(b, seq_len, k)) <= budget
    if not fits.any():
        return None
    # B / t orders the candidates as B * S / t does (S is the bucket's, common to all)
    rate = np.where(fits, b / np.asarray(cost.predict(b, seq_len, k), dtype=np.float64), -np.inf)
    top = np.flatnonzero(rate.ravel() == rate.max())
    # among the best: largest B, then fewest k
    best = max(top, key=lambda i: (b.ravel()[i], -k.ravel()[i]))
    return int(b.ravel()[best]), int(k.ravel()[best])
