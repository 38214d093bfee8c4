"""BalanceTracker against fp64 loops (statistics module) on random gathered rows: the metrics of
each interval, the rolling temporal CV across intervals, busy time of the profiled steps only,
compile counts, and the run summary."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from lightning_adaptiveload.monitoring.balance import BalanceTracker
from lightning_adaptiveload.monitoring.per_rank_log import COLUMN, FIELDS

RANKS, WINDOW = 3, 4


def _interval(rng, steps: int, profiled: set[int], compiles: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    rows = np.zeros((steps, RANKS, len(FIELDS)))
    rows[:, :, COLUMN["samples"]] = rng.integers(1, 9, size=(steps, RANKS))
    rows[:, :, COLUMN["seq_len"]] = rng.integers(64, 4096, size=(steps, RANKS))
    rows[:, :, COLUMN["tokens"]] = rows[:, :, COLUMN["samples"]] * rows[:, :, COLUMN["seq_len"]]
    rows[:, :, COLUMN["load"]] = rng.uniform(5, 50, size=(steps, RANKS))
    rows[:, :, COLUMN["step_time_ms"]] = rng.uniform(10, 60, size=(steps, RANKS))
    rows[:, :, COLUMN["interval_ms"]] = rows[:, :, COLUMN["step_time_ms"]] + rng.uniform(0, 5, size=(steps, RANKS))
    rows[:, :, COLUMN["busy_ms"]] = np.nan
    rows[:, :, COLUMN["comm_ms"]] = np.nan
    for i in profiled:
        rows[i, :, COLUMN["busy_ms"]] = rng.uniform(2, 40, size=RANKS)
        rows[i, :, COLUMN["comm_ms"]] = rng.uniform(0, 10, size=RANKS)
    for k, name in enumerate(("compile_recompiles", "compile_graph_breaks", "compile_limit_hits")):
        rows[:, :, COLUMN[name]] = compiles[k]
    return rows


def _cv(x):
    return statistics.pstdev(x) / statistics.fmean(x)


def _col(rows, name):
    return [[float(v) for v in step] for step in rows[:, :, COLUMN[name]]]


def test_interval_metrics_and_summary_match_formulas():
    rng = np.random.default_rng(0)
    tracker = BalanceTracker(RANKS, window=WINDOW)
    intervals = [_interval(rng, 5, {4}, (1, 0, 0)), _interval(rng, 3, set(), (3, 2, 0)),
                 _interval(rng, 4, {1, 3}, (3, 2, 1))]
    # the last rank to report a count is rank 2: the logged count is the most of any rank
    intervals[2][-1, 1, COLUMN["compile_recompiles"]] = 5
    slowest_so_far = []
    for k, rows in enumerate(intervals):
        got = tracker.update(rows)
        load, ms, tokens = _col(rows, "load"), _col(rows, "step_time_ms"), _col(rows, "tokens")
        assert got["balance/load_cv"] == pytest.approx(statistics.fmean(_cv(x) for x in load), rel=1e-12)
        assert got["balance/load_max_over_mean"] == pytest.approx(
            statistics.fmean(max(x) / statistics.fmean(x) for x in load), rel=1e-12)
        assert got["balance/bubble_frac"] == pytest.approx(
            1 - sum(statistics.fmean(x) for x in load) / sum(max(x) for x in load), rel=1e-12)
        assert got["balance/step_time_cv"] == pytest.approx(statistics.fmean(_cv(x) for x in ms), rel=1e-12)
        slowest_so_far += [max(x) for x in ms]
        assert got["balance/step_time_cv_temporal"] == pytest.approx(_cv(slowest_so_far[-WINDOW:]), rel=1e-12)
        assert got["balance/unpredicted_ms"] == pytest.approx(
            statistics.fmean(statistics.fmean(m) - max(x) for m, x in zip(ms, load)), rel=1e-12)
        wall_s = max(sum(rows[i, r, COLUMN["interval_ms"]] for i in range(len(rows))) for r in range(RANKS)) / 1e3
        assert got["throughput/tokens_per_s"] == pytest.approx(sum(map(sum, tokens)) / wall_s, rel=1e-12)
        for r in range(RANKS):
            assert got[f"rank{r}/load"] == pytest.approx(statistics.fmean(x[r] for x in load), rel=1e-12)
            assert got[f"rank{r}/tokens"] == pytest.approx(statistics.fmean(x[r] for x in tokens), rel=1e-12)
        profiled = [i for i in range(len(rows)) if np.isfinite(rows[i, 0, COLUMN["busy_ms"]])]
        if profiled:
            busy = [_col(rows, "busy_ms")[i] for i in profiled]
            comm = [_col(rows, "comm_ms")[i] for i in profiled]
            assert got["balance/busy_cv"] == pytest.approx(statistics.fmean(_cv(x) for x in busy), rel=1e-12)
            assert got["balance/busy_max_over_mean"] == pytest.approx(
                statistics.fmean(max(x) / statistics.fmean(x) for x in busy), rel=1e-12)
            for r in range(RANKS):
                assert got[f"rank{r}/busy_ms"] == pytest.approx(statistics.fmean(x[r] for x in busy), rel=1e-12)
                assert got[f"rank{r}/comm_ms"] == pytest.approx(statistics.fmean(x[r] for x in comm), rel=1e-12)
        else:
            assert not any("busy" in key or "comm" in key for key in got)
        expect_recompiles = (1, 3, 5)[k]
        assert (got["compile/recompiles"], got["compile/graph_breaks"]) == (expect_recompiles, (0, 2, 2)[k])
        assert tracker.ranks_over_recompile_limit() == ([] if k < 2 else [0, 1, 2])

    run = np.concatenate(intervals)
    load, ms = _col(run, "load"), _col(run, "step_time_ms")
    summary = tracker.summary(overhead_ms_per_step=0.5)
    assert summary["steps"] == len(run) and summary["world_size"] == RANKS
    assert summary["load_cv_mean"] == pytest.approx(statistics.fmean(_cv(x) for x in load), rel=1e-12)
    assert summary["load_cv_max"] == pytest.approx(max(_cv(x) for x in load), rel=1e-12)
    assert summary["bubble_frac"] == pytest.approx(
        1 - sum(statistics.fmean(x) for x in load) / sum(max(x) for x in load), rel=1e-12)
    assert summary["step_time_cv_temporal_run"] == pytest.approx(_cv([max(x) for x in ms]), rel=1e-12)
    mean_ms = statistics.fmean(v for x in ms for v in x)
    assert summary["step_time_ms_mean"] == pytest.approx(mean_ms, rel=1e-12)
    assert summary["monitor_overhead_frac"] == pytest.approx(0.5 / mean_ms, rel=1e-12)
    wall_s = max(run[:, r, COLUMN["interval_ms"]].sum() for r in range(RANKS)) / 1e3
    assert summary["tokens_per_s"] == pytest.approx(run[:, :, COLUMN["tokens"]].sum() / wall_s, rel=1e-12)
    busy = [_col(run, "busy_ms")[i] for i in range(len(run)) if np.isfinite(run[i, 0, COLUMN["busy_ms"]])]
    assert summary["busy_steps"] == len(busy) == 3
    assert summary["busy_cv_mean"] == pytest.approx(statistics.fmean(_cv(x) for x in busy), rel=1e-12)
    assert (summary["compile_recompiles"], summary["compile_graph_breaks"], summary["compile_limit_hits"]) == (5, 2, 1)
    table = tracker.format_summary(summary)
    assert f"LoadBalanceMonitor: {len(run)} steps x {RANKS} ranks" in table
    assert "5 recompiles, 2 graph breaks" in table and "over 3 profiled steps" in table
    rank1 = next(line for line in table.splitlines() if line.split()[:1] == ["1"]).split()
    assert float(rank1[5]) == pytest.approx(statistics.fmean(x[1] for x in ms), abs=0.01)
    assert float(rank1[6]) == pytest.approx(statistics.fmean(x[1] for x in busy), abs=0.01)
    # busy time is the profiled steps' own: the table names their step time, the mean over those
    # steps and the ranks, beside step_ms over every step
    profiled_ms = statistics.fmean(v for i in range(len(run)) if np.isfinite(run[i, 0, COLUMN["busy_ms"]])
                                   for v in ms[i])
    assert summary["busy_step_time_ms_mean"] == pytest.approx(profiled_ms, rel=1e-12)
    assert f"the 3 profiled step(s) only, whose step_ms was {profiled_ms:.2f}" in table
    assert f"step_ms: all {len(run)} steps" in table
    assert "here:" not in table  # the monitor adds log_every_n_steps; the tracker alone has no interval


def test_overhead_line_says_what_the_fit_paid_for():
    rng = np.random.default_rng(3)
    tracker = BalanceTracker(RANKS, window=WINDOW)
    tracker.update(_interval(rng, 5, set()))
    tracker.update(_interval(rng, 5, {4}))
    summary = tracker.summary(overhead_ms_per_step=1.5) | {"log_every_n_steps": 5, "busy_window_ms_per_step": 86.0}
    table = tracker.format_summary(summary)
    # one window of 86 ms spread over the 10 steps
    assert "here: a gather and CSV append every 5 steps, 1 profiled step(s) in 10 (8.600 ms/step of it)" in table
    no_busy = BalanceTracker(RANKS, window=WINDOW)
    no_busy.update(_interval(rng, 4, set()))
    table = no_busy.format_summary(no_busy.summary(0.2) | {"log_every_n_steps": 50})
    assert "here: a gather and CSV append every 50 steps; less with a larger log_every_n_steps" in table
    assert "profiled step(s) only" not in table


def test_proxy_load_and_bad_rows():
    rng = np.random.default_rng(1)
    tracker = BalanceTracker(RANKS, window=WINDOW, load_unit="tokens^2 (proxy)")
    got = tracker.update(_interval(rng, 3, set()))
    assert "balance/unpredicted_ms" not in got  # a proxy load is not ms: nothing to compare step times with
    assert "unpredicted_ms_mean" not in tracker.summary() and "busy_cv_mean" not in tracker.summary()
    table = tracker.format_summary(tracker.summary())
    assert "recompiles" not in table and "busy CV" not in table
    with pytest.raises(ValueError, match=rf"shape \(steps >= 1, 3, {len(FIELDS)}\)"):
        tracker.update(np.zeros((2, 2, len(FIELDS))))
    with pytest.raises(ValueError, match="window"):
        BalanceTracker(2, window=1)
    assert BalanceTracker(2).summary() == {}


def test_peak_memory_per_interval_and_steps_over_the_budget():
    rng = np.random.default_rng(7)
    budget = 100 * 2**30
    tracker = BalanceTracker(RANKS, window=WINDOW, memory_budget_bytes=budget)
    totals, over_total = [0.0, 0.0], 0
    for interval in range(3):
        rows = _interval(rng, 5, set())
        rows[:, :, COLUMN["peak_allocated_bytes"]] = rng.uniform(60, 105, size=(5, RANKS)) * 2**30
        rows[:, :, COLUMN["peak_reserved_bytes"]] = rows[:, :, COLUMN["peak_allocated_bytes"]] + \
            rng.uniform(0, 6, size=(5, RANKS)) * 2**30
        got = tracker.update(rows)
        # reference by loops: the largest of any rank and step; a step is over when any rank's
        # allocated or reserved peak is
        alloc = max(float(v) for step in rows for v in step[:, COLUMN["peak_allocated_bytes"]])
        reserved = max(float(v) for step in rows for v in step[:, COLUMN["peak_reserved_bytes"]])
        over = sum(any(max(r[COLUMN["peak_allocated_bytes"]], r[COLUMN["peak_reserved_bytes"]]) > budget for r in step)
                   for step in rows)
        assert got["memory/peak_allocated_gib"] == pytest.approx(alloc / 2**30, rel=1e-12)
        assert got["memory/peak_reserved_gib"] == pytest.approx(reserved / 2**30, rel=1e-12)
        assert got["memory/steps_over_budget"] == over
        totals = [max(totals[0], alloc), max(totals[1], reserved)]
        over_total += over
    summary = tracker.summary()
    assert (summary["peak_allocated_bytes"], summary["peak_reserved_bytes"]) == (totals[0], totals[1])
    assert summary["steps_over_budget"] == over_total > 0 and summary["memory_budget_bytes"] == budget
    assert f"{over_total} step(s) over it" in tracker.format_summary(summary)
    cpu = BalanceTracker(RANKS, window=WINDOW, memory_budget_bytes=budget)
    rows = _interval(rng, 3, set())
    rows[:, :, COLUMN["peak_allocated_bytes"]] = rows[:, :, COLUMN["peak_reserved_bytes"]] = np.nan
    assert not any(key.startswith("memory/") for key in cpu.update(rows))
    assert "peak_allocated_bytes" not in cpu.summary()


def test_busy_time_shows_imbalance_that_equal_step_times_hide():
    """What the 2-process DDP busy test in tests/callbacks/test_monitor.py shows, with injected
    times instead of times measured on a shared CPU (the measured comparison is the benchmark
    benchmarks/e2e/busy_imbalance.py): under DDP every rank's step lasts as long as the slowest
    rank's, so step times are equal across ranks, while each rank's profiled ops follow its work.
    The op lists are what a rank's profiler window would hold (names as torch's, self times in us):
    rank r does WORK[r] units of matrix products, and the faster ranks spend the difference inside
    the gradient all-reduce. busy_and_comm_ms must split them into busy and communication, and
    BalanceTracker must then report the work's imbalance in busy time and none in step time."""
    from lightning_adaptiveload.monitoring.busy import busy_and_comm_ms

    work = [1, 4, 2]  # units of extra compute per rank (RANKS ranks)
    unit_us, common_us, steps = 3000.0, 500.0, 6
    step_ms = 0.5 + max(work) * unit_us / 1e3 + 1.0  # the slowest rank's step, every rank's (DDP)
    rows = np.zeros((steps, RANKS, len(FIELDS)))
    rows[:, :, COLUMN["samples"]], rows[:, :, COLUMN["seq_len"]] = 2, 16
    rows[:, :, COLUMN["tokens"]] = 32
    rows[:, :, COLUMN["load"]] = 32 * 16**2  # the same batch on every rank: proxy load
    rows[:, :, COLUMN["step_time_ms"]] = step_ms
    rows[:, :, COLUMN["interval_ms"]] = step_ms + 0.25
    rows[:, :, COLUMN["peak_allocated_bytes"]] = rows[:, :, COLUMN["peak_reserved_bytes"]] = np.nan
    for i in range(steps):
        for r, units in enumerate(work):
            ops = ([("aten::addmm", common_us), ("aten::mse_loss_backward", 250.0)]
                   + [("aten::mm", unit_us / 2), ("aten::tanh", unit_us / 2)] * units
                   # the wait for the slowest rank, inside the collective's op
                   + [("c10d::allreduce_", 40.0 + (max(work) - units) * unit_us)])
            rows[i, r, COLUMN["busy_ms"]], rows[i, r, COLUMN["comm_ms"]] = busy_and_comm_ms(ops)
    # the split, written out: every non-collective op is busy, the all-reduce is communication
    for r, units in enumerate(work):
        assert rows[0, r, COLUMN["busy_ms"]] == pytest.approx((common_us + 250.0 + units * unit_us) / 1e3, rel=1e-12)
        assert rows[0, r, COLUMN["comm_ms"]] == pytest.approx((40.0 + (max(work) - units) * unit_us) / 1e3, rel=1e-12)

    got = BalanceTracker(RANKS, window=WINDOW, load_unit="tokens^2 (proxy)").update(rows)
    busy = [float(v) for v in rows[0, :, COLUMN["busy_ms"]]]
    assert got["balance/step_time_cv"] == 0.0  # DDP's equal step times: no imbalance visible
    assert got["balance/busy_cv"] == pytest.approx(_cv(busy), rel=1e-12)
    # the busy CV is the work's, diluted only by the ops every rank runs alike (fp64 formula)
    common_ms = (common_us + 250.0) / 1e3
    assert got["balance/busy_cv"] == pytest.approx(
        statistics.pstdev(work) * unit_us / 1e3 / (common_ms + statistics.fmean(work) * unit_us / 1e3), rel=1e-12)
    assert got["balance/busy_cv"] > 0.5 * _cv(work) > got["balance/step_time_cv"]
    assert got["balance/busy_max_over_mean"] == pytest.approx(max(busy) / statistics.fmean(busy), rel=1e-12)
    for r in range(RANKS):
        assert got[f"rank{r}/busy_ms"] == pytest.approx(busy[r], rel=1e-12)
        assert got[f"rank{r}/step_time_ms"] == step_ms
    # the busiest rank is the one with the most work, on every step
    assert (rows[:, :, COLUMN["busy_ms"]].argmax(axis=1) == int(np.argmax(work))).all()
