"""benchmarks/kernel/attention.py --smoke on the CPU (a tiny DiT, flash and math): every FLOP count and
rate in its result file against the formulas worked out here from the model's shape (the per-layer
parameter count by hand, not the script's shape hooks), the fastest correct backend against the
timings, and the plot written. The H200 run is the lead's (benchmarks/gpu_session.sh attention)."""
import json

import pytest

from benchmarks.kernel import attention as attention_benchmark


def linear_fwd_flops_by_hand(c: dict, text_len: int, tokens: int) -> int:
    """2 x weights x rows of every linear of examples/video_dit's VideoDiT, layer by layer."""
    d, f, patch = c["dim"], c["ffn_dim"], c["patch"][0] * c["patch"][1] * c["patch"][2]
    per_video_token = (c["in_channels"] * patch * d  # patch embedding (Conv3d)
                       + c["num_layers"] * (4 * d * d + 2 * d * d + 2 * d * f)  # self q k v o, cross q o, FFN
                       + d * c["out_channels"] * patch)  # head
    per_text_token = c["text_dim"] * d + d * d + c["num_layers"] * 2 * d * d  # text embedding, cross k v
    per_sample = c["freq_dim"] * d + d * d + d * 6 * d  # time embedding, time projection
    return 2 * (per_video_token * tokens + per_text_token * text_len + per_sample)


def test_smoke_run_reports_what_the_formulas_give(tmp_path):
    out = tmp_path / "attention.json"
    assert attention_benchmark.main(["--smoke", "--out", str(out), "--kernel-repeats", "2", "--step-repeats", "1"]) == 0
    doc = json.loads(out.read_text())
    smoke = attention_benchmark.SMOKE
    c, text_len = smoke["config"], smoke["text_len"]
    heads, head_dim = c["num_heads"], c["dim"] // c["num_heads"]

    m = doc["matmul"]
    assert m["tflops"] == pytest.approx(2 * m["n"] ** 3 / (m["ms"] * 1e-3) / 1e12)

    kernels = doc["kernels"]
    assert sorted((r["kind"], r["seq_len"]) for r in kernels) == sorted(
        (kind, t * (h // 2) * (w // 2)) for kind in ("self", "cross") for t, h, w in smoke["latents"])
    for r in kernels:
        s_kv = r["seq_len"] if r["kind"] == "self" else text_len
        assert (r["seq_kv"], r["heads"], r["head_dim"], r["batch_size"]) == (s_kv, heads, head_dim, 1)
        assert r["fwd_bwd_flops"] == pytest.approx(3.5 * 4 * heads * r["seq_len"] * s_kv * head_dim)
        ran = {n: b for n, b in r["backends"].items() if b["ms"] is not None and b["error"] is None}
        assert set(ran) == {"flash", "math"}  # both run on the CPU, both within tolerance
        for b in ran.values():
            assert b["tflops"] == pytest.approx(r["fwd_bwd_flops"] / (b["ms"] * 1e-3) / 1e12)
            assert 0 <= b["max_rel_err"] <= b["tolerance"]
        assert r["fastest_correct"] == min(ran, key=lambda n: ran[n]["ms"])
        assert r["torch_default"] == "flash"  # torch's CPU selection: flash whenever it can run

    step = doc["step"]
    t, h, w = smoke["step_latent"]
    tokens = t * (h // 2) * (w // 2)
    flops = step["flops"]
    assert flops["tokens"] == tokens
    assert flops["linear_fwd_bwd"] == pytest.approx(3 * linear_fwd_flops_by_hand(c, text_len, tokens))
    attention = 3.5 * c["num_layers"] * 4 * heads * head_dim * (tokens * tokens + tokens * text_len)
    assert flops["attention_fwd_bwd"] == pytest.approx(attention)
    assert flops["total"] == pytest.approx(flops["linear_fwd_bwd"] + attention)
    assert [r["backend"] for r in step["backends"]][0] == "flash"  # torch's pick runs first
    assert {r["backend"] for r in step["backends"]} == {"flash", "math"}
    for r in step["backends"]:
        assert r["error"] is None
        assert r["utilisation"] == pytest.approx(flops["total"] / (r["ms"] * 1e-3) / (m["tflops"] * 1e12))
    assert step["checkpointed"] == c["num_layers"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_step_the_budget_cannot_hold_is_skipped_and_recorded():
    """Past the deadline the first backend still runs (nothing is known of its step time yet); the next is
    skipped with the reason, at the time the first one's steps took."""
    import argparse
    import time

    import torch

    from examples.video_dit.model import DiTConfig, VideoDiT

    smoke = attention_benchmark.SMOKE
    config = DiTConfig(**smoke["config"])
    model = VideoDiT(config)
    latent = smoke["step_latent"]
    calls = attention_benchmark.record(model, config, smoke["text_len"], 1, latent, torch.device("cpu"))
    args = argparse.Namespace(checkpointed=1, step_warmup=0, step_repeats=1, save_attention=["on", "off"])
    _, rows = attention_benchmark.step_rows(model, config, args, smoke, calls, ["flash", "math"], 1.0,
                                            torch.device("cpu"), deadline=time.perf_counter())
    # each backend with the checkpointed blocks keeping their attention, then recomputing it
    assert [(r["backend"], r["save_attention"]) for r in rows] == [("flash", True), ("flash", False),
                                                                  ("math", True), ("math", False)]
    assert rows[0]["ms"] > 0 and rows[0]["error"] is None
    assert all(r["ms"] is None and r["error"].startswith("skipped:") and "1 steps of" in r["error"] for r in rows[1:])
