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


def _write_run(run_dir, seed=0) -> np.ndarray:
    """A random balance_per_rank.csv + meta; returns (batches, world, [load, step_ms, tokens, interval])."""
    rng = np.random.default_rng(seed)
    values = np.empty((BATCHES, WORLD, 4))
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "balance_per_rank.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for i in range(BATCHES):
            for r in range(WORLD):
                b, s = int(rng.integers(1, 9)), int(rng.integers(64, 4096))
                load, ms = rng.uniform(5, 50), rng.uniform(10, 30)
                interval = ms + rng.uniform(0, 3)
                values[i, r] = (load, ms, b * s, interval)
                w.writerow([0, i, i, r, b, b * s, s, repr(load), repr(ms), repr(interval)])
    (run_dir / "balance_meta.json").write_text(json.dumps({"load_unit": "ms (cost model)", "window": WINDOW}))
    return values


def test_per_step_series_matches_formulas(tmp_path):
    values = _write_run(tmp_path / "run")
    series = per_step_series(read_per_rank_csv(tmp_path / "run" / "balance_per_rank.csv"), WINDOW)
    rank_mean_ms = [statistics.fmean(values[i, :, 1]) for i in range(BATCHES)]
    for i in range(BATCHES):
        load, ms = list(values[i, :, 0]), list(values[i, :, 1])
        assert series["load_cv"][i] == pytest.approx(statistics.pstdev(load) / statistics.fmean(load), rel=1e-12)
        assert series["bubble_frac"][i] == pytest.approx(1 - statistics.fmean(load) / max(load), rel=1e-12)
        assert series["load_max_over_mean"][i] == pytest.approx(max(load) / statistics.fmean(load), rel=1e-12)
        assert series["step_time_cv"][i] == pytest.approx(statistics.pstdev(ms) / statistics.fmean(ms), rel=1e-12)
        window = rank_mean_ms[max(0, i + 1 - WINDOW):i + 1]
        want = statistics.pstdev(window) / statistics.fmean(window) if len(window) > 1 else 0.0
        assert series["step_time_cv_temporal"][i] == pytest.approx(want, rel=1e-12, abs=1e-15)
    slowest_load = [max(values[i, :, 0]) for i in range(BATCHES)]
    slowest_ms = [max(values[i, :, 1]) for i in range(BATCHES)]
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
    png = tmp_path / "logs" / "version_0" / "imbalance.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_falls_back_to_metrics_csv(tmp_path, capsys):
    rng = np.random.default_rng(1)
    cols = ["balance/load_cv", "balance/load_max_over_mean", "balance/bubble_frac", "balance/step_time_cv",
            "balance/step_time_cv_temporal", "throughput/tokens_per_s", "data/skipped", "step", "train/loss"]
    load_cv = rng.uniform(0, 0.5, size=6)
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for i, cv in enumerate(load_cv):
            w.writerow([repr(float(cv)), 1.2, 0.1, 0.05, 0.2, 1000.0, 2 + i, 10 * i + 9, ""])
            w.writerow(["", "", "", "", "", "", "", 10 * i + 9, 0.5])  # a train/loss row
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("load_cv "))
    assert float(line.split()[1]) == pytest.approx(load_cv.mean(), abs=1e-4)
    assert "data/skipped: 7" in out
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
