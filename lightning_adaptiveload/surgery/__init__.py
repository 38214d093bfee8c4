"""Module surgery: swap the AdaLN (LayerNorm + modulate) of existing DiT/MMDiT models for the
fused op, keeping each model's numerics, parameters and classes. See docs/surgery.md.

    report = apply_fused_adaln(model)        # instance level, any time before FSDP wrapping
    print(report)
    apply_fused_adaln_to_wan()               # class level: diffusers models built afterwards

Two ways a module is recognised: a pattern (a fused forward checked against the exact source of
a known class: diffusers, the original DiT, or one you register), and, for code no pattern knows,
the idiom recogniser (surgery/idioms/: an AST rewrite of the forward, verified numerically).
`PATTERNS` / `PATTERN_NAMES` are read at each access, so they include registered patterns.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_adaptiveload.surgery import dit, mmdit, verify, wan
from lightning_adaptiveload.surgery.core import (
    FP32_LAYER_NORM_CHECKED,
    AdaLNPattern,
    SurgeryReport,
    fused_modulate,
    fused_modulate_fp32,
    layer_norms_check,
    run_original,
    run_surgery,
    source_fingerprint,
    upcast_fallback_reason,
)
from lightning_adaptiveload.surgery.idioms import IdiomRecogniser
from lightning_adaptiveload.surgery.mmdit import apply_fused_adaln_to_flux, apply_fused_adaln_to_sd3
from lightning_adaptiveload.surgery.registry import (
    PatternSpec,
    merge_patterns,
    register_adaln_patterns,
    registered_patterns,
    resolve_patterns,
)
from lightning_adaptiveload.surgery.wan import apply_fused_adaln_to_wan

register_adaln_patterns(dit.PATTERNS, wan.PATTERNS, mmdit.PATTERNS)


def __getattr__(name: str) -> Any:
    if name == "PATTERNS":
        return tuple(registered_patterns())
    if name == "PATTERN_NAMES":
        return tuple(p.name for p in registered_patterns())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply_fused_adaln(
    model: nn.Module,
    *,
    patterns: Iterable[str] | None = None,
    extra_patterns: PatternSpec | None = None,
    idioms: bool = True,
    dry_run: bool = False,
    example_inputs: tuple | dict | None = None,
) -> SurgeryReport:
    """Replace every AdaLN in `model` that a pattern or the idiom recogniser fuses, in place.

    patterns: names of patterns to use, from PATTERN_NAMES and `extra_patterns` (default: all).
    extra_patterns: AdaLNPatterns for this call, tried before the registered ones; objects,
        import paths ("examples.video_dit.surgery.VIDEO_DIT_PATTERNS") or lists of them.
    idioms: rewrite recognised AdaLN idioms in modules no pattern fuses (docs/surgery.md).
    dry_run: report only, change nothing.
    example_inputs: positional args (tuple) or keyword args (dict) of `model` for one no-grad
        call right after the surgery, which runs the first-call check of every idiom rewrite now
        (e.g. before torch.compile, under which that check cannot run). RNG states are restored.
    Idempotent: modules already fused are reported as such and not touched again. Parameters,
    buffers, `state_dict` and module classes are unchanged; only instance `forward`s are bound.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_fused_adaln: model must be a torch.nn.Module, got {type(model).__name__}")
    available = merge_patterns(resolve_patterns(extra_patterns), registered_patterns())
    names = [p.name for p in available]
    if patterns is None:
        selected = set(names)
    else:
        selected = set([patterns] if isinstance(patterns, str) else patterns)
        unknown = sorted(selected - set(names))
        if unknown:
            raise ValueError(f"apply_fused_adaln: unknown pattern(s) {unknown}; known: {names}")
    report = run_surgery(model, available, selected, dry_run, IdiomRecogniser() if idioms else None)
    if example_inputs is not None and not dry_run and verify.PENDING in report.verification.values():
        args, kwargs = (((), example_inputs) if isinstance(example_inputs, dict) else (tuple(example_inputs), {}))
        with torch.random.fork_rng(devices=verify.cuda_devices(model, (args, kwargs))), torch.no_grad():
            model(*args, **kwargs)
    return report


__all__ = [
    "FP32_LAYER_NORM_CHECKED",
    "AdaLNPattern",
    "PatternSpec",
    "SurgeryReport",
    "apply_fused_adaln",
    "apply_fused_adaln_to_flux",
    "apply_fused_adaln_to_sd3",
    "apply_fused_adaln_to_wan",
    "fused_modulate",
    "fused_modulate_fp32",
    "layer_norms_check",
    "register_adaln_patterns",
    "registered_patterns",
    "resolve_patterns",
    "run_original",
    "source_fingerprint",
    "upcast_fallback_reason",
]
