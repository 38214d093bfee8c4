"""The entry point: `IdiomRecogniser`, the idiom pass of one `apply_fused_adaln` call (run_surgery's
`fuse_idioms`). Per class one rewrite.ForwardAnalysis; per instance the norm checks
(core.norm_reason); per site the numeric check (verify.check_site); then the rewritten forward is
bound on the instance, its first eager call compared with the original (verify.FirstCallCheck).
"""
from __future__ import annotations

import types
from typing import Callable

import torch
from torch import nn

from lightning_adaptiveload.surgery import verify
from lightning_adaptiveload.surgery.core import UPCAST_LAYER_NORMS, SurgeryReport, norm_reason
from lightning_adaptiveload.surgery.idioms.rewrite import ForwardAnalysis
from lightning_adaptiveload.surgery.idioms.runtime import FusedSite


def _is_norm_like(obj: object) -> bool:
    return isinstance(obj, nn.Module) and any("norm" in c.__name__.lower() for c in type(obj).__mro__)


def _attr(module: nn.Module, dotted: str) -> object:
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def _bound_forward(rewritten: Callable, name: str) -> Callable:
    """The forward bound on instances: the rewritten one, run against the original on its first
    eager call (verify.FirstCallCheck). Under torch.compile the check is not traced."""

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            check = self.__dict__.get(verify.CHECK_ATTR)
            if check is not None:
                return check.run(self, rewritten, args, kwargs)
        return rewritten(self, *args, **kwargs)

    forward._fused_adaln_name = name
    forward._fused_adaln_source = rewritten._fused_adaln_source  # print(block.forward._fused_adaln_source)
    forward.__qualname__ = f"fused_adaln[{name}]"
    return forward


class IdiomRecogniser:
    """The idiom pass of one `apply_fused_adaln` call, as run_surgery's `fuse_idioms`. Analyses
    and rewritten forwards are cached per class for this call only: a helper such as `modulate`
    may be replaced between calls, and the analysis resolved it by identity."""

    def __init__(self) -> None:
        self._analyses: dict[type, ForwardAnalysis | None] = {}
        self._forwards: dict[tuple[type, frozenset], Callable] = {}
        self._checks: dict[tuple, str | None] = {}

    def _check_site(self, site: FusedSite, norm: nn.Module | None) -> str | None:
        """verify.check_site, once per site and norm configuration (the 30 blocks of a model share one)."""
        config = None if norm is None else (
            type(norm), tuple(norm.normalized_shape), norm.eps,
            *((p.dtype, p.device) if p is not None else None for p in (norm.weight, norm.bias)))
        key = (id(site), config)
        if key not in self._checks:
            self._checks[key] = verify.check_site(site, norm)
        return self._checks[key]

    def analyze(self, cls: type) -> ForwardAnalysis | None:
        """The AdaLN sites of `cls.forward`, or None when it has none (or no source)."""
        if cls not in self._analyses:
            analysis = ForwardAnalysis(cls)
            self._analyses[cls] = analysis if analysis.sites else None
        return self._analyses[cls]

    def __call__(self, module: nn.Module, module_name: str, report: SurgeryReport, dry_run: bool) -> list[str]:
        """Rewrite the recognised AdaLN sites of `module`'s forward (per-instance norm checks, then a
        numeric check of each site); record it in `report`. Returns why sites were left alone."""
        cls = type(module)
        analysis = self.analyze(cls)
        if analysis is None:
            return []
        lines = ", ".join(str(s.line) for s in analysis.sites)
        if "forward" in module.__dict__:
            return [f"AdaLN at line(s) {lines}, but forward is already overridden on this instance"]
        if analysis.refusal is not None:
            return [f"AdaLN at line(s) {lines} of {analysis.where}, not rewritten: {analysis.refusal}"]
        accepted, reasons = [], []
        for site in analysis.sites:
            if site.refusal is not None:
                reasons.append(f"{site.describe()}: {site.refusal}")
                continue
            if site.norm_attr is not None:
                norm = _attr(module, site.norm_attr)
                if not _is_norm_like(norm):
                    continue  # e.g. `self.proj(x) * (1 + s) + t`: not a norm at all
                reason = norm_reason(norm, site.norm_attr, upcast_forwards=UPCAST_LAYER_NORMS)
                if reason is not None:
                    reasons.append(f"{site.describe()}: {reason}")
                    continue
            accepted.append(site)
        while accepted:
            keys = frozenset(s.key for s in accepted)
            try:
                rewritten, specs = analysis.build(keys)
            except Exception as error:  # noqa: BLE001 - an unforeseen construct: leave the module alone, say why
                reasons.append(f"{analysis.where} could not be rewritten ({type(error).__name__}: {error})")
                return reasons
            failed = []
            for site in accepted:
                reason = self._check_site(specs[site.key], _attr(module, site.norm_attr) if site.norm_attr else None)
                if reason is not None:
                    failed.append(site)
                    reasons.append(f"{site.describe()}: numeric check failed: {reason}")
            if not failed:
                break
            accepted = [s for s in accepted if s not in failed]
        if not accepted:
            return reasons
        name = f"idiom:{cls.__qualname__}"
        if len(accepted) < len(analysis.sites):
            name += f" (lines {', '.join(str(s.line) for s in accepted)})"
        report.add_replaced(name, module_name)
        report.sites[name] = [s.describe() for s in accepted]
        if not dry_run:
            if (cls, keys) not in self._forwards:
                self._forwards[(cls, keys)] = _bound_forward(rewritten, name)
            module.forward = types.MethodType(self._forwards[(cls, keys)], module)
            module.__dict__[verify.CHECK_ATTR] = verify.FirstCallCheck(report, module_name, name)
            report.verification[module_name] = verify.PENDING
        return reasons
