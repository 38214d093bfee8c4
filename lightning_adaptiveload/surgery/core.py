"""The model walk behind `apply_fused_adaln`: match modules to patterns, check, bind fused forwards.

A pattern names a class, the source fingerprints of that class's `forward` it was checked
against, a structural check, and a drop-in `forward` that calls the fused op. A module matches a
pattern by class name (anywhere on its MRO) or, for renamed copies, by its forward's fingerprint.
Modules no pattern fuses go to the idiom recogniser (surgery/idioms/). Patching binds the
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
class AdaLNPattern:
    """A checked fused forward for one module class: instances whose class (or a base) is named
    `class_name`, or whose `forward` has a fingerprint in `checked`, get `fused_forward` bound if
    their forward's fingerprint is in `checked` and `check(module)` returns None."""

    name: str  # e.g. "diffusers.WanTransformerBlock"
    class_name: str  # matched against the names on the module's MRO
    fused_forward: Callable  # same signature and outputs as the original forward
    checked: dict[str, str]  # forward source fingerprint -> where it was checked, e.g. "diffusers 0.42.1"
    check: Callable[[nn.Module], str | None]  # why this instance cannot be fused, or None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"AdaLNPattern: name must be a non-empty string, got {self.name!r}")
        if not callable(self.fused_forward) or not callable(self.check):
            raise TypeError(f"AdaLNPattern {self.name}: fused_forward and check must be callables")
        if not isinstance(self.checked, dict) or not self.checked:
            raise ValueError(f"AdaLNPattern {self.name}: checked must be a non-empty dict {{fingerprint: where checked}}")


@dataclass
class SurgeryReport:
    """What `apply_fused_adaln` replaced, found already fused, and saw but left alone (with why)."""

    dry_run: bool = False
    replaced: dict[str, list[str]] = field(default_factory=dict)  # pattern name -> module names
    already_fused: dict[str, list[str]] = field(default_factory=dict)  # pattern name -> module names
    left_alone: list[tuple[str, str, str]] = field(default_factory=list)  # (module name, class, reason)
    # recognised idioms: "generic:<class>" -> the rewritten expressions ("line 57: norm1(x) * (1 + scale) + shift")
    sites: dict[str, list[str]] = field(default_factory=dict)
    # module name -> outcome of the first-call check of an idiom rewrite ("pending first call", "verified ...",
    # "failed ..."); updated in place by that call (surgery/verify.py)
    verification: dict[str, str] = field(default_factory=dict)

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
            "sites": self.sites,
            "verification": self.verification,
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
                lines.append(
                    f"  {p:<{width}}  {len(self.replaced.get(p, [])):>15}  {len(self.already_fused.get(p, [])):>13}  {_names(names)}"
                )
        for p, sites in self.sites.items():
            lines.append(f"{p} sites: " + "; ".join(sites))
        if self.verification:
            by_status: dict[str, list[str]] = {}
            for module, status in self.verification.items():
                by_status.setdefault(status, []).append(module)
            lines.append("first-call verification:")
            lines += [f"  {status}: " + _names(modules) for status, modules in by_status.items()]
        if self.left_alone:
            lines.append(f"left alone ({len(self.left_alone)}):")
            lines += [f"  {_display(m)} ({c}): {r}" for m, c, r in self.left_alone]
        return "\n".join(lines)

    def add_replaced(self, pattern: str, module_name: str) -> None:
        self.replaced.setdefault(pattern, []).append(module_name)

    def withdraw(self, pattern: str, module_name: str, cls: str, reason: str) -> None:
        """Move a module from `replaced` to `left_alone` (a rewrite that failed its first-call check)."""
        names = self.replaced.get(pattern, [])
        if module_name in names:
            names.remove(module_name)
            if not names:
                del self.replaced[pattern]
        self.left_alone.append((module_name, cls, reason))


def _display(module_name: str) -> str:
    return module_name or "<root>"


def _names(module_names: list[str]) -> str:
    shown = ", ".join(_display(n) for n in module_names[:4])
    return shown + (f", ... ({len(module_names)})" if len(module_names) > 4 else "")


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


