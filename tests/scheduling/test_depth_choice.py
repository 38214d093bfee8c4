import numpy as np
import pytest

from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.depth_choice import choose_batch_and_depth
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl
from tests.helpers.h200_ac import H200_AC

GiB = 2**30
MIX = "lightning_adaptiveload/data/reference_mix.jsonl"


def random_models(rng, num_blocks):
    """A memory and a time model with random physical parameters (the fits are tested elsewhere)."""
    memory = MemoryModel("quadratic", {
        "m0": rng.uniform(1e9, 2e10), "c": rng.uniform(0, 3e7), "a": rng.uniform(1e4, 3e5),
        "q": rng.choice([0.0, rng.uniform(0, 5.0)]), "c_k": rng.uniform(0, 1e7), "b": rng.uniform(1e4, 2e5),
        "q_k": rng.choice([0.0, rng.uniform(0, 5.0)])}, num_blocks=num_blocks)
    base = CostModel("floor_work", {"floor": rng.uniform(5, 50), "c0": rng.uniform(0, 1), "c1": rng.uniform(1e-3, 5e-3),
                                    "c2": rng.uniform(0, 3e-7), "k": rng.uniform(1.5, 8)}, p=1.3, quality={})
    return memory, DepthCostModel(base, num_blocks, recompute_fraction=rng.uniform(0.05, 0.3))


