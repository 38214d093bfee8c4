"""Shape warm-up: one forward + backward of every (batch size, latent shape) training can schedule,
before training starts.

A step that meets a (B, T, H, W) for the first time in the process pays for building its kernels:
cuDNN attention builds an execution graph per new shape (90-210 ms per new shape on an H200 with 8
Wan-1.3B blocks, docs/cost_model.md), a compiled model compiles it (seconds). Under balanced
scheduling no rank has idle time to hide that, and a rank meeting a new shape stalls every other
rank. Warming every scheduled shape once, on every rank in the same order, moves that cost before
the first step. The cuDNN graph cache is an unbounded per-thread map that is never evicted, so a
warmed shape stays warm for the life of the process.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import ContextManager

from lightning_adaptiveload.calibration.runner import StepRunner
from lightning_adaptiveload.scheduling.buckets import ScheduledShape


def warm_shapes(runner: StepRunner, batch_fn: Callable[[tuple[int, int, int], int], dict],
                shapes: Iterable[tuple], budget_s: float,
                predict: Callable[[ScheduledShape], dict] | None = None,
                progress: Callable[[str], None] | None = None,
                at_depth: Callable[[int | None], ContextManager] | None = None) -> list[dict]:
    """Run one forward + backward of `batch_fn(latent_shape, batch_size)` per entry of `shapes`
    (ScheduledShape, or a plain tuple of its first three or four fields), most frequent first, until
    `budget_s` seconds are spent (decided on every rank together). `at_depth(k)` is entered around
    each step with the shape's checkpointing depth (None: no memory plan), so the step runs as
    training will run it.

    Returns one entry per shape: batch_size, latent_shape, batches_per_epoch, checkpointed, status
    ("warmed", "oom": the scheduled batch does not fit in memory, "skipped_budget": left cold), and
    for warmed ones cold_ms (the first step's time, the maximum over ranks), peak_bytes and the
    fields `predict(shape)` returns (e.g. predicted_ms, the cost model's warm time, so cold_ms -
    predicted_ms estimates what the first occurrence would have cost training).
    """
    order = sorted((ScheduledShape(*entry) for entry in shapes), key=lambda x: (-x[2], x[0], tuple(x[1])))
    start = time.perf_counter()
    results = []
    for i, shape in enumerate(order):
        batch_size, thw, count, depth = int(shape.batch_size), tuple(int(v) for v in shape.latent_shape), \
            int(shape.batches_per_epoch), shape.checkpointed
        entry = {"batch_size": batch_size, "latent_shape": list(thw), "batches_per_epoch": count,
                 "checkpointed": None if depth is None else int(depth)}
        if runner.agree(time.perf_counter() - start > budget_s):
            entry["status"] = "skipped_budget"
        else:
            with at_depth(depth) if at_depth is not None else contextlib.nullcontext():
                measured = runner.measure(lambda: batch_fn(thw, batch_size), warmup=0, repeats=1)
            if measured["status"] == "oom":
                entry["status"] = "oom"
            else:
                entry.update(status="warmed", cold_ms=measured["time_ms"], peak_bytes=measured["peak_bytes"])
                if predict is not None:
                    entry.update(predict(ScheduledShape(batch_size, thw, count, depth)))
        results.append(entry)
        if progress is not None:
            progress(f"warm-up {i + 1}/{len(order)}: B={batch_size} latent {thw}"
                     + ("" if depth is None else f" k={depth}") + " "
                     + (f"{entry['cold_ms']:.1f} ms" if entry["status"] == "warmed" else entry["status"]))
    return results
