"""benchmarks/data/encode.py in its tiny CPU mode: it runs, writes the result header and rows whose
arithmetic holds, and its training-step references are the committed H200 results' numbers."""
import json

import pytest

from benchmarks.data import encode as bench
from tests.benchmarks import REPO

pytest.importorskip("av", reason="the [encode] extra (PyAV) is not installed")
pytest.importorskip("transformers", reason="the [encode] extra (transformers) is not installed")


def test_tiny_cpu_run(tmp_path, one_thread, capsys):
    out = tmp_path / "encode.json"
    assert bench.main(["--device", "cpu", "--tiny", "--out", str(out), "--repeats", "1", "--text-repeats", "1",
                       "--pipeline-clips", "2", "--num-workers", "1"]) == 0
    doc = json.loads(out.read_text())
    assert {"command", "date", "device", "versions", "git_commit"} <= doc.keys()
    assert doc["versions"]["diffusers"] and doc["versions"]["transformers"] and doc["versions"]["av"]
    assert doc["text"]["finite"] and doc["text"]["caption_tokens"] == bench.CAPTION_WORDS + 1
    table = capsys.readouterr().out
    for row, (f, h, w) in zip(doc["shapes"], [(9, 32, 48), (9, 48, 80)]):
        assert row["status"] == "ok" and row["latent_finite"]
        assert row["latent_shape"] == [1 + (f - 1) // 4, h // 8, w // 8]
        assert row["tokens"] == row["latent_shape"][0] * (h // 16) * (w // 16)  # patch (1, 2, 2)
        assert row["clip_s"] == pytest.approx(row["vae_s"] + doc["text"]["median_ms"] / 1e3)
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] * row["clips_per_s"])
        assert row["tiled"] == (h * w > 32 * 48) and row["decode_cpu_s"] > 0
        run = row["pipeline"]  # encode_videos itself, on two clips of this shape
        assert run["clips"] == 2 and run["decode_wait_share"] == pytest.approx(run["wait_s"] / run["seconds"])
        assert run["tokens_per_s"] == pytest.approx(row["tokens"] * run["clips_per_s"])
        assert 0 <= run["decode_wait_share"] < 1
        assert row["shape"] in table
    assert not doc["skipped"]
    # a spent budget skips the stages left, and says which
    assert bench.main(["--device", "cpu", "--tiny", "--out", str(out), "--repeats", "1", "--text-repeats", "1",
                       "--budget-s", "0"]) == 0
    doc = json.loads(out.read_text())
    assert [r["status"] for r in doc["shapes"]] == ["not run", "not run"]
    assert doc["skipped"] == ["9x32x48: encoders (budget of 0 s spent)", "9x48x80: encoders (budget of 0 s spent)"]


def test_training_references_are_the_committed_step_times():
    plan = json.loads((REPO / "benchmarks/results/memory_plan_h200.json").read_text())
    surgery = json.loads((REPO / "benchmarks/results/gpu_surgery/surgery_h200.json").read_text())
    per_bucket = {r["seq_len"]: r for r in plan["configurations"]["per_bucket"]["buckets"]}
    curve = json.loads((REPO / "lightning_adaptiveload/data/h200_dit_cost_curve.json").read_text())
    measured = {m["seq_len"]: m["time_ms"] for m in curve["measurements"] if m["batch_size"] == 1}
    refs = bench.training_step_refs(32760)  # 81 x 480 x 832
    assert [r["source"] for r in refs] == ["lightning_adaptiveload/data/h200_dit_cost_curve.json",
                                           "benchmarks/results/memory_plan_h200.json",
                                           "benchmarks/results/gpu_surgery/surgery_h200.json"]
    # the curve times 4 blocks at B = 1: Wan 2.1 1.3B has 30
    assert refs[0]["train_ms_per_sample"] == pytest.approx(measured[32760] * 30 / 4) and not refs[0]["extrapolated"]
    assert refs[1]["train_ms_per_sample"] == per_bucket[32760]["measured_ms"] / per_bucket[32760]["batch_size"]
    assert refs[2]["train_ms_per_sample"] == surgery["results"]["eager"]["step_ms_mean"]
    fitted, planned = bench.training_step_refs(75600)  # 81 x 720 x 1280: beyond the curve; the memory plan ran it
    assert fitted["extrapolated"] and "extrapolated" in fitted["field"]
    # above the largest measured point (46800 tokens), growing at least linearly in tokens
    assert fitted["train_ms_per_sample"] > measured[46800] * 30 / 4 * 75600 / 46800
    assert planned["train_ms_per_sample"] == per_bucket[75600]["measured_ms"] / per_bucket[75600]["batch_size"]
    assert [r["source"] for r in bench.training_step_refs(12345)] == [refs[0]["source"]]


def test_dry_run_prints_the_plan(capsys):
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "81x480x832: latent [21, 60, 104], 32760 tokens, not tiled" in out
    assert "81x720x1280: latent [21, 90, 160], 75600 tokens, tiled" in out
