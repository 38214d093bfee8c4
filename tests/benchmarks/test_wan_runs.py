"""benchmarks/e2e/wan_runs.py: the configurations of runs (a), (b), (c) against what issue 30 asks
of them, the comparison's arithmetic on fake per-run JSONs (tokens/s on the common samples against
an fp64 loop over the buckets, a speed factor known by construction, the targets, the loss
agreement against brute-force windows), epoch 0's tokens/s on a hand-written per-rank CSV, the
surgery's coverage, bad inputs; and the CPU smoke mode end to end (three `adaptiveload fit` runs)."""
import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_adaptiveload.cli import main as cli_main
from lightning_adaptiveload.monitoring.per_rank_log import FIELDS, append_rows
from benchmarks.e2e import wan_runs
from tests.benchmarks import REPO


WAN_BLOCK = "diffusers.models.transformers.transformer_wan.WanTransformerBlock"


def _args(tmp_path: Path, smoke: bool = False) -> argparse.Namespace:
    return argparse.Namespace(workdir=str(tmp_path), steps=12, max_steps=12, log_every=1, samples=80, time_budget_s=45.0,
                              warmup=1, repeats=2, smoke=smoke)


def _callbacks(config: dict) -> list[str]:
    return [c["class_path"].rsplit(".", 1)[1] for c in config["trainer"]["callbacks"]]


# -- the three configurations --

def test_baseline_config_parses():
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(REPO / "examples" / "configs" / "wan21_1.3b_baseline.yaml"), "--print_config"])
    assert exit_info.value.code == 0


def test_run_configs_differ_only_by_the_levers(tmp_path):
    a, b, c = (wan_runs.run_config(name, _args(tmp_path)) for name in "abc")
    # (a): FSDP1 checkpointing every block through the strategy, eager, no surgery, no memory plan
    assert a["trainer"]["strategy"]["class_path"].endswith("FSDPStrategy")
    assert a["trainer"]["strategy"]["init_args"]["activation_checkpointing_policy"] == [WAN_BLOCK]
    assert _callbacks(a) == ["CostModelCalibration", "LoadBalanceMonitor"]
    assert a["model"]["init_args"]["compile"] is None
    assert a["data"]["init_args"]["memory_planning"] is False and a["data"]["init_args"]["drop_last"] is True
    # (b): everything on under FSDP1; (c): the same under FSDP2
    assert b["trainer"]["strategy"]["class_path"].endswith("FSDPStrategy")
    assert c["trainer"]["strategy"]["class_path"].endswith("ModelParallelStrategy")
    for run in (b, c):
        assert _callbacks(run) == ["FusedAdaLNSurgery", "PerBucketCheckpointing", "CompileCache", "CostModelCalibration",
                                  "LoadBalanceMonitor"]
        assert run["model"]["init_args"]["compile"] == "auto" and run["data"]["init_args"]["memory_planning"] is True
    # the same data, steps, recipe and calibration settings in all three
    for run, name in ((a, "a"), (b, "b"), (c, "c")):
        trainer = run["trainer"]
        assert (trainer["devices"], trainer["max_steps"], trainer["max_epochs"], trainer["log_every_n_steps"]) == (1, 12, -1, 1)
        assert trainer["default_root_dir"] == str(tmp_path / name)
        data = run["data"]["init_args"]
        assert (data["shards"], data["index"], data["synthesize"], data["seed"]) == \
            (str(tmp_path / "shards"), str(tmp_path / "index.jsonl"), 80, 0)
        calibration = next(cb["init_args"] for cb in trainer["callbacks"] if cb["class_path"].endswith("CostModelCalibration"))
        assert (calibration["time_budget_s"], calibration["warmup"], calibration["repeats"]) == (45.0, 1, 2)
        assert calibration["cache_path"] == str(tmp_path / name / "calibration_cache.json")
    levers = {"compile", "fsdp2_param_dtype"}
    recipe = {k: v for k, v in b["model"]["init_args"].items() if k not in levers}
    assert {k: v for k, v in a["model"]["init_args"].items() if k not in levers} == recipe
    assert {k: v for k, v in c["model"]["init_args"].items() if k not in levers} == recipe
    keep = lambda d: {k: v for k, v in d.items() if k not in ("memory_planning", "drop_last")}  # noqa: E731
    assert keep(a["data"]["init_args"]) == keep(b["data"]["init_args"]) == keep(c["data"]["init_args"])
    assert a["trainer"]["precision"] == b["trainer"]["precision"] == "bf16-mixed"


