"""Memory that calibration's steps do not show: the optimizer's state, and the device's size.

Calibration runs forward + backward and never an optimizer step (it must leave no trace), so its
peaks lack what the optimizer holds during training: Adam's two moments per parameter are created at
the first step and stay for the whole run, alongside every later step's activations. The memory
plan adds them to every predicted peak (the memory model's m0). The rule (docs/memory.md):

- measured: if an optimizer's `state` holds tensors (a resumed run, or any optimizer that creates
  its state up front, e.g. Adagrad), the bytes of their distinct storages on this rank;
- predicted: otherwise, from its type and each parameter group's options, states per parameter x
  the bytes of this rank's part of the parameter (torch creates each state like its parameter:
  same dtype, and under FSDP the optimizer holds the local shards): Adam/AdamW 2 (3 with amsgrad),
  NAdam, RAdam, Adamax, Adadelta 2, RMSprop 1 (+1 with momentum, +1 centered), SGD 1 with momentum
  else 0, Adagrad 1; another type is assumed Adam-like (2) and named in `rule`.

The optimizer step itself (parameters, gradients, state and the foreach implementations' temporary
of about one more parameter copy) runs after backward has freed the activations, so it is not part
of the per-batch peak; `step_bytes` estimates it, and calibration warns when it alone exceeds the
plan's budget.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_TWO_MOMENTS = ("NAdam", "RAdam", "Adamax", "Adadelta")
ASSUMED_STATES = 2  # an optimizer type the rule does not know: Adam-like


@dataclass(frozen=True)
class OptimizerMemory:
    """state_bytes: the optimizers' state on this rank; param_bytes: the parameters they update (this
    rank's part); rule: how state_bytes was found, per optimizer."""

    state_bytes: int
    param_bytes: int
    rule: str

    @property
    def step_bytes(self) -> int:
        """Estimated peak of the optimizer step: parameters, gradients, state and one parameter-sized
        temporary."""
        return 2 * self.param_bytes + self.state_bytes + (self.param_bytes if self.state_bytes else 0)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard; any other tensor as is)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def states_per_param(optimizer: torch.optim.Optimizer, group: dict) -> int | None:
    """State tensors the optimizer creates per parameter of `group` (None: a type the rule does not know)."""
    name = type(optimizer).__name__
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if name in _TWO_MOMENTS:
        return 2
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum") else 0
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    return None


def optimizer_memory(optimizers: list[torch.optim.Optimizer]) -> OptimizerMemory:
    """The optimizers' state bytes on this rank by the module's rule, and their parameters' bytes."""
    state_total = param_total = 0
    rules = []
    for optimizer in optimizers:
        params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
        param_total += sum(_nbytes(p) for p in params.values())
        tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        name = type(optimizer).__name__
        if tensors:
            storages = {}
            for t in tensors:
                local = _local(t)
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            state_total += sum(storages.values())
            rules.append(f"{name}: measured ({len(tensors)} state tensors)")
            continue
        unknown = False
        for group in optimizer.param_groups:
            per = states_per_param(optimizer, group)
            unknown |= per is None
            state_total += (ASSUMED_STATES if per is None else per) * sum(_nbytes(p) for p in group["params"])
        rules.append(f"{name}: " + (f"unknown type, assumed {ASSUMED_STATES} states per parameter" if unknown
                                    else "predicted from its type"))
    return OptimizerMemory(state_bytes=int(state_total), param_bytes=int(param_total), rule="; ".join(rules))


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device` in bytes: a CUDA device's, else the machine's physical memory (CPU
    calibration peaks are estimates, see calibration/runner.py)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
