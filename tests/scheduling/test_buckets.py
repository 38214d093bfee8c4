"""Buckets: scheduling keys and the BucketTable against a plain-Python reference."""
import math
from collections import defaultdict
from fractions import Fraction

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.buckets import BucketTable, schedule_keys
from lightning_adaptiveload.scheduling.cost_model import CostModel

SHAPES = [(1, 4, 4), (1, 4, 8), (1, 8, 4), (3, 6, 6), (1, 6, 18), (5, 8, 8), (2, 8, 8), (1, 16, 8)]


def tokens_of(t, h, w):
    return t * (h // 2) * (w // 2)


def reference_table(rows, policy, m_mem, max_seq_len, model):
    """Distinct (tokens, T, H, W) that fit, sorted; key = max(tokens, previous key + 1); counts summed;
    batch sizes by the formulas in exact arithmetic."""
    counts = defaultdict(int)
    for tokens, thw, n in rows:
        if tokens <= max_seq_len:
            counts[(tokens, *thw)] += n
    keys, prev = [], 0
    for tokens, *thw in sorted(counts):
        prev = max(tokens, prev + 1)
        keys.append((prev, tuple(thw), counts[(tokens, *thw)]))
    p = max(model.p, 1.0)  # dual_p
    m_comp = model.m_comp(m_mem, keys[-1][0])  # the longest scheduled key (test_cost_model checks the rule)
    out = []
    for key, thw, n in keys:
        if policy == "token_equal":
            b = max(1, m_mem // key)
        else:
            b = max(1, min(m_mem // key, math.floor(Fraction(m_comp) / Fraction(float(key) ** p))))
        out.append((key, thw, n, b, model.predict(b, key)))
    return out, (None if policy == "token_equal" else m_comp)


def test_schedule_keys_one_shape_per_key():
    rng = np.random.default_rng(0)
    shapes = np.array([SHAPES[i] for i in rng.integers(len(SHAPES), size=500)])
    tokens = np.array([tokens_of(*s) for s in shapes])
    keys = schedule_keys(shapes, tokens)
    assert (keys >= tokens).all()
    for k in np.unique(keys):
        assert len({tuple(s) for s in shapes[keys == k]}) == 1
    assert len(np.unique(keys)) == len({tuple(s) for s in shapes})
    assert (keys - tokens).max() <= 2  # collisions move a count by at most the group size


@pytest.mark.parametrize("policy", ["token_equal", "dual_constraint", "balanced"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_equals_reference(policy, seed):
    rng = np.random.default_rng(seed)
    model = CostModel("power", {"a": 5.0, "b": 1e-3, "p": 1.4}, 1.4, {})
    rows = [(tokens_of(*SHAPES[i]), SHAPES[i], int(rng.integers(0, 50))) for i in rng.integers(len(SHAPES), size=40)]
    m_mem, max_seq_len = int(rng.integers(64, 400)), int(rng.choice([40, 80, 400]))
    table = BucketTable.build([r[0] for r in rows], [r[2] for r in rows], [r[1] for r in rows], policy=policy,
                              m_mem=m_mem, cost_model=model, max_seq_len=max_seq_len)
    expected, m_comp = reference_table(rows, policy, m_mem, max_seq_len, model)
    assert table.seq_len.tolist() == [e[0] for e in expected]
    assert [tuple(t) for t in table.latent_thw.tolist()] == [e[1] for e in expected]
    assert table.samples.tolist() == [e[2] for e in expected]
    assert table.batch_size.tolist() == [e[3] for e in expected]
    np.testing.assert_allclose(table.cost_ms, [e[4] for e in expected], rtol=1e-12)
    assert table.m_comp == (None if m_comp is None else pytest.approx(m_comp))
    for row, e in zip(table.rows(), expected):
        assert (row["seq_len"], row["latent_shape"], row["samples"], row["batch_size"]) == e[:4]


def test_token_rows_without_a_model_and_output_forms():
    table = BucketTable.build([300, 100, 300, 900], [2, 5, 3, 1], policy="dual_constraint", m_mem=600,
                              m_comp=2000.0, p=1.0, max_seq_len=600)
    assert table.seq_len.tolist() == [100, 300] and table.samples.tolist() == [5, 5]  # 900 > max_seq_len
    assert table.batch_size.tolist() == [min(6, 20), min(2, 6)]
    assert np.isnan(table.cost_ms).all() and [row["latent_shape"] for row in table.rows()] == [None, None]
    doc = table.to_dict()
    assert doc["cost_ms"] == [None, None] and doc["latent_thw"] == [[-1, -1, -1]] * 2 and doc["m_comp"] == 2000.0
    assert [r["latent_shape"] for r in table.rows()] == [None, None]
    lines = table.format().splitlines()
    assert lines[0].startswith("policy dual_constraint: m_mem=600 tokens, m_comp=2000") and len(lines) == 2 + 2
    assert lines[2].split() == ["100", "-", "5", "6", "600", "-"]


def test_build_errors():
    with pytest.raises(ValueError, match="every shape is longer than max_seq_len=50"):
        BucketTable.build([100], [1], policy="token_equal", m_mem=50)
    with pytest.raises(ValueError, match="same non-zero number of rows"):
        BucketTable.build([100, 200], [1], policy="token_equal", m_mem=500)
    with pytest.raises(ValueError, match="needs m_comp and p"):
        BucketTable.build([100], [1], policy="balanced", m_mem=500)
    with pytest.raises(ValueError, match=r"m_mem \(tokens per batch\) must be an integer >= 1"):
        BucketTable.build([100], [1], policy="token_equal", m_mem=0)