def test_smoke_configs_are_the_demo_on_the_cpu(tmp_path):
    demo = yaml.safe_load((REPO / "examples" / "configs" / "wan21_demo.yaml").read_text())
    a, b, c = (wan_runs.run_config(name, _args(tmp_path, smoke=True)) for name in "abc")
    for run in (a, b, c):
        assert run["trainer"]["accelerator"] == "cpu" and run["model"]["init_args"]["compile"] is None
        assert run["model"]["init_args"]["transformer_config"] == demo["model"]["init_args"]["transformer_config"]
        assert run["data"]["init_args"]["m_mem"] == demo["data"]["init_args"]["m_mem"]
    assert "strategy" not in a["trainer"] and "strategy" not in b["trainer"]  # Lightning's FSDP1 needs a GPU
    assert c["trainer"]["strategy"]["class_path"].endswith("ModelParallelStrategy")
    per_bucket = next(cb for cb in b["trainer"]["callbacks"] if cb["class_path"].endswith("PerBucketCheckpointing"))
    assert per_bucket["init_args"] == {"block_classes": [WAN_BLOCK]}
    assert a["data"]["init_args"]["drop_last"] is True and b["data"]["init_args"]["memory_planning"] is True


# -- what one run's files say --

def test_epoch0_tokens_per_s_from_the_per_rank_csv(tmp_path):
    rng = np.random.default_rng(3)
    epochs = np.array([0, 0, 0, 1, 1])
    rows = np.zeros((len(epochs), 1, len(FIELDS)))
    col = {name: i for i, name in enumerate(FIELDS)}
    rows[:, 0, col["epoch"]] = epochs
    rows[:, 0, col["samples"]] = rng.integers(1, 5, len(epochs))
    rows[:, 0, col["seq_len"]] = rng.integers(100, 900, len(epochs))
    rows[:, 0, col["tokens"]] = rows[:, 0, col["samples"]] * rows[:, 0, col["seq_len"]]
    rows[:, 0, col["interval_ms"]] = rng.uniform(100, 900, len(epochs))
    append_rows(tmp_path / "balance_per_rank.csv", rows)
    cols = wan_runs.read_per_rank_csv(tmp_path / "balance_per_rank.csv")
    got = wan_runs.epoch0(cols)
    first = rows[epochs == 0, 0]
    assert got["complete"] and got["steps"] == 3 and got["samples"] == int(first[:, col["samples"]].sum())
    expected = sum(float(r[col["tokens"]]) for r in first) / (sum(float(r[col["interval_ms"]]) for r in first) / 1000)
    assert got["tokens_per_s"] == pytest.approx(expected, rel=1e-12)
    # a run that stopped inside epoch 0 has no epoch tokens/s
    assert wan_runs.epoch0({k: v[:3] for k, v in cols.items()}) == {"complete": False, "steps": 3,
                                                                     "samples": got["samples"], "tokens_per_s": None}


def test_fused_blocks_counts_the_surgery_report(tmp_path):
    config = {"model": {"init_args": {"transformer_config": {"num_layers": 3}}}}
    assert wan_runs.fused_blocks(config, tmp_path) == {"blocks": 3, "fused": 0, "every_block": False, "report": False}
    names = [f"transformer.blocks.{i}" for i in range(3)]
    (tmp_path / "fused_adaln_surgery.json").write_text(json.dumps({"replaced": {"diffusers.WanTransformerBlock": names[:2]}}))
    assert wan_runs.fused_blocks(config, tmp_path)["fused"] == 2
    (tmp_path / "fused_adaln_surgery.json").write_text(json.dumps({"replaced": {"diffusers.WanTransformerBlock": names}}))
    assert wan_runs.fused_blocks(config, tmp_path)["every_block"]
    assert wan_runs.fused_blocks({"model": {"init_args": {}}}, tmp_path)["blocks"] == 30  # the published 1.3B


