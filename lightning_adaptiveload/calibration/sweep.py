"""The grid sweep: time and held memory of real training steps at every (B, S) of the calibration
grid, and of the points the fit needs again with fewer blocks checkpointed: at half the blocks and
at the fewest predicted to fit (k = 0 where it fits), the depths the plan picks most."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import ContextManager

from lightning_adaptiveload.calibration.config import LONG_STEP_MS, cold_step_stands
from lightning_adaptiveload.calibration.grid import (forecast_held_bytes, lowest_fitting_depth, predicted_peak_bytes,
                                                     required_points)
from lightning_adaptiveload.calibration.protocols import Runner

INFEASIBLE_STATUSES = ("oom", "predicted_oom", "skipped_oom")


def dominated(points: list[dict], b: int, s: int, checkpointed: int | None) -> bool:
    """Whether a point no larger in B and S, at the same depth or one checkpointing more blocks (so
    holding no more memory), did not fit."""
    def no_deeper(k: int | None) -> bool:
        return k == checkpointed if k is None or checkpointed is None else k >= checkpointed

    return any(p["status"] in INFEASIBLE_STATUSES and p["batch_size"] <= b and p["seq_len"] <= s
               and no_deeper(p.get("checkpointed")) for p in points)


def point_line(point: dict) -> str:
    """A point as its progress line shows it: the warm step time and the first (cold) step's, which
    holds a compiled model's compilation of the shape (the cold time is outside calibration's time
    budget, so a run's log is the only place it shows before calibration ends), or its status."""
    if point["status"] != "ok":
        return point["status"]
    cold = "" if point.get("cold_ms") is None else f" ({point['cold_ms']:.1f} cold)"
    return f"{point['time_ms']:.2f} ms warm{cold}"


def measure_point(runner: Runner, batch_fn: Callable[[], dict], warmup: int, repeats: int, settle: bool,
                  built: bool | None = False) -> dict:
    """One grid point's fields: status, and for steps that ran time_ms (median of the timed steps),
    cold_ms (the first step: with its kernel builds, or its compilation in a compiled model),
    peak_bytes and reserved_bytes (the allocator's allocated and reserved peaks over every step, or
    on CPU both the bytes saved for backward), repeats (the timed steps).

    With warmup >= 1 the first step runs alone, from an empty allocator cache (empty_cache: the
    reserved peak is then this point's own, not what a larger earlier point left cached), and when it
    took LONG_STEP_MS or more only one more step is timed, without further warm-up
    (config.LONG_STEP_MS: a step that long varies by a small fraction of itself, and each extra step
    would cost seconds); otherwise the remaining warmup - 1 untimed steps and `repeats` timed ones
    follow. With warmup 0 the first step is timed with the others. settle: untimed steps until two
    agree first (runner.settle), after the first step. built: the step's kernels are built (an eager
    model's (B, S) measured just before at another depth): a long first step is then the point's
    time, and no other step runs (its first step added 12-22 ms to 2.1-2.4 s on an H200, from an
    empty allocator cache; benchmarks/results/gpu_session8/eager_call1/calibration.json); so is a very
    long first step of an eager model whatever was built (config.cold_step_stands); None: a compiled
    model, whose first step of a shape may hold its compilation and never stands."""
    if warmup == 0:
        raw = runner.measure(batch_fn, 0, repeats, settle=settle, empty_cache=True)
        return {"status": raw["status"]} if raw["status"] != "ok" else {
            "status": "ok", "time_ms": raw["time_ms"], "cold_ms": raw["first_ms"], "peak_bytes": raw["peak_bytes"],
            "reserved_bytes": raw["reserved_bytes"], "repeats": repeats}
    cold = runner.measure(batch_fn, 0, 1, empty_cache=True)
    if cold["status"] != "ok":
        return {"status": cold["status"]}
    long_step = cold["first_ms"] >= LONG_STEP_MS  # max over ranks: every rank takes the same branch
    if cold_step_stands(cold["first_ms"], built):
        return {"status": "ok", "time_ms": cold["first_ms"], "cold_ms": cold["first_ms"], "peak_bytes": cold["peak_bytes"],
                "reserved_bytes": cold["reserved_bytes"], "repeats": 1}
    timed = 1 if long_step else repeats
    # the allocator holds this point's own blocks now: its reserved peak stays the point's own
    warm = runner.measure(batch_fn, 0 if long_step else warmup - 1, timed, settle=settle)
    if warm["status"] != "ok":
        return {"status": warm["status"]}
    return {"status": "ok", "time_ms": warm["time_ms"], "cold_ms": cold["first_ms"],
            "peak_bytes": max(cold["peak_bytes"], warm["peak_bytes"]),
            "reserved_bytes": max(cold["reserved_bytes"], warm["reserved_bytes"]), "repeats": timed}