def brute_force(seq_len, memory, cost, budget, max_tokens, max_batch_size):
    """Best (B, k) by enumerating every B up to the caps and every k; ties: larger B, then fewer k."""
    L = memory.num_blocks
    top = min(max_batch_size, max(1, max_tokens // seq_len))
    best = None
    for b in range(1, top + 1):
        for k in range(L + 1):
            if memory.predict(b, seq_len, k) <= budget:
                rate = b * seq_len / cost.predict(b, seq_len, k)
                if best is None or (rate, b, -k) > best[0]:
                    best = ((rate, b, -k), b, k)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_choice_equals_brute_force_on_random_models(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 13))
    memory, cost = random_models(rng, L)
    seq_lens = np.unique(rng.integers(64, 60000, 12))
    device = float(rng.uniform(0.5, 3.0) * memory.predict(4, 8000, L // 2))
    choice = choose_batch_and_depth(seq_lens, memory, cost, device_memory_bytes=device, max_memory_fraction=0.9,
                                    max_tokens=40000, max_batch_size=48)
    for i, s in enumerate(seq_lens):
        ref = brute_force(int(s), memory, cost, 0.9 * device, 40000, 48)
        if ref is None:
            assert not choice.fits[i] and choice.batch_size[i] == 0 and choice.checkpointed[i] == L
            assert choice.peak_bytes[i] == pytest.approx(memory.predict(1, s, L))
            assert memory.predict(1, s, L) > 0.9 * device
            assert np.isnan(choice.time_ms[i])
            continue
        assert choice.fits[i]
        assert choice.tokens_per_s[i] == pytest.approx(ref[0][0] * 1e3, rel=1e-12)
        assert (choice.batch_size[i], choice.checkpointed[i]) == (ref[1], ref[2])
        assert choice.peak_bytes[i] == pytest.approx(memory.predict(ref[1], s, ref[2]), rel=1e-12)
        assert choice.time_ms[i] == pytest.approx(cost.predict(ref[1], s, ref[2]), rel=1e-12)


def test_more_memory_or_a_larger_token_cap_never_lowers_predicted_throughput():
    rng = np.random.default_rng(11)
    for _ in range(5):
        L = int(rng.integers(2, 31))
        memory, cost = random_models(rng, L)
        seq_lens = np.unique(rng.integers(64, 80000, 25))
        device = float(memory.predict(8, 8000, 0))
        previous = None
        for scale in (0.3, 0.5, 0.8, 1.0, 1.5, 3.0):
            choice = choose_batch_and_depth(seq_lens, memory, cost, device_memory_bytes=scale * device,
                                            max_tokens=65536, max_batch_size=256)
            assert np.all(choice.peak_bytes[choice.fits] <= choice.budget_bytes)
            assert np.all((choice.checkpointed >= 0) & (choice.checkpointed <= L))
            if previous is not None:
                assert np.all(choice.tokens_per_s >= previous.tokens_per_s * (1 - 1e-12))
                assert np.all(choice.fits >= previous.fits)
            previous = choice
        rates = [choose_batch_and_depth(seq_lens, memory, cost, device_memory_bytes=device, max_tokens=cap,
                                        max_batch_size=256).tokens_per_s for cap in (4096, 16384, 65536, 262144)]
        for low, high in zip(rates, rates[1:]):
            assert np.all(high >= low * (1 - 1e-12))


def test_h200_reference_mix_keeps_every_bucket_and_beats_checkpointing_everywhere():
    """Models fitted to the H200 measurements (issue 14): with the token cap of token_equal at m_mem 65,536,
    every bucket of the reference mix fits, the 75,600-token bucket at B = 1 (a token budget drops it), and each
    bucket's predicted tokens/s is at least that of the token-equal batch with every block checkpointed."""
    b, s, k, t, peak = np.array(H200_AC).T
    memory = MemoryModel.fit(b, s, k, peak * GiB, num_blocks=30)
    cost = DepthCostModel.fit(b, s, k, t, num_blocks=30)
    tokens = read_shapes_jsonl(MIX).tokens
    choice = choose_batch_and_depth(tokens, memory, cost, device_memory_bytes=139.8 * GiB, max_tokens=65536)
    assert choice.fits.all()
    assert choice.batch_size[tokens == 75600].tolist() == [1]
    assert np.all(choice.peak_bytes <= 0.85 * 139.8 * GiB)
    token_equal = np.maximum(1, 65536 // tokens)
    baseline = token_equal * tokens / (cost.predict(token_equal, tokens) / 1e3)  # k = L
    assert np.all(choice.tokens_per_s >= baseline * (1 - 1e-12))
    assert np.any(choice.checkpointed < 30)


def test_bucket_that_fits_nowhere_is_reported():
    memory = MemoryModel("linear", {"m0": 1e9, "c": 1e6, "a": 1e4, "c_k": 1e5, "b": 1e3}, num_blocks=4)
    cost = DepthCostModel(CostModel("power", {"a": 5.0, "b": 1e-3, "p": 1.2}, p=1.2, quality={}), 4, 0.25)
    fits_one = (2e9 - 1e9 - 1e6 - 1e5) / (1e4 + 1e3)  # the longest sample that fits at B = 1, k = L (one live block)
    seq_lens = np.array([1000, int(fits_one) - 10, int(fits_one) + 10])
    choice = choose_batch_and_depth(seq_lens, memory, cost, device_memory_bytes=2e9, max_memory_fraction=1.0,
                                    max_tokens=4096)
    assert choice.fits.tolist() == [True, True, False]
    assert choice.batch_size[1:].tolist() == [1, 0]  # over the token cap, still trained at B = 1
    assert choice.checkpointed[1:].tolist() == [3, 4]  # k = L - 1 peaks as k = L does, and runs faster
    assert choice.unfit_seq_lens.tolist() == [int(fits_one) + 10]
    rows = choice.rows()
    assert rows[2]["fits"] is False and rows[2]["time_ms"] is None and rows[2]["peak_bytes"] > 2e9


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_memory_bytes=0), "device_memory_bytes"),
    (dict(max_memory_fraction=1.5), "max_memory_fraction"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_batch_size=2.5), "max_batch_size"),
    (dict(seq_lens=[0, 100]), "seq_lens"),
    (dict(seq_lens=[]), "non-empty"),
    (dict(num_blocks=5), "num_blocks"),
])
def test_rejects_bad_input(kwargs, message):
    num_blocks = kwargs.pop("num_blocks", 4)
    memory = MemoryModel("linear", {"m0": 1e9, "c": 1e6, "a": 1e4, "c_k": 1e5, "b": 1e3}, num_blocks=4)
    cost = DepthCostModel(CostModel("power", {"a": 5.0, "b": 1e-3, "p": 1.2}, p=1.2, quality={}), num_blocks, 0.2)
    args = dict(seq_lens=[100, 1000], device_memory_bytes=4e9)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        choose_batch_and_depth(args.pop("seq_lens"), memory, cost, **args)


def test_without_any_bound_on_the_batch_size_asks_for_one():
    memory = MemoryModel("linear", {"m0": 1e9, "c": 0.0, "a": 0.0, "c_k": 0.0, "b": 0.0}, num_blocks=4)
    cost = DepthCostModel(CostModel("power", {"a": 5.0, "b": 1e-3, "p": 1.2}, p=1.2, quality={}), 4, 0.2)
    with pytest.raises(ValueError, match="max_batch_size or max_tokens"):
        choose_batch_and_depth([100], memory, cost, device_memory_bytes=4e9)
    choice = choose_batch_and_depth([100], memory, cost, device_memory_bytes=4e9, max_batch_size=8)
    assert choice.batch_size.tolist() == [8]