def test_read_losses_keeps_the_logged_steps(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss,calibration/seconds\n0,0,,12.5\n0,0,1.5,\n0,1,1.25,\n1,2,0.75,\n")
    assert wan_runs.read_losses(path) == {"step": [0, 1, 2], "loss": [1.5, 1.25, 0.75]}


def test_run_stopped_before_its_logs(tmp_path, monkeypatch):
    """A fit the timeout stopped during calibration: the per-run JSON says so, with no result; an
    earlier attempt's log folder is cleared first (its metrics.csv would be appended to)."""
    stale = tmp_path / "b" / "logs" / "version_0"
    stale.mkdir(parents=True)
    (stale / "metrics.csv").write_text("epoch,step,train/loss\n0,0,9.0\n")
    seen = {}

    def stopped(name, args, config):
        seen.update(name=name, config=config, stale_left=stale.exists())
        return {"exit": "timeout", "wall_s": 480.0, "out_of_memory": False, "log_tail": "calibration 3/40"}

    monkeypatch.setattr(wan_runs, "launch", stopped)
    doc = wan_runs.run_one("b", _args(tmp_path))
    assert seen["name"] == "b" and not seen["stale_left"] and seen["config"] == wan_runs.run_config("b", _args(tmp_path))
    assert doc["complete"] is False and doc["result"] is None and doc["losses"] is None and doc["exit"] == "timeout"
    assert doc["surgery"] == {"blocks": 30, "fused": 0, "every_block": False, "report": False}
    assert json.loads((tmp_path / "wan_b.json").read_text())["run"] == "b"


# -- the comparison --

def _buckets(rng, seq_lens, speed: dict[int, float]) -> dict:
    """Per bucket S: samples, tokens, seconds of the steps, at `speed[S]` tokens/s."""
    out = {}
    for s in seq_lens:
        n = int(rng.integers(1, 12))
        out[str(s)] = {"samples": n, "tokens": float(n * s), "step_s": n * s / speed[s]}
    return out


def _run_doc(name: str, buckets: dict, losses: list[float], batches: dict, oom: bool = False, peak_gib: float = 40.0,
             fused: int = 30) -> dict:
    tokens = sum(b["tokens"] for b in buckets.values())
    seconds = sum(b["step_s"] for b in buckets.values())
    return {"benchmark": "wan_runs", "run": name, "config": wan_runs.RUNS[name], "command": f"wan_runs.py --run {name}",
            "date": "2026-01-01T00:00:00+00:00", "git_commit": "abc", "device": "NVIDIA H200 x1",
            "exit": 0, "complete": True, "wall_s": 400.0, "out_of_memory": oom,
            "result": {"verification": {"out_of_memory": 0}, "calibration_source": "cache", "steps": len(losses),
                       "samples_trained": sum(b["samples"] for b in buckets.values()), "tokens_per_s": tokens / seconds,
                       "steady_tokens_per_s": tokens / seconds, "peak_allocated_bytes": peak_gib * 2**30,
                       "peak_reserved_bytes": (peak_gib + 1) * 2**30, "buckets": buckets},
            "epoch0": {"complete": True, "steps": 10, "samples": 40, "tokens_per_s": tokens / seconds},
            "surgery": {"blocks": 30, "fused": fused, "every_block": fused == 30, "report": True},
            "losses": {"step": list(range(len(losses))), "loss": list(losses)}, "batches": batches}


def _fake_runs(rng, b_over_a: float, c_over_b: float, oom_c: bool = False):
    seq_lens = [256, 1560, 9408, 32760, 75600]
    speed_a = {s: float(rng.uniform(8e3, 2e4)) for s in seq_lens}
    steps = 30
    loss = rng.uniform(0.2, 1.5, steps)
    batches_b = {"samples": rng.integers(1, 9, steps).tolist(), "seq_len": rng.choice(seq_lens, steps).tolist()}
    a = _run_doc("a", _buckets(rng, seq_lens[:-1], speed_a), rng.uniform(0.2, 1.5, steps),  # (a) drops the longest
                 {"samples": [1] * steps, "seq_len": [256] * steps}, fused=0)
    speed_b = {s: b_over_a * speed_a[s] for s in seq_lens}
    b = _run_doc("b", _buckets(rng, seq_lens, speed_b), loss, batches_b)
    c = _run_doc("c", _buckets(rng, seq_lens, {s: c_over_b * speed_b[s] for s in seq_lens}), loss * 1.01, batches_b,
                 oom=oom_c, peak_gib=38.0)
    return a, b, c


def _common_reference(base: dict, other: dict) -> float:
    """fp64 loop: per bucket both trained, the fewer samples at each run's own seconds per sample."""
    t_base = t_other = 0.0
    for s, bb in base.items():
        if s not in other:
            continue
        n = min(bb["samples"], other[s]["samples"])
        t_base += n * bb["step_s"] / bb["samples"]
        t_other += n * other[s]["step_s"] / other[s]["samples"]
    return t_base / t_other


def test_compare_ratios_targets_and_losses():
    rng = np.random.default_rng(0)
    a, b, c = _fake_runs(rng, b_over_a=1.5, c_over_b=0.98)
    out = wan_runs.compare({"a": a, "b": b, "c": c})
    # a speed factor that is the same in every bucket is the answer, whatever the samples trained
    assert out["b_over_a"]["common_samples"]["speedup"] == pytest.approx(1.5, rel=1e-12)
    assert out["c_over_b"]["common_samples"]["speedup"] == pytest.approx(0.98, rel=1e-12)
    assert out["targets"] == {"b_over_a_common_samples": out["b_over_a"]["common_samples"]["speedup"], "b_over_a_met": True,
                              "c_over_b_common_samples": out["c_over_b"]["common_samples"]["speedup"],
                              "c_within_3pct_of_b": True, "no_out_of_memory": True, "surgery_fused_every_block_b_c": True,
                              "all_complete": True}
    assert out["runs"]["c"]["peak_memory_gib"] == pytest.approx(39.0)
    assert out["c_over_b"]["peak_memory"] == pytest.approx(39.0 / 41.0)
    # (b) and (c) trained the same batches with losses 1% apart: every measure of the gap says 1%
    loss = out["c_over_b"]["loss"]
    assert loss["same_batches"] and loss["steps"] == 30
    assert loss["per_step_max_rel_diff"] == pytest.approx(0.01, rel=1e-9)
    assert loss["smoothed_max_rel_diff"] == pytest.approx(0.01, rel=1e-9)
    assert not out["b_over_a"]["loss"]["same_batches"] and "per_step_max_rel_diff" not in out["b_over_a"]["loss"]

    # per-bucket speed factors that differ: the fp64 loop over the common samples
    a, b, c = _fake_runs(rng, b_over_a=1.2, c_over_b=0.9, oom_c=True)
    for s in b["result"]["buckets"]:
        b["result"]["buckets"][s]["step_s"] *= float(rng.uniform(0.5, 1.5))
    out = wan_runs.compare({"a": a, "b": b, "c": c})
    assert out["b_over_a"]["common_samples"]["speedup"] == pytest.approx(
        _common_reference(a["result"]["buckets"], b["result"]["buckets"]), rel=1e-12)
    assert out["c_over_b"]["common_samples"]["speedup"] == pytest.approx(
        _common_reference(b["result"]["buckets"], c["result"]["buckets"]), rel=1e-12)
    assert out["out_of_memory_runs"] == 1 and out["targets"]["no_out_of_memory"] is False


def test_compare_thresholds():
    rng = np.random.default_rng(1)
    for b_over_a, c_over_b, met, within in ((1.34, 1.0, False, True), (1.35, 1.031, True, False), (2.0, 0.969, True, False)):
        a, b, c = _fake_runs(rng, b_over_a, c_over_b)
        targets = wan_runs.compare({"a": a, "b": b, "c": c})["targets"]
        assert (targets["b_over_a_met"], targets["c_within_3pct_of_b"]) == (met, within)
    a, b, c = _fake_runs(rng, 1.5, 1.0)
    c["surgery"] = {"blocks": 30, "fused": 29, "every_block": False, "report": True}
    c["complete"], c["result"] = False, None  # a run stopped before its logs existed: no ratio, not complete
    out = wan_runs.compare({"a": a, "b": b, "c": c})
    assert out["c_over_b"] is None and out["targets"]["c_within_3pct_of_b"] is None
    assert out["targets"]["surgery_fused_every_block_b_c"] is False and out["targets"]["all_complete"] is False


def test_moving_average_against_windows():
    values = np.random.default_rng(2).uniform(size=17)
    expected = [values[max(0, i + 1 - 5):i + 1].mean() for i in range(17)]
    np.testing.assert_allclose(wan_runs.moving_average(values, 5), expected, rtol=1e-12)


def test_write_comparison_files_and_bad_inputs(tmp_path):
    rng = np.random.default_rng(4)
    paths = []
    for doc in _fake_runs(rng, 1.4, 1.01):
        paths.append(str(tmp_path / f"wan_{doc['run']}.json"))
        Path(paths[-1]).write_text(json.dumps(doc))
    out = tmp_path / "results" / "wan_runs_h200.json"
    wan_runs.write_comparison(paths, str(out), ["--compare", *paths])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "wan_runs" and [r["run"] for r in doc["runs_from"]] == ["a", "b", "c"]
    assert doc["targets"]["b_over_a_met"]
    assert doc["losses"]["b"]["loss"] == json.loads(Path(paths[1]).read_text())["losses"]["loss"]
    assert out.with_suffix(".png").stat().st_size > 0
    with pytest.raises(ValueError, match="missing: c"):
        wan_runs.write_comparison(paths[:2], str(out), None)
    with pytest.raises(ValueError, match="given twice"):
        wan_runs.write_comparison([paths[0], paths[0], paths[1]], str(out), None)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "shipped_config"}))
    with pytest.raises(ValueError, match="not a per-run JSON"):
        wan_runs.write_comparison([str(other)], str(out), None)


