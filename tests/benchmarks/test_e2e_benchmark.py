"""benchmarks/e2e/e2e.py's report arithmetic on a hand-written monitor CSV: balance metrics follow
docs/monitoring.md (checked against per-batch fp64 loops), throughput counts tokens, batches that
share an optimizer step (gradient accumulation) stay separate rows, short runs get a loss window
that fits, and a missing baseline is a clear error. The GPU runs themselves: benchmarks/gpu_e2e.sh."""
import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks.e2e import e2e


WORLD, BATCHES = 2, 12


def _write_run(log_dir: Path, rng: np.random.Generator, busy: bool = False) -> dict[str, np.ndarray]:
    """A monitor CSV of BATCHES batches x WORLD ranks; two batches per optimizer step (so `step`
    repeats). Without `busy`, the columns of a CSV written before busy time existed; with it,
    busy_ms and comm_ms on every third batch (NaN on the others). Returns the columns as
    (batches, world) arrays."""
    cols = {
        "samples": rng.integers(1, 9, size=(BATCHES, WORLD)),
        "seq_len": rng.integers(64, 4096, size=(BATCHES, WORLD)),
        "load": rng.uniform(5.0, 50.0, size=(BATCHES, WORLD)),
        "step_time_ms": rng.uniform(20.0, 80.0, size=(BATCHES, WORLD)),
        "interval_ms": rng.uniform(80.0, 90.0, size=(BATCHES, WORLD)),
    }
    cols["tokens"] = cols["samples"] * cols["seq_len"]
    floats = ["load", "step_time_ms", "interval_ms"]
    if busy:
        profiled = (np.arange(BATCHES) % 3 == 2)[:, None]
        cols["busy_ms"] = np.where(profiled, rng.uniform(5.0, 60.0, size=(BATCHES, WORLD)), np.nan)
        cols["comm_ms"] = np.where(profiled, rng.uniform(0.0, 20.0, size=(BATCHES, WORLD)), np.nan)
        floats += ["busy_ms", "comm_ms"]
    log_dir.mkdir(parents=True)
    with open(log_dir / "balance_per_rank.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epoch", "step", "batch_idx", "rank", "samples", "tokens", "seq_len"] + floats)
        for i in range(BATCHES):
            for r in range(WORLD):
                writer.writerow([0, i // 2, i, r] + [int(cols[k][i, r]) for k in ("samples", "tokens", "seq_len")]
                                + [repr(float(cols[k][i, r])) for k in floats])
    return cols


def _result(config: str, log_dir: Path, epoch_s: float, rng: np.random.Generator, samples_rank0) -> dict:
    return {"config": config, "log_dir": str(log_dir), "epoch_wall_s": epoch_s, "peak_mem_gib_per_rank": [3.0, 4.5],
            "calibration": {"seconds": 12.0, "from_cache": False},
            "losses_rank0": rng.uniform(0.5, 1.5, size=len(samples_rank0)).tolist(),
            "samples_rank0": [int(v) for v in samples_rank0]}


def _cv(x):
    mean = sum(x) / len(x)
    return math.sqrt(sum((v - mean) ** 2 for v in x) / len(x)) / mean


def test_summarize_run_follows_the_monitoring_definitions(tmp_path):
    rng = np.random.default_rng(3)
    cols = _write_run(tmp_path / "run", rng)
    res = _result("balanced", tmp_path / "run", 7.5, rng, cols["samples"][:, 0])
    got = e2e.summarize_run(res)

    kept = range(e2e.WARMUP_STEPS, BATCHES)
    load = [[float(cols["load"][i, r]) for r in range(WORLD)] for i in kept]
    step = [[float(cols["step_time_ms"][i, r]) for r in range(WORLD)] for i in kept]
    assert got["load_cv"] == pytest.approx(sum(_cv(x) for x in load) / len(load), rel=1e-12)
    assert got["load_max_over_mean"] == pytest.approx(sum(max(x) / (sum(x) / WORLD) for x in load) / len(load),
                                                      rel=1e-12)
    # time-weighted: idle rank-time over the slowest ranks' time
    assert got["bubble_frac"] == pytest.approx(1 - sum(sum(x) / WORLD for x in load) / sum(max(x) for x in load),
                                               rel=1e-12)
    assert got["step_time_cv_ranks"] == pytest.approx(sum(_cv(x) for x in step) / len(step), rel=1e-12)
    assert got["step_time_cv_temporal"] == pytest.approx(_cv([max(x) for x in step]), rel=1e-12)
    assert math.isnan(got["busy_cv"]) and got["busy_steps"] == 0  # a CSV from before busy time
    # every batch counts once, although two batches share each optimizer step
    tokens = sum(int(cols["tokens"][i, r]) for i in range(BATCHES) for r in range(WORLD))
    assert got["steps"] == BATCHES and got["tokens_consumed"] == tokens
    assert got["samples_consumed"] == int(cols["samples"].sum())
    assert got["tokens_per_s_epoch"] == pytest.approx(tokens / 7.5, rel=1e-12)
    per_step = [sum(int(cols["tokens"][i, r]) for r in range(WORLD)) / (max(s) / 1e3) for i, s in zip(kept, step)]
    assert got["tokens_per_s_step_median"] == pytest.approx(float(np.median(per_step)), rel=1e-12)
    assert got["longest_seq_trained"] == int(cols["seq_len"].max()) and got["peak_mem_gib_max"] == 4.5
    slowest = [max(float(cols["load"][i, r]) for r in range(WORLD)) for i in range(BATCHES)]
    mean_time = [sum(float(cols["step_time_ms"][i, r]) for r in range(WORLD)) / WORLD for i in range(BATCHES)]
    assert got["predicted_step_sum_s"] == pytest.approx(sum(slowest) / 1e3, rel=1e-12)
    assert got["measured_step_sum_s"] == pytest.approx(sum(mean_time) / 1e3, rel=1e-12)
    assert got["unpredicted_ms_per_step"] == pytest.approx((sum(mean_time) - sum(slowest)) / BATCHES, rel=1e-12)


def test_summarize_run_busy_time_of_the_profiled_batches(tmp_path):
    rng = np.random.default_rng(8)
    cols = _write_run(tmp_path / "run", rng, busy=True)
    got = e2e.summarize_run(_result("balanced", tmp_path / "run", 7.5, rng, cols["samples"][:, 0]))
    busy = [[float(cols["busy_ms"][i, r]) for r in range(WORLD)] for i in range(e2e.WARMUP_STEPS, BATCHES)
            if i % 3 == 2]
    assert got["busy_steps"] == len(busy) > 0
    assert got["busy_cv"] == pytest.approx(sum(_cv(x) for x in busy) / len(busy), rel=1e-12)
    assert got["busy_max_over_mean"] == pytest.approx(sum(max(x) / (sum(x) / WORLD) for x in busy) / len(busy),
                                                      rel=1e-12)


def test_unpredicted_time_by_sample_length_bands(tmp_path):
    """Each band's numbers from per-step loops; the bands' step-weighted mean is the run's
    unpredicted_ms_per_step; the time between steps is interval minus step time, slowest rank."""
    rng = np.random.default_rng(5)
    cols = _write_run(tmp_path / "run", rng)
    got = e2e.summarize_run(_result("balanced", tmp_path / "run", 7.5, rng, cols["samples"][:, 0]))
    edges = (1000, 2500)
    bands = e2e.unpredicted_by_seq_len(e2e.read_per_rank_csv(tmp_path / "run" / e2e.CSV_NAME), edges)
    expect = {}
    for i in range(BATCHES):
        seq = [float(cols["seq_len"][i, r]) for r in range(WORLD)]
        band = sum(sum(seq) / WORLD >= e for e in edges)
        slowest = max(float(cols["load"][i, r]) for r in range(WORLD))
        beyond = sum(float(cols["step_time_ms"][i, r]) for r in range(WORLD)) / WORLD - slowest
        per_rank = sum(int(cols["samples"][i, r]) for r in range(WORLD)) / WORLD
        expect.setdefault(band, []).append((beyond, beyond / slowest, (max(seq) - min(seq)) / max(seq), per_rank))
    assert [(b["seq_len_from"], b["seq_len_to"]) for b in bands] == [((0, *edges)[k], (*edges, None)[k])
                                                                     for k in sorted(expect)]
    for b, k in zip(bands, sorted(expect)):
        values = np.array(expect[k])
        assert b["steps"] == len(values)
        assert [b["unpredicted_ms_per_step"], b["unpredicted_frac_of_predicted"], b["rank_seq_len_spread"],
                b["samples_per_rank"]] == pytest.approx(values.mean(axis=0).tolist(), rel=1e-12)
    weighted = sum(b["steps"] * b["unpredicted_ms_per_step"] for b in bands) / BATCHES
    assert weighted == pytest.approx(got["unpredicted_ms_per_step"], rel=1e-12)
    assert sum(b["steps"] for b in got["unpredicted_by_seq_len"]) == BATCHES
    between = [max(float(cols["interval_ms"][i, r] - cols["step_time_ms"][i, r]) for r in range(WORLD))
               for i in range(e2e.WARMUP_STEPS, BATCHES)]
    assert got["between_steps_ms"] == pytest.approx(sum(between) / len(between), rel=1e-12)


def test_too_short_run_is_a_clear_error(tmp_path):
    rng = np.random.default_rng(4)
    cols = _write_run(tmp_path / "run", rng)
    lines = (tmp_path / "run" / "balance_per_rank.csv").read_text().splitlines()
    (tmp_path / "run" / "balance_per_rank.csv").write_text("\n".join(lines[:1 + WORLD * e2e.WARMUP_STEPS]) + "\n")
    with pytest.raises(SystemExit, match="warm-up batches"):
        e2e.summarize_run(_result("balanced", tmp_path / "run", 1.0, rng, cols["samples"][:, 0]))


def test_loss_curves_of_short_runs_use_a_window_that_fits(tmp_path):
    rng = np.random.default_rng(5)
    runs = {name: _result(name, tmp_path, 1.0, rng, rng.integers(1, 4, size=n))
            for name, n in (("token_equal", 20), ("balanced", 25))}
    grid, window = e2e.loss_grid(runs)
    shortest = min(sum(r["samples_rank0"]) for r in runs.values())
    assert window == max(1, shortest // 4) and grid[0] == window and grid[-1] == shortest
    res = runs["token_equal"]
    per_sample = np.repeat(res["losses_rank0"], res["samples_rank0"])
    got = e2e.smoothed_loss_vs_samples(res, grid, window)
    for x, value in zip(grid, got):  # the mean of the `window` samples ending at x (x between samples: linear)
        lo, hi = math.floor(x), math.ceil(x)
        at = [float(np.mean(per_sample[k - window:k])) for k in (lo, hi)]
        expected = at[0] if lo == hi else at[0] + (x - lo) * (at[1] - at[0])
        assert value == pytest.approx(expected, rel=1e-12)


def test_report_without_the_baseline_is_a_clear_error(tmp_path):
    (tmp_path / "balanced.json").write_text(json.dumps({"config": "balanced"}))
    args = type("Args", (), {"workdir": str(tmp_path), "out": str(tmp_path / "r.json")})
    with pytest.raises(SystemExit, match="token_equal.json"):
        e2e.report(args)


def _run_file(work: Path, name: str, epoch_s: float, rng: np.random.Generator) -> dict:
    """A run as `e2e.py run` leaves it for the report: monitor CSV under <work>/<name>/version_0
    and the result dict (returned, not yet written to <work>/<name>.json)."""
    log_dir = work / name / "version_0"
    cols = _write_run(log_dir, rng)
    return {**_result(name, log_dir, epoch_s, rng, cols["samples"][:, 0]), "command": f"run {name}", "devices": WORLD,
            "versions": {}, "device": "cpu", "date": "d", "layers": 1, "m_mem": 65536, "scale": "cpu",
            "samples_in_shards": 100}


def _write_cost_model(work: Path) -> None:
    e2e.CostModel("power", {"a": 5.0, "b": 1e-4, "p": 1.3}, 1.3, {}).to_json(
        work / "token_equal" / "version_0" / "calibration_cost_model.json")


def test_report_repeats_a_configuration_that_had_the_same_plan(tmp_path):
    """dual_constraint skipped as the same plan as token_equal: its row repeats token_equal's
    numbers, marked, with zero loss difference; measured rows are unaffected."""
    rng = np.random.default_rng(6)
    for name, epoch_s in (("token_equal", 9.0), ("balanced", 7.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_run_file(tmp_path, name, epoch_s, rng)))
    _write_cost_model(tmp_path)
    (tmp_path / "dual_constraint.json").write_text(json.dumps(
        {"config": "dual_constraint", "same_plan_as": "token_equal", "command": "run dual_constraint"}))
    args = type("Args", (), {"workdir": str(tmp_path), "out": str(tmp_path / "r.json")})
    e2e.report(args)
    rows = {r["config"]: r for r in json.loads((tmp_path / "r.json").read_text())["runs"]}
    assert set(rows) == {"token_equal", "balanced", "dual_constraint"}
    dual, base = rows.pop("dual_constraint"), rows["token_equal"]
    assert dual.pop("same_plan_as") == "token_equal" and "same_plan_as" not in base
    assert dual == {**base, "config": "dual_constraint"}
    assert rows["balanced"]["throughput_vs_token_equal"] == pytest.approx(
        rows["balanced"]["tokens_consumed"] / 7.0 / (base["tokens_consumed"] / 9.0), rel=1e-12)
    doc = json.loads((tmp_path / "r.json").read_text())
    check, bal = doc["simulator_check"], rows["balanced"]
    assert check["measured"] == bal["throughput_vs_token_equal"] and check["world_size"] == WORLD
    assert check["predicted_for_these_batches"] == pytest.approx(
        (bal["tokens_consumed"] / bal["predicted_step_sum_s"]) / (base["tokens_consumed"] / base["predicted_step_sum_s"]))
    sim = {s["policy"]: s["predicted_tokens_per_s"] for s in doc["simulated_with_calibrated_cost_model"]
           if s["world_size"] == WORLD}
    assert check["simulated"] == pytest.approx(sim["balanced"] / sim["token_equal"])
    assert (tmp_path / "r.png").stat().st_size > 0
    late = [k for k in rows["balanced"] if k.endswith("second_half")]
    assert late and rows["balanced"][late[0]] <= rows["balanced"]["smoothed_loss_max_rel_diff_vs_token_equal"]


def test_report_compares_fused_and_unfused_batch_by_batch(tmp_path):
    rng = np.random.default_rng(7)
    for name in ("token_equal", "balanced", "balanced_fused"):
        res = _run_file(tmp_path, name, 5.0, rng)
        if name == "balanced_fused":  # the same batches as balanced, losses off by known factors
            base = json.loads((tmp_path / "balanced.json").read_text())
            factors = 1 + rng.uniform(-1e-3, 1e-3, size=len(base["losses_rank0"]))
            res["losses_rank0"] = (np.asarray(base["losses_rank0"]) * factors).tolist()
            res["samples_rank0"] = base["samples_rank0"]
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    _write_cost_model(tmp_path)
    e2e.report(type("Args", (), {"workdir": str(tmp_path), "out": str(tmp_path / "r.json")}))
    rows = {r["config"]: r for r in json.loads((tmp_path / "r.json").read_text())["runs"]}
    assert rows["balanced_fused"]["batch_loss_max_rel_diff_vs_balanced"] == pytest.approx(
        float(np.max(np.abs(factors - 1))), rel=1e-9)
    assert "batch_loss_max_rel_diff_vs_balanced" not in rows["balanced"]


@pytest.mark.parametrize("p, expect_same", [(1.0, False), (1.3, False), (3.0, True)])
def test_same_plan_check_agrees_with_the_bucket_batch_sizes(tmp_path, p, expect_same):
    """dual_constraint is skipped only when its plan equals token_equal's: here that holds exactly
    when every bucket gets the same batch size under both rules (same seed, same sampler)."""
    from lightning_adaptiveload.scheduling.policies import batch_sizes

    args = argparse.Namespace(scale="cpu", samples=96, devices=2)
    assert not e2e.same_plan_as_token_equal(args, tmp_path)  # token_equal has not run
    data = e2e.make_datamodule(args, tmp_path, "token_equal", None)
    data.prepare_data()
    data.setup("fit")
    model = e2e.CostModel("power", {"a": 1.0, "b": 1e-3, "p": p}, p, {})
    (tmp_path / "token_equal" / "version_0").mkdir(parents=True)
    model.to_json(tmp_path / "token_equal" / "version_0" / "calibration_cost_model.json")
    seq = data.bucket_seq_lens()
    m_mem = e2e.SCALES["cpu"]["m_mem"]
    same_sizes = np.array_equal(batch_sizes(seq, "token_equal", m_mem),
                                batch_sizes(seq, "dual_constraint", m_mem, model.m_comp(m_mem, int(seq[-1])), model.dual_p))
    # Longest bucket 450 tokens at m_mem 640: B_ref = 1, and the cap floor((450 / S)^p) falls below
    # 640 // S for some S unless p is large.
    assert same_sizes == expect_same
    assert e2e.same_plan_as_token_equal(args, tmp_path) == same_sizes
