"""Module surgery: swap the AdaLN (LayerNorm + modulate) of existing DiT/MMDiT models for the
fused op, keeping each model's numerics, parameters and classes. See docs/surgery.md.

    report = apply_fused_adaln(model)        # instance level, any time before FSDP wrapping
    print(report)
    apply_fused_adaln_to_wan()               # class level: diffusers models built afterwards
"""
from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lightning_adaptiveload.surgery import dit, mmdit, video_dit, wan
from lightning_adaptiveload.surgery.core import Pattern, SurgeryReport, run_surgery, source_fingerprint
from lightning_adaptiveload.surgery.mmdit import apply_fused_adaln_to_flux, apply_fused_adaln_to_sd3
from lightning_adaptiveload.surgery.wan import apply_fused_adaln_to_wan

PATTERNS: list[Pattern] = video_dit.PATTERNS + dit.PATTERNS + wan.PATTERNS + mmdit.PATTERNS
PATTERN_NAMES: list[str] = [p.name for p in PATTERNS]


def apply_fused_adaln(
    model: nn.Module, *, patterns: Iterable[str] | None = None, dry_run: bool = False
) -> SurgeryReport:
    """Replace every AdaLN in `model` that a pattern recognises with the fused op, in place.

    patterns: names from PATTERN_NAMES to use (default: all). dry_run: report only, change nothing.
    Idempotent: modules already fused are reported as such and not touched again. Parameters,
    buffers, `state_dict` and module classes are unchanged; only instance `forward`s are bound.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_fused_adaln: model must be a torch.nn.Module, got {type(model).__name__}")
    if patterns is None:
        selected = set(PATTERN_NAMES)
    else:
        selected = set([patterns] if isinstance(patterns, str) else patterns)
        unknown = sorted(selected - set(PATTERN_NAMES))
        if unknown:
            raise ValueError(f"apply_fused_adaln: unknown pattern(s) {unknown}; known: {PATTERN_NAMES}")
    return run_surgery(model, PATTERNS, selected, dry_run)


__all__ = [
    "PATTERNS",
    "PATTERN_NAMES",
    "Pattern",
    "SurgeryReport",
    "apply_fused_adaln",
    "apply_fused_adaln_to_flux",
    "apply_fused_adaln_to_sd3",
    "apply_fused_adaln_to_wan",
    "source_fingerprint",
]
