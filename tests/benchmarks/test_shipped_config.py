"""benchmarks/e2e/shipped_config.py's summary of one run's logs: each shape's first training step grouped by
what verification did with it, and the plan's prices judged on later steps only (hand-computed reference)."""
import csv
import json
from pathlib import Path

import numpy as np
import pytest

from lightning_adaptiveload.monitoring.per_rank_log import CSV_HEADER, CSV_NAME
from benchmarks.e2e import shipped_config


def measured(b, s, status, **kw):
    doc = {"batch_size": b, "seq_len": s, "latent_shape": [1, 1, s], "checkpointed": 0, "status": status, "warm_ms": None,
           "cold_ms": None, "peak_bytes": None, "reserved_bytes": None, "predicted_ms": None, "predicted_peak_bytes": None,
           "round": 1, "timed_cold": False, "bound_by": None}
    return doc | kw


def test_first_steps_are_grouped_by_verification_and_prices_judged_on_later_steps(tmp_path):
    rng = np.random.default_rng(0)
    shapes = [measured(2, 4000, "fits", warm_ms=300.0, cold_ms=500.0, peak_bytes=5e9, reserved_bytes=6e9),
              measured(1, 9000, "over_budget", warm_ms=700.0, cold_ms=900.0, peak_bytes=9e9, reserved_bytes=9.5e9),
              measured(1, 9000, "fits", warm_ms=650.0, cold_ms=800.0, peak_bytes=7e9, reserved_bytes=7.5e9, checkpointed=2,
                       round=2),
              measured(1, 3000, "bounded", bound_by=[2, 4000, 0])]
    (tmp_path / "calibration.json").write_text(json.dumps({
        "seconds": 10.0, "verify_seconds": 5.0, "source": "measured", "trusted": True,
        "verification": {"shapes": shapes, "budget_bytes": 8e9, "rounds": 2, "converged": True, "settled": [],
                         "unresolved": [], "left_cold": 2}}))
    # (B, S, planned ms, step ms): 2 x 4000 three times, 1 x 9000 twice, 1 x 3000 and 3 x 500 once each
    steps = [(2, 4000, 300.0, 420.0), (1, 3000, 200.0, 460.0), (1, 9000, 650.0, 700.0), (2, 4000, 300.0, 330.0),
             (3, 500, 100.0, 350.0), (2, 4000, 300.0, 318.0), (1, 9000, 650.0, 660.0)]
    with open(tmp_path / CSV_NAME, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_HEADER)
        w.writeheader()
        for i, (b, s, load, ms) in enumerate(steps):
            w.writerow({c: 0 for c in CSV_HEADER} | {"step": i, "batch_idx": i, "samples": b, "tokens": b * s, "seq_len": s,
                                                      "load": load, "step_time_ms": ms, "interval_ms": ms + rng.uniform(1, 5),
                                                      "peak_allocated_bytes": 4e9, "peak_reserved_bytes": 5e9})
    got = shipped_config.summarize_run(tmp_path)
    by = got["shapes"]
    assert {k: v["verification"] for k, v in by.items()} == {"2x4000": "run", "1x9000": "run", "1x3000": "bounded",
                                                             "3x500": "not verified"}
    assert by["2x4000"]["median_step_ms"] == pytest.approx(324.0) and by["2x4000"]["first_step_ms"] == 420.0
    assert by["1x9000"]["median_over_planned"] == pytest.approx(660.0 / 650.0 - 1)
    assert by["1x3000"]["median_step_ms"] is None and by["1x3000"]["first_over_planned"] == pytest.approx(460.0 / 200.0 - 1)
    assert got["first_steps_by_verification"] == {
        "bounded": {"shapes": 1, "mean_excess_ms": 260.0, "max_excess_ms": 260.0},
        "not verified": {"shapes": 1, "mean_excess_ms": 250.0, "max_excess_ms": 250.0},
        "run": {"shapes": 2, "mean_excess_ms": pytest.approx((120.0 + 50.0) / 2), "max_excess_ms": 120.0}}
    # only shapes with later steps are judged: 2 x 4000 at 324 / 300, not the once-run 1 x 3000 at 2.3x
    assert got["worst_shape_median_over_planned"] == pytest.approx(0.08)
    assert got["verification"]["bounded"] == 1 and got["verification"]["replanned"] == 1


@pytest.mark.parametrize("again_max_steps", [None, 12])
def test_a_run_on_another_runs_caches_may_stop_early_and_first_runs_never_do(tmp_path, again_max_steps):
    import argparse

    args = argparse.Namespace(workdir=str(tmp_path), max_steps=-1, again_max_steps=again_max_steps, log_every=5,
                              time_budget_s=60.0, warmup=None, repeats=None, samples=80, tiny=False, layers=None)
    steps = {name: shipped_config.run_config(name, args)["trainer"]["max_steps"] for name in shipped_config.RUNS}
    again = {name for name in shipped_config.RUNS if name.endswith("_again")}
    assert again == set(shipped_config.CACHES_OF) and again
    for name, max_steps in steps.items():
        expected = again_max_steps if name in again and again_max_steps is not None else -1
        assert max_steps == expected, name
    shipped = shipped_config.run_config("dynamic", args)["model"]["init_args"]["num_layers"]
    args.layers = 3
    assert shipped == 30 and shipped_config.run_config("dynamic", args)["model"]["init_args"]["num_layers"] == 3


def test_a_runs_caches_travel_through_the_cache_dir_to_its_next_call(tmp_path, monkeypatch):
    """What a run (stopped by its timeout or not) leaves, its calibration cache and its compile cache
    folder, goes to --cache-dir and comes back into the next call's run of the same config, and into
    its `_again` run's folder."""
    import argparse
    import subprocess

    def fit(command, cwd, env, stdout, stderr, timeout):  # writes what `adaptiveload fit` leaves, then times out
        root = Path(command[-1]).parent
        found = (root / "calibration_cache.json").read_text() if (root / "calibration_cache.json").exists() else None
        seen.append((root.name, found, sorted(p.name for p in (root / "compile_cache").glob("*"))
                     if (root / "compile_cache").is_dir() else None))
        (root / "calibration_cache.json").write_text(json.dumps({"points": [len(seen)]}))
        (root / "compile_cache" / "fxgraph").mkdir(parents=True, exist_ok=True)
        (root / "compile_cache" / "fxgraph" / f"graph{len(seen)}").write_text("code")
        raise subprocess.TimeoutExpired(command, timeout)

    seen = []
    monkeypatch.setattr(shipped_config.subprocess, "run", fit)
    cache_dir = tmp_path / "kept"
    for call in ("one", "two"):
        args = argparse.Namespace(workdir=str(tmp_path / call), cache_dir=str(cache_dir), max_steps=-1,
                                  again_max_steps=None, log_every=5, time_budget_s=60.0, warmup=None, repeats=None,
                                  samples=80, tiny=False, layers=None, run_timeout_s=1.0)
        assert shipped_config.launch("dynamic", args)["exit"] == "timeout"
    assert seen[0] == ("dynamic", None, None)
    assert seen[1] == ("dynamic", json.dumps({"points": [1]}), ["fxgraph"])
    assert json.loads((cache_dir / "dynamic_calibration_cache.json").read_text()) == {"points": [2]}
    assert sorted(p.name for p in (cache_dir / "dynamic_compile_cache" / "fxgraph").iterdir()) == ["graph1", "graph2"]
    shipped_config.launch("dynamic_again", args)
    assert seen[2][0] == "dynamic_again" and seen[2][1] == json.dumps({"points": [2]})
