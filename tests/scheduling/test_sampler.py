import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.policies import dual_constraint_batch_size, token_equal_batch_size
from lightning_adaptiveload.scheduling.buckets import assign_buckets
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
from lightning_adaptiveload.scheduling.verification import Verification

M_MEM = 65536
BUCKETS = np.array([256, 1024, 1560, 3600, 7800, 14040, 20280, 32760, 46800, 61200, 75600])


def power_model(p=1.3, a=10.0, b=1e-4):
    return CostModel("power", {"a": a, "b": b, "p": p}, p, {})


def random_seq_lens(n, seed):
    rng = np.random.default_rng(seed)
    return rng.choice(BUCKETS, size=n, p=np.linspace(3, 1, len(BUCKETS)) / np.linspace(3, 1, len(BUCKETS)).sum())


def make_ranks(seq_lens, world, **kw):
    return [BucketBatchSampler(seq_lens, num_replicas=world, rank=r, **kw) for r in range(world)]


# --- batch-size rules against exact rational arithmetic --------------------------------------

def test_token_equal_batch_size_formula():
    rng = np.random.default_rng(1)
    for s, m in zip(rng.integers(1, 200_000, 200), rng.integers(1, 200_000, 200)):
        assert token_equal_batch_size(int(s), int(m)) == max(1, int(m) // int(s))
    assert token_equal_batch_size(70_000, 65_536) == 1  # S > m_mem still runs one sample
    with pytest.raises(ValueError, match="seq_len"):
        token_equal_batch_size(0, 10)


@pytest.mark.parametrize("p", [1, 2])
def test_dual_constraint_integer_p_exact(p):
    rng = np.random.default_rng(p)
    for _ in range(300):
        s, m_mem = int(rng.integers(1, 100_000)), int(rng.integers(1, 200_000))
        m_comp = int(rng.integers(1, 10**12))
        expected = max(1, min(m_mem // s, math.floor(Fraction(m_comp, s**p))))
        assert dual_constraint_batch_size(s, m_mem, m_comp, p) == expected


def test_dual_constraint_edges():
    rng = np.random.default_rng(3)
    for s in rng.integers(1, 60_000, 50).tolist():
        # huge m_comp: memory alone decides, i.e. token_equal
        assert dual_constraint_batch_size(s, M_MEM, 1e300, 1.3) == token_equal_batch_size(s, M_MEM)
        # tiny m_comp: compute would allow 0, the rule still runs one sample
        assert dual_constraint_batch_size(s, M_MEM, 1e-9, 1.3) == 1
    assert dual_constraint_batch_size(100_000, M_MEM, 1e300, 1.0) == 1  # S > m_mem
    p = 1.29
    for s in (256, 4096, 32760):
        m_comp = 3.7 * s**p
        assert dual_constraint_batch_size(s, 10**9, m_comp, p) == math.floor(Fraction(m_comp) / Fraction(s**p))


# --- sampler invariants ------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("policy", ["token_equal", "dual_constraint", "balanced"])
def test_plan_invariants(world, policy):
    seq_lens = random_seq_lens(4000, seed=world)
    samplers = make_ranks(seq_lens, world, policy=policy, m_mem=M_MEM, cost_model=power_model(), seed=7,
                          drop_last=True)
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0]) > 0
    flat = np.concatenate([np.concatenate(b) for b in per_rank])
    assert len(np.unique(flat)) == len(flat), "an index was yielded twice in one epoch"
    stats = samplers[0].stats
    dropped = stats["dropped_oversize"] + stats["dropped_partial_batch"] + stats["dropped_step_remainder"]
    assert len(flat) == stats["samples_scheduled"] == len(seq_lens) - dropped
    assert stats["dropped_oversize"] == int((seq_lens > M_MEM).sum())
    bucket_batch = dict(zip(samplers[0].bucket_seq_len.tolist(), samplers[0].bucket_batch.tolist()))
    for batches in per_rank:
        for batch in batches:
            s = np.unique(seq_lens[batch])
            assert len(s) == 1, "a batch mixes buckets"
            assert len(batch) == bucket_batch[int(s[0])]  # drop_last: only full batches
            assert len(batch) * s[0] <= M_MEM
    # every rank computed the same plan
    for s in samplers[1:]:
        assert np.array_equal(s.plan().steps, samplers[0].plan().steps)


def test_determinism_and_set_epoch():
    seq_lens = random_seq_lens(3000, seed=5)
    kw = dict(policy="balanced", m_mem=M_MEM, cost_model=power_model(), num_replicas=4, rank=2, seed=11)
    a, b = BucketBatchSampler(seq_lens, **kw), BucketBatchSampler(seq_lens, **kw)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    second = list(a)
    assert second != first
    assert sorted(map(tuple, second)) != sorted(map(tuple, first))
    a.set_epoch(0)
    assert list(a) == first
    assert list(BucketBatchSampler(seq_lens, **{**kw, "seed": 12})) != first


def test_balanced_is_optimal_grouping():
    """Sum over steps of the slowest rank's predicted cost equals that of sorted consecutive grouping
    (the minimum), computed independently from the bucket batch sizes."""
    seq_lens = random_seq_lens(6000, seed=9)
    world, model = 8, power_model(p=1.4)
    s = BucketBatchSampler(seq_lens, policy="balanced", m_mem=M_MEM, cost_model=model, num_replicas=world, rank=0,
                           drop_last=True)
    plan = s.plan()
    step_costs = model.predict(plan.batch_len[plan.steps], plan.batch_seq_len[plan.steps])
    costs = np.sort(step_costs.ravel())  # the batches actually scheduled
    optimum = costs.reshape(-1, world).max(axis=1).sum()
    assert step_costs.max(axis=1).sum() == pytest.approx(optimum, rel=1e-12)
    rnd = BucketBatchSampler(seq_lens, policy="dual_constraint", m_mem=M_MEM, cost_model=model,
                             num_replicas=world, rank=0).plan()
    rnd_costs = model.predict(rnd.batch_len[rnd.steps], rnd.batch_seq_len[rnd.steps])
    assert rnd_costs.max(axis=1).sum() > 1.2 * step_costs.max(axis=1).sum()


@pytest.mark.parametrize("policy", ["dual_constraint", "balanced"])
@pytest.mark.parametrize("world", [2, 8])
def test_drop_last_false_keeps_partials(world, policy):
    seq_lens = random_seq_lens(2500, seed=world + 20)
    samplers = make_ranks(seq_lens, world, policy=policy, m_mem=M_MEM, cost_model=power_model(),
                          drop_last=False)
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1
    flat = np.concatenate([np.concatenate(b) for b in per_rank])
    assert len(np.unique(flat)) == len(flat)
    stats = samplers[0].stats
    assert stats["dropped_partial_batch"] == 0
    # only oversize samples, and a leftover of fewer than `world` samples, may be left out
    assert stats["dropped_step_remainder"] < world
    assert len(flat) == len(seq_lens) - stats["dropped_oversize"] - stats["dropped_step_remainder"]
    assert all(len(b) >= 1 for r in per_rank for b in r)


@pytest.mark.parametrize("policy, keeps", [("balanced", True), ("token_equal", False), ("dual_constraint", False)])
def test_drop_last_defaults_to_keeping_partial_batches_only_for_balanced(policy, keeps):
    seq_lens = random_seq_lens(1500, seed=31)
    default = BucketBatchSampler(seq_lens, policy=policy, m_mem=M_MEM, cost_model=power_model(), num_replicas=4,
                                 rank=0)
    explicit = BucketBatchSampler(seq_lens, policy=policy, m_mem=M_MEM, cost_model=power_model(), num_replicas=4,
                                  rank=0, drop_last=not keeps)
    assert default.drop_last is (not keeps)
    assert np.array_equal(default.plan().steps, explicit.plan().steps)
    partial = default.stats["dropped_partial_batch"]
    assert (partial == 0) if keeps else partial > 0


@pytest.mark.parametrize("policy", ["token_equal", "dual_constraint", "balanced"])
@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_drop_last_false_schedules_every_sample_once(policy, world, monkeypatch):
    """Every sample exactly once, equal steps on every rank, whenever the epoch's samples can fill
    ceil(batches / world) steps of non-empty batches; otherwise only the last leftover (< world
    samples) is left out and counted. Mixes heavy in B = 1 buckets make small leftovers common."""
    import lightning_adaptiveload.scheduling.epoch_plan as epoch_plan

    resplits = []
    original = epoch_plan._steps_to_resplit
    monkeypatch.setattr(epoch_plan, "_steps_to_resplit", lambda *a: resplits.append(original(*a)) or resplits[-1])
    rng = np.random.default_rng(world)
    weights = np.array([1, 1, 1, 1, 1, 1, 2, 2, 6, 6], dtype=float)  # BUCKETS[:-1]: the last two have B = 1
    for trial in range(25):
        seq_lens = rng.choice(BUCKETS[:-1], size=int(rng.integers(world, 80)), p=weights / weights.sum())
        samplers = make_ranks(seq_lens, world, policy=policy, m_mem=M_MEM, cost_model=power_model(), seed=trial,
                              drop_last=False)
        size = dict(zip(samplers[0].bucket_seq_len.tolist(), samplers[0].bucket_batch.tolist()))
        counts = {s: int((seq_lens == s).sum()) for s in size}
        batches = sum(-(-n // size[s]) for s, n in counts.items())
        fillable = len(seq_lens) >= -(-batches // world) * world
        per_rank = [list(s) for s in samplers]
        assert len({len(r) for r in per_rank}) == 1
        flat = np.concatenate([np.asarray(b) for r in per_rank for b in r])
        assert len(np.unique(flat)) == len(flat)
        for r in per_rank:
            for b in r:
                s = np.unique(seq_lens[b])
                assert len(s) == 1 and 1 <= len(b) <= size[int(s[0])]
        stats = samplers[0].stats
        assert stats["dropped_partial_batch"] == 0 and stats["samples_scheduled"] == len(flat)
        if fillable:
            assert sorted(flat.tolist()) == list(range(len(seq_lens))) and stats["dropped_step_remainder"] == 0
            assert len(per_rank[0]) == -(-batches // world)
        else:
            assert 0 < stats["dropped_step_remainder"] == len(seq_lens) - len(flat) < world
    assert any(r and r > 0 for r in resplits), "no case re-split earlier steps"


def test_oversize_drop_and_resize():
    seq_lens = np.array([100, 200, 200, 5000, 300, 9000, 100])
    bucket_of, bucket_seq = assign_buckets(seq_lens, max_seq_len=1000)
    assert bucket_seq.tolist() == [100, 200, 300]
    assert bucket_of.tolist() == [0, 1, 1, -1, 2, -1, 0]
    bucket_of, _ = assign_buckets(seq_lens, max_seq_len=1000, oversize="resize")
    assert bucket_of.tolist() == [0, 1, 1, 2, 2, 2, 0]
    s = BucketBatchSampler(seq_lens, policy="token_equal", m_mem=1000, max_seq_len=1000, oversize="resize")
    assert s.target_seq_lens.tolist() == [100, 200, 200, 300, 300, 300, 100]
    s = BucketBatchSampler(seq_lens, policy="token_equal", m_mem=1000, drop_last=False)
    assert s.stats["dropped_oversize"] == 2 and s.target_seq_lens[3] == -1


def test_buckets_verification_left_out_are_dropped_as_oversize():
    # verification found the 9000-token bucket fits nowhere: the sampler's buckets and the bucket
    # table's agree (they once disagreed, and plan_epoch failed on arrays of two lengths)
    seq_lens = np.array([100, 200, 200, 5000, 300, 9000, 100])
    s = BucketBatchSampler(seq_lens, policy="token_equal", m_mem=20000, drop_last=False,
                           verification=Verification(max_seq_len=5000))
    assert s.bucket_seq_len.tolist() == s.bucket_table.seq_len.tolist() == [100, 200, 300, 5000]
    assert s.target_seq_lens.tolist() == [100, 200, 200, 5000, 300, -1, 100]
    batches = list(s)
    assert s.stats["dropped_oversize"] == 1 and sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4, 6]


def test_bad_input_errors():
    seq = random_seq_lens(100, 0)
    with pytest.raises(ValueError, match="world size 1000 is larger than the number of batches"):
        BucketBatchSampler(seq, policy="token_equal", m_mem=M_MEM, num_replicas=1000, rank=0).plan()
    with pytest.raises(ValueError, match="seq_lens must be >= 1 token, got 0 at index 2"):
        BucketBatchSampler(np.array([5, 6, 0]), policy="token_equal", m_mem=M_MEM)
    with pytest.raises(ValueError, match="integers"):
        BucketBatchSampler(np.array([5.5, 6.0]), policy="token_equal", m_mem=M_MEM)
    with pytest.raises(ValueError, match="needs m_comp and p"):
        BucketBatchSampler(seq, policy="balanced", m_mem=M_MEM)
    with pytest.raises(ValueError, match="policy must be one of"):
        BucketBatchSampler(seq, policy="fastest", m_mem=M_MEM)
    with pytest.raises(ValueError, match="longer than max_seq_len"):
        BucketBatchSampler(np.array([5000, 6000]), policy="token_equal", m_mem=1000)
    with pytest.raises(ValueError, match="m_mem"):
        BucketBatchSampler(seq, policy="token_equal", m_mem=0)


# --- resume ------------------------------------------------------------------------------------

def consume(samplers, k):
    taken = []
    for s in samplers:
        it = iter(s)
        taken.append([next(it) for _ in range(k)])
    return taken


def flat(batches_per_rank):
    return np.concatenate([np.asarray(b, dtype=np.int64) for r in batches_per_rank for b in r]) \
        if any(batches_per_rank) else np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("policy", ["token_equal", "balanced"])
def test_resume_same_world_size_is_exact(policy):
    seq_lens = random_seq_lens(3000, seed=31)
    kw = dict(policy=policy, m_mem=M_MEM, cost_model=power_model(), seed=3)
    full = [list(s) for s in make_ranks(seq_lens, 4, **kw)]
    run = make_ranks(seq_lens, 4, **kw)
    for s in run:
        s.set_epoch(0)
    consume(run, 17)
    state = run[0].state_dict()
    assert all(s.state_dict() == state for s in run), "state must not depend on the rank"
    resumed = make_ranks(seq_lens, 4, **kw)
    for s in resumed:
        s.load_state_dict(state)
        s.set_epoch(0)  # what Lightning does at the start of the resumed epoch: must not restart it
    assert [len(s) for s in resumed] == [len(full[0]) - 17] * 4
    assert [list(s) for s in resumed] == [f[17:] for f in full]


@pytest.mark.parametrize("policy, drop_last", [("dual_constraint", True), ("balanced", True), ("balanced", False)])
def test_resume_other_world_sizes_no_repeats(policy, drop_last):
    seq_lens = random_seq_lens(5000, seed=41)
    kw = dict(policy=policy, m_mem=M_MEM, cost_model=power_model(), seed=5, drop_last=drop_last)
    first = make_ranks(seq_lens, 4, **kw)
    for s in first:
        s.set_epoch(2)
    taken = consume(first, 40)
    state = first[0].state_dict(steps_consumed=40)

    second = make_ranks(seq_lens, 6, **kw)
    for s in second:
        s.load_state_dict(state)
    assert len({len(s) for s in second}) == 1
    taken2 = consume(second, 25)
    state2 = second[3].state_dict()
    assert state2["segments"] == [[4, 40], [6, 25]]

    third = make_ranks(seq_lens, 3, **kw)
    for s in third:
        s.load_state_dict(state2)
    remaining = len(third[0])
    rest = [list(s) for s in third]
    assert len({len(r) for r in rest}) == 1 and len(rest[0]) == remaining > 0

    everything = np.concatenate([flat(taken), flat(taken2), flat(rest)])
    assert len(np.unique(everything)) == len(everything), "a resumed epoch repeated a sample"
    stats = third[0].stats
    assert stats["samples_consumed_before"] == len(flat(taken)) + len(flat(taken2))
    left_out = stats["dropped_oversize"] + stats["dropped_partial_batch"] + stats["dropped_step_remainder"]
    assert len(everything) + left_out == len(seq_lens)
    assert third[0].epoch == 2


def test_load_state_rejects_other_config():
    seq_lens = random_seq_lens(1000, seed=2)
    a = BucketBatchSampler(seq_lens, policy="token_equal", m_mem=M_MEM)
    b = BucketBatchSampler(seq_lens, policy="token_equal", m_mem=M_MEM // 2)
    with pytest.raises(ValueError, match="different configuration.*m_mem"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({"seed": 0})


def test_dataloader_batch_sampler():
    seq_lens = random_seq_lens(800, seed=4)
    dataset = torch.arange(len(seq_lens)) * 10
    sampler = BucketBatchSampler(seq_lens, policy="balanced", m_mem=M_MEM, cost_model=power_model(),
                                 num_replicas=2, rank=1)
    loader = DataLoader(dataset, batch_sampler=sampler)
    assert len(loader) == len(sampler)
    expected = list(sampler)
    got = [b.tolist() for b in loader]
    assert got == [[10 * i for i in batch] for batch in expected]


def test_reads_world_from_torch_distributed(tmp_path):
    import torch.distributed as dist

    seq_lens = random_seq_lens(500, seed=6)
    assert BucketBatchSampler(seq_lens, policy="token_equal", m_mem=M_MEM).num_replicas == 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        s = BucketBatchSampler(seq_lens, policy="token_equal", m_mem=M_MEM)
        assert (s.num_replicas, s.rank) == (1, 0)
        assert list(s) == list(BucketBatchSampler(seq_lens, policy="token_equal", m_mem=M_MEM, num_replicas=1, rank=0))
    finally:
        dist.destroy_process_group()


def test_reads_rank_from_torch_distributed(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    seq_lens = random_seq_lens(800, seed=8)
    s = BucketBatchSampler(seq_lens, policy="token_equal", m_mem=M_MEM)
    assert (s.num_replicas, s.rank) == (4, 2)
    assert list(s) == list(BucketBatchSampler(seq_lens, policy="token_equal", m_mem=M_MEM, num_replicas=4, rank=2))


def test_lightning_trainer_uses_it_and_sets_epoch(tmp_path):
    """Trainer(use_distributed_sampler=False) keeps the batch sampler and calls set_epoch each epoch."""
    import lightning as L

    seq_lens = random_seq_lens(600, seed=12)
    sampler = BucketBatchSampler(seq_lens, policy="balanced", m_mem=M_MEM, cost_model=power_model(), seed=4)
    seen = []

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            seen.append((self.current_epoch, batch.tolist()))
            return (self.w * batch.float()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    loader = DataLoader(torch.arange(len(seq_lens)), batch_sampler=sampler)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(Recorder(), loader)
    for epoch in (0, 1):
        reference = BucketBatchSampler(seq_lens, policy="balanced", m_mem=M_MEM, cost_model=power_model(), seed=4)
        reference.set_epoch(epoch)
        assert [b for e, b in seen if e == epoch] == list(reference)


def test_integer_arguments_give_clear_errors():
    from lightning_adaptiveload._validation import require_int
    from lightning_adaptiveload.scheduling.simulate import simulate
    from lightning_adaptiveload.scheduling.stream_batcher import StreamingBucketBatcher, make_stream_schedule
    from lightning_adaptiveload.scheduling.shapes import ShapeMix

    assert require_int("n", 4096.0) == 4096 and require_int("n", np.int64(7)) == 7 and require_int("n", 0, 0) == 0
    seq = random_seq_lens(100, 0)
    for bad in (None, "4096", True, 1.5, float("nan"), 0, -3):  # None and str were a TypeError before
        with pytest.raises(ValueError, match=r"m_mem \(tokens per batch\) must be an integer >= 1"):
            BucketBatchSampler(seq, policy="token_equal", m_mem=bad)
    with pytest.raises(ValueError, match="max_seq_len"):
        BucketBatchSampler(seq, policy="token_equal", m_mem=M_MEM, max_seq_len="long")
    mix = ShapeMix(tokens=np.array([100, 400]), counts=np.array([5, 5]), latent_thw=-np.ones((2, 3), np.int64))
    with pytest.raises(ValueError, match="batches_per_epoch must be an integer >= 1, got None"):
        StreamingBucketBatcher(make_stream_schedule(mix, policy="token_equal", m_mem=M_MEM), batches_per_epoch=None,
                               worker=0, num_workers=1)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got None"):
        simulate(mix, None, m_mem=M_MEM, world_size=1, policy="token_equal", steps=None)


def test_cost_model_with_sub_linear_p_gives_token_equal_batches():
    """resolve the compute budget from a cost model whose fitted p < 1 (overhead-bound
    calibration): every bucket keeps its memory-limited batch instead of collapsing to B = 1."""
    model = CostModel("power", {"a": 6.0, "b": 1.5, "p": 0.09}, 0.09, {})
    seq_lens = np.random.default_rng(0).choice([16, 32, 64, 128, 256], size=400)
    sampler = BucketBatchSampler(seq_lens, policy="balanced", m_mem=256, cost_model=model, num_replicas=2, rank=0,
                                 drop_last=True)
    assert sampler.p == 1.0
    for batch in sampler:
        s = int(seq_lens[batch[0]])
        assert len(batch) == token_equal_batch_size(s, 256)
