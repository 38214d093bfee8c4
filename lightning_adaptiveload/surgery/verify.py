"""Numeric checks of idiom rewrites (surgery/idioms/): nothing is kept that was not compared.

1. At surgery time, per instance and per rewritten site (`check_site`): the fused op against the
   site's eager expression on random inputs of the norm's real width, parameters and device,
   outputs and gradients (x, shift, scale and the norm's parameters), per-sample and per-token
   modulation. A site that differs is not rewritten; the reason goes to the report.
2. On the module's first eager call (`FirstCallCheck`): the original and the rewritten forward
   both run on that call's inputs (copies, same RNG state, no autograd graph) and their outputs are
   compared at a tolerance for their dtype (`OUTPUT_RTOL`); then the call runs again, with autograd,
   through the rewritten forward if they agreed, else through the original one, which stays
   bound from then on (the report says why, and a warning is raised). How many forwards run does
   not depend on the numbers compared, so every rank runs the same ones (collectives inside a block
   stay matched); the RNG state and the module's buffers end as after one call. A forward that changes its buffers (a counter,
   running statistics) cannot be compared this way and keeps its original forward. Under
   torch.compile the first call is traced, not run: this check is skipped (the report keeps saying
   "pending"); pass `example_inputs` to `apply_fused_adaln` to run it before compiling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_adaptiveload.surgery.core import SurgeryReport, warn_once

CHECK_ATTR = "_fused_adaln_first_call_check"
PENDING = "pending: compared with the original forward on its first eager call"

# First-call tolerance, relative L2 error of each output tensor, by its dtype. The op computes in
# fp32 and rounds once where eager may round after every step (SD3/DiT style in 16-bit), so
# 16-bit outputs differ by a few ulps through a block; a misread site (wrong eps, shift and scale
# exchanged, a dropped cast) differs by O(1).
OUTPUT_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}
# Site check on random inputs: fp32 outputs and gradients, and 16-bit outputs.
SITE_RTOL = {torch.float32: 1e-5, torch.float16: 2.0**-6, torch.bfloat16: 2.0**-6}
SITE_GRAD_RTOL = 1e-4
_SITE_WIDTH = 8  # D for functional sites, whose width is known only at run time


def rel_err(a: Tensor, ref: Tensor, floor: float = 1e-30) -> float:
    """||a - ref|| / max(||ref||, floor), in fp64."""
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm().clamp_min(floor))


# --- 1. per site, at surgery time -----------------------------------------------------------------------
def _site_values(site: Any, norm: nn.Module | None, width: int, x_dtype: torch.dtype, mod_dtype: torch.dtype,
                 rows: int, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    """Random leaves for `site` by role: x (2, 3, D), shift/scale (2, rows, D), the norm's own
    parameters (module norms) or random ones (F.layer_norm), casts to fp32 in and to x's dtype out."""

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)

    x = rand(2, 3, width, dtype=x_dtype)
    values: dict[str, Any] = {"x": x, "shift": rand(2, rows, width, dtype=mod_dtype),
                              "scale": rand(2, rows, width, dtype=mod_dtype)}
    targets = {"in_cast": torch.float32, "mid_cast": x_dtype, "out_cast": x_dtype}
    for role in site.roles:
        if role == "norm":
            values[role] = norm
        elif role == "normalized_shape":
            values[role] = (width,)
        elif role in ("weight", "bias"):
            values[role] = rand(width)
        elif role == "eps":
            values[role] = 1e-5
        elif role in targets:
            method = site.casts[role.removesuffix("_cast")].method
            values[role] = targets[role] if method == "to" else torch.zeros(1, device=device, dtype=targets[role])
    return values


def check_site(site: Any, norm: nn.Module | None) -> str | None:
    """Why `site` (an idioms.runtime.FusedSite) must not be fused with this norm, or None.

    Compares `site.fused` with `site.eager` wherever the site would use the op, for x in fp32
    (else the first 16-bit dtype it takes). Inputs the eager expression itself rejects are
    skipped; norms on the meta device cannot be run and are left to the first-call check.
    """
    params = list(norm.parameters()) if norm is not None else []
    device = params[0].device if params else torch.device("cpu")
    if device.type == "meta":
        return None
    width = int(norm.normalized_shape[0]) if norm is not None else _SITE_WIDTH
    gen = torch.Generator().manual_seed(0)
    for x_dtype in (torch.float32, torch.bfloat16, torch.float16):
        compared = 0
        for mod_dtype in dict.fromkeys((x_dtype, torch.float32)):
            for rows in (1, 3):
                values = _site_values(site, norm, width, x_dtype, mod_dtype, rows, device, gen)
                if site.fallback_reason(values) is not None:
                    continue
                try:
                    expected = site.eager(values)
                except (RuntimeError, TypeError, ValueError):  # e.g. a bf16-weight LayerNorm given fp32 x
                    continue
                reason = _compare_site(site.fused(values), expected, values, params, x_dtype)
                if reason is not None:
                    return f"x {x_dtype}, shift/scale {mod_dtype} {tuple(values['shift'].shape)}: {reason}"
                compared += 1
        if compared:
            return None
    return None


