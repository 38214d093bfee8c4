"""An exponential moving average of the weights, kept in the optimizer's state.

After every optimizer step, for each parameter p the optimizer updates:
    ema <- decay * ema + (1 - decay) * p,   ema = p after the first step
in fp32, stored as `optimizer.state[p][EMA_KEY]`, a tensor like p. Why the optimizer state: a
checkpoint saves it with AdamW's moments and resumes it with them, and calibration's steps, which
never step the optimizer, leave it alone. For one device and DDP only (WanModule refuses it under
FSDP1 and FSDP2): the update itself would work on each rank's shard, but a distributed checkpoint
resumes an optimizer's state into a template built from a fresh first step, which has no EMA
entry, so the average would silently restart at every resume.

Memory: one more fp32 copy of the parameters, which the memory plan does not predict on a
fresh run (calibration counts AdamW's two moments; a resumed run measures the state it holds):
leave that much room under `max_memory_fraction`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

EMA_KEY = "ema"


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


@torch.no_grad()
def update_ema(optimizer: torch.optim.Optimizer, decay: float) -> None:
    """One EMA update of every trainable parameter of `optimizer` (module docstring), after its step."""
    fresh, old, new = [], [], []
    for p in _params(optimizer):
        state = optimizer.state[p]
        if EMA_KEY not in state:
            fresh.append(p)
        else:
            old.append(state[EMA_KEY])
            new.append(p.float())
    for p in fresh:  # after the optimizer's own step, so its state is not empty (AdamW inits on empty)
        optimizer.state[p][EMA_KEY] = p.detach().float().clone()
    if old:
        torch._foreach_lerp_(old, new, 1.0 - decay)


@contextlib.contextmanager
def ema_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, every parameter holding an EMA holds its EMA values (copied in place); on exit, the
    trained values again. For sampling or export: `with ema_weights(opt): model.save_pretrained(...)`.
    Holds one copy of the swapped parameters meanwhile."""
    swapped = [(p, p.detach().clone()) for p in _params(optimizer) if EMA_KEY in optimizer.state[p]]
    with torch.no_grad():
        for p, _ in swapped:
            p.copy_(optimizer.state[p][EMA_KEY])
    try:
        yield
    finally:
        with torch.no_grad():
            for p, trained in swapped:
                p.copy_(trained)
