"""Verification's data in the scheduling core: measured shapes, bucket limits honoured by the depth
choice and the bucket table, and batches priced with measured step times."""
import json

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.buckets import BucketTable
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan, choose_batch_and_depth
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
from lightning_adaptiveload.scheduling.verification import BucketLimit, MeasuredCosts, MeasuredShape, Verification

L = 6
GIB = 2**30


def models():
    base = CostModel("linear_quadratic", {"a": 40.0, "c1": 2e-3, "c2": 4e-8}, 1.0, {})
    depth = DepthCostModel(base, L, 0.25)
    memory = MemoryModel("linear", {"m0": 10 * GIB, "c": 2e6, "a": 3e3, "c_k": 1e6, "b": 6e3}, L)
    return depth, memory


def shape(b=2, s=4096, k=3, status="fits", **kw):
    kw = {"warm_ms": 100.0, "cold_ms": 150.0, "peak_bytes": 5e9, "reserved_bytes": 5.2e9, **kw}
    if status == "oom":
        kw = {}
    return MeasuredShape(batch_size=b, seq_len=s, latent_shape=(1, 64, 64), checkpointed=k, status=status, **kw)


def brute_force(seq_len, memory, depth, budget, max_tokens, limit):
    """(B, k) by enumerating every (B, k) with B <= the caps: ruled out if a failed (b, f) has B >= b and
    k <= f; feasible if a fitted (b, f) has B <= b and k >= f, else if m0 + scale * (peak - m0) + gap <=
    budget; per B the fewest feasible k, then the highest B*S/t, ties to the larger B (the rule of
    choose_batch_and_depth, written out in scalars)."""
    m0 = memory.params["m0"]
    best = None
    cap = max(1, max_tokens // seq_len)
    if limit.batch_bound is not None:
        cap = min(cap, limit.batch_bound)
    for b in range(1, cap + 1):
        def feasible(k):
            if any(b >= fb and k <= (L if fk is None else fk) for fb, fk in limit.failed):
                return False
            if any(b <= fb and k >= (L if fk is None else fk) for fb, fk in limit.fitted):
                return True
            return m0 + limit.memory_scale * (memory.predict(b, seq_len, k) - m0) + limit.gap_bytes <= budget
        fitting = [k for k in range(L + 1) if feasible(k)]
        if not fitting:
            continue
        k = fitting[0]
        rate = b / depth.predict(b, seq_len, k)
        if best is None or rate >= best[0]:
            best = (rate, b, k)
    return None if best is None else best[1:]


def test_measured_shape_checks_its_fields_and_round_trips_through_json():
    m = shape()
    assert m.fits and m.used_bytes == 5.2e9
    assert MeasuredShape.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    oom = shape(status="oom")
    assert not oom.fits and oom.used_bytes is None and oom.warm_ms is None
    with pytest.raises(ValueError, match="status"):
        shape(status="warm")
    with pytest.raises(ValueError, match="needs warm_ms and peak_bytes"):
        MeasuredShape(2, 64, None, None, "fits")
    with pytest.raises(ValueError, match="unknown keys"):
        MeasuredShape.from_dict({**m.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="memory_scale"):
        BucketLimit(memory_scale=0.0)
    with pytest.raises(ValueError, match="pinned"):
        BucketLimit(pinned=True)
    with pytest.raises(ValueError, match="failed must be a list of \\(B, k\\) pairs"):
        BucketLimit(failed=((0, 3),))
    with pytest.raises(ValueError, match="gap_bytes"):
        BucketLimit(gap_bytes=-1.0)


def test_verification_round_trips_and_rejects_malformed_documents():
    limits = {4096: BucketLimit(failed=((4, 3), (9, None)), fitted=((2, 3),), memory_scale=1.2, gap_bytes=6e9,
                                batch_bound=8, pinned=(2, 3)),
              1024: BucketLimit(failed=((7, 0),), memory_scale=0.9)}
    v = Verification((shape(), shape(b=4, status="oom"), shape(b=9, k=None, status="predicted_oom")), limits, 20000, 7e10)
    again = Verification.from_dict(json.loads(json.dumps(v.to_dict())))
    assert again.shapes == v.shapes and dict(again.limits) == dict(v.limits)
    assert again.max_seq_len == 20000 and again.budget_bytes == 7e10
    with pytest.raises(ValueError, match="ckpt: limits\\['4096'\\]"):
        Verification.from_dict({**v.to_dict(), "limits": {"4096": {"max_batch_size": 0, "min_checkpointed": 1}}}, "ckpt")
    with pytest.raises(ValueError, match="ckpt: limits\\['4096'\\]: unknown keys \\['box'\\]"):
        Verification.from_dict({**v.to_dict(), "limits": {"4096": {"box": 1}}}, "ckpt")
    with pytest.raises(ValueError, match="ckpt: must be an object"):
        Verification.from_dict({"shapes": []}, "ckpt")


def test_old_box_limits_read_as_the_frontier_they_mean():
    """A box limit of earlier versions (B <= max_batch_size, k >= min_checkpointed) allows exactly the
    (B, k) its converted frontier allows."""
    box = {"max_batch_size": 5, "min_checkpointed": 2, "memory_scale": 1.3, "pinned": False}
    limit = BucketLimit.from_dict(box)
    b = np.arange(1, 12)
    for k in range(L + 1):
        allowed = (limit.depth_floor(b, L) <= k) & (b <= limit.max_batch_size)
        np.testing.assert_array_equal(allowed, (b <= 5) & (k >= 2))
    pinned = BucketLimit.from_dict({**box, "pinned": True})
    assert pinned.pinned == (5, 2) and pinned.max_batch_size == 5


def test_limits_bound_the_depth_choice_as_a_brute_force_does():
    depth, memory = models()
    seq_lens = np.array([1024, 4096, 16384, 40000])
    budget_device = 40 * GIB
    rng = np.random.default_rng(3)

    def points(n):
        return tuple((int(rng.integers(1, 40)), None if rng.random() < 0.15 else int(rng.integers(0, L + 1)))
                     for _ in range(n))
    for trial in range(40):
        limits = {int(s): BucketLimit(failed=points(int(rng.integers(0, 4))), fitted=points(int(rng.integers(0, 3))),
                                      memory_scale=float(rng.uniform(0.8, 1.6)), gap_bytes=float(rng.uniform(0, 8 * GIB)),
                                      batch_bound=None if rng.random() < 0.7 else int(rng.integers(1, 40)))
                  for s in seq_lens if rng.random() < 0.8}
        choice = choose_batch_and_depth(seq_lens, memory, depth, device_memory_bytes=budget_device,
                                        max_memory_fraction=0.8, max_tokens=65536, limits=limits)
        for i, s in enumerate(seq_lens):
            limit = limits.get(int(s), BucketLimit())
            ref = brute_force(int(s), memory, depth, 0.8 * budget_device, 65536, limit)
            if ref is None:  # nothing feasible: B = 1 at k = L unless a failure rules it out
                fallback = int(s) in limits and not any(fb <= 1 and (fk is None or fk >= L) for fb, fk in limit.failed)
                assert choice.fits[i] == fallback, (trial, int(s), limit)
                assert (choice.batch_size[i], choice.checkpointed[i]) == ((1, L) if fallback else (0, L))
                continue
            assert (choice.batch_size[i], choice.checkpointed[i]) == ref, (trial, int(s), limit)
            m0 = memory.params["m0"]
            assert choice.peak_bytes[i] == pytest.approx(
                m0 + limit.memory_scale * (memory.predict(ref[0], int(s), ref[1]) - m0) + limit.gap_bytes)


def test_a_pinned_bucket_keeps_its_verified_choice_whatever_the_models_say():
    depth, memory = models()
    pinned = BucketLimit(fitted=((7, 0),), pinned=(7, 0))  # the models say it does not fit
    assert memory.predict(7, 40000, 0) > 0.8 * 20 * GIB
    choice = choose_batch_and_depth(np.array([40000]), memory, depth, device_memory_bytes=20 * GIB,
                                    max_memory_fraction=0.8, max_tokens=65536, limits={40000: pinned})
    assert choice.fits[0] and (choice.batch_size[0], choice.checkpointed[0]) == (7, 0)
    assert choice.time_ms[0] == pytest.approx(depth.predict(7, 40000, 0))


def test_the_table_caps_token_budget_batches_leaves_out_long_buckets_and_shows_the_measurements():
    tokens, counts = np.array([256, 1024, 4096, 16384]), np.array([50, 40, 30, 20])
    limits = {1024: BucketLimit(failed=((11, None),), batch_bound=10), 4096: BucketLimit(failed=((1, 1),))}
    v = Verification((shape(b=10, s=1024, k=None, warm_ms=77.0),), limits, max_seq_len=4096)
    table = BucketTable.build(tokens, counts, policy="token_equal", m_mem=65536, verification=v)
    assert table.seq_len.tolist() == [256, 1024, 4096]  # 16384 above verification's max_seq_len
    assert table.batch_size.tolist() == [256, 10, 16]  # 1024: 64 capped at 10; k bounds do not apply
    text = table.format()
    assert "meas ms" in text and "77.0" in text and "not run" in text


def test_measured_costs_price_measured_pairs_exactly_and_others_by_the_buckets_ratio():
    base = CostModel("linear_quadratic", {"a": 10.0, "c1": 1e-3, "c2": 0.0}, 1.0, {})
    measured = [shape(b=4, s=1000, warm_ms=30.0), shape(b=2, s=1000, warm_ms=14.0), shape(b=8, s=5000, warm_ms=100.0)]
    costs = MeasuredCosts(base, measured)
    # independent reference: per bucket the median of measured / predicted over its measured pairs
    ratio_1000 = np.median([30.0 / (10 + 1e-3 * 4000), 14.0 / (10 + 1e-3 * 2000)])
    ratio_5000 = 100.0 / (10 + 1e-3 * 40000)
    # a bucket without measurements: the ratio linear in log S between its measured neighbours, the
    # nearest one's beyond the ends
    ratio_2000 = ratio_1000 + (ratio_5000 - ratio_1000) * (np.log(2000) - np.log(1000)) / (np.log(5000) - np.log(1000))
    b = np.array([[4, 2, 3, 6], [8, 1, 5, 2]])
    s = np.array([[1000, 1000, 1000, 2000], [5000, 5000, 777, 9000]])
    expected = np.array([[30.0, 14.0, (10 + 3.0) * ratio_1000, (10 + 12.0) * ratio_2000],
                         [100.0, (10 + 5.0) * ratio_5000, (10 + 1e-3 * 3885) * ratio_1000, (10 + 18.0) * ratio_5000]])
    np.testing.assert_allclose(costs.predict(b, s), expected, rtol=1e-12)
    assert MeasuredCosts(base, []).predict(3, 777) == 10 + 1e-3 * 2331  # no measurement: the model alone
    assert costs.predict(4, 1000) == 30.0 and isinstance(costs.predict(3, 1000), float)
    assert costs.measured == {(2, 1000): 14.0, (4, 1000): 30.0, (8, 5000): 100.0}


def test_the_balanced_plan_prices_batches_with_the_measured_times():
    depth, memory = models()
    plan = MemoryPlan(memory, depth, 80 * GIB, 0.85)
    rng = np.random.default_rng(5)
    seq_lens = rng.choice([1024, 4096, 16384], size=4000)
    plain = BucketBatchSampler(seq_lens, policy="balanced", m_mem=65536, memory_plan=plan, num_replicas=4, rank=0)
    rows = plain.bucket_table.rows()
    # a measurement that makes the 1024 bucket the most expensive of all
    slow = [MeasuredShape(r["batch_size"], r["seq_len"], None, r["checkpointed"], "fits", warm_ms=1e6 if
                          r["seq_len"] == 1024 else r["cost_ms"], peak_bytes=1e9) for r in rows]
    limits = {r["seq_len"]: BucketLimit(pinned=(r["batch_size"], r["checkpointed"])) for r in rows}
    sampler = BucketBatchSampler(seq_lens, policy="balanced", m_mem=65536, memory_plan=plan, num_replicas=4, rank=0,
                                 verification=Verification(tuple(slow), limits))
    assert sampler.bucket_table.batch_size.tolist() == plain.bucket_table.batch_size.tolist()  # pinned: same B, k
    epoch = sampler.plan()
    full = epoch.batch_len == dict(zip(sampler.bucket_table.seq_len, sampler.bucket_table.batch_size))[1024]
    expensive = (epoch.batch_seq_len == 1024) & full
    # balanced sorts by cost: the full 1024 batches now share steps with each other only
    steps_with = np.isin(epoch.steps, np.flatnonzero(expensive))
    mixed = steps_with.any(axis=1) & ~steps_with.all(axis=1)
    assert expensive.sum() >= 8 and mixed.sum() <= 1
