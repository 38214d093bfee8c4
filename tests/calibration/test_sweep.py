"""The grid sweep (calibration/sweep.py) against a fake runner whose memory and times follow known
formulas: the held bytes (max of allocated and reserved) recorded and fitted, the low depth measured at
the smallest k that fits (brute force over the formula), the long-step rule's steps, the time budget
that counts warm measurement only, and the CPU thread count restored."""
import contextlib
import math

import numpy as np
import pytest
import torch

from lightning_adaptiveload.calibration.config import COLD_STANDS_MS, LONG_STEP_MS
from lightning_adaptiveload.calibration.fit import fit_memory_models
from lightning_adaptiveload.calibration.grid import calibration_grid, required_points
from lightning_adaptiveload.calibration.loop import CPU_MEASUREMENT_THREADS, measurement_threads
from lightning_adaptiveload.calibration.sweep import measure_point, sweep
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.memory_model import MemoryModel

L = 8  # blocks


class FakeRunner:
    """Runner protocol over formulas: alloc = m0 + c*B*S + a*n*B*S bytes with n = max(L - k, 1) live
    blocks (the memory model's, docs/memory.md), reserved = alloc *
    frag + gap (a gap that is not a pure scale), step ms = t0 + u*B*S*(1 + (L - k) / L * 0.1) plus
    noise, the first step of a (B, S, k) `cold_ms` longer. The clock advances by every step."""

    def __init__(self, rng, cold_extra_ms=5.0, m0=1e6, c=300.0, a=40.0, frag=1.12, gap=3e5, t0=2.0, u=0.01,
                 device="cuda"):
        self.rng, self.cold_extra_ms = rng, cold_extra_ms
        self.m0, self.c, self.a, self.frag, self.gap, self.t0, self.u = m0, c, a, frag, gap, t0, u
        self.device, self.is_global_zero = torch.device(device), True
        self.k = L
        self.now = 0.0
        self.calls = []  # (B, S, k, warmup, repeats)
        self.noise = 0.01  # relative, one-sided: interference only adds time
        self.medians = []  # time_ms of every measurement
        self.seen = set()

    def alloc(self, b, s, k):
        return self.m0 + self.c * b * s + self.a * max(L - k, 1) * b * s

    def reserved(self, b, s, k):
        return self.alloc(b, s, k) * self.frag + self.gap

    def step_ms(self, b, s, k):
        return self.t0 + self.u * b * s * (1 + (L - k) / L * 0.1)

    @contextlib.contextmanager
    def checkpointing(self, k):
        old, self.k = self.k, k
        yield
        self.k = old

    def measure(self, batch_fn, warmup, repeats, settle=False, empty_cache=False):
        batch = batch_fn()
        b, s, k = batch["b"], batch["s"], self.k
        self.calls.append((b, s, k, warmup, repeats))
        times = []
        for _ in range((2 if settle else 0) + warmup + repeats):
            ms = self.step_ms(b, s, k) * (1 + self.noise * self.rng.random())
            if (b, s, k) not in self.seen:
                ms += self.cold_extra_ms(b, s) if callable(self.cold_extra_ms) else self.cold_extra_ms
                self.seen.add((b, s, k))
            times.append(ms)
            self.now += ms / 1e3
        timed = times[(2 if settle else 0) + warmup:]
        self.medians.append(float(np.median(timed)))
        return {"status": "ok", "time_ms": self.medians[-1], "first_ms": times[0],
                "peak_bytes": int(self.alloc(b, s, k)), "reserved_bytes": int(self.reserved(b, s, k))}

    def agree(self, flag):
        return bool(flag)

    def max_over_ranks(self, *values):
        return list(values)

    def broadcast(self, obj):
        return obj


