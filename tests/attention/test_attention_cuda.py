"""GPU tests of torch's attention kernels at the shipped shapes (tests/attention/shapes.py: B = 1, 12 heads
of dim 128, bf16, S in 256 .. 75,600, self-attention S x S and cross-attention S x 512, the example model's
transposed (B, S, h, d) views), forward and backward against the blocked fp32 reference on random data
(the reference itself is checked against fp64 math on the CPU, test_reference.py); the non-strict
priority order honoured; a checkpointed recomputation in backward keeping the kernel; and, one process per
backend, the compiled (dynamic=True) call at 75,600. A kernel that refuses a shape is an xfail naming
torch's reason (what the plan records); wrong numbers or any other error fail.
Run on a GPU machine (~1 min on an H200): python -m pytest -m cuda -rA tests/attention/test_attention_cuda.py"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_adaptiveload.attention import TOLERANCE, attention_backend, backends_run
from lightning_adaptiveload.attention.choose import check_backend, reference_outputs
from tests.attention.shapes import SEQ_LENS, cross_attention, self_attention

pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parents[2]
KERNELS = ("flash", "efficient", "cudnn")
CASES = [(kind, s) for s in SEQ_LENS for kind in ("self", "cross")]
_references: dict = {}


def reference(kind: str, seq: int):
    """(inputs, output gradient, fp32 reference) of one shape, computed once per session."""
    key = (kind, seq)
    if key not in _references:
        call = self_attention(seq) if kind == "self" else cross_attention(seq)
        _references.clear()  # one shape's tensors at a time
        _references[key] = reference_outputs(call, "cuda", seed=seq + (kind == "cross"))
    return _references[key]


def refused(why: str | None) -> bool:
    return why is not None and ("No available kernel" in why or "No viable backend" in why)


@pytest.mark.parametrize("kernel", KERNELS)  # the top decorator varies fastest: one shape's reference, then its kernels
@pytest.mark.parametrize("kind, seq", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_kernel_matches_the_reference(kernel, kind, seq):
    args, grad_out, ref = reference(kind, seq)
    assert args["query"].stride() == (seq * 12 * 128, 128, 12 * 128, 1)  # the model's transposed view
    err, why = check_backend(kernel, args, grad_out, ref, TOLERANCE["bfloat16"])
    print(f"{kernel} {kind} S={seq}: max relative error {err}, {why or 'ok'}")
    if refused(why):
        pytest.xfail(f"{kernel} refuses {kind}-attention at S={seq}: {why}")
    assert why is None, why
    assert 0 < err <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_priority_order_runs_the_chosen_kernel_when_it_can(kernel):
    args, grad_out, _ = reference("self", 3600)
    q, k, v = args["query"], args["key"], args["value"]

    def step():
        out = F.scaled_dot_product_attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad_out)
        torch.cuda.synchronize()

    with attention_backend(kernel):  # not strict: the others are enabled after it
        ran = backends_run(step)
    if ran != {kernel}:
        with attention_backend(kernel, strict=True):
            try:
                step()
            except RuntimeError as e:
                pytest.xfail(f"{kernel} refuses this shape, {ran} ran instead: {str(e).splitlines()[0]}")
    assert ran == {kernel}


@pytest.mark.parametrize("kernel", KERNELS)
def test_checkpointed_recomputation_in_backward_keeps_the_kernel(kernel):
    """The backward runs on the autograd engine's device thread; the recomputed forward must use the kernel
    too (another kernel's saved tensors would not match the checkpoint's)."""
    args, grad_out, ref = reference("cross", 3600)
    q, k, v = args["query"], args["key"], args["value"]

    def step():
        out = torch.utils.checkpoint.checkpoint(F.scaled_dot_product_attention, q, k, v, use_reentrant=False)
        got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
        torch.cuda.synchronize()
        return got

    with attention_backend(kernel, strict=True):
        try:
            ran = backends_run(step)
        except RuntimeError as e:
            if refused(str(e)):
                pytest.xfail(f"{kernel} refuses this shape: {str(e).splitlines()[0]}")
            raise
    assert ran == {kernel}


def test_compiled_dynamic_shapes_at_75600_one_process_per_kernel():
    """torch.compile(dynamic=True) of the call, traced at 3,600 and run at 75,600 (the issue's crash point),
    forward and backward vs the reference; each kernel in its own process, all three at once."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_COMPILE_THREADS": "4"}
    procs = {kernel: subprocess.Popen([sys.executable, str(REPO / "tests" / "attention" / "compiled_script.py"), kernel,
                                       "3600", "75600"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for kernel in KERNELS}
    rows, failures = [], []
    for kernel, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        print(f"{kernel}: exit {proc.returncode}; " + "; ".join(json.dumps(r) for r in got))
        if proc.returncode != 0:
            failures.append(f"{kernel}: process exited {proc.returncode}: {err[-2000:]}")
        elif [r["seq_len"] for r in got] != [3600, 75600] and got[-1]["status"] != "error":
            failures.append(f"{kernel}: expected results at S = 3600 and 75600, got {got}")
        rows += got
    for r in rows:
        where = f"{r['backend']} at S={r['seq_len']} compiled"
        if r["status"] == "error":
            failures.append(f"{where}: {r['error']}")
        elif r["status"] == "ok" and r["ran"] != [r["backend"]]:
            failures.append(f"{where} ran {r['ran']}")
        elif r["status"] == "ok" and not r["max_rel_err"] <= TOLERANCE["bfloat16"]:
            failures.append(f"{where}: relative error {r['max_rel_err']}")
    assert not failures, "\n".join(failures)
    refusals = [r for r in rows if r["status"] == "refused"]
    if refusals:
        pytest.xfail("refused under compile: " + "; ".join(f"{r['backend']} S={r['seq_len']}: {r['error']}"
                                                           for r in refusals))