# -- the smoke mode: three `adaptiveload fit` runs on the CPU --

@pytest.mark.slow
def test_smoke_runs_all_three_and_compares(tmp_path):
    pytest.importorskip("diffusers")
    assert wan_runs.main(["--smoke", "--workdir", str(tmp_path), "--steps", "3", "--samples", "40"]) == 0
    doc = json.loads((tmp_path / "wan_runs_smoke.json").read_text())
    for name in "abc":
        run = json.loads((tmp_path / f"wan_{name}.json").read_text())
        assert run["exit"] == 0 and run["complete"] and not run["out_of_memory"], run["log_tail"]
        assert run["losses"]["step"] == [0, 1, 2] and all(0 < v < 100 for v in run["losses"]["loss"])
        assert len(run["batches"]["samples"]) == 3 and run["result"]["steps"] == 3
        assert (tmp_path / name / "fit.log").exists() and (tmp_path / name / "calibration_cache.json").exists()
        assert doc["runs"][name]["surgery"]["fused"] == (0 if name == "a" else 2)
    assert doc["targets"]["surgery_fused_every_block_b_c"] and doc["targets"]["no_out_of_memory"]
    assert doc["b_over_a"]["common_samples"]["tokens"] >= 0 and doc["c_over_b"]["loss"]["steps"] == 3
    assert (tmp_path / "wan_runs_smoke.png").exists()
