"""Activation checkpointing of a model's blocks that can be switched per step.

`BlockCheckpointing(blocks)` binds a small forward on each block *instance*: when the block's switch
is on and autograd is recording, it runs the block's previous forward under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` (the block runs again in backward),
otherwise it calls it directly.

What a checkpointed block keeps (`save_attention`): by default its inputs and the outputs of torch's
fused attention kernels (`ATTENTION_OPS`, selective checkpointing), so backward recomputes the block
without its attention. At long sequences attention is most of a block's work (at S = 75,600 in the
1.3B model, 4 S D = 464 MFLOP per token against ~86 MFLOP per token for the block's linears: ~85%)
and its output is one (B, S, D) tensor: recomputing a whole block there cost about 80 ms per step on
an H200 (benchmarks/results/gpu_session8: 11.1 s a step with 30 blocks checkpointed, 10.2 s with 18),
keeping its attention costs 2 B S D bytes per attention call (232 MB at S = 75,600, D = 1536), a few
percent of what an un-checkpointed block of that length holds. False: only the inputs are kept and
the block runs again whole. Attention a model computes with other kernels (a math-backend SDPA, an
external flash-attention package) is recomputed either way.

No module is added, moved or renamed, so parameter names, `state_dict` keys and module classes stay
what they were: checkpoints load in both directions, and FSDP auto-wrap policies keyed on the block
class still find the blocks.

`set_checkpointed(k)` switches the first k blocks (in the order given; `find_blocks` gives
registration order, which is the forward order of a DiT's block list) on and the last L - k off.
Why the last ones stay un-checkpointed: backward reaches them first, so their activations are
freed before any checkpointed block is recomputed. With the first blocks un-checkpointed instead,
backward would recompute the last block while every un-checkpointed activation is still held: the
same end-of-forward peak plus one more block's activations.

Under data parallelism ranks may use different k in the same step. Recomputation runs inside the
block's backward, after the strategy has gathered the block's parameters for it (FSDP's pre-backward
hook of the unit the block is, or is inside), so a recomputing rank issues no extra collective and
DDP/FSDP gradient hooks fire in the same order on every rank. That holds only if no FSDP unit sits
*inside* a block (its forward would all-gather again during recomputation, on some ranks only):
`check_composition` refuses that layout, and a second checkpointing layer (torch's
`CheckpointWrapper`, e.g. from Lightning's `activation_checkpointing_policy`) around or inside a
block.
"""
from __future__ import annotations

import contextlib
import functools
import numbers
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_adaptiveload._imports import import_object

# BATCH_KEY: the batch entry saying how many blocks the step checkpoints (an int; absent = all),
# which the DataModule writes under a memory plan
from lightning_adaptiveload.scheduling.depth_choice import CHECKPOINTED_BATCH_KEY as BATCH_KEY

_STATE = "_adaptiveload_checkpointing"

# torch's fused attention kernels (SDPA's flash, cuDNN, memory-efficient and CPU flash backends): the
# ops whose outputs a selectively checkpointed block keeps (their output, log-sum-exp and RNG state,
# everything their backward reads beside q, k, v).
ATTENTION_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"))


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVE_ATTENTION = functools.partial(create_selective_checkpoint_contexts, _keep_attention)


@dataclass
class _BlockState:
    forward: Callable  # the forward the block had before wrapping (its class's, or an instance patch)
    instance_forward: bool  # whether that was an instance attribute (restored by unwrap)
    checkpoint: bool = True
    save_attention: bool = True


def _switchable_forward(self: nn.Module, *args, **kwargs):
    state: _BlockState = self.__dict__[_STATE]
    if state.checkpoint and torch.is_grad_enabled():
        if state.save_attention:
            return checkpoint(state.forward, *args, use_reentrant=False, context_fn=_SAVE_ATTENTION, **kwargs)
        return checkpoint(state.forward, *args, use_reentrant=False, **kwargs)
    return state.forward(*args, **kwargs)


def _is_wrapped(block: nn.Module) -> bool:
    return getattr(block.__dict__.get("forward"), "__func__", None) is _switchable_forward


def resolve_block_classes(spec) -> tuple[type[nn.Module], ...]:
    """Block classes from a class, an import path "package.module.Class", or an iterable of those
    (as Lightning's `activation_checkpointing_policy` takes a set of classes)."""
    items = [spec] if isinstance(spec, (str, type)) else list(spec)
    if not items:
        raise ValueError("block_classes is empty: name at least one block class")
    classes = []
    for item in items:
        cls = import_object(item, "block class") if isinstance(item, str) else item
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"block class {item!r} is not a torch.nn.Module subclass (use a class or 'pkg.mod.Class')")
        classes.append(cls)
    return tuple(classes)


