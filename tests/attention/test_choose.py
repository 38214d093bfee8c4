"""Timing, checking and choosing on the CPU (flash and math run there, efficient and cuDNN refuse), with a
deliberately wrong backend (a stand-in external whose output is off by 5%) that the check must reject;
and the AttentionPlan's JSON: round trip, errors naming the field, backend_for."""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from lightning_adaptiveload.attention import (
    AttentionPlan, BackendResult, BucketAttention, TOLERANCE, choose_backends, record_sdpa_calls, time_calls,
)
from lightning_adaptiveload.attention import backends
from lightning_adaptiveload.attention.backends import EXTERNAL_BACKENDS, SDPA
from lightning_adaptiveload.attention.choose import check_backend, reference_outputs
from tests.attention.helpers import forward, tiny_dit
from tests.helpers.json_docs import assert_rejected


@pytest.fixture(scope="module")
def calls():
    """The tiny DiT's calls in bf16 (self-attention S x S, cross-attention S x 7), S = 24, B = 2."""
    model = tiny_dit().to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return record_sdpa_calls(forward(model, 2, (1, 8, 12)))


@pytest.fixture
def wrong_fa3(monkeypatch):
    """An external backend whose output is 5% too large: runs fast, is wrong."""
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        return 1.05 * SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                           scale=softmax_scale).transpose(1, 2)

    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    monkeypatch.setitem(EXTERNAL_BACKENDS, "fa3", dataclasses.replace(EXTERNAL_BACKENDS["fa3"], devices=("cpu",)))
    monkeypatch.setattr(backends, "_externals", {})


def test_calls_are_bf16_self_and_cross(calls):
    assert [(c.dtype, c.k_shape[-2], c.count) for c in calls] == [("bfloat16", 24, 3), ("bfloat16", 7, 3)]


def test_time_calls_runs_or_says_why(calls):
    flash = time_calls(calls, "flash", "cpu", warmup=1, repeats=2)
    assert flash.ms > 0 and flash.error is None
    refused = time_calls(calls, "efficient", "cpu", warmup=1, repeats=2)
    assert refused.ms is None and "No viable backend" in refused.error


def test_check_passes_the_right_kernels_and_rejects_a_wrong_one(calls, wrong_fa3):
    args, grad_out, reference = reference_outputs(calls[0], "cpu", seed=5)
    assert args["query"].stride() == calls[0].q_stride
    for name in ("flash", "math"):
        err, why = check_backend(name, args, grad_out, reference, TOLERANCE["bfloat16"])
        assert why is None and 0 < err < TOLERANCE["bfloat16"], name  # bf16 rounding: small, not zero
    err, why = check_backend("fa3", args, grad_out, reference, TOLERANCE["bfloat16"])
    assert err == pytest.approx(0.05, rel=0.1) and "over tolerance" in why
    err, why = check_backend("efficient", args, grad_out, reference, TOLERANCE["bfloat16"])
    assert err is None and "No viable backend" in why


def test_choose_takes_the_fastest_correct_and_records_every_backend(calls, wrong_fa3):
    plan = choose_backends({24: calls}, backends=["flash", "math", "efficient", "fa3"], device="cpu",
                           warmup=1, repeats=2)
    bucket = plan.buckets[24]
    results = {r.backend: r for r in bucket.results}
    assert results["efficient"].ms is None and results["efficient"].error
    assert results["fa3"].ms is not None and results["fa3"].correct is False  # it ran, and was wrong
    usable = [r for r in bucket.results if r.usable]
    assert {r.backend for r in usable} == {"flash", "math"}
    assert bucket.backend == min(usable, key=lambda r: r.ms).backend
    assert bucket.torch_default == "flash" and bucket.batch_size == 2
    assert plan.backend_for(24) == bucket.backend and plan.backend_for(25) is None
    assert plan.device == "cpu" and plan.torch_version == torch.__version__


def test_without_check_the_fastest_that_ran_wins(calls):
    plan = choose_backends({24: calls}, backends=["efficient", "flash"], device="cpu", warmup=0, repeats=1,
                           check=False)
    assert plan.backend_for(24) == "flash" and plan.buckets[24].result("flash").max_rel_err is None


def example_plan() -> AttentionPlan:
    return AttentionPlan.of([
        BucketAttention(256, 8, "flash", "flash", (BackendResult("flash", 1.5, None, 3e-3, TOLERANCE["bfloat16"]),
                                                   BackendResult("cudnn", None, "RuntimeError: no kernel"))),
        BucketAttention(75600, 1, None, "flash", (BackendResult("flash", None, "OutOfMemoryError: ..."),)),
    ], "NVIDIA H200", "2.11.0")


def test_plan_json_round_trip(tmp_path):
    plan = example_plan()
    plan.to_json(tmp_path / "plan.json")
    back = AttentionPlan.from_json(tmp_path / "plan.json")
    assert back.to_dict() == plan.to_dict()
    assert back.backend_for(256) == "flash" and back.backend_for(75600) is None
    assert back.backends_used() == {"flash", None}
    assert "75600" in back.format() and "failed" in back.format()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format="other"), "'format' must be"),
    (lambda d: d.update(version=2), "unsupported 'version'"),
    (lambda d: d.pop("buckets"), "missing keys"),
    (lambda d: d.update(buckets={}), "'buckets' must be a list"),
    (lambda d: d["buckets"][0].pop("torch_default"), r"buckets\[0\]: must be an object with keys"),
    (lambda d: d["buckets"][0].update(seq_len=0), r"buckets\[0\]: seq_len must be an integer"),
    (lambda d: d["buckets"][0].update(backend="cudnn"), r"buckets\[0\]: .*'cudnn' is not among its results"),
    (lambda d: d["buckets"][0]["results"][0].update(ms=-1), r"buckets\[0\]: results\[0\]: .*'ms' must be"),
    (lambda d: d["buckets"][0]["results"][0].pop("error"), r"results\[0\]: keys must be"),
    (lambda d: d["buckets"][0]["results"][0].update(tolerance=None), "given together"),
    (lambda d: d["buckets"][0]["results"].append(d["buckets"][0]["results"][0]), "listed twice"),
    (lambda d: d["buckets"].append(d["buckets"][0]), "lists a seq_len twice"),
    (lambda d: d.update(device=3), "'device' must be a string"),
])
def test_plan_errors_name_the_file_and_field(tmp_path, edit, message):
    doc = example_plan().to_dict()
    edit(doc)
    assert_rejected(AttentionPlan.from_json, tmp_path, doc, message)
