"""Data-parallel step simulation: run the sampler's real plan on a ShapeMix and price every rank's
batch with the cost model. A step lasts as long as its slowest rank (the others wait at the
gradient all-reduce), so imbalance shows up as bubble time and lost throughput."""
from __future__ import annotations

import numpy as np
from tqdm import tqdm

from lightning_adaptiveload._validation import require_int
from lightning_adaptiveload.scheduling import metrics
from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
from lightning_adaptiveload.scheduling.shapes import ShapeMix
from lightning_adaptiveload.scheduling.stream_batcher import StreamingBucketBatcher, make_stream_schedule


def step_metrics(times_ms: np.ndarray, tokens: np.ndarray, samples: np.ndarray) -> dict:
    """Load-balance metrics of per-rank step times. All inputs (steps, world_size): predicted time
    (ms), tokens and samples each rank ran at each step. Definitions in scheduling/metrics.py:

    load_cv_mean: mean over steps of the CV across ranks; load_max_over_mean_mean: mean over steps
    of max/mean; bubble_frac: the time-weighted bubble fraction; predicted_tokens_per_s,
    predicted_samples_per_s: all ranks' work over the sum of step times; step_time_mean_ms: the
    mean step time (the slowest rank's); step_time_cv_temporal: CV over steps of the step time.
    """
    times_ms = np.asarray(times_ms, dtype=np.float64)
    if times_ms.ndim != 2 or times_ms.size == 0:
        raise ValueError(f"times_ms must be a non-empty (steps, world_size) array, got shape {times_ms.shape}")
    return {
        "steps": int(times_ms.shape[0]),
        "world_size": int(times_ms.shape[1]),
        "load_cv_mean": metrics.mean_over_steps(metrics.cv_across_ranks(times_ms)),
        "load_max_over_mean_mean": metrics.mean_over_steps(metrics.max_over_mean(times_ms)),
        "bubble_frac": metrics.bubble_fraction(times_ms),
        "predicted_tokens_per_s": metrics.predicted_throughput(tokens, times_ms),
        "predicted_samples_per_s": metrics.predicted_throughput(samples, times_ms),
        "step_time_mean_ms": metrics.mean_over_steps(metrics.step_time(times_ms)),
        "step_time_cv_temporal": metrics.step_time_cv_temporal(times_ms),
    }


def simulate(mix: ShapeMix, cost_model, *, m_mem: int, world_size: int, policy: str, steps: int, seed: int = 0,
             m_comp: float | None = None, max_seq_len: int | None = None, num_samples: int | None = None,
             memory_plan: MemoryPlan | None = None, drop_last: bool | None = None, progress: bool = False) -> dict:
    """Simulate `steps` data-parallel steps of `policy` (epochs 0, 1, ... of the sampler's plan).

    The dataset is the mix's histogram expanded to one entry per sample, or, with num_samples,
    that many samples drawn from the mix's shape distribution (seeded). Returns step_metrics plus
    policy, m_mem, m_comp, p, the bucket table (`BucketTable.to_dict()`) and the first epoch's
    sample accounting (samples_per_epoch, steps_per_epoch, dropped_*, samples_scheduled_frac).
    memory_plan: plan batch sizes and checkpointing depths with measured memory (the sampler's
    memory_plan; each batch priced at its bucket's depth). drop_last: the sampler's (None: its
    policy's default). progress: a tqdm bar of steps on a terminal.
    """
    steps = require_int("steps", steps)
    if num_samples is None:
        seq_lens = mix.per_sample_tokens()
    else:
        rng = np.random.default_rng([int(seed), 1])
        seq_lens = rng.choice(mix.tokens, size=require_int("num_samples", num_samples), p=mix.counts / mix.counts.sum())
    sampler = BucketBatchSampler(seq_lens, policy=policy, m_mem=m_mem, m_comp=m_comp, cost_model=cost_model,
                                 num_replicas=world_size, rank=0, seed=seed, max_seq_len=max_seq_len,
                                 memory_plan=memory_plan, drop_last=drop_last)
    price = sampler.bucket_table.step_cost_model(cost_model)
    times, tokens, samples = [], [], []
    epoch, have = 0, 0
    bar = tqdm(total=steps, desc=f"simulate {policy}", unit="step", disable=None if progress else True)
    while have < steps:
        sampler.set_epoch(epoch)
        plan = sampler.plan()
        take = plan.steps[: steps - have]
        b, s = plan.batch_len[take], plan.batch_seq_len[take]
        times.append(np.asarray(price.predict(b, s), dtype=np.float64).reshape(take.shape))
        tokens.append(b * s)
        samples.append(b)
        have += len(take)
        bar.update(len(take))
        epoch += 1
        if epoch == 1:
            first = sampler.stats
    bar.close()
    balance = step_metrics(np.concatenate(times), np.concatenate(tokens), np.concatenate(samples))
    return {
        "policy": policy,
        **balance,
        "m_mem": int(m_mem),
        "m_comp": sampler.m_comp,
        "p": sampler.p,
        "max_seq_len": sampler.max_seq_len,
        "epochs_used": epoch,
        "samples_per_epoch": int(len(seq_lens)),
        "steps_per_epoch": first["steps"],
        "dropped_oversize": first["dropped_oversize"],
        "dropped_partial_batch": first["dropped_partial_batch"],
        "dropped_step_remainder": first["dropped_step_remainder"],
        "samples_scheduled_frac": first["samples_scheduled"] / len(seq_lens),
        "buckets": sampler.bucket_table.to_dict(),
    }


