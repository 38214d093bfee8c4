"""benchmarks/e2e/compile.py's report arithmetic: --combine of two runs' result files compares every mode with
its own run's eager row, and the pay-back of a mode's extra first pass equals the formula (random
numbers standing in for measured ones; the GPU runs are the lead's)."""
import json

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.shapes import TokenSpec, read_shapes_jsonl
from benchmarks.e2e import compile as compile_benchmark
from tests.benchmarks import REPO

M_MEM = 65536


def run_doc(rng, modes):
    rows = [{"mode": m, "steady_tokens_per_s": float(rng.uniform(1e5, 2e5)), "first_pass_s": float(rng.uniform(3, 150)),
             "compile_s": 0.0, "graphs_compiled": 0, "recompiles_after_first_pass": 0, "graph_breaks": 0,
             "peak_gib": float(rng.uniform(30, 60))} for m in modes]
    meta = {"command": "x", "date": "d", "git_commit": "c", "device": "GPU", "versions": {},
            "settings": {"m_mem": M_MEM}, "batch_shapes": []}
    return meta | {"results": rows, "failed": {}}


def test_combine_compares_each_mode_with_its_own_runs_eager(tmp_path):
    rng = np.random.default_rng(0)
    docs = {"a.json": run_doc(rng, ["eager", "static"]), "b.json": run_doc(rng, ["eager", "auto", "dynamic"])}
    for name, doc in docs.items():
        (tmp_path / name).write_text(json.dumps(doc))
    out = tmp_path / "combined.json"
    assert compile_benchmark.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                   "--out", str(out)]) == 0
    combined = json.loads(out.read_text())
    assert [(r["source"], r["mode"]) for r in combined["results"]] == [
        ("a.json", "eager"), ("a.json", "static"), ("b.json", "eager"), ("b.json", "auto"), ("b.json", "dynamic")]
    mix = read_shapes_jsonl(REPO / "lightning_adaptiveload" / "data" / "reference_mix.jsonl", TokenSpec())
    kept = mix.tokens <= M_MEM
    per_sample = (mix.tokens[kept] * mix.counts[kept]).sum() / mix.counts[kept].sum()
    for name, doc in docs.items():
        eager = doc["results"][0]
        for r in doc["results"][1:]:
            got = combined["amortisation"][name]["modes"][r["mode"]]
            saved = 1 / eager["steady_tokens_per_s"] - 1 / r["steady_tokens_per_s"]  # s per token
            extra = r["first_pass_s"] - eager["first_pass_s"]
            assert got["extra_first_pass_s"] == pytest.approx(extra)
            if saved > 0:
                assert got["break_even_samples"] == pytest.approx(max(extra, 0) / saved / per_sample, rel=1e-9)
                assert got["fraction_of_epoch"] == pytest.approx(got["break_even_samples"] / 100_000)
            else:
                assert got["break_even_samples"] is None


def test_combine_refuses_runs_it_cannot_compare(tmp_path):
    rng = np.random.default_rng(1)
    no_eager, other_m_mem = run_doc(rng, ["static"]), run_doc(rng, ["eager"])
    other_m_mem["settings"]["m_mem"] = 4096
    (tmp_path / "a.json").write_text(json.dumps(run_doc(rng, ["eager"])))
    (tmp_path / "b.json").write_text(json.dumps(no_eager))
    (tmp_path / "c.json").write_text(json.dumps(other_m_mem))
    with pytest.raises(SystemExit, match="no eager row"):
        compile_benchmark.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out",
                                str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="m_mem"):
        compile_benchmark.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--out",
                                str(tmp_path / "o.json")])
