"""`adaptiveload report`: per-step statistics against fp64 formulas on random per-rank CSVs."""
from __future__ import annotations

import csv
import json
import statistics

import numpy as np
import pytest

from lightning_adaptiveload.cli import main
from lightning_adaptiveload.cli.report import per_step_series, prediction_check, read_per_rank_csv

WORLD, BATCHES, WINDOW = 3, 17, 5
HEADER = ["epoch", "step", "batch_idx", "rank", "samples", "tokens", "seq_len", "load", "step_time_ms", "interval_ms"]
BUSY_HEADER = ["busy_ms", "comm_ms", "compile_recompiles", "compile_graph_breaks", "compile_limit_hits"]
PROFILED = {4, 9, 14}  # batches with busy time


def _write_run(run_dir, seed=0, busy=True) -> np.ndarray:
    """A random balance_per_rank.csv + meta; returns (batches, world, [load, step_ms, tokens,
    interval, busy_ms, comm_ms]), busy and comm NaN outside PROFILED. Without `busy`, the columns
    of a file written before busy time and compile counts existed."""
    rng = np.random.default_rng(seed)
    values = np.full((BATCHES, WORLD, 6), np.nan)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "balance_per_rank.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER + (BUSY_HEADER if busy else []))
        for i in range(BATCHES):
            for r in range(WORLD):
                b, s = int(rng.integers(1, 9)), int(rng.integers(64, 4096))
                load, ms = rng.uniform(5, 50), rng.uniform(10, 30)
                interval = ms + rng.uniform(0, 3)
                values[i, r, :4] = (load, ms, b * s, interval)
                row = [0, i, i, r, b, b * s, s, repr(load), repr(ms), repr(interval)]
                if busy:
                    if i in PROFILED:
                        values[i, r, 4:] = rng.uniform(2, ms), rng.uniform(0, 5)
                    row += ["nan" if np.isnan(v) else repr(float(v)) for v in values[i, r, 4:]] + [i // 5, r, 0]
                w.writerow(row)
    (run_dir / "balance_meta.json").write_text(json.dumps({"load_unit": "ms (cost model)", "window": WINDOW}))
    return values


def test_per_step_series_matches_formulas(tmp_path):
    values = _write_run(tmp_path / "run")
    series = per_step_series(read_per_rank_csv(tmp_path / "run" / "balance_per_rank.csv"), WINDOW)
    slowest_ms = [max(values[i, :, 1]) for i in range(BATCHES)]  # a step lasts as long as its slowest rank
    for i in range(BATCHES):
        load, ms = list(values[i, :, 0]), list(values[i, :, 1])
        assert series["load_cv"][i] == pytest.approx(statistics.pstdev(load) / statistics.fmean(load), rel=1e-12)
        assert series["bubble_frac"][i] == pytest.approx(1 - statistics.fmean(load) / max(load), rel=1e-12)
        assert series["load_max_over_mean"][i] == pytest.approx(max(load) / statistics.fmean(load), rel=1e-12)
        assert series["step_time_cv"][i] == pytest.approx(statistics.pstdev(ms) / statistics.fmean(ms), rel=1e-12)
        window = slowest_ms[max(0, i + 1 - WINDOW):i + 1]
        want = statistics.pstdev(window) / statistics.fmean(window) if len(window) > 1 else 0.0
        assert series["step_time_cv_temporal"][i] == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert series["unpredicted_ms"][i] == pytest.approx(statistics.fmean(ms) - max(load), rel=1e-12)
        busy = list(values[i, :, 4])
        if i in PROFILED:
            assert series["busy_cv"][i] == pytest.approx(statistics.pstdev(busy) / statistics.fmean(busy), rel=1e-12)
            assert series["busy_max_over_mean"][i] == pytest.approx(max(busy) / statistics.fmean(busy), rel=1e-12)
        else:
            assert np.isnan(series["busy_cv"][i]) and np.isnan(series["busy_max_over_mean"][i])
    slowest_load = [max(values[i, :, 0]) for i in range(BATCHES)]
    r_value, ratio = prediction_check(series)
    assert r_value == pytest.approx(statistics.correlation(slowest_load, slowest_ms), rel=1e-9)
    assert ratio == pytest.approx(statistics.median([m / x for m, x in zip(slowest_ms, slowest_load)]), rel=1e-12)


def test_report_prints_summary_and_writes_png(tmp_path, capsys):
    values = _write_run(tmp_path / "logs" / "version_0")
    assert main(["report", str(tmp_path / "logs")]) == 0  # finds the CSV under a parent dir
    out = capsys.readouterr().out
    assert f"{BATCHES} train batches x {WORLD} ranks" in out
    load_cv = [statistics.pstdev(v) / statistics.fmean(v) for v in values[:, :, 0].tolist()]
    line = next(line for line in out.splitlines() if line.startswith("load_cv "))
    assert float(line.split()[1]) == pytest.approx(statistics.fmean(load_cv), abs=1e-4)
    tokens_per_s = values[:, :, 2].sum() / (values[:, :, 3].sum(axis=0).max() / 1e3)
    line = next(line for line in out.splitlines() if line.startswith("global throughput"))
    assert float(line.split()[2]) == pytest.approx(tokens_per_s, rel=1e-3)
    loads = values[:, :, 0].tolist()
    bubble = 1 - sum(statistics.fmean(x) for x in loads) / sum(max(x) for x in loads)  # time-weighted
    line = next(line for line in out.splitlines() if line.startswith("bubble fraction over the run"))
    assert float(line.split()[-1]) == pytest.approx(bubble, abs=1e-4)
    busy = [list(values[i, :, 4]) for i in sorted(PROFILED)]
    line = next(line for line in out.splitlines() if line.startswith("busy_cv "))
    assert float(line.split()[1]) == pytest.approx(statistics.fmean(statistics.pstdev(x) / statistics.fmean(x)
                                                                    for x in busy), abs=1e-4)
    for r in range(WORLD):  # per-rank table: busy_ms and comm_ms are means over the profiled batches
        cells = next(line for line in out.splitlines() if line.split()[:1] == [str(r)]).split()
        assert float(cells[6]) == pytest.approx(np.mean([values[i, r, 4] for i in PROFILED]), abs=0.01)
        assert float(cells[7]) == pytest.approx(np.mean([values[i, r, 5] for i in PROFILED]), abs=0.01)
    # compile counts: the last batch's, the most on any rank
    assert f"{(BATCHES - 1) // 5} recompiles, {WORLD - 1} graph breaks" in out
    png = tmp_path / "logs" / "version_0" / "imbalance.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_reads_a_csv_from_before_busy_time(tmp_path, capsys):
    values = _write_run(tmp_path / "run", busy=False)
    cols = read_per_rank_csv(tmp_path / "run" / "balance_per_rank.csv")
    assert np.isnan(cols["busy_ms"]).all() and cols["busy_ms"].shape == (BATCHES, WORLD)
    assert np.array_equal(cols["load"], values[:, :, 0])
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "busy_cv" not in out and "busy time profiled" not in out and "torch.compile" not in out


def test_report_falls_back_to_metrics_csv(tmp_path, capsys):
    rng = np.random.default_rng(1)
    cols = ["balance/load_cv", "balance/load_max_over_mean", "balance/bubble_frac", "balance/step_time_cv",
            "balance/step_time_cv_temporal", "throughput/tokens_per_s", "balance/busy_cv", "data/skipped",
            "data/dropped_partial_batch", "step", "train/loss"]
    load_cv, busy_cv = rng.uniform(0, 0.5, size=6), rng.uniform(0, 0.5, size=6)
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for i, cv in enumerate(load_cv):
            busy = repr(float(busy_cv[i])) if i % 2 else ""  # profiled in every other interval
            w.writerow([repr(float(cv)), 1.2, 0.1, 0.05, 0.2, 1000.0, busy, "", "", 10 * i + 9, ""])
            w.writerow(["", "", "", "", "", "", "", "", "", 10 * i + 9, 0.5])  # a train/loss row
            w.writerow(["", "", "", "", "", "", "", 2 + i, 17 * i, 10 * i + 9, ""])  # the epoch's data counters
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("load_cv "))
    assert float(line.split()[1]) == pytest.approx(load_cv.mean(), abs=1e-4)
    line = next(line for line in out.splitlines() if line.startswith("busy_cv "))
    assert float(line.split()[1]) == pytest.approx(busy_cv[1::2].mean(), abs=1e-4)
    assert "data/skipped: 7" in out and "data/dropped_partial_batch: 85" in out  # the last value of each
    assert (tmp_path / "imbalance.png").stat().st_size > 10_000


def test_report_bad_inputs(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["report", str(tmp_path / "nope")])
    with pytest.raises(SystemExit, match="no balance_per_rank.csv or metrics.csv"):
        main(["report", str(tmp_path)])
    for window in ("0", "-3"):  # 0 used to fall back to the default silently, -3 to garbage windows
        with pytest.raises(SystemExit, match="--window must be >= 2"):
            main(["report", str(tmp_path), "--window", window])
    (tmp_path / "balance_per_rank.csv").write_text("step,rank\n0,0\n")
    with pytest.raises(ValueError, match="missing columns"):
        main(["report", str(tmp_path)])
    with open(tmp_path / "balance_per_rank.csv", "w") as f:
        f.write(",".join(HEADER) + "\n")
        for rank in (0, 1, 1):  # rank 0's row of the second batch is missing
            f.write(f"0,0,0,{rank},1,10,10,1.0,2.0,2.0\n")
    with pytest.raises(ValueError, match="one row per rank per batch"):
        main(["report", str(tmp_path)])
