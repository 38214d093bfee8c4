import numpy as np
import pytest

from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.shapes import ShapeMix
from lightning_adaptiveload.scheduling.simulate import simulate, step_metrics


def mix_of(tokens, counts):
    tokens = np.asarray(tokens, dtype=np.int64)
    return ShapeMix(tokens=tokens, counts=np.asarray(counts, dtype=np.int64),
                    latent_thw=np.full((len(tokens), 3), -1, dtype=np.int64))


def test_step_metrics_hand_computed():
    times = np.array([[1.0, 3.0], [2.0, 2.0]])
    tokens = np.array([[10, 30], [20, 20]])
    samples = np.array([[1, 2], [3, 4]])
    m = step_metrics(times, tokens, samples)
    # step 0: mean 2, std 1 -> cv 0.5, max/mean 1.5; step 1: cv 0, max/mean 1
    assert m["load_cv_mean"] == pytest.approx(0.25)
    assert m["load_max_over_mean_mean"] == pytest.approx(1.25)
    assert m["bubble_frac"] == pytest.approx(1 - 4 / 5)
    assert m["predicted_tokens_per_s"] == pytest.approx(80 / 0.005)
    assert m["predicted_samples_per_s"] == pytest.approx(10 / 0.005)
    assert m["step_time_mean_ms"] == pytest.approx(2.5)
    assert m["step_time_cv_temporal"] == pytest.approx(0.5 / 2.5)  # step times 3 and 2: CV over steps
    assert m["steps"] == 2 and m["world_size"] == 2


def test_step_metrics_random_against_fp64_loops():
    rng = np.random.default_rng(0)
    times = rng.uniform(5, 500, size=(37, 6))
    tokens = rng.integers(100, 10_000, size=(37, 6))
    m = step_metrics(times, tokens, np.ones_like(tokens))
    cvs = [np.sqrt(sum((x - sum(r) / 6) ** 2 for x in r) / 6) / (sum(r) / 6) for r in times.tolist()]
    assert m["load_cv_mean"] == pytest.approx(sum(cvs) / len(cvs), rel=1e-12)
    assert m["bubble_frac"] == pytest.approx(1 - sum(sum(r) / 6 for r in times.tolist()) / sum(map(max, times.tolist())))


def test_simulate_small_example_by_hand():
    """Buckets 100 tokens (8 samples, B=4) and 400 tokens (2 samples, B=1) at m_mem=400; time = B*S^2 ms.
    Batches cost 40000 ms (short) and 160000 ms (long); 4 batches on 2 ranks -> 2 steps."""
    mix = mix_of([100, 400], [8, 2])
    model = CostModel("power", {"a": 0.0, "b": 1.0, "p": 2.0}, 2.0, {})
    balanced = simulate(mix, model, m_mem=400, world_size=2, policy="balanced", steps=2, m_comp=1e12)
    assert balanced["buckets"]["batch_size"] == [4, 1]
    assert balanced["load_cv_mean"] == 0 and balanced["bubble_frac"] == 0
    assert balanced["predicted_tokens_per_s"] == pytest.approx(1600 / 200.0)
    assert balanced["predicted_samples_per_s"] == pytest.approx(10 / 200.0)
    for seed in range(6):
        r = simulate(mix, model, m_mem=400, world_size=2, policy="token_equal", steps=2, seed=seed)
        # random grouping: either both steps are pure (as balanced) or both mix a short and a long batch
        mixed = {"load_cv_mean": 0.6, "load_max_over_mean_mean": 1.6, "bubble_frac": 1 - 200000 / 320000,
                 "predicted_tokens_per_s": 1600 / 320.0}
        pure = {"load_cv_mean": 0.0, "load_max_over_mean_mean": 1.0, "bubble_frac": 0.0,
                "predicted_tokens_per_s": 1600 / 200.0}
        want = mixed if r["load_cv_mean"] > 0 else pure
        for key, value in want.items():
            assert r[key] == pytest.approx(value, abs=1e-12), (seed, key)


