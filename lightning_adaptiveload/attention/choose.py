"""Measure attention backends on a bucket's calls and choose the fastest correct one per bucket.

`time_calls` times forward+backward of every call on random inputs with the recorded strides
(summed with the calls' counts); `check_backend` compares a backend's output and q, k, v grads with
the fp32 reference (reference.py) on random inputs; `choose_backends` does both for every backend
and bucket and returns an `AttentionPlan`. A backend that refuses a call (torch's "No available
kernel", raised after warnings that say why), runs out of memory or fails otherwise is recorded
with the reason, never raised: the others still get measured.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from lightning_adaptiveload._validation import require_int
from lightning_adaptiveload.attention.backends import (
    attention_backend, candidate_backends, forward_backward, require_backend, torch_choice,
)
from lightning_adaptiveload.attention.calls import SdpaCall, make_inputs
from lightning_adaptiveload.attention.plan import AttentionPlan, BackendResult, BucketAttention
from lightning_adaptiveload.attention.reference import reference_attention, relative_error

# Largest relative error (Frobenius, of out, dq, dk, dv) against the fp32 reference, by input dtype:
# twice the dtype's machine epsilon (bf16 2**-7, fp16 2**-10), since the kernels round the output and,
# in backward, P and dS to it; fp32 inputs get TF32's epsilon (kernels may use TF32 matmuls). A wrong
# kernel (a lost scale, a misread stride) errs by O(1).
TOLERANCE = {"bfloat16": 2 * 2 ** -7, "float16": 2 * 2 ** -10, "float32": 2 * 2 ** -10, "float64": 1e-10}


def _failure(error: BaseException, caught: list) -> str:
    """One line: the exception and the warnings torch gave before it (why a kernel refused)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    reasons = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught))
    text = f"{type(error).__name__}: {first}"
    return f"{text} ({reasons})" if reasons else text


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device, warmup: int = 2, repeats: int = 5) -> float:
    """Median ms of `repeats` calls of fn() after `warmup` untimed ones: CUDA events around each
    call on CUDA (GPU time of the work it queued), the wall clock elsewhere. The one timer of the
    attention measurements and of benchmarks/kernel/attention.py (matmul rate, training steps)."""
    require_int("repeats", repeats)
    require_int("warmup", warmup, minimum=0)
    device = _device(device)
    for _ in range(warmup):
        fn()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def time_calls(calls: Sequence[SdpaCall], backend: str, device="cuda", warmup: int = 2,
               repeats: int = 5) -> BackendResult:
    """Forward+backward ms of every call under `backend` (strict: only that kernel), summed with the
    calls' counts: `.ms`, or None with `.error` saying why when the backend refused a call or failed.
    Inputs are N(0, 1) with each call's shapes and strides (calls.make_inputs), one call at a time."""
    require_backend(backend)
    require_int("repeats", repeats)
    require_int("warmup", warmup, minimum=0)
    device = _device(device)
    total = 0.0
    for call in calls:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                args = make_inputs(call, device)
                with attention_backend(backend, strict=True):
                    total += call.count * median_ms(lambda: forward_backward(args), device, warmup, repeats)
            except (RuntimeError, ImportError) as e:  # torch.OutOfMemoryError is a RuntimeError
                error = _failure(e, caught)
                del e
                _release(device)
                return BackendResult(backend, None, error)
            finally:
                args = None
        _release(device)
    return BackendResult(backend, total)


def reference_outputs(call: SdpaCall, device, seed: int = 0,
                      block_bytes: int = 2 ** 28) -> tuple[dict, torch.Tensor, tuple]:
    """(inputs, output gradient, (out, dq, dk, dv) of the fp32 reference) for one call: N(0, 1)
    inputs from `seed` (make_inputs) and an N(0, 1) output gradient from `seed` + 1."""
    if call.dropout_p:
        raise ValueError("a call with dropout cannot be checked against a deterministic reference")
    args = make_inputs(call, _device(device), seed)
    out_shape = (*call.q_shape[:-1], call.v_shape[-1])
    generator = torch.Generator(device=args["query"].device).manual_seed(seed + 1)
    grad_out = torch.randn(out_shape, generator=generator, device=args["query"].device,
                           dtype=torch.float32).to(args["query"].dtype)
    return args, grad_out, reference_attention(**args, grad_out=grad_out, block_bytes=block_bytes)


