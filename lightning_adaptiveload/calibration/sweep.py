"""The grid sweep: time and peak memory of real training steps at every (B, S) of the calibration
grid, and of the points the fit needs again with fewer blocks checkpointed."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import ContextManager

from lightning_adaptiveload.calibration.grid import predicted_depth_peak_bytes, predicted_peak_bytes, required_points
from lightning_adaptiveload.calibration.protocols import Runner

INFEASIBLE_STATUSES = ("oom", "predicted_oom", "skipped_oom")


def dominated(points: list[dict], b: int, s: int, checkpointed: int | None) -> bool:
    """Whether a point no larger in B and S at the same depth did not fit."""
    return any(p["status"] in INFEASIBLE_STATUSES and p["batch_size"] <= b and p["seq_len"] <= s
               and p.get("checkpointed") == checkpointed for p in points)


def point_line(point: dict) -> str:
    return f"{point['time_ms']:.2f} ms" if point["status"] == "ok" else point["status"]


def sweep(runner: Runner, batch_fn: Callable[[int, int], dict], grid: list[tuple[int, int]], *,
          batch_sizes: tuple[int, ...], max_tokens: int | None, warmup: int, repeats: int, time_budget_s: float,
          memory_limit: float | None, checkpointed: tuple[int, int] | None,
          checkpointing: Callable[[int], ContextManager] | None, progress: Callable[[str], None]) -> list[dict]:
    """The grid's points in order, each at k = checkpointed[0] (every block checkpointed; None without a
    switch); with checkpointed, each required point that fits is measured again right after at
    k = checkpointed[1]
    (the same (B, S) for the time ratio, and right after for the same machine state).

    batch_fn(seq_len, batch_size) builds a batch; memory_limit: bytes a point may be predicted to peak
    at before it is recorded "predicted_oom" without running (an out-of-memory inside a sharded
    collective on one rank cannot be agreed on without risking a hang); the optional points stop
    starting once `time_budget_s`, counted after the last required point, is spent (agreed across ranks).
    """
    required = set(required_points(sorted({s for _, s in grid}), list(batch_sizes), max_tokens))
    every_block, deeper_k = checkpointed if checkpointed is not None else (None, None)
    points: list[dict] = []
    budget_start = None  # the optional points' clock starts after the last required point

    def measure(b: int, s: int, k: int | None, settle: bool) -> dict:
        with checkpointing(k) if checkpointing is not None else contextlib.nullcontext():
            return runner.measure(lambda: batch_fn(s, b), warmup, repeats, settle=settle)

    for i, (b, s) in enumerate(grid):
        point = {"batch_size": b, "seq_len": s, "checkpointed": every_block}
        if (b, s) not in required and budget_start is None:
            budget_start = time.perf_counter()
        out_of_time = budget_start is not None and time.perf_counter() - budget_start > time_budget_s
        if runner.agree(out_of_time):
            point["status"] = "skipped_budget"
        elif dominated(points, b, s, every_block):
            point["status"] = "skipped_oom"  # a smaller (B, S) already did not fit
        elif memory_limit is not None and predicted_peak_bytes(points, b, s, every_block) > memory_limit:
            point["status"] = "predicted_oom"
        else:
            point.update(_point(measure(b, s, every_block, settle=not any(p["status"] == "ok" for p in points))))
        points.append(point)
        progress(f"calibration {i + 1}/{len(grid)}: B={b} S={s} " + point_line(point))
        if deeper_k is None or (b, s) not in required or point["status"] != "ok":
            continue
        deeper = {"batch_size": b, "seq_len": s, "checkpointed": deeper_k}
        if dominated(points, b, s, deeper_k):
            deeper["status"] = "skipped_oom"
        elif memory_limit is not None and max(predicted_peak_bytes(points, b, s, deeper_k),
                                              predicted_depth_peak_bytes(points, b, s, deeper_k, every_block)) > memory_limit:
            deeper["status"] = "predicted_oom"
        else:
            deeper.update(_point(measure(b, s, deeper_k, settle=False)))
        points.append(deeper)
        progress(f"calibration {i + 1}/{len(grid)}: B={b} S={s} k={deeper_k} " + point_line(deeper))
    return points


def _point(measured: dict) -> dict:
    """A grid point's fields of a runner measurement: status, and for a step that ran its median
    time_ms and peak_bytes (the first step's time is not kept: warm-up steps absorb it)."""
    return {k: v for k, v in measured.items() if k in ("status", "time_ms", "peak_bytes")}
