"""benchmarks/e2e/cpu_robustness.py without its long runs: what it reads from a fit's output and its
calibration.json, and its per-config summary, on made-up runs."""
import json
import os

import pytest

from benchmarks.e2e import cpu_robustness as bench


def test_the_log_says_whether_the_first_pass_was_trusted_whether_it_fell_back_and_the_throughput():
    trusted = "calibration 1/9: B=1 S=16 2.1 ms\nglobal throughput:                13012.5 tokens/s\n"
    assert bench.parse_log(trusted) == {"trusted_first_pass": True, "fell_back": False, "tokens_per_s": 13012.5}
    again = ("UserWarning: CostModelCalibration: the fit is not trusted (held-out mean error 22.0% > 15%); measuring "
             "again with 9 repeats per point\nglobal throughput:                9000.0 tokens/s\n")
    assert bench.parse_log(again) == {"trusted_first_pass": False, "fell_back": False, "tokens_per_s": 9000.0}
    fallback = (again + "CostModelCalibration: the cost model is NOT trusted (...); training falls back to the "
                "token_equal policy with M_mem = 640\nglobal throughput:   1.0 tokens/s\nglobal throughput: 647.0 tokens/s")
    assert bench.parse_log(fallback) == {"trusted_first_pass": False, "fell_back": True, "tokens_per_s": 647.0}
    assert bench.parse_log("Traceback ...")["tokens_per_s"] is None


def test_the_newest_calibration_json_is_read_and_a_missing_one_is_none(tmp_path):
    assert bench.read_calibration(tmp_path) is None
    old, new = tmp_path / "logs" / "version_0" / "calibration.json", tmp_path / "logs" / "version_1" / "calibration.json"
    for path, source in ((old, "measured again"), (new, "measured")):
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"trusted": source == "measured", "source": source, "policy": "balanced",
                                    "seconds": 3.5, "cold_seconds": 0.25, "verify_seconds": 1.0, "points": []}))
    os.utime(old, (1, 1))
    assert bench.read_calibration(tmp_path) == {"trusted": True, "source": "measured", "policy": "balanced",
                                                "seconds": 3.5, "cold_seconds": 0.25, "verify_seconds": 1.0}


def test_the_summary_counts_each_config_apart():
    def run(config, rc, wall, first, back, rate, trusted):
        return {"config": config, "rc": rc, "wall_s": wall, "trusted_first_pass": first, "fell_back": back,
                "tokens_per_s": rate, "calibration": None if trusted is None else {"trusted": trusted}}

    runs = [run("a.yaml", 0, 10.0, True, False, 100.0, True), run("a.yaml", 0, 30.0, False, True, 10.0, False),
            run("a.yaml", 0, 20.0, False, False, None, True), run("b.yaml", 1, 5.0, True, False, None, None)]
    assert bench.summarize(runs) == {
        "a.yaml": {"runs": 3, "ok": 3, "trusted_first_pass": 1, "trusted": 2, "fell_back": 1, "median_wall_s": 20.0,
                   "median_tokens_per_s": 55.0},
        "b.yaml": {"runs": 1, "ok": 0, "trusted_first_pass": 1, "trusted": 0, "fell_back": 0, "median_wall_s": 5.0,
                   "median_tokens_per_s": None}}


def test_the_fit_command_puts_every_output_under_the_runs_root(tmp_path):
    cmd = bench.fit_command("examples/configs/demo.yaml", tmp_path / "r", tmp_path / "d")
    assert cmd[1:5] == ["-m", "lightning_adaptiveload", "fit", "--config"]
    pairs = dict(zip(cmd[6::2], cmd[7::2]))
    assert pairs == {"--trainer.default_root_dir": str(tmp_path / "r"),
                     "--trainer.logger.init_args.save_dir": str(tmp_path / "r"),
                     "--data.shards": str(tmp_path / "d" / "shards"), "--data.index": str(tmp_path / "d" / "index.jsonl")}
    with pytest.raises(SystemExit):
        bench.main(["--runs", "0"])