def check_backend(backend: str, args: dict, grad_out: torch.Tensor, reference: tuple,
                  tolerance: float) -> tuple[float | None, str | None]:
    """(max relative error of out, dq, dk, dv against `reference` (reference_outputs' for the same
    `args` and `grad_out`), error): the error says why the backend did not run, or that it exceeded
    `tolerance`; (None, why) when it did not run."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with attention_backend(backend, strict=True):
                got = forward_backward(args, grad_out)
            errors = [relative_error(g, r) for g, r in zip(got, reference)]
        except (RuntimeError, ImportError) as e:
            return None, _failure(e, caught)
    worst = max(errors)
    if not worst <= tolerance:
        names = ("out", "dq", "dk", "dv")
        detail = ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errors))
        return (worst if math.isfinite(worst) else None), f"relative error over tolerance {tolerance:.2e} ({detail})"
    return worst, None


def _torch_default(calls: Sequence[SdpaCall], device) -> str | None:
    """The kernel(s) torch's own selection picks for the calls, "+"-joined when they differ."""
    picks = [torch_choice(make_inputs(call, device)) or "none" for call in calls]
    return "+".join(dict.fromkeys(picks))


def choose_backends(calls: Mapping[int, Sequence[SdpaCall]], *, backends: Sequence[str] | None = None,
                    device="cuda", warmup: int = 2, repeats: int = 5, check: bool = True,
                    check_batch_size: int | None = 1, block_bytes: int = 2 ** 28) -> AttentionPlan:
    """Per bucket seq_len -> its step's calls (`CallTemplate.instantiate` or `record_sdpa_calls`):
    every backend of `backends` (default `candidate_backends(device)`) timed (`time_calls`) and, with
    `check`, compared with the fp32 reference (`check_backend`, tolerance `TOLERANCE` by dtype) on
    each call with its batch cut to `check_batch_size` samples (None: the whole batch; the reference
    costs about as much as the fp32 attention, and the kernels' correctness does not depend on B);
    the bucket's backend is the fastest that ran and was within tolerance, None (torch's own choice)
    when none did. The returned plan also records the kernel torch picks by itself."""
    device = _device(device)
    names = list(backends) if backends is not None else candidate_backends(device.type)
    for name in names:
        require_backend(name)
    if check_batch_size is not None:
        require_int("check_batch_size", check_batch_size)
    buckets = []
    for seq_len, bucket_calls in sorted(calls.items()):
        bucket_calls = list(bucket_calls)
        if not bucket_calls:
            raise ValueError(f"bucket {seq_len}: no attention calls to measure")
        errors: dict[str, list[float]] = {n: [] for n in names}
        failures: dict[str, str] = {}
        if check:
            for n, call in enumerate(bucket_calls):
                small = call if check_batch_size is None else call.with_batch(min(call.q_shape[0], check_batch_size))
                args, grad_out, reference = reference_outputs(small, device, seed=2 * n, block_bytes=block_bytes)
                for name in names:
                    if name in failures:
                        continue
                    err, why = check_backend(name, args, grad_out, reference, TOLERANCE[call.dtype])
                    if why is not None:
                        failures[name] = why
                    if err is not None:
                        errors[name].append(err)
                del args, grad_out, reference
                _release(device)
        results = []
        for name in names:
            timing = time_calls(bucket_calls, name, device, warmup, repeats)
            worst = max(errors[name]) if errors[name] else None
            results.append(BackendResult(name, timing.ms, failures.get(name) or timing.error, worst,
                                         None if worst is None else TOLERANCE[bucket_calls[0].dtype]))
        usable = [r for r in results if r.usable and (r.checked or not check)]
        chosen = min(usable, key=lambda r: r.ms).backend if usable else None
        buckets.append(BucketAttention(int(seq_len), bucket_calls[0].q_shape[0], chosen,
                                       _torch_default(bucket_calls, device), results))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return AttentionPlan.of(buckets, name, torch.__version__)
