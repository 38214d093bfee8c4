"""The model walk behind `apply_fused_adaln`: match modules to patterns, check, bind fused forwards.

A pattern names a class, the source fingerprints of that class's `forward` it was checked
against, a structural check, and a drop-in `forward` that calls the fused op. Patching binds the
fused forward on the *instance* (`module.forward = ...`), so the module's class, parameters,
buffers and `state_dict` stay exactly as they were: FSDP auto-wrap and activation-checkpointing
policies keyed on the class keep matching, and checkpoints load both ways.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from lightning_adaptiveload.ops import adaln_modulate
from lightning_adaptiveload.ops.adaln import FLOAT_DTYPES


@dataclass(frozen=True)
class Pattern:
    """One recognised AdaLN site: instances of `class_name` whose `forward` source is in `checked`."""

    name: str  # e.g. "diffusers.WanTransformerBlock"
    class_name: str  # matched against the names on the module's MRO
    fused_forward: Callable  # same signature and outputs as the original forward
    checked: dict[str, str]  # forward source fingerprint -> where it was checked, e.g. "diffusers 0.42.1"
    check: Callable[[nn.Module], str | None]  # why this instance cannot be fused, or None


@dataclass
class SurgeryReport:
    """What `apply_fused_adaln` replaced, found already fused, and saw but left alone (with why)."""

    dry_run: bool = False
    replaced: dict[str, list[str]] = field(default_factory=dict)  # pattern name -> module names
    already_fused: dict[str, list[str]] = field(default_factory=dict)  # pattern name -> module names
    left_alone: list[tuple[str, str, str]] = field(default_factory=list)  # (module name, class, reason)

    @property
    def num_replaced(self) -> int:
        return sum(len(names) for names in self.replaced.values())

    def counts(self) -> dict[str, int]:
        """Modules replaced per pattern (would be replaced, for a dry run)."""
        return {pattern: len(names) for pattern, names in self.replaced.items()}

    def to_dict(self) -> dict:
        return {
            "dry_run": self.dry_run,
            "replaced": self.replaced,
            "already_fused": self.already_fused,
            "left_alone": [{"module": m, "class": c, "reason": r} for m, c, r in self.left_alone],
        }

    def __str__(self) -> str:
        verb = "would replace" if self.dry_run else "replaced"
        lines = [f"fused AdaLN surgery: {verb} {self.num_replaced} module(s)"]
        patterns = sorted(set(self.replaced) | set(self.already_fused))
        if patterns:
            width = max(len(p) for p in patterns)
            lines.append(f"  {'pattern':<{width}}  {verb:>15}  {'already fused':>13}  modules")
            for p in patterns:
                names = self.replaced.get(p, []) + self.already_fused.get(p, [])
                shown = ", ".join(_display(n) for n in names[:4]) + (f", ... ({len(names)})" if len(names) > 4 else "")
                lines.append(
                    f"  {p:<{width}}  {len(self.replaced.get(p, [])):>15}  {len(self.already_fused.get(p, [])):>13}  {shown}"
                )
        if self.left_alone:
            lines.append(f"left alone ({len(self.left_alone)}):")
            lines += [f"  {_display(m)} ({c}): {r}" for m, c, r in self.left_alone]
        return "\n".join(lines)


def _display(module_name: str) -> str:
    return module_name or "<root>"


def _canonical(node: object) -> str:
    """AST as text, independent of the Python version's ast.dump format: fields that are None or
    empty (e.g. 3.12's `type_params`) are skipped, type comments and string prefixes ignored."""
    if isinstance(node, ast.AST):
        fields = [
            f"{name}={_canonical(value)}"
            for name, value in ast.iter_fields(node)
            if value is not None and value != [] and name not in ("type_comment", "kind")
        ]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_canonical(item) for item in node) + "]"
    return repr(node)


