"""monitoring/per_rank_log.py: rows round-trip exactly through the CSV (NaN included), resume
drops the rows it retrains and upgrades older files, bad input is a clear error."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from lightning_adaptiveload.monitoring import per_rank_log as log
from lightning_adaptiveload.monitoring.per_rank_log import COLUMN, CSV_HEADER, FIELDS, INT_FIELDS


def _rows(rng, steps: int, ranks: int, first_step: int = 0) -> np.ndarray:
    rows = rng.uniform(0.1, 1000.0, size=(steps, ranks, len(FIELDS)))
    for name in INT_FIELDS:
        rows[:, :, COLUMN[name]] = rng.integers(0, 50, size=(steps, ranks))
    rows[:, :, COLUMN["step"]] = (first_step + np.arange(steps))[:, None]
    rows[::2, :, COLUMN["busy_ms"]] = np.nan  # busy time only on profiled steps
    rows[::2, :, COLUMN["comm_ms"]] = np.nan
    return rows


def test_rows_round_trip_exactly(tmp_path):
    rng = np.random.default_rng(0)
    first, second = _rows(rng, 4, 3), _rows(rng, 2, 3, first_step=4)
    path = tmp_path / log.CSV_NAME
    log.append_rows(path, first)
    log.append_rows(path, second)
    cols = log.read_per_rank_csv(path)
    both = np.concatenate([first, second])
    for name in FIELDS:
        assert cols[name].shape == (6, 3)
        np.testing.assert_array_equal(cols[name], both[:, :, COLUMN[name]])  # exact, NaN where NaN
    assert np.array_equal(cols["rank"], np.tile(np.arange(3), (6, 1)))
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert tuple(lines[0]) == CSV_HEADER and len(lines) == 1 + 6 * 3  # header once


def test_resume_drops_retrained_steps_and_upgrades_an_older_file(tmp_path):
    path = tmp_path / log.CSV_NAME
    old_header = ["epoch", "step", "batch_idx", "rank", "samples", "tokens", "seq_len", "load", "step_time_ms",
                  "interval_ms"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(old_header)
        for step in range(5):
            for rank in range(2):
                w.writerow([0, step, step, rank, 2, 20, 10, repr(1.5 * step), "3.0", "4.0"])
        f.write("0,5,")  # a run killed while writing leaves an incomplete last row
    log.drop_rows_from_step(path, 3)
    cols = log.read_per_rank_csv(path)
    assert cols["step"][:, 0].tolist() == [0, 1, 2]
    assert cols["load"][:, 1].tolist() == [0.0, 1.5, 3.0]
    assert np.isnan(cols["busy_ms"]).all()
    log.append_rows(path, _rows(np.random.default_rng(1), 2, 2, first_step=3))  # the resumed fit appends
    assert log.read_per_rank_csv(path)["step"][:, 0].tolist() == [0, 1, 2, 3, 4]


def test_meta_round_trip_and_bad_input(tmp_path):
    log.write_meta(tmp_path, load_unit="ms (cost model)", world_size=2, window=7)
    assert log.read_meta(tmp_path) == {"load_unit": "ms (cost model)", "world_size": 2, "window": 7,
                                       "fields": list(FIELDS)}
    assert log.read_meta(tmp_path / "missing") == {}
    (tmp_path / log.META_NAME).write_text("{not json")
    with pytest.raises(ValueError, match=r"balance_meta.json: line 1: not valid JSON"):
        log.read_meta(tmp_path)
    with pytest.raises(ValueError, match=rf"shape \(steps, ranks, {len(FIELDS)}\)"):
        log.append_rows(tmp_path / "x.csv", np.zeros((2, len(FIELDS))))
    (tmp_path / "bad.csv").write_text("step,rank\n0,0\n")
    with pytest.raises(ValueError, match="missing columns"):
        log.read_per_rank_csv(tmp_path / "bad.csv")
    (tmp_path / "empty.csv").write_text(",".join(CSV_HEADER) + "\n")
    with pytest.raises(ValueError, match="no rows"):
        log.read_per_rank_csv(tmp_path / "empty.csv")
    with open(tmp_path / "gap.csv", "w") as f:
        f.write(",".join(CSV_HEADER) + "\n")
        for rank in (0, 1, 1):  # rank 0's row of the second batch is missing
            f.write(f"0,0,0,{rank},1,10,10,1.0,2.0,2.0,nan,nan,0,0,0,nan,nan\n")
    with pytest.raises(ValueError, match="one row per rank per batch"):
        log.read_per_rank_csv(tmp_path / "gap.csv")
    (tmp_path / "text.csv").write_text(",".join(CSV_HEADER) + "\n0,0,0,0,1,10,10,abc,2.0,2.0,nan,nan,0,0,0,nan,nan\n")
    with pytest.raises(ValueError, match="line 2: unreadable number"):
        log.read_per_rank_csv(tmp_path / "text.csv")
