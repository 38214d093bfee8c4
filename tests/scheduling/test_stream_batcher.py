import logging

import numpy as np
import pytest
import torch
import webdataset as wds

from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.shapes import ShapeMix
from lightning_adaptiveload.scheduling.simulate import simulate, simulate_streaming
from lightning_adaptiveload.scheduling.stream_batcher import (SCHEDULE_BLOCK, StreamingBucketBatcher, class_schedule,
                                                              make_stream_schedule)

M_MEM = 65536
MODEL = CostModel("power", {"a": 8.0, "b": 3e-5, "p": 1.3}, 1.3, {})


def mix_of(tokens, counts):
    tokens = np.asarray(tokens, dtype=np.int64)
    return ShapeMix(tokens=tokens, counts=np.asarray(counts, dtype=np.int64),
                    latent_thw=np.full((len(tokens), 3), -1, dtype=np.int64))


MIX = mix_of([256, 1024, 3600, 7800, 14040, 32760, 46800, 80000], [900, 700, 400, 300, 300, 500, 150, 100])


def stream(mix, seed, with_ids=True):
    rng = np.random.default_rng(seed)
    probs = mix.counts / mix.counts.sum()
    i = 0
    while True:
        for s in rng.choice(mix.tokens, size=512, p=probs):
            yield {"seq_len": int(s), "id": (seed, i)} if with_ids else {"seq_len": int(s)}
            i += 1


def test_schedule_shared_and_proportional():
    schedule = make_stream_schedule(MIX, policy="balanced", m_mem=M_MEM, cost_model=MODEL)
    a = class_schedule(schedule, seed=3, epoch=1, steps=1000)
    assert np.array_equal(a, class_schedule(schedule, seed=3, epoch=1, steps=1000))  # every rank agrees
    assert not np.array_equal(a, class_schedule(schedule, seed=3, epoch=2, steps=1000))
    block = a[:SCHEDULE_BLOCK]
    counts = np.bincount(block, minlength=len(schedule.class_prob))
    assert np.all(np.abs(counts - schedule.class_prob * SCHEDULE_BLOCK) < 1.0)
    # class_prob is the expected batch share: samples / batch size, summed per cost class
    tokens = MIX.tokens[MIX.tokens <= M_MEM]
    b = np.array([schedule.batch_size(int(s)) for s in tokens])
    classes = np.array([schedule.batch_class(int(s)) for s in tokens])
    expected = np.bincount(classes, weights=MIX.counts[MIX.tokens <= M_MEM] / b)
    assert schedule.class_prob == pytest.approx(expected / expected.sum())


@pytest.mark.parametrize("policy", ["token_equal", "balanced"])
def test_stage_invariants(policy):
    schedule = make_stream_schedule(MIX, policy=policy, m_mem=M_MEM, cost_model=MODEL)
    world, steps, bound = 4, 300, 600
    classes = class_schedule(schedule, seed=0, epoch=0, steps=steps)
    per_rank, stages = [], []
    for rank in range(world):
        stage = StreamingBucketBatcher(schedule, batches_per_epoch=steps, max_buffer_samples=bound, worker=0,
                                       num_workers=1)
        per_rank.append(list(stage(stream(MIX, seed=rank))))
        stages.append(stage)
    assert all(len(b) == steps for b in per_rank)
    for batches, stage in zip(per_rank, stages):
        ids = [x["id"] for batch in batches for x in batch]
        assert len(set(ids)) == len(ids), "a sample was emitted twice"
        full = 0
        for batch in batches:
            s = {x["seq_len"] for x in batch}
            assert len(s) == 1 and max(s) <= M_MEM
            s = s.pop()
            assert len(batch) * s <= M_MEM or len(batch) == 1
            full += len(batch) == schedule.batch_size(s)
        assert full == steps - stage.stats["partial_batches"]
        assert stage.stats["buffer_peak_samples"] <= bound
        assert stage.stats["skipped_oversize"] > 0  # the 80000-token shape
    if policy == "balanced":
        off = sum(s.stats["fallback_batches"] + s.stats["partial_batches"] for s in stages)
        mismatched = sum(schedule.batch_class(b[0]["seq_len"]) != classes[t] for batches in per_rank
                         for t, b in enumerate(batches))
        assert mismatched <= off
        assert mismatched < 0.02 * world * steps