def simulate_streaming(mix: ShapeMix, cost_model, *, m_mem: int, world_size: int, policy: str, steps: int,
                       seed: int = 0, m_comp: float | None = None, max_seq_len: int | None = None,
                       max_buffer_samples: int = 4096, class_tolerance: float = 0.1) -> dict:
    """Simulate the streaming stage: each rank reads its own endless stream of samples drawn from the
    mix (as from its own shards of a shuffled corpus) through a StreamingBucketBatcher with no
    communication. Returns step_metrics plus the stage's counts summed over ranks
    (fallback_batches, partial_batches, skipped_oversize) and the largest buffer any rank held."""
    schedule = make_stream_schedule(mix, policy=policy, m_mem=m_mem, m_comp=m_comp, cost_model=cost_model,
                                max_seq_len=max_seq_len, class_tolerance=class_tolerance)
    probs = mix.counts / mix.counts.sum()
    batch_len = np.zeros((steps, world_size), dtype=np.int64)
    batch_seq_len = np.zeros((steps, world_size), dtype=np.int64)
    totals = {"fallback_batches": 0, "partial_batches": 0, "skipped_oversize": 0, "buffer_peak_samples": 0}
    for rank in range(world_size):
        rng = np.random.default_rng([int(seed), 2, rank])

        def stream():
            while True:
                yield from ({"seq_len": int(s)} for s in rng.choice(mix.tokens, size=4096, p=probs))

        stage = StreamingBucketBatcher(schedule, batches_per_epoch=steps, seed=seed, max_buffer_samples=max_buffer_samples,
                                       worker=0, num_workers=1)
        for step, batch in enumerate(stage(stream())):
            batch_len[step, rank] = len(batch)
            batch_seq_len[step, rank] = batch[0]["seq_len"]  # a batch holds one bucket
        for key in totals:
            combine = max if key == "buffer_peak_samples" else int.__add__
            totals[key] = combine(totals[key], stage.stats[key])
    times = np.asarray(cost_model.predict(batch_len, batch_seq_len), dtype=np.float64)
    balance = step_metrics(times, batch_len * batch_seq_len, batch_len)
    return {"policy": f"streaming_{policy}", **balance, "m_mem": int(m_mem), "m_comp": schedule.m_comp, "p": schedule.p,
            "max_buffer_samples": int(max_buffer_samples), "class_tolerance": float(class_tolerance),
            "cost_classes": int(len(schedule.class_prob)), **totals}