def source_fingerprint(fn: Callable) -> str | None:
    """sha256 (16 hex) of a function's AST without docstrings, comments and type annotations.

    Two functions share a fingerprint iff they are the same code up to formatting, so a pattern
    applies to every library version whose forward is the one we checked, and to no other. The
    same source gives the same fingerprint on Python 3.10-3.13. None when the source is not
    available (e.g. a C function or a frozen install).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str) and len(body) > 1:
                    node.body = body[1:]
        elif isinstance(node, ast.arg):
            node.annotation = None
    return hashlib.sha256(_canonical(tree).encode()).hexdigest()[:16]


def layer_norm_reason(module: nn.Module, attr: str, *, fp32_forward: dict[str, str] | None = None) -> str | None:
    """Why `module.<attr>` is not a LayerNorm the fused op reproduces, or None.

    Accepts exactly `torch.nn.LayerNorm` over the last dim, or (with `fp32_forward`, the checked
    fingerprints of diffusers' FP32LayerNorm.forward) a subclass whose forward is that one.
    Forward hooks on the norm would be bypassed by the fused op, so they are refused too.
    """
    norm = getattr(module, attr, None)
    if not isinstance(norm, nn.LayerNorm):
        return f"{attr} is {type(norm).__name__}, not a LayerNorm (the fused op is LayerNorm-only)"
    if type(norm) is not nn.LayerNorm:
        if fp32_forward is None or source_fingerprint(type(norm).forward) not in fp32_forward:
            return f"{attr} is {type(norm).__name__}, a LayerNorm subclass with a forward we have not checked"
    if len(norm.normalized_shape) != 1:
        return f"{attr} normalizes over {tuple(norm.normalized_shape)}; the fused op normalizes the last dim only"
    if norm._forward_hooks or norm._forward_pre_hooks:
        return f"{attr} has forward hooks that the fused op would bypass"
    return None


def layer_norms_check(*attrs: str, fp32_forward: dict[str, str] | None = None) -> Callable[[nn.Module], str | None]:
    """A Pattern.check: the first `layer_norm_reason` among `attrs`, or None."""

    def check(module: nn.Module) -> str | None:
        for attr in attrs:
            reason = layer_norm_reason(module, attr, fp32_forward=fp32_forward)
            if reason is not None:
                return reason
        return None

    return check


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def upcast_fallback_reason(x: Tensor) -> str | None:
    """Why the fused op cannot take hidden states x at all, or None. Wan-style blocks (fp32
    modulation, one cast back to x.dtype) check this on entry and otherwise run their original forward."""
    if x.dtype not in FLOAT_DTYPES:
        return f"x dtype {x.dtype} (the fused op takes {FLOAT_DTYPES})"
    if x.dim() != 3:
        return f"x of shape {tuple(x.shape)} (the fused op takes (B, N, D) here)"
    return None


def fallback_reason(x: Tensor, shift: Tensor, scale: Tensor, *, result_dtype: torch.dtype) -> str | None:
    """Why the fused op cannot reproduce `norm(x) * (1 + scale) + shift` cast to `result_dtype`
    for these tensors, or None. x (B, N, D); shift, scale (B, 1, D) or (B, N, D)."""
    reason = upcast_fallback_reason(x)
    if reason is not None:
        return reason
    batch, seq, dim = x.shape
    for name, t in (("shift", shift), ("scale", scale)):
        if t.dtype not in FLOAT_DTYPES:
            return f"{name} dtype {t.dtype} (the fused op takes {FLOAT_DTYPES})"
        if tuple(t.shape) not in ((batch, 1, dim), (batch, seq, dim)):
            return f"{name} of shape {tuple(t.shape)} for x {tuple(x.shape)} (the fused op takes (B, 1, D) or (B, N, D))"
    if result_dtype != x.dtype:
        return f"result dtype {result_dtype} differs from x dtype {x.dtype} (the fused op writes x's dtype)"
    return None


def _unit_inner_stride(t: Tensor) -> Tensor:
    # The op reads rows with unit inner stride; e.g. `flatten(2).transpose(1, 2)` after a patch
    # embedding is not. A copy changes no value, only what the op keeps for backward.
    return t if t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous()


def fused_modulate(norm: nn.LayerNorm, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """`norm(x) * (1 + scale) + shift` (the SD3/Flux/DiT expression) through the fused op.

    x (B, N, D); shift, scale (B, 1, D) or (B, N, D). The op computes in fp32 and rounds once to
    x.dtype; eager rounds after each step in x.dtype, so the two agree exactly in fp32 and within
    rounding noise in bf16/fp16. Where the op cannot produce eager's result (its dtype would differ
    from x's, fp64, unsupported shapes) this call runs the eager expression and warns once.
    """
    result_dtype = torch.promote_types(torch.promote_types(x.dtype, shift.dtype), scale.dtype)
    reason = fallback_reason(x, shift, scale, result_dtype=result_dtype)
    if reason is not None:
        warn_once(f"fused AdaLN: eager fallback for {reason}")
        return norm(x) * (1 + scale) + shift
    return adaln_modulate(
        _unit_inner_stride(x), _unit_inner_stride(shift), _unit_inner_stride(scale), norm.weight, norm.bias, norm.eps
    )


def fused_modulate_fp32(norm: nn.LayerNorm, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """Wan's `(norm(x.float()) * (1 + scale) + shift).type_as(x)` through the fused op.

    shift, scale fp32 (B, 1, D) or (B, N, D); the op computes in fp32 and casts back once, as Wan
    does. Callers check `upcast_fallback_reason(x)` on entry to the block. Modulation shapes the
    op does not take (e.g. a (1, 1, D) time embedding broadcast over B > 1) run this eager
    expression for the call and warn once.
    """
    reason = fallback_reason(x, shift, scale, result_dtype=x.dtype)
    if reason is not None:
        warn_once(f"fused AdaLN: eager fallback for {reason}")
        return (norm(x.float()) * (1 + scale) + shift).type_as(x)
    return adaln_modulate(
        _unit_inner_stride(x), _unit_inner_stride(shift), _unit_inner_stride(scale), norm.weight, norm.bias, norm.eps
    )


def run_original(module: nn.Module, reason: str, *args, **kwargs):
    """The class's own forward for this call (warns once per reason)."""
    warn_once(f"fused AdaLN: {type(module).__name__} runs its original forward for {reason}")
    return type(module).forward(module, *args, **kwargs)


def _mro_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def is_fused(module: nn.Module, pattern: Pattern) -> bool:
    bound = module.__dict__.get("forward")
    return getattr(bound, "__func__", None) is pattern.fused_forward


def why_not(module: nn.Module, pattern: Pattern) -> str | None:
    """Why `pattern` must not be applied to `module`, or None."""
    if "forward" in module.__dict__:
        return "forward is already overridden on this instance (another patch or a hook registry)"
    fingerprint = source_fingerprint(type(module).forward)
    if fingerprint not in pattern.checked:
        where = ", ".join(sorted(set(pattern.checked.values())))
        return (
            f"{type(module).__name__}.forward (source fingerprint {fingerprint}) is not the code pattern "
            f"{pattern.name} was checked against ({where})"
        )
    return pattern.check(module)


def bind(module: nn.Module, pattern: Pattern) -> None:
    # Instance attribute, not a class change: copy.deepcopy rebinds it to the copy.
    module.forward = types.MethodType(pattern.fused_forward, module)


def unrecognised_reason(module: nn.Module) -> str | None:
    """A reason to list a module with no pattern as 'seen' (it looks like AdaLN), or None."""
    name = type(module).__name__
    lowered = name.lower()
    if "adalayernorm" in lowered or "adaln" in lowered or "rmsnormzero" in lowered:
        return "AdaLN-like module with no fused pattern"
    if hasattr(module, "adaLN_modulation"):
        return "has `adaLN_modulation` but its forward matches no known pattern"
    if name == "WanTransformer3DModel":
        return "its output-norm modulation is inline in the model forward (once per step); not patched"
    return None


def run_surgery(model: nn.Module, patterns: list[Pattern], selected: set[str], dry_run: bool) -> SurgeryReport:
    """Walk `model` once; apply each selected pattern to the modules it matches."""
    report = SurgeryReport(dry_run=dry_run)
    for name, module in model.named_modules():
        mro = _mro_names(module)
        candidates = [p for p in patterns if p.class_name in mro]
        if not candidates:
            reason = unrecognised_reason(module)
            if reason:
                report.left_alone.append((name, type(module).__name__, reason))
            continue
        done = next((p for p in candidates if is_fused(module, p)), None)
        if done is not None:
            report.already_fused.setdefault(done.name, []).append(name)
            continue
        usable = [p for p in candidates if p.name in selected]
        if not usable:
            skipped = ", ".join(p.name for p in candidates)
            report.left_alone.append((name, type(module).__name__, f"pattern(s) {skipped} not selected"))
            continue
        reasons = {}
        for pattern in usable:
            reasons[pattern.name] = why_not(module, pattern)
            if reasons[pattern.name] is None:
                if not dry_run:
                    bind(module, pattern)
                report.replaced.setdefault(pattern.name, []).append(name)
                break
        else:
            report.left_alone.append((name, type(module).__name__, "; ".join(reasons.values())))
    return report


def patch_class(cls: type, pattern: Pattern) -> str:
    """Make instances of exactly `cls` built from now on use `pattern` (checked per instance).

    Returns "patched", "already patched", or the reason the class was left alone. Subclasses are
    not patched here (they may change the structure after `super().__init__()`); run
    `apply_fused_adaln` on the built model for those.
    """
    if getattr(cls.__init__, "_fused_adaln_pattern", None) is pattern:
        return "already patched"
    fingerprint = source_fingerprint(cls.forward)
    if fingerprint not in pattern.checked:
        reason = f"{cls.__name__}.forward (fingerprint {fingerprint}) is not the code {pattern.name} was checked against"
        warn_once(f"fused AdaLN: left {cls.__name__} alone: {reason}")
        return reason
    original_init = cls.__init__

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if type(self) is cls:
            reason = why_not(self, pattern)
            if reason is None:
                bind(self, pattern)
            else:
                warn_once(f"fused AdaLN: a new {cls.__name__} was left alone: {reason}")

    init._fused_adaln_pattern = pattern
    cls.__init__ = init
    return "patched"
