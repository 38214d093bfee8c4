"""MemoryPlan through the scheduling core: the longest sample a device fits, the bucket table's (B, k)
(against a brute-force search over every B and k) and predicted peaks, the sampler's balanced order at
each bucket's depth and its resume check, the streaming schedule, and MemoryModel.max_seq_len against
a brute-force search."""
import numpy as np
import pytest

from lightning_adaptiveload.scheduling.buckets import NO_DEPTH, BucketTable, schedule_keys
from lightning_adaptiveload.scheduling.depth_choice import BucketDepthCosts, MemoryPlan
from lightning_adaptiveload.scheduling.memory_model import NO_BOUND, MemoryModel
from lightning_adaptiveload.scheduling.policies import dual_constraint_batch_size, token_equal_batch_size
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
from lightning_adaptiveload.scheduling.stream_batcher import make_stream_schedule
from lightning_adaptiveload.scheduling.shapes import ShapeMix
from tests.helpers.depth_brute_force import best_batch_and_depth
from tests.scheduling.test_depth_choice import random_models


def plan_of(seed, L=None, scale=1.0):
    """A random plan whose device fits a 4 x 8000-token batch at k = L // 2 times `scale`."""
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 13)) if L is None else L
    memory, cost = random_models(rng, L)
    device = float(scale * memory.predict(4, 8000, L // 2))
    return MemoryPlan(memory, cost, device_memory_bytes=device, max_memory_fraction=0.9), rng


def brute_max_seq_len(model: MemoryModel, budget, b, k, top):
    """Largest S in [1, top] that fits, by evaluating every one (0: none; top must be past the answer)."""
    s = np.arange(1, top + 1)
    fits = s[model.predict(b, s, k) <= budget]
    assert not len(fits) or fits[-1] < top, "the search range is too short"
    return int(fits[-1]) if len(fits) else 0


@pytest.mark.parametrize("seed", range(8))
def test_max_seq_len_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    memory, _ = random_models(rng, int(rng.integers(1, 9)))
    for _ in range(4):
        b = int(rng.integers(1, 9))
        k = int(rng.integers(0, memory.num_blocks + 1))
        # a budget whose answer lies in [1, 20000] or is 0 (nothing fits)
        target = int(rng.integers(1, 20000))
        budget = float(memory.predict(b, target, k)) * rng.uniform(0.999, 1.001)
        got = memory.max_seq_len(budget, b, k)
        assert got == brute_max_seq_len(memory, budget, b, k, 25000)
    assert memory.max_seq_len(0.5 * memory.params["m0"]) == 0
    flat = MemoryModel("linear", {"m0": 1e9, "c": 1e6, "a": 0.0, "c_k": 0.0, "b": 0.0}, num_blocks=2)
    assert flat.max_seq_len(2e9) == NO_BOUND and flat.max_seq_len(5e8) == 0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("policy", ["balanced", "token_equal", "dual_constraint"])
def test_bucket_table_under_a_memory_plan(seed, policy):
    plan, rng = plan_of(seed)
    tokens = np.unique(rng.integers(64, 120000, 30))
    counts = rng.integers(1, 40, len(tokens))
    m_mem = int(rng.choice([16384, 65536]))
    table = BucketTable.build(tokens, counts, policy=policy, m_mem=m_mem, max_seq_len=10**7, memory_plan=plan)
    longest = brute_max_seq_len(plan.memory_model, plan.budget_bytes, 1, plan.num_blocks, 2 * 10**6)
    assert table.max_seq_len == min(10**7, longest) == plan.max_seq_len
    kept = tokens <= longest
    assert table.seq_len.tolist() == tokens[kept].tolist() and table.samples.tolist() == counts[kept].tolist()
    memory, cost = plan.memory_model, plan.cost_model
    if policy == "balanced":  # the plan's choice, token cap m_mem; samples over m_mem at B = 1
        # the best (B, k) of every bucket by brute force (not choose_batch_and_depth, which builds the table)
        ref = [best_batch_and_depth(int(s), memory, cost, 0.9 * plan.device_memory_bytes, m_mem)
               for s in table.seq_len]
        assert None not in ref  # every kept bucket fits some (B, k)
        assert table.batch_size.tolist() == [b for b, _ in ref]
        assert table.checkpointed.tolist() == [k for _, k in ref]
        assert np.all(table.batch_size[table.seq_len > m_mem] == 1)
        assert np.all(table.peak_bytes <= plan.budget_bytes) and table.m_comp is None and table.p is None
    else:  # token budgets, every block checkpointed
        m_comp = cost.base.m_comp(m_mem, int(table.seq_len[-1]))
        expect = [token_equal_batch_size(s, m_mem) if policy == "token_equal"
                  else dual_constraint_batch_size(s, m_mem, m_comp, cost.base.dual_p) for s in table.seq_len]
        assert table.batch_size.tolist() == expect and np.all(table.checkpointed == plan.num_blocks)
    for s, b, k, ms, peak in zip(table.seq_len, table.batch_size, table.checkpointed, table.cost_ms, table.peak_bytes):
        assert ms == pytest.approx(cost.predict(int(b), int(s), int(k)), rel=1e-12)
        assert peak == pytest.approx(memory.predict(int(b), int(s), int(k)), rel=1e-12)
    rows, doc = table.rows(), table.to_dict()
    assert [r["checkpointed"] for r in rows] == table.checkpointed.tolist() == doc["checkpointed"]
    assert doc["memory_plan"]["budget_bytes"] == pytest.approx(plan.budget_bytes)
    lines = table.format().splitlines()
    assert lines[1].startswith(f"memory plan: peak <= {plan.budget_bytes / 2**30:.2f} GiB (0.9 of")
    assert lines[2].split()[-3:] == ["k", "peak", "MiB"]
    for line, k, peak in zip(lines[3:], table.checkpointed, table.peak_bytes):
        over = peak > plan.budget_bytes
        assert line.split()[-4 if over else -2:][:2] == [str(k), f"{peak / 2**20:.1f}"]
        assert line.endswith("over budget") == over


def test_table_without_a_plan_has_no_depth_and_nothing_fits_is_a_clear_error():
    table = BucketTable.build([100, 300], [2, 3], policy="token_equal", m_mem=600)
    assert table.checkpointed.tolist() == [NO_DEPTH] * 2 and np.isnan(table.peak_bytes).all()
    assert table.rows()[0]["checkpointed"] is None and table.to_dict()["memory_plan"] is None
    assert "memory plan" not in table.format()
    plan, _ = plan_of(0, L=4, scale=1e-6)
    with pytest.raises(ValueError, match=r"no sample fits the device: the shortest \(100 tokens\)"):
        BucketTable.build([100, 300], [2, 3], policy="balanced", m_mem=600, memory_plan=plan)
    with pytest.raises(ValueError, match="no sample fits the device"):
        BucketBatchSampler(np.array([100, 300]), policy="balanced", m_mem=600, memory_plan=plan, num_replicas=1, rank=0)


def test_bucket_depth_costs_price_each_bucket_at_its_depth_and_others_at_all_blocks():
    plan, _ = plan_of(3, L=6)
    costs = BucketDepthCosts(plan.cost_model, np.array([900, 100, 400]), np.array([1, 5, 3]))
    s = np.array([100, 400, 900, 250])
    assert costs.checkpointed_at(s).tolist() == [5, 3, 1, 6]
    np.testing.assert_allclose(costs.predict(np.array([3, 2, 1, 4]), s),
                               [plan.cost_model.predict(b, int(x), k) for b, x, k in zip([3, 2, 1, 4], s, [5, 3, 1, 6])])


@pytest.mark.parametrize("world", [1, 4])
def test_sampler_drops_what_fits_nowhere_and_balances_at_each_buckets_depth(world):
    plan, rng = plan_of(5, L=8)
    seq_lens = rng.choice(np.unique(rng.integers(64, 150000, 40)), size=3000)
    sampler = BucketBatchSampler(seq_lens, policy="balanced", m_mem=65536, memory_plan=plan, num_replicas=world,
                                 rank=0, seed=1, max_seq_len=10**6, drop_last=True)
    longest = plan.max_seq_len
    assert sampler.max_seq_len == longest and sampler.plan().stats["dropped_oversize"] == int((seq_lens > longest).sum())
    table = sampler.bucket_table
    k_of = dict(zip(table.seq_len.tolist(), table.checkpointed.tolist()))
    plan_ = sampler.plan()
    # reference costs: the time model at the depth of each batch's bucket
    cost = np.array([plan.cost_model.predict(int(b), int(s), k_of[int(s)])
                     for b, s in zip(plan_.batch_len, plan_.batch_seq_len)])
    step_cost = cost[plan_.steps]
    order = np.lexsort((step_cost.min(axis=1), step_cost.max(axis=1)))
    lo, hi = step_cost.min(axis=1)[order], step_cost.max(axis=1)[order]
    assert np.all(hi[:-1] <= lo[1:] * (1 + 1e-12))  # steps hold consecutive runs of the cost-sorted batches
    # a resume under another plan (other batch sizes) is refused
    other = MemoryPlan(plan.memory_model, plan.cost_model, plan.device_memory_bytes, max_memory_fraction=0.85)
    again = BucketBatchSampler(seq_lens, policy="balanced", m_mem=65536, memory_plan=other, num_replicas=world,
                               rank=0, seed=1, max_seq_len=10**6, drop_last=True)
    with pytest.raises(ValueError, match="different configuration.*memory_plan|different configuration.*max_seq_len"):
        again.load_state_dict(sampler.state_dict())
    same = BucketBatchSampler(seq_lens, policy="balanced", m_mem=65536, memory_plan=plan, num_replicas=world,
                              rank=0, seed=1, max_seq_len=10**6, drop_last=True)
    same.load_state_dict(sampler.state_dict())


def test_stream_schedule_follows_the_plan_also_for_unlisted_buckets():
    plan, rng = plan_of(2, L=5)
    tokens = np.unique(rng.integers(64, 100000, 12))
    mix = ShapeMix(tokens=tokens, counts=rng.integers(1, 30, len(tokens)),
                   latent_thw=np.full((len(tokens), 3), -1, dtype=np.int64))
    schedule = make_stream_schedule(mix, policy="balanced", m_mem=65536, memory_plan=plan, max_seq_len=10**6)
    assert schedule.max_seq_len == plan.max_seq_len
    listed = [int(s) for s in tokens if s <= plan.max_seq_len]
    unlisted = listed[0] + 1
    # the best (B, k) by brute force, not by the plan.choose the schedule calls
    ref = [best_batch_and_depth(s, plan.memory_model, plan.cost_model, plan.budget_bytes, 65536)
           for s in listed + [unlisted]]
    assert [schedule.batch_size(s) for s in listed + [unlisted]] == [b for b, _ in ref]
    # a listed bucket is priced at its depth, an unlisted one at k = L (what it runs at: no depth in its batches)
    assert schedule.cost_model.checkpointed_at(np.array([listed[0], unlisted])).tolist() == [ref[0][1], 5]


def test_schedule_keys_stay_the_table_keys_under_a_plan():
    plan, _ = plan_of(1, L=3, scale=50.0)
    tokens = np.array([96, 96, 200])
    thw = np.array([[1, 8, 12], [1, 12, 8], [2, 10, 10]])
    table = BucketTable.build(tokens, [1, 2, 3], thw, policy="balanced", m_mem=400, memory_plan=plan, max_seq_len=10**5)
    assert table.seq_len.tolist() == sorted(set(schedule_keys(thw, tokens).tolist())) == [96, 97, 200]
