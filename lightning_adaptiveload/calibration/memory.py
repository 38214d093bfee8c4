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

Verification does not predict: `optimizer_state_present` runs each optimizer's first step before
the shapes run (zero gradients, learning rate 0: the update is exactly zero for the optimizers the
rule knows, and the parameters of any other are restored from a host copy), so their steps hold
the state training will hold, measured, and the step's own peak is measured too; on exit the state
is dropped again, as before, and the first training step creates it as it always does.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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


@dataclass
class MaterializedState:
    """What `optimizer_state_present` measured: state_bytes the optimizers' new state holds on this
    rank (CUDA allocator bytes; the rule's prediction on other devices), step_peak_bytes the device's
    peak allocated memory during that first step (gradients present, as in training; None off CUDA),
    created: whether any state was created (False when every optimizer held its state already)."""

    state_bytes: int
    step_peak_bytes: int | None
    created: bool


def _update_is_zero_at_lr_0(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step at learning rate 0 leaves the parameters bit-identical: every optimizer the
    state rule knows scales its update by lr (AdamW's decay by lr * weight_decay as well)."""
    return all(states_per_param(optimizer, group) is not None for group in optimizer.param_groups)


def _first_step(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's first step at learning rate 0 on zero gradients, which creates its state; its
    learning rates, gradients and parameters are as before afterwards. Its own function so that
    nothing it held (the gradients it set aside, a host copy) outlives it: the caller's steps that
    follow must hold only what training holds."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    host_copy = None if _update_is_zero_at_lr_0(optimizer) else [p.detach().to("cpu", copy=True) for p in params]
    saved_grads = [p.grad for p in params]
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
        with torch.no_grad():
            optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        if host_copy is not None:
            with torch.no_grad():
                for p, copy in zip(params, host_copy):
                    p.copy_(copy)


@contextlib.contextmanager
def optimizer_state_present(optimizers: list[torch.optim.Optimizer], device: torch.device
                            ) -> Iterator[MaterializedState]:
    """Inside, every optimizer that held no state holds the state its first step creates; on exit it
    holds none again and its learning rates, gradients (None) and parameters are as before. An
    optimizer that already holds state (a resumed run) is left alone. Nothing else is kept alive
    inside: the gradients present on entry are the parameters' own again, freed when a step replaces
    them (a list of them kept across the `yield` held one gradient copy, 5.3 GiB at 1.3B parameters,
    in every verified peak of the H200 runs before 2026-12-03: peaks 4.7% above training's)."""
    cuda = device.type == "cuda"
    fresh = [opt for opt in optimizers if not any(len(state) for state in opt.state.values())]
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for optimizer in fresh:
        _first_step(optimizer)
    if cuda:
        torch.cuda.synchronize(device)
        state = MaterializedState(torch.cuda.memory_allocated(device) - before,
                                  torch.cuda.max_memory_allocated(device), bool(fresh))
    else:
        state = MaterializedState(optimizer_memory(fresh).state_bytes if fresh else 0, None, bool(fresh))
    try:
        yield state
    finally:
        for optimizer in fresh:
            optimizer.state.clear()