def test_simulate_spans_epochs_and_counts_drops():
    rng = np.random.default_rng(1)
    mix = mix_of([256, 4096, 30000, 90000], rng.integers(50, 400, size=4))
    model = CostModel("power", {"a": 8.0, "b": 2e-5, "p": 1.3}, 1.3, {})
    r = simulate(mix, model, m_mem=65536, world_size=4, policy="dual_constraint", steps=500)
    assert r["steps"] == 500 and r["epochs_used"] > 1
    assert r["dropped_oversize"] == int(mix.counts[3])
    assert r["buckets"]["seq_len"] == [256, 4096, 30000]
    drawn = simulate(mix, model, m_mem=65536, world_size=4, policy="balanced", steps=50, num_samples=20000)
    assert drawn["samples_per_epoch"] == 20000
    assert drawn["load_cv_mean"] < r["load_cv_mean"]


def test_simulate_bad_input():
    mix = mix_of([256, 1024], [10, 10])
    model = CostModel("power", {"a": 8.0, "b": 2e-5, "p": 1.3}, 1.3, {})
    with pytest.raises(ValueError, match="world size 50 is larger"):
        simulate(mix, model, m_mem=65536, world_size=50, policy="token_equal", steps=3)
    with pytest.raises(ValueError, match="steps"):
        simulate(mix, model, m_mem=65536, world_size=1, policy="token_equal", steps=0)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1, got 0"):
        simulate(mix, model, m_mem=65536, world_size=1, policy="token_equal", steps=3, num_samples=0)


def test_simulate_with_a_memory_plan_prices_each_batch_at_its_buckets_depth():
    from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
    from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan
    from lightning_adaptiveload.scheduling.memory_model import MemoryModel
    from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
    from tests.helpers.h200_ac import H200_AC, NUM_BLOCKS

    b, s, k, t, peak = np.array(H200_AC).T
    memory = MemoryModel.fit(b, s, k, peak * 2**30, num_blocks=NUM_BLOCKS)
    depth = DepthCostModel.fit(b, s, k, t, num_blocks=NUM_BLOCKS)
    plan = MemoryPlan(memory, depth, 139.8 * 2**30)
    mix = ShapeMix(tokens=np.array([1024, 20280, 46800, 75600]), counts=np.array([300, 40, 20, 10]),
                   latent_thw=np.full((4, 3), -1))
    out = simulate(mix, depth, m_mem=65536, world_size=4, policy="balanced", steps=40, memory_plan=plan,
                   max_seq_len=plan.max_seq_len)
    # reference: the same sampler's plan, each batch priced by hand at its bucket's k
    sampler = BucketBatchSampler(mix.per_sample_tokens(), policy="balanced", m_mem=65536, cost_model=depth,
                                 num_replicas=4, rank=0, max_seq_len=plan.max_seq_len, memory_plan=plan)
    k_of = dict(zip(sampler.bucket_table.seq_len.tolist(), sampler.bucket_table.checkpointed.tolist()))
    scheduled = sampler.plan().stats["samples_scheduled"] / mix.num_samples  # epoch 0
    times, tokens, epoch = [], 0, 0
    while len(times) < 40:  # one row of per-rank times per step, over as many epochs as needed
        sampler.set_epoch(epoch)
        p = sampler.plan()
        for step in p.steps[: 40 - len(times)]:
            row = [depth.predict(int(p.batch_len[i]), int(p.batch_seq_len[i]), k_of[int(p.batch_seq_len[i])])
                   for i in step]
            times.append(row)
            tokens += int((p.batch_len[step] * p.batch_seq_len[step]).sum())
        epoch += 1
    wall_s = sum(max(row) for row in times) / 1e3
    assert out["predicted_tokens_per_s"] == pytest.approx(tokens / wall_s, rel=1e-9)
    assert 75600 in out["buckets"]["seq_len"] and out["samples_scheduled_frac"] == pytest.approx(scheduled)
