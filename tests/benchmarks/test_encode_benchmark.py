"""benchmarks/data/encode.py in its tiny CPU mode: it runs, writes the result header and rows whose
arithmetic holds, and its training-step references are the committed H200 results' numbers."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("av", reason="the [encode] extra (PyAV) is not installed")
pytest.importorskip("transformers", reason="the [encode] extra (transformers) is not installed")

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("encode_benchmark", REPO / "benchmarks" / "data" / "encode.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)


def test_tiny_cpu_run(tmp_path, one_thread, capsys):
    out = tmp_path / "encode.json"
    assert bench.main(["--device", "cpu", "--tiny", "--out", str(out), "--repeats", "1", "--text-repeats", "1"]) == 0
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
        assert row["shape"] in table


def test_training_references_are_the_committed_step_times():
    plan = json.loads((REPO / "benchmarks/results/memory_plan_h200.json").read_text())
    surgery = json.loads((REPO / "benchmarks/results/gpu_surgery/surgery_h200.json").read_text())
    per_bucket = {r["seq_len"]: r for r in plan["configurations"]["per_bucket"]["buckets"]}
    refs = bench.training_step_refs(32760)  # 81 x 480 x 832
    assert [r["source"] for r in refs] == ["benchmarks/results/memory_plan_h200.json",
                                           "benchmarks/results/gpu_surgery/surgery_h200.json"]
    assert refs[0]["train_ms_per_sample"] == per_bucket[32760]["measured_ms"] / per_bucket[32760]["batch_size"]
    assert refs[1]["train_ms_per_sample"] == surgery["results"]["eager"]["step_ms_mean"]
    (ref,) = bench.training_step_refs(75600)  # 81 x 720 x 1280: only the memory plan ran it
    assert ref["train_ms_per_sample"] == per_bucket[75600]["measured_ms"] / per_bucket[75600]["batch_size"]
    assert bench.training_step_refs(12345) == []


def test_dry_run_prints_the_plan(capsys):
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "81x480x832: latent [21, 60, 104], 32760 tokens, not tiled" in out
    assert "81x720x1280: latent [21, 90, 160], 75600 tokens, tiled" in out