def find_blocks(root: nn.Module, select: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Modules under `root` (not root itself) for which `select` is true, in registration order,
    outermost only (a selected module's descendants are not searched), each once."""
    found, seen = [], set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if select(child):
                found.append(child)
            else:
                visit(child)

    visit(root)
    return found


class BlockCheckpointing:
    """The switch over a model's blocks; blocks[i] is checkpointed iff i < checkpointed.

    save_attention: a checkpointed block keeps its attention kernels' outputs (module docstring).
    Wrapping is idempotent: blocks wrapped earlier (by another BlockCheckpointing) are taken over,
    with this switch's save_attention. Starts with every block checkpointed, the safe default."""

    def __init__(self, blocks: Sequence[nn.Module], save_attention: bool = True):
        blocks = list(blocks)
        if not blocks:
            raise ValueError("BlockCheckpointing needs at least one block")
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("BlockCheckpointing: a block appears twice")
        for block in blocks:
            if not _is_wrapped(block):
                prior = block.__dict__.get("forward")
                block.__dict__[_STATE] = _BlockState(forward=prior if prior is not None else block.forward,
                                                     instance_forward=prior is not None)
                block.forward = types.MethodType(_switchable_forward, block)
            block.__dict__[_STATE].save_attention = bool(save_attention)
        self.blocks = blocks
        self.save_attention = bool(save_attention)
        self.set_checkpointed(len(blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def checkpointed(self) -> int:
        """How many blocks (the first ones) are checkpointed now."""
        return self._checkpointed

    def set_checkpointed(self, k: int) -> None:
        """Checkpoint the first k blocks and run the last num_blocks - k plainly (from the next
        forward on). k: a whole number in [0, num_blocks]."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k <= self.num_blocks:
            raise ValueError(f"checkpointed blocks must be an integer in [0, {self.num_blocks}], got {k!r}")
        for i, block in enumerate(self.blocks):
            block.__dict__[_STATE].checkpoint = i < k
        self._checkpointed = int(k)

    @contextlib.contextmanager
    def checkpointing(self, k: int) -> Iterator[None]:
        """Run the body with k blocks checkpointed, then restore the previous setting (e.g. for
        calibration steps that bypass the training loop's batch hook)."""
        previous = self.checkpointed
        self.set_checkpointed(k)
        try:
            yield
        finally:
            self.set_checkpointed(previous)

    def unwrap(self) -> None:
        """Give every block back the forward it had before wrapping."""
        for block in self.blocks:
            state = block.__dict__.pop(_STATE)
            if state.instance_forward:
                block.forward = state.forward
            else:
                del block.forward


def checkpointed_from_batch(batch, num_blocks: int, key: str = BATCH_KEY) -> int:
    """How many blocks a batch asks to checkpoint: `batch[key]` (an int, or a one-element integer
    tensor or array) for a Mapping batch that has the key; num_blocks (all) otherwise."""
    if not isinstance(batch, Mapping) or key not in batch:
        return num_blocks
    value = batch[key]
    if (isinstance(value, torch.Tensor) and value.numel() == 1) or (isinstance(value, np.ndarray) and value.size == 1):
        value = value.item()  # a CUDA tensor synchronises here: prefer a Python int in the batch
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= num_blocks:
        raise ValueError(f"batch[{key!r}] must be an integer in [0, {num_blocks}] (blocks to checkpoint), "
                         f"got {value!r}")
    return int(value)


def check_composition(root: nn.Module, switch: BlockCheckpointing) -> None:
    """Raise ValueError if the wrapped model cannot switch checkpointing per rank and step safely:
    a block's switchable forward was replaced after wrapping (e.g. by a later instance patch), an
    FSDP unit sits inside a block (recomputing it would all-gather on some ranks only: a hang), or
    torch's CheckpointWrapper wraps a block or sits inside one (checkpointing twice). Call it after
    the strategy wrapped the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    units = (FullyShardedDataParallel, FSDPModule)
    for i, block in enumerate(switch.blocks):
        name = f"block {i} ({type(block).__name__})"
        if not _is_wrapped(block):
            raise ValueError(f"{name}: its switchable forward was replaced after wrapping (another patch of the "
                             "instance's forward, e.g. a module surgery applied later; apply that one first)")
        inner = [type(m).__name__ for m in block.modules() if m is not block and isinstance(m, units)]
        if inner:
            raise ValueError(f"{name} contains FSDP units ({', '.join(inner[:3])}): recomputing it would all-gather "
                             "again on the ranks that checkpoint it and hang the others; wrap whole blocks (or larger) "
                             "as FSDP units, e.g. auto_wrap_policy={BlockClass}")
        if any(isinstance(m, CheckpointWrapper) for m in block.modules()):
            raise ValueError(f"{name} contains a CheckpointWrapper: it would be checkpointed twice")
    blocks = {id(b) for b in switch.blocks}
    for module in root.modules():
        if isinstance(module, CheckpointWrapper) and any(id(m) in blocks for m in module.modules()):
            inner = type(module._checkpoint_wrapped_module).__name__
            raise ValueError(f"a CheckpointWrapper wraps a switchable block ({inner}): remove the strategy's "
                             "activation_checkpointing_policy (or let PerBucketCheckpointing take it over) so the "
                             "block is not checkpointed twice")


def select_instances(classes: Iterable[type[nn.Module]]) -> Callable[[nn.Module], bool]:
    """A `find_blocks` selector for instances of `classes`."""
    classes = tuple(classes)
    return lambda module: isinstance(module, classes)