def test_a_failure_rules_out_only_its_quadrant():
    """B = 2 at k = 0 over the budget rules out B >= 2 at k = 0 only: B = 1 at k = 0 (never measured)
    stays a candidate and wins where it is predicted to fit and runs fastest (the box of earlier
    versions, B <= 2 and k >= 1, forced B = 1 to k = 1); B = 2 needs k >= 1."""
    from lightning_adaptiveload.scheduling.verification import BucketLimit
    L = 6
    memory = MemoryModel("linear", {"m0": 10 * GiB, "c": 2e6, "a": 3e3, "c_k": 1e6, "b": 6e4}, num_blocks=L)
    # time per sample grows with B (a saturated device), so B = 1 at k = 0 beats B = 2 at any k
    cost = DepthCostModel(CostModel("power", {"a": 0.0, "b": 1e-3, "p": 1.3}, p=1.3, quality={}), L, 0.3)
    s = 20000
    device = (memory.predict(2, s, 0) + memory.predict(1, s, 0)) / 2 / 0.9  # B = 1 fits at k = 0, B = 2 not
    assert memory.predict(1, s, 0) <= 0.9 * device < memory.predict(2, s, 0)
    limit = BucketLimit(failed=((2, 0),))
    choice = choose_batch_and_depth([s], memory, cost, device_memory_bytes=device, max_memory_fraction=0.9,
                                    max_tokens=65536, limits={s: limit})
    assert (choice.batch_size[0], choice.checkpointed[0]) == (1, 0)
    np.testing.assert_array_equal(limit.depth_floor([1, 2, 3], L), [0, 1, 1])
    # a measured fit proves its quadrant: B <= 3 at k >= 2 fits whatever the prediction says
    proven = BucketLimit(failed=((4, L),), fitted=((3, 2),), memory_scale=10.0)
    np.testing.assert_array_equal(proven.proven_depth([1, 3, 4], L), [2, 2, L + 1])
    choice = choose_batch_and_depth([s], memory, cost, device_memory_bytes=device, max_memory_fraction=0.9,
                                    max_tokens=65536, limits={s: proven})
    assert choice.fits[0] and choice.batch_size[0] <= 3 and choice.checkpointed[0] >= 2


@pytest.mark.parametrize("seed", range(4))
def test_a_plan_margin_plans_unverified_buckets_within_the_smaller_budget(seed):
    """Every bucket not yet verified gets brute force's choice at (1 - margin) of the budget, unless
    B = 1 at k = L fits only the whole budget: then brute force's at the whole budget (no sample is
    dropped for the margin); a verified (limited) bucket is planned as without a margin."""
    from lightning_adaptiveload.scheduling.verification import BucketLimit
    rng = np.random.default_rng(100 + seed)
    L = int(rng.integers(2, 13))
    memory, cost = random_models(rng, L)
    seq_lens = np.unique(rng.integers(64, 60000, 12))
    device = float(rng.uniform(0.5, 3.0) * memory.predict(4, 8000, L // 2))
    budget, margin = 0.9 * device, 0.05
    # a bucket whose B = 1, k = L fits the whole budget but not the smaller one
    edge = int(memory.max_seq_len(budget, 1, L))
    if memory.predict(1, edge, L) > (1 - margin) * budget:
        seq_lens = np.unique(np.append(seq_lens, edge))
    verified = int(seq_lens[0])
    limits = {verified: BucketLimit(memory_scale=1.0)}
    choice = choose_batch_and_depth(seq_lens, memory, cost, device_memory_bytes=device, max_memory_fraction=0.9,
                                    max_tokens=40000, max_batch_size=48, limits=limits, plan_margin=margin)
    plain = choose_batch_and_depth(seq_lens, memory, cost, device_memory_bytes=device, max_memory_fraction=0.9,
                                   max_tokens=40000, max_batch_size=48, limits=limits)
    assert choice.budget_bytes == pytest.approx(budget)
    smaller_seen = whole_seen = False
    for i, s in enumerate(seq_lens):
        if int(s) == verified:
            assert (choice.batch_size[i], choice.checkpointed[i]) == (plain.batch_size[i], plain.checkpointed[i])
            continue
        within = memory.predict(1, s, L) <= (1 - margin) * budget
        ref = brute_force(int(s), memory, cost, (1 - margin) * budget if within else budget, 40000, 48)
        if ref is None:
            assert not choice.fits[i]
            continue
        smaller_seen |= bool(within)
        whole_seen |= not within
        assert (choice.batch_size[i], choice.checkpointed[i]) == (ref[1], ref[2])
    assert smaller_seen and whole_seen
    assert choice.fits.tolist() == plain.fits.tolist()  # the margin drops no bucket
    assert (choice.tokens_per_s[choice.fits] <= plain.tokens_per_s[choice.fits] * (1 + 1e-12)).all()


def test_a_plan_margin_outside_zero_to_one_is_refused():
    memory = MemoryModel("linear", {"m0": 1e9, "c": 1e6, "a": 1e4, "c_k": 1e5, "b": 1e3}, num_blocks=4)
    cost = DepthCostModel(CostModel("power", {"a": 5.0, "b": 1e-3, "p": 1.2}, p=1.2, quality={}), 4, 0.2)
    for bad in (-0.01, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="plan_margin"):
            choose_batch_and_depth([100], memory, cost, device_memory_bytes=4e9, max_tokens=4096, plan_margin=bad)