def test_workers_split_steps_in_order():
    schedule = make_stream_schedule(MIX, policy="balanced", m_mem=M_MEM, cost_model=MODEL)
    steps, workers = 100, 3
    classes = class_schedule(schedule, seed=5, epoch=2, steps=steps)
    emitted = []
    for w in range(workers):
        stage = StreamingBucketBatcher(schedule, batches_per_epoch=steps, seed=5, worker=w, num_workers=workers)
        stage.set_epoch(2)
        batches = list(stage(stream(MIX, seed=10 + w)))
        assert len(batches) == len(range(w, steps, workers))
        emitted.append((batches, stage.stats))
    # round-robin over workers restores step order; each batch is of its step's scheduled class
    for t in range(steps):
        batches, stats = emitted[t % workers]
        batch = batches[t // workers]
        if stats["fallback_batches"] == 0:
            assert schedule.batch_class(batch[0]["seq_len"]) == classes[t]


def test_bad_samples_skipped_and_counted(caplog):
    schedule = make_stream_schedule(mix_of([100, 200], [1, 1]), policy="token_equal", m_mem=400)
    good = [{"seq_len": 100, "id": i} for i in range(8)]
    bad = [{"no_len": 1}, {"seq_len": "100"}, {"seq_len": 2.5}, {"seq_len": 0}, {"seq_len": -3},
           {"seq_len": torch.tensor([1, 2])}, {"seq_len": 500}]
    samples = good[:4] + bad + good[4:] + [{"seq_len": np.int64(200)}, {"seq_len": torch.tensor(200)}]
    stage = StreamingBucketBatcher(schedule, batches_per_epoch=3, worker=0, num_workers=1)
    with caplog.at_level(logging.WARNING):
        batches = list(stage(iter(samples)))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [x["id"] for x in batches[0] + batches[1]] == list(range(8))
    assert stage.stats["skipped_bad"] == 6 and stage.stats["skipped_oversize"] == 1
    assert stage.stats["partial_batches"] == 0 and "without a valid integer 'seq_len'" in caplog.text


def test_input_running_dry():
    schedule = make_stream_schedule(mix_of([100, 200], [1, 1]), policy="token_equal", m_mem=400)
    samples = [{"seq_len": 100}] * 5 + [{"seq_len": 200}]
    stage = StreamingBucketBatcher(schedule, batches_per_epoch=3, worker=0, num_workers=1)
    out = stage(iter(samples))
    assert len(next(out)) == 4
    # the dry input leaves partial batches, fullest relative to its batch size first (1/2 > 1/4)
    assert [x["seq_len"] for x in next(out)] == [200]
    assert [x["seq_len"] for x in next(out)] == [100]
    assert stage.stats["partial_batches"] == 2
    stage = StreamingBucketBatcher(schedule, batches_per_epoch=3, worker=0, num_workers=1)
    with pytest.raises(RuntimeError, match="input ran out before step 1.*resampled shards"):
        list(stage(iter([{"seq_len": 100}] * 4)))


def test_byte_bound():
    schedule = make_stream_schedule(mix_of([100, 200], [1, 1]), policy="balanced", m_mem=400, m_comp=1e9, p=1.0)
    rng = np.random.default_rng(0)
    src = ({"seq_len": int(s), "x": rng.standard_normal(16)} for s in rng.choice([100, 200], size=10_000))
    stage = StreamingBucketBatcher(schedule, batches_per_epoch=200, max_buffer_bytes=128 * 10,
                                   nbytes=lambda sample: sample["x"].nbytes, worker=0, num_workers=1)
    assert len(list(stage(src))) == 200
    assert 0 < stage.stats["buffer_peak_bytes"] <= 128 * 10 + 128


def test_worker_and_byte_bound_arguments():
    schedule = make_stream_schedule(mix_of([100, 200], [1, 1]), policy="token_equal", m_mem=400)
    with pytest.raises(ValueError, match="worker must be < num_workers"):
        StreamingBucketBatcher(schedule, batches_per_epoch=3, worker=2, num_workers=2)
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        StreamingBucketBatcher(schedule, batches_per_epoch=3, worker=0, num_workers=0)
    with pytest.raises(TypeError, match="worker"):  # no silent default: every worker would emit every step
        StreamingBucketBatcher(schedule, batches_per_epoch=3)
    with pytest.raises(ValueError, match="max_buffer_bytes and nbytes go together"):
        StreamingBucketBatcher(schedule, batches_per_epoch=3, worker=0, num_workers=1, max_buffer_bytes=1024)


def test_webdataset_pipeline_stage():
    schedule = make_stream_schedule(MIX, policy="balanced", m_mem=M_MEM, cost_model=MODEL)
    stage = StreamingBucketBatcher(schedule, batches_per_epoch=20, worker=0, num_workers=1)
    source = list(zip(range(5000), stream(MIX, seed=1)))
    pipeline = wds.DataPipeline(lambda: (s for _, s in source), stage)
    assert len(list(pipeline)) == 20


def test_streaming_close_to_map_balanced():
    world, steps = 8, 400
    kw = dict(m_mem=M_MEM, world_size=world, steps=steps)
    streamed = simulate_streaming(MIX, MODEL, policy="balanced", max_buffer_samples=1024, **kw)
    greedy = simulate_streaming(MIX, MODEL, policy="token_equal", **kw)
    mapped = simulate(MIX, MODEL, policy="balanced", **kw)
    assert streamed["load_cv_mean"] < 0.03 and streamed["load_max_over_mean_mean"] < 1.05
    assert greedy["load_cv_mean"] > 5 * streamed["load_cv_mean"]
    assert streamed["predicted_tokens_per_s"] > 0.95 * mapped["predicted_tokens_per_s"]
