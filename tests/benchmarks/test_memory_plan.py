"""benchmarks/scheduling/memory_plan.py in its CPU smoke mode (a toy DiT on the demo mix): it runs, and its report's
arithmetic holds: the fraction of the mix each configuration trains, the epoch tokens/s from the per-bucket
rows, predicted peaks from the fitted memory model, per-bucket choices inside the budget. (The CPU numbers
themselves mean nothing; the GPU run is the lead's.)"""
import json

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl
from benchmarks.scheduling import memory_plan
from tests.benchmarks import REPO

GiB = 2**30


@pytest.mark.slow
def test_tiny_cpu_run_and_report_arithmetic(tmp_path, one_thread):
    out = tmp_path / "memory_plan.json"
    assert memory_plan.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"command", "date", "device", "versions", "git_commit"} <= doc.keys()
    mix = read_shapes_jsonl(REPO / "examples" / "configs" / "demo_mix.jsonl")
    m_mem = doc["args"]["m_mem"]
    over = mix.tokens > m_mem
    assert over.any(), "the demo mix must have a bucket over the token cap"
    configs = doc["configurations"]
    for name in ("token_equal_ac", "balanced_ac"):
        assert configs[name]["fraction_of_mix_trained"] == pytest.approx(1 - mix.counts[over].sum() / mix.counts.sum())
    assert configs["per_bucket"]["fraction_of_mix_trained"] == 1.0  # the long bucket fits at B = 1
    memory = MemoryModel(doc["memory_model"]["form"], doc["memory_model"]["params"], doc["model"]["blocks"])
    counts = dict(zip(mix.tokens.tolist(), mix.counts.tolist()))
    for name, result in configs.items():
        rows = [r for r in result["buckets"] if r["status"] == "ok"]
        tokens = sum(counts[r["seq_len"]] * r["seq_len"] for r in rows)
        seconds = sum(counts[r["seq_len"]] / r["batch_size"] * np.median(r["timed_steps"]) / 1e3 for r in rows)
        assert result["epoch_tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-12), name
        assert result["epoch_s"] == pytest.approx(seconds, rel=1e-12), name
        first_excess = sum(r["first_ms"] - np.median(r["timed_steps"]) for r in rows) / 1e3
        assert result["first_epoch_s"] == pytest.approx(seconds + first_excess, rel=1e-12), name
        assert all(isinstance(r["first_was_new_shape"], bool) for r in rows)
        for r in result["buckets"]:
            assert r["predicted_peak_gib"] * GiB == pytest.approx(
                memory.predict(r["batch_size"], r["seq_len"], r["checkpointed"]), rel=1e-12)
            assert r["peak_rel_err"] == pytest.approx((r["predicted_peak_gib"] - r["measured_peak_gib"])
                                                      / r["measured_peak_gib"], rel=1e-9)
    # per_bucket on the samples balanced_ac trains, from its own rows
    both = {r["seq_len"] for r in configs["balanced_ac"]["buckets"] if r["status"] == "ok"}
    rows = [r for r in configs["per_bucket"]["buckets"] if r["status"] == "ok" and r["seq_len"] in both]
    same = (sum(counts[r["seq_len"]] * r["seq_len"] for r in rows)
            / sum(counts[r["seq_len"]] / r["batch_size"] * np.median(r["timed_steps"]) / 1e3 for r in rows))
    assert doc["summary"]["per_bucket_vs_balanced_ac_same_samples"] == pytest.approx(
        same / configs["balanced_ac"]["epoch_tokens_per_s"] - 1, rel=1e-9)
    budget = doc["summary"]["budget_gib"]
    for r in configs["per_bucket"]["buckets"]:
        assert 0 <= r["checkpointed"] <= doc["model"]["blocks"]
        assert r["predicted_peak_gib"] <= budget * (1 + 1e-12)
        assert r["batch_size"] <= max(1, m_mem // r["seq_len"])