def _compare_site(got: Tensor, expected: Tensor, values: dict[str, Any], params: list[Tensor],
                  x_dtype: torch.dtype) -> str | None:
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"fused gives {got.dtype} {tuple(got.shape)}, eager {expected.dtype} {tuple(expected.shape)}"
    err = rel_err(got, expected)
    if err > SITE_RTOL[x_dtype]:
        return f"output differs by {err:.2e} relative"
    if x_dtype != torch.float32:  # 16-bit gradients differ by eager's roundings; fp32 checks the math
        return None
    inputs = [values[k] for k in ("x", "shift", "scale", "weight", "bias") if isinstance(values.get(k), Tensor)]
    inputs += [p for p in params if p.requires_grad]
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to(expected)
    grads_got = torch.autograd.grad((got * cotangent).sum(), inputs, allow_unused=True)
    grads_expected = torch.autograd.grad((expected * cotangent).sum(), inputs, allow_unused=True)
    for i, (g, e) in enumerate(zip(grads_got, grads_expected)):
        if (g is None) != (e is None):
            return f"gradient {i} is missing on one side"
        if g is not None and rel_err(g, e) > SITE_GRAD_RTOL:
            return f"gradient {i} differs by {rel_err(g, e):.2e} relative"
    return None


# --- 2. per module, on its first call -----------------------------------------------------------------------
def _as_tree(out: Any) -> Any:
    """Model outputs with a `to_tuple` (diffusers BaseOutput, transformers ModelOutput) as tuples."""
    return tuple(out.to_tuple()) if hasattr(out, "to_tuple") else out


def compare_outputs(got: Any, expected: Any) -> str | None:
    """Why the rewritten forward's output `got` is not the original's `expected`, or None."""
    got_leaves, got_spec = pytree.tree_flatten(_as_tree(got))
    expected_leaves, expected_spec = pytree.tree_flatten(_as_tree(expected))
    if got_spec != expected_spec:
        return f"the output structure differs ({type(got).__name__} vs {type(expected).__name__})"
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        if isinstance(e, Tensor):
            if not isinstance(g, Tensor) or g.shape != e.shape or g.dtype != e.dtype:
                return (f"output {i} is {getattr(g, 'dtype', type(g).__name__)} {tuple(getattr(g, 'shape', ()))}, "
                        f"the original's {e.dtype} {tuple(e.shape)}")
            if not e.is_floating_point():
                if not torch.equal(g, e):
                    return f"output {i} ({e.dtype}) differs"
                continue
            finite = torch.isfinite(e)
            if not torch.equal(finite, torch.isfinite(g)):
                return f"output {i} has non-finite values in other places"
            err = rel_err(g[finite], e[finite])
            tolerance = OUTPUT_RTOL.get(e.dtype, 0.0)
            if err > tolerance:
                return f"output {i} differs by {err:.2e} relative (tolerance {tolerance:g} for {e.dtype})"
        else:
            try:
                same = bool(g == e)
            except Exception:  # noqa: BLE001 - objects we cannot compare count as different
                same = False
            if not same:
                return f"output {i} ({type(e).__name__}) differs"
    return None


def _copy_inputs(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, tree)


def _versions(module: nn.Module) -> list[int]:
    return [t._version for t in [*module.parameters(), *module.buffers()]]


def cuda_devices(module: nn.Module, tree: Any) -> list[int]:
    tensors = [*module.parameters(), *module.buffers(), *(t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor))]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


@dataclass
class FirstCallCheck:
    """Kept on a rewritten module (attribute CHECK_ATTR) until its first eager call."""

    report: SurgeryReport
    module_name: str
    pattern_name: str

    def run(self, module: nn.Module, rewritten: Callable, args: tuple, kwargs: dict) -> Any:
        original = type(module).forward
        versions = _versions(module)
        buffers = list(module.buffers())
        saved = [b.detach().clone() for b in buffers]
        devices = cuda_devices(module, (args, kwargs))
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            expected = original(module, *_copy_inputs(args), **_copy_inputs(kwargs))
        if _versions(module) != versions:
            with torch.no_grad():  # undo what the check's run changed (a counter, running statistics)
                for buffer, value in zip(buffers, saved):
                    buffer.copy_(value)
            reason = "its forward changes the module's parameters or buffers, so it cannot run twice to be compared"
        else:
            try:
                with torch.random.fork_rng(devices=devices), torch.no_grad():
                    got = rewritten(module, *_copy_inputs(args), **_copy_inputs(kwargs))
                reason = compare_outputs(got, expected)
            except Exception as error:  # noqa: BLE001 - a rewrite that raises is a failed rewrite
                reason = f"the rewritten forward raised {type(error).__name__}: {error}"
        module.__dict__.pop(CHECK_ATTR, None)
        if reason is None:
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in pytree.tree_leaves(_as_tree(expected))
                             if isinstance(t, Tensor) and t.is_floating_point()})
            self.report.verification[self.module_name] = f"verified on its first call ({', '.join(dtypes) or 'no float'} outputs)"
            return rewritten(module, *args, **kwargs)
        module.__dict__.pop("forward", None)
        self.report.verification[self.module_name] = f"failed on its first call, original forward restored: {reason}"
        self.report.withdraw(self.pattern_name, self.module_name, type(module).__name__,
                             f"rewrite failed its first-call check: {reason}")
        warn_once(f"fused AdaLN: the rewrite of {type(module).__qualname__}.forward failed its first-call check "
                  f"({reason}); those modules run their original forward (see the surgery report)")
        return original(module, *args, **kwargs)