@functools.lru_cache(maxsize=None)
def source_fingerprint(fn: Callable) -> str | None:
    """sha256 (16 hex) of a function's AST without docstrings, comments and type annotations.

    Two functions share a fingerprint iff they are the same code up to formatting, so a pattern
    applies to every library version whose forward is the one we checked, and to no other. The
    same source gives the same fingerprint on Python 3.10-3.13. None when the source is not
    available (e.g. a C function or a frozen install). Cached per function object.
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


# LayerNorm subclasses whose forward is the LayerNorm of x computed in fp32 and cast back to x's
# dtype (the op's own math): fingerprint of that forward -> where it was checked.
FP32_LAYER_NORM_CHECKED = {"6130489cb2d1044a": "diffusers 0.42.1 FP32LayerNorm"}
WAN_LAYER_NORM_CHECKED = {"0f3a00d425454b87": "Wan2.1 wan/modules/model.py WanLayerNorm"}
UPCAST_LAYER_NORMS = {**FP32_LAYER_NORM_CHECKED, **WAN_LAYER_NORM_CHECKED}


def norm_reason(norm: object, name: str, *, upcast_forwards: dict[str, str] | None = None) -> str | None:
    """Why `norm` (reached as `name`) is not a LayerNorm the fused op reproduces, or None.

    Accepts exactly `torch.nn.LayerNorm` over the last dim, or a subclass whose forward has a
    fingerprint in `upcast_forwards` (e.g. diffusers' FP32LayerNorm). Forward hooks on the norm
    would be bypassed by the fused op, so they are refused too.
    """
    if not isinstance(norm, nn.LayerNorm):
        return f"{name} is {type(norm).__name__}, not a LayerNorm (the fused op is LayerNorm-only)"
    if type(norm) is not nn.LayerNorm:
        if upcast_forwards is None or source_fingerprint(type(norm).forward) not in upcast_forwards:
            return f"{name} is {type(norm).__name__}, a LayerNorm subclass with a forward we have not checked"
    if len(norm.normalized_shape) != 1:
        return f"{name} normalizes over {tuple(norm.normalized_shape)}; the fused op normalizes the last dim only"
    if norm._forward_hooks or norm._forward_pre_hooks:
        return f"{name} has forward hooks that the fused op would bypass"
    return None


def layer_norms_check(*attrs: str, fp32_forward: dict[str, str] | None = None) -> Callable[[nn.Module], str | None]:
    """An AdaLNPattern.check: the first `norm_reason` among the module's `attrs`, or None.

    fp32_forward: the checked fingerprints of LayerNorm subclasses the fused forward may take
    (e.g. FP32_LAYER_NORM_CHECKED); default: exactly torch.nn.LayerNorm.
    """

    def check(module: nn.Module) -> str | None:
        for attr in attrs:
            reason = norm_reason(getattr(module, attr, None), attr, upcast_forwards=fp32_forward)
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
    if not isinstance(x, Tensor):
        return f"x of type {type(x).__name__}"
    if x.dtype not in FLOAT_DTYPES:
        return f"x dtype {x.dtype} (the fused op takes {FLOAT_DTYPES})"
    if x.dim() != 3:
        return f"x of shape {tuple(x.shape)} (the fused op takes (B, N, D) here)"
    return None


def fallback_reason(x: Tensor, shift: Tensor, scale: Tensor, *, result_dtype: torch.dtype) -> str | None:
    """Why the fused op cannot reproduce `norm(x) * (1 + scale) + shift` cast to `result_dtype`
    for these tensors, or None. x (B, N, D); shift, scale (B, 1, D) or (B, N, D)."""
    return upcast_fallback_reason(x) or modulation_fallback_reason(x, shift, scale, result_dtype=result_dtype)


def has_shape(t: Tensor, *sizes: int) -> bool:
    """`t.shape == sizes`, compared size by size.

    Not `tuple(t.shape) in (...)`: under torch.compile with dynamic shapes, dynamo of torch 2.11
    and 2.13 (not 2.14.1) decides membership of an all-constant tuple by comparing it only with
    candidates that are all constants. In a block compiled with dynamic=True, a batch of 1 is
    specialized, so shift's shape (1, 1, D) is all constants (D from a parameter), while x's
    (1, N, D) holds symbols: (batch, 1, dim) never matched, the fused op was skipped for the eager
    fallback, and its warning broke the graph. One `!=` per size is an ordinary SymInt comparison,
    decided and guarded like any other (checked on 2.11, 2.13 and 2.14.1).
    """
    shape = t.shape
    if len(shape) != len(sizes):
        return False
    for have, want in zip(shape, sizes):
        if have != want:
            return False
    return True


def modulation_fallback_reason(x: Tensor, shift: Tensor, scale: Tensor, *, result_dtype: torch.dtype) -> str | None:
    """`fallback_reason` for an x that already passed `upcast_fallback_reason`: shift, scale and
    the result dtype only."""
    batch, seq, dim = x.shape
    for name, t in (("shift", shift), ("scale", scale)):
        if not isinstance(t, Tensor):
            return f"{name} of type {type(t).__name__} (the fused op takes tensors)"
        if t.dtype not in FLOAT_DTYPES:
            return f"{name} dtype {t.dtype} (the fused op takes {FLOAT_DTYPES})"
        if not (has_shape(t, batch, 1, dim) or has_shape(t, batch, seq, dim)):
            return f"{name} of shape {tuple(t.shape)} for x {tuple(x.shape)} (the fused op takes (B, 1, D) or (B, N, D))"
    if shift.shape != scale.shape:
        return f"shift {tuple(shift.shape)} and scale {tuple(scale.shape)} of different shapes"
    if result_dtype != x.dtype:
        return f"result dtype {result_dtype} differs from x dtype {x.dtype} (the fused op writes x's dtype)"
    return None


def _unit_inner_stride(t: Tensor) -> Tensor:
    # The op reads rows with unit inner stride; e.g. `flatten(2).transpose(1, 2)` after a patch
    # embedding is not. A copy changes no value, only what the op keeps for backward.
    return t if t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous()


def adaln_any_stride(x: Tensor, shift: Tensor, scale: Tensor, weight: Tensor | None, bias: Tensor | None,
                     eps: float) -> Tensor:
    """`adaln_modulate`, with x, shift and scale copied to unit inner stride where they are not."""
    return adaln_modulate(_unit_inner_stride(x), _unit_inner_stride(shift), _unit_inner_stride(scale), weight, bias, eps)


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
    return adaln_any_stride(x, shift, scale, norm.weight, norm.bias, norm.eps)


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
    return adaln_any_stride(x, shift, scale, norm.weight, norm.bias, norm.eps)


def run_original(module: nn.Module, reason: str, *args, **kwargs):
    """The class's own forward for this call (warns once per reason)."""
    warn_once(f"fused AdaLN: {type(module).__name__} runs its original forward for {reason}")
    return type(module).forward(module, *args, **kwargs)


def _mro_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _is_torch_class(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "torch"


def pattern_candidates(module: nn.Module, patterns: list[AdaLNPattern]) -> list[AdaLNPattern]:
    """Patterns for `module`: its class (or a base) has the pattern's class name, or its forward is
    code the pattern was checked against under another class name (a renamed copy)."""
    if _is_torch_class(module):
        return []
    mro = _mro_names(module)
    fingerprint = source_fingerprint(type(module).forward)
    return [p for p in patterns if p.class_name in mro or fingerprint in p.checked]


def fused_name(module: nn.Module, patterns: list[AdaLNPattern]) -> str | None:
    """The pattern (or idiom rewrite) whose fused forward is bound on this instance, or None."""
    fn = getattr(module.__dict__.get("forward"), "__func__", None)
    if fn is None:
        return None
    for pattern in patterns:
        if fn is pattern.fused_forward:
            return pattern.name
    return getattr(fn, "_fused_adaln_name", None)


def why_not(module: nn.Module, pattern: AdaLNPattern) -> str | None:
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


def bind(module: nn.Module, pattern: AdaLNPattern) -> None:
    # Instance attribute, not a class change: copy.deepcopy rebinds it to the copy.
    module.forward = types.MethodType(pattern.fused_forward, module)


def unrecognised_reason(module: nn.Module) -> str | None:
    """A reason to list a module nothing fused as 'seen' (it looks like AdaLN), or None."""
    lowered = type(module).__name__.lower()
    if "adalayernorm" in lowered or "adaln" in lowered or "rmsnormzero" in lowered:
        return "AdaLN-like module with no fused pattern and no recognised idiom in its forward"
    if hasattr(module, "adaLN_modulation"):
        return "has `adaLN_modulation` but its forward matches no known pattern or idiom"
    return None


# fuse_idioms(module, module_name, report, dry_run) -> reasons: the idiom recogniser
# (surgery/idioms/recogniser.IdiomRecogniser); it records what it fused in the report and returns
# why sites were left alone.
IdiomFuser = Callable[[nn.Module, str, SurgeryReport, bool], list[str]]


def run_surgery(
    model: nn.Module,
    patterns: list[AdaLNPattern],
    selected: set[str],
    dry_run: bool,
    fuse_idioms: IdiomFuser | None,
) -> SurgeryReport:
    """Walk `model` once. Per module: a selected pattern that applies (the fast path), else the idiom
    recogniser; what neither fuses is listed under `left_alone` when there was a reason to look."""
    report = SurgeryReport(dry_run=dry_run)
    for name, module in model.named_modules():
        done = fused_name(module, patterns)
        if done is not None:
            report.already_fused.setdefault(done, []).append(name)
            continue
        candidates = pattern_candidates(module, patterns)
        usable = [p for p in candidates if p.name in selected]
        reasons = []
        if candidates and not usable:
            reasons.append(f"pattern(s) {', '.join(p.name for p in candidates)} not selected")
        fused = False
        for pattern in usable:
            reason = why_not(module, pattern)
            if reason is None:
                if not dry_run:
                    bind(module, pattern)
                report.add_replaced(pattern.name, name)
                fused = True
                break
            reasons.append(reason)
        if fused:
            continue
        if fuse_idioms is not None and not _is_torch_class(module):
            before = report.num_replaced
            idiom_reasons = fuse_idioms(module, name, report, dry_run)
            fused = report.num_replaced > before
            # fused by idiom: list only its own refused sites, not why the patterns did not apply
            reasons = idiom_reasons if fused else reasons + idiom_reasons
        if not reasons and not fused:
            reason = unrecognised_reason(module)
            reasons = [reason] if reason else []
        if reasons:
            report.left_alone.append((name, type(module).__name__, "; ".join(reasons)))
    return report


def patch_class(cls: type, pattern: AdaLNPattern) -> str:
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
