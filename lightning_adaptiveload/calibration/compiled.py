"""Calibration of compiled models: find the compiled regions and give dynamo the recompile room
the plan needs.

`torch.compile` specializes a graph on its input shapes; a region compiled without dynamic shapes
recompiles for every new (B, T, H, W), and after `torch._dynamo.config.recompile_limit` (8 by
default) recompiles of one code object dynamo silently runs it eagerly from then on. Calibration
and shape warm-up together feed a compiled model every grid point and every scheduled batch shape,
so they raise the limit to cover them (and say so); the monitor counts any recompile after that.
Regional compilation (`block.compile()` on each transformer block) shares one code object across
identical blocks, so the count is per shape, not per block. See docs/lightning.md, "Compiled
training", for which compile strategy to choose.
"""
from __future__ import annotations

import torch

# Headroom above the shapes calibration knows of: a shape dynamo guards on that the grid does not
# enumerate (e.g. the last, smaller batch of a bucket on the streaming path).
RECOMPILE_SLACK = 8


def compiled_submodules(module: torch.nn.Module) -> list[str]:
    """Names of the submodules (the module itself as "") that run compiled: `nn.Module.compile()`
    sets `_compiled_call_impl`; `torch.compile(module)` returns an OptimizedModule."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [name for name, sub in module.named_modules()
            if getattr(sub, "_compiled_call_impl", None) is not None or isinstance(sub, OptimizedModule)]


def raise_recompile_limit(shapes: int) -> tuple[int, int]:
    """Make dynamo's per-code-object recompile limit (and its accumulated limit) at least
    `shapes + RECOMPILE_SLACK`; returns (old, new) limit. Never lowers a limit the user set."""
    config = torch._dynamo.config
    old = int(config.recompile_limit)
    new = max(old, int(shapes) + RECOMPILE_SLACK)
    config.recompile_limit = new
    config.accumulated_recompile_limit = max(int(config.accumulated_recompile_limit), new)
    return old, new