def revisit(runner: Runner, batch_fn: Callable[[int, int], dict], points: list[dict], passes: int,
            checkpointing: Callable[[int], ContextManager] | None) -> None:
    """`passes` more passes over the measured points, one timed step each per pass, in grid order;
    each point keeps its fastest step (time_ms), counts it in repeats, and its peaks the largest.

    How CPU calibration spends its repeats: another process on the cores only ever adds time to a
    step, and on a busy 2-core machine it does so in episodes longer than a point's consecutive
    repeats (runs of grid points all about 2x slower; a median of 3 in a row moved with them: with a busy loop per core,
    wan21_demo.yaml fitted to 23-27% held out and fell back, benchmarks/results/
    cpu_robustness_median.json). Spread over the sweep and taken at their fastest, a point's steps
    are its own cost, whatever episode the point first fell in."""
    for _ in range(passes):
        for p in points:
            if p["status"] != "ok":
                continue
            with checkpointing(p["checkpointed"]) if checkpointing is not None else contextlib.nullcontext():
                raw = runner.measure(lambda: batch_fn(p["seq_len"], p["batch_size"]), 0, 1)
            if raw["status"] != "ok":  # left as measured: one more step is no reason to drop a point
                continue
            p["time_ms"] = min(p["time_ms"], raw["time_ms"])
            p["repeats"] += 1
            p["peak_bytes"] = max(p["peak_bytes"], raw["peak_bytes"])
            p["reserved_bytes"] = max(p["reserved_bytes"], raw["reserved_bytes"])


def sweep(runner: Runner, batch_fn: Callable[[int, int], dict], grid: list[tuple[int, int]], *,
          batch_sizes: tuple[int, ...], max_tokens: int | None, warmup: int, repeats: int, time_budget_s: float,
          memory_limit: float | None, checkpointed: tuple[int, int] | None,
          checkpointing: Callable[[int], ContextManager] | None, progress: Callable[[str], None],
          eager: bool = False, clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """The grid's points in order, each at k = checkpointed[0] (L, every block checkpointed; None
    without a switch); with checkpointed, each required point that fits is measured again right after
    (the same (B, S) for the time ratio, and right after for the same machine state) at k =
    checkpointed[1] (L/2) and, when that fits, at the smallest k below it predicted to fit
    (grid.lowest_fitting_depth, k = 0 where it fits).

    batch_fn(seq_len, batch_size) builds a batch; memory_limit: bytes a point may be predicted to
    hold before it is recorded "predicted_oom" without running (an out-of-memory inside a sharded
    collective on one rank cannot be agreed on without risking a hang). The optional points stop
    starting once `time_budget_s` of their warm measurement is spent (agreed across ranks): the
    clock counts from the first optional point, without any point's first (cold) step, so a
    compiled model's compilation of each new shape never costs grid points. Every point records
    its cold_ms (measure_point). On CPU (runner.device) each point is measured with one timed step
    and revisited `repeats` - 1 times after the grid, its fastest step counting (`revisit`); the
    revisits are outside the budget (one step per point and pass). eager: no region of the model is
    compiled, so a deeper point's long first step is its time (measure_point's `built`).
    """
    required = set(required_points(sorted({s for _, s in grid}), list(batch_sizes), max_tokens))
    every_block, half = checkpointed if checkpointed is not None else (None, None)
    points: list[dict] = []
    warm_s = 0.0  # the optional points' measurement seconds, less their cold steps

    # on CPU a point's repeats are spread over the sweep (revisit): one timed step now, the rest later
    spread = runner.device.type == "cpu" and repeats > 1

    def measure(b: int, s: int, k: int | None, settle: bool, built: bool = False) -> dict:
        with checkpointing(k) if checkpointing is not None else contextlib.nullcontext():
            return measure_point(runner, lambda: batch_fn(s, b), warmup, 1 if spread else repeats, settle,
                                 built if eager else None)

    def deeper(i: int, b: int, s: int, k: int) -> dict:
        point = {"batch_size": b, "seq_len": s, "checkpointed": k}
        if dominated(points, b, s, k):
            point["status"] = "skipped_oom"
        elif memory_limit is not None and forecast_held_bytes(points, b, s, k, every_block) > memory_limit:
            point["status"] = "predicted_oom"
        else:
            point.update(measure(b, s, k, settle=False, built=eager))
        points.append(point)
        progress(f"calibration {i + 1}/{len(grid)}: B={b} S={s} k={k} " + point_line(point))
        return point

    for i, (b, s) in enumerate(grid):
        point = {"batch_size": b, "seq_len": s, "checkpointed": every_block}
        optional = (b, s) not in required
        if runner.agree(optional and warm_s > time_budget_s):
            point["status"] = "skipped_budget"
        elif dominated(points, b, s, every_block):
            point["status"] = "skipped_oom"  # a smaller (B, S) already did not fit
        elif memory_limit is not None and predicted_peak_bytes(points, b, s, every_block) > memory_limit:
            point["status"] = "predicted_oom"
        else:
            begin = clock()
            point.update(measure(b, s, every_block, settle=not any(p["status"] == "ok" for p in points)))
            if optional:
                warm_s += clock() - begin - point.get("cold_ms", 0.0) / 1e3
        points.append(point)
        progress(f"calibration {i + 1}/{len(grid)}: B={b} S={s} " + point_line(point))
        if half is None or optional or point["status"] != "ok":
            continue
        if deeper(i, b, s, half)["status"] != "ok":
            continue
        low = lowest_fitting_depth(points, b, s, every_block, half, memory_limit)
        if low is not None:
            deeper(i, b, s, low)
    if spread:
        # a long step's one timed step stands (the long-step rule)
        short = [p for p in points if not (warmup and p.get("cold_ms", 0.0) >= LONG_STEP_MS)]
        revisit(runner, batch_fn, short, repeats - 1, checkpointing)
    return points