def _run(runner, grid, batch_sizes, memory_limit, warmup=1, repeats=2, time_budget_s=1e9):
    return sweep(runner, lambda s, b: {"b": b, "s": s}, grid, batch_sizes=batch_sizes, max_tokens=None, warmup=warmup,
                 repeats=repeats, time_budget_s=time_budget_s, memory_limit=memory_limit, checkpointed=(L, L // 2),
                 checkpointing=runner.checkpointing, progress=lambda line: None, clock=lambda: runner.now)


def test_points_hold_max_of_allocated_and_reserved_and_the_low_depth_is_the_smallest_that_fits():
    runner = FakeRunner(np.random.default_rng(0))
    seq_lens, sizes = [64, 256, 1024], [1, 2, 4, 8]
    grid = calibration_grid(seq_lens, sizes, None)
    held = lambda b, s, k: max(runner.alloc(b, s, k), runner.reserved(b, s, k))  # noqa: E731
    # (4, 256) fits down to k = 2 only, half a block's growth from the limit; the B = 1 points fit at k = 0
    limit = (held(4, 256, 2) + held(4, 256, 1)) / 2
    points = _run(runner, grid, sizes, limit)
    for p in points:
        if p["status"] == "ok":
            b, s, k = p["batch_size"], p["seq_len"], p["checkpointed"]
            assert p["peak_bytes"] == int(runner.alloc(b, s, k)) and p["reserved_bytes"] == int(runner.reserved(b, s, k))
    # every required point that fits at L and L/2 is measured once more at the smallest k below L/2 that
    # fits the limit, by brute force over the formula
    required = required_points(seq_lens, sizes, None)
    low = {(p["batch_size"], p["seq_len"]): p["checkpointed"] for p in points
           if p["checkpointed"] is not None and p["checkpointed"] < L // 2}
    expected = {}
    for b, s in required:
        if held(b, s, L // 2) <= limit:
            fitting = [k for k in range(L // 2) if held(b, s, k) <= limit]
            if fitting:
                expected[(b, s)] = min(fitting)
    assert low == expected and 0 in low.values() and any(k > 0 for k in low.values())
    assert all(held(b, s, k) <= limit for (b, s), k in low.items())
    # the memory model is fitted on the held bytes: the same fit as MemoryModel.fit on max(alloc, reserved)
    ok = [p for p in points if p["status"] == "ok"]
    b, s, k, t = (np.array([p[key] for p in ok], dtype=np.float64)
                  for key in ("batch_size", "seq_len", "checkpointed", "time_ms"))
    reference_held = np.maximum([p["peak_bytes"] for p in ok], [p["reserved_bytes"] for p in ok]).astype(np.float64)
    assert np.all(reference_held > [p["peak_bytes"] for p in ok])  # the test can tell the two apart
    at_l = [p for p in ok if p["checkpointed"] == L]
    base = CostModel.fit(*(np.array([p[key] for p in at_l], dtype=np.float64)
                           for key in ("batch_size", "seq_len", "time_ms")))
    memory, _, why = fit_memory_models(points, L, base, extra_bytes=0, max_heldout_error=math.inf)
    assert why is None
    ref = MemoryModel.fit(b, s, k, reference_held, L)
    assert memory.form == ref.form and memory.params == pytest.approx(ref.params, rel=1e-9)


def test_long_steps_get_one_warm_step_and_short_ones_the_configured_steps():
    long_tokens = 2048
    runner = FakeRunner(np.random.default_rng(1),
                        cold_extra_ms=lambda b, s: LONG_STEP_MS if b * s >= long_tokens else 1.0)
    grid = [(1, 256), (1, 1024), (1, 4096), (2, 256), (4, 256), (2, 1024), (4, 1024), (8, 1024)]
    points = _run(runner, grid, (1, 2, 4, 8), memory_limit=None, warmup=3, repeats=5)
    by_point: dict[tuple, list] = {}
    for b, s, k, warmup, repeats in runner.calls:
        by_point.setdefault((b, s, k), []).append((warmup, repeats))
    for p in points:
        key = (p["batch_size"], p["seq_len"], p["checkpointed"])
        long_step = p["batch_size"] * p["seq_len"] >= long_tokens
        # the cold step alone, then one timed step for a long shape, else warmup - 1 untimed and the repeats
        assert by_point[key] == ([(0, 1), (0, 1)] if long_step else [(0, 1), (2, 5)]), key
        assert p["repeats"] == (1 if long_step else 5)
        assert p["cold_ms"] >= runner.step_ms(*key) + (LONG_STEP_MS if long_step else 1.0)
        assert p["time_ms"] < runner.step_ms(*key) * 1.02  # the warm steps carry no cold cost
    assert any(p["batch_size"] * p["seq_len"] >= long_tokens for p in points)


@pytest.mark.parametrize("eager", [True, False])
def test_in_an_eager_model_a_deeper_long_point_is_timed_on_its_one_step(eager):
    """A deeper point (k = L/2 and the low depth) follows its (B, S) at k = L: in an eager model its
    kernels are built, so a long first step is the point's time and no second step runs; at k = L, for
    short steps, and in a compiled model (eager False: a new depth may compile) the warm step runs."""
    runner = FakeRunner(np.random.default_rng(5), u=1.0)  # S = 4096 steps take over LONG_STEP_MS, S = 256 do not
    grid = [(1, 256), (1, 4096)]
    points = sweep(runner, lambda s, b: {"b": b, "s": s}, grid, batch_sizes=(1,), max_tokens=None, warmup=1,
                   repeats=2, time_budget_s=1e9, memory_limit=None, checkpointed=(L, L // 2),
                   checkpointing=runner.checkpointing, progress=lambda line: None, eager=eager,
                   clock=lambda: runner.now)
    calls: dict[tuple, int] = {}
    for b, s, k, *_ in runner.calls:
        calls[(b, s, k)] = calls.get((b, s, k), 0) + 1
    deeper_long = [p for p in points if p["seq_len"] == 4096 and p["checkpointed"] < L]
    assert len(deeper_long) == 2 and all(p["status"] == "ok" for p in points)
    for p in points:
        key = (p["batch_size"], p["seq_len"], p["checkpointed"])
        one_step = eager and p in deeper_long
        assert calls[key] == (1 if one_step else 2), key
        assert (p["time_ms"] == p["cold_ms"]) == one_step
        assert p["time_ms"] >= runner.step_ms(*key)  # the fake's step time, whichever step it is
        if one_step:
            assert p["repeats"] == 1 and p["time_ms"] >= LONG_STEP_MS


@pytest.mark.parametrize("eager", [True, False])
def test_a_very_long_first_step_of_an_eager_model_is_its_point_time_at_any_depth(eager):
    """config.cold_step_stands: a first step of COLD_STANDS_MS or more stands for the point's time even at
    k = L, where no earlier step built the (B, S); a compiled model's first step (a compilation, maybe) never."""
    long_tokens = 4096
    runner = FakeRunner(np.random.default_rng(6),
                        cold_extra_ms=lambda b, s: COLD_STANDS_MS if b * s >= long_tokens else 1.0)
    points = sweep(runner, lambda s, b: {"b": b, "s": s}, [(1, 256), (1, 4096)], batch_sizes=(1,), max_tokens=None,
                   warmup=1, repeats=2, time_budget_s=1e9, memory_limit=None, checkpointed=(L, L // 2),
                   checkpointing=runner.checkpointing, progress=lambda line: None, eager=eager,
                   clock=lambda: runner.now)
    calls: dict[tuple, int] = {}
    for b, s, k, *_ in runner.calls:
        calls[(b, s, k)] = calls.get((b, s, k), 0) + 1
    assert all(p["status"] == "ok" for p in points)
    for p in points:
        key = (p["batch_size"], p["seq_len"], p["checkpointed"])
        one_step = eager and p["seq_len"] == long_tokens
        assert calls[key] == (1 if one_step else 2), key
        assert (p["time_ms"] == p["cold_ms"]) == one_step


def test_warmup_0_times_the_first_step_with_the_others_in_one_call():
    runner = FakeRunner(np.random.default_rng(2))
    point = measure_point(runner, lambda: {"b": 2, "s": 64}, warmup=0, repeats=3, settle=False)
    assert runner.calls == [(2, 64, L, 0, 3)] and point["repeats"] == 3
    assert point["cold_ms"] >= runner.step_ms(2, 64, L) + runner.cold_extra_ms


def test_on_cpu_the_repeats_are_spread_over_the_sweep_and_the_fastest_counts():
    runner = FakeRunner(np.random.default_rng(4), device="cpu")
    runner.noise = 3.0  # a busy machine: steps up to 4x their own cost
    seq_lens, sizes = [64, 256], [1, 2, 4]
    grid = calibration_grid(seq_lens, sizes, None)
    points = _run(runner, grid, tuple(sizes), memory_limit=None, warmup=2, repeats=4)
    keys = [(p["batch_size"], p["seq_len"], p["checkpointed"]) for p in points]
    # the sweep: per point its cold step, then the rest of the warm-up and one timed step; then 3 passes
    # over every point in order, one timed step each
    sweep_calls = [c for key in keys for c in ((*key, 0, 1), (*key, 1, 1))]
    assert runner.calls == sweep_calls + [(*key, 0, 1) for _ in range(3) for key in keys]
    timed: dict[tuple, list[float]] = {}
    for call, ms in zip(runner.calls, runner.medians):
        timed.setdefault(call[:3], []).append(ms)
    for p, key in zip(points, keys):
        assert p["repeats"] == 4 and p["time_ms"] == min(timed[key][1:])  # the cold step does not count
        assert p["cold_ms"] == pytest.approx(timed[key][0])
    assert any(p["time_ms"] < np.median(timed[key][1:]) for p, key in zip(points, keys))  # min, not median
    gpu = FakeRunner(np.random.default_rng(4))
    _run(gpu, grid, tuple(sizes), memory_limit=None, warmup=2, repeats=4)
    assert gpu.calls == [c for key in keys for c in ((*key, 0, 1), (*key, 1, 4))]  # GPU: one measurement, its median


def test_the_time_budget_counts_warm_measurement_not_the_cold_steps():
    cold_ms, budget_s = 60_000.0, 1.2  # a compiled model's first step of each shape: a minute
    runner = FakeRunner(np.random.default_rng(3), cold_extra_ms=cold_ms, t0=500.0, u=0.0)  # every step 0.5-0.505 s
    seq_lens, sizes = [64, 128], [1, 2, 4, 8, 16, 32]
    grid = calibration_grid(seq_lens, sizes, None)
    required = set(required_points(seq_lens, sizes, None))
    optional = [p for p in grid if p not in required]
    points = _run(runner, grid, tuple(sizes), memory_limit=None, warmup=1, repeats=2, time_budget_s=budget_s)
    status = [p["status"] for p in points if (p["batch_size"], p["seq_len"]) in optional and p["checkpointed"] == L]
    # each optional point's warm measurement: the one timed step (the long-step rule) of 0.5 s (+1% noise at
    # most) after the cold one; points start while no more than the budget is spent: n run, n * warm_s > budget
    warm_s = 0.5
    runs = min(len(optional), math.floor(budget_s / warm_s) + 1)
    assert len(optional) > runs > 1
    assert status == ["ok"] * runs + ["skipped_budget"] * (len(optional) - runs)
    assert all(p["cold_ms"] >= cold_ms for p in points if p["status"] == "ok")


def test_each_progress_line_shows_the_warm_and_the_cold_step_of_its_point():
    runner = FakeRunner(np.random.default_rng(4), cold_extra_ms=40_000.0)
    lines = []
    points = sweep(runner, lambda s, b: {"b": b, "s": s}, [(1, 64), (2, 64)], batch_sizes=(1, 2), max_tokens=None,
                   warmup=1, repeats=2, time_budget_s=1e9, memory_limit=None, checkpointed=(L, L // 2),
                   checkpointing=runner.checkpointing, progress=lines.append, clock=lambda: runner.now)
    ok = [p for p in points if p["status"] == "ok"]
    assert len(lines) == len(points) and len(ok) >= 2
    for line, point in zip(lines, points):
        if point["status"] == "ok":
            assert line.endswith(f"{point['time_ms']:.2f} ms warm ({point['cold_ms']:.1f} cold)")
            assert point["cold_ms"] >= 40_000.0 > point["time_ms"]
        else:
            assert line.endswith(point["status"])


def test_cpu_measurement_runs_on_one_thread_and_restores_the_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with measurement_threads(torch.device("cpu"), lambda line: None):
            assert torch.get_num_threads() == CPU_MEASUREMENT_THREADS
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"):
            with measurement_threads(torch.device("cpu"), lambda line: None):
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
        with measurement_threads(torch.device("cuda", 0), lambda line: None):  # the GPU path is left alone
            assert torch.get_num_threads() == 2
        with measurement_threads(torch.device("cpu"), lambda line: None, compiled=True):  # graphs guard on it
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
