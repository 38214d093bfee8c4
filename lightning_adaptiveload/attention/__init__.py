"""Attention per bucket, by measurement: record a step's SDPA calls, derive them for any (B, S), time
and check every backend on them, choose the fastest correct one per bucket, and run each step under
its bucket's backend (README.md here draws the flow; docs/attention.md)."""
from lightning_adaptiveload.attention.backends import (
    BACKENDS, EXTERNAL_BACKENDS, TORCH_BACKENDS, attention_backend, backends_run, candidate_backends,
    external_status,
)
from lightning_adaptiveload.attention.calls import SdpaCall, make_inputs, record_sdpa_calls
from lightning_adaptiveload.attention.choose import TOLERANCE, check_backend, choose_backends, time_calls
from lightning_adaptiveload.attention.plan import AttentionPlan, BackendResult, BucketAttention
from lightning_adaptiveload.attention.reference import reference_attention, relative_error
from lightning_adaptiveload.attention.templates import CallTemplate, Probe, TemplateError

__all__ = ["BACKENDS", "EXTERNAL_BACKENDS", "TORCH_BACKENDS", "attention_backend", "backends_run",
           "candidate_backends", "external_status", "SdpaCall", "make_inputs", "record_sdpa_calls", "TOLERANCE",
           "check_backend", "choose_backends", "time_calls", "AttentionPlan", "BackendResult", "BucketAttention",
           "reference_attention", "relative_error", "CallTemplate", "Probe", "TemplateError"]
