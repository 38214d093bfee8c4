"""Regional compilation of a DiT's transformer blocks, with no graph spent on how an input was made.

`compile_blocks(blocks, mode)` runs `block.compile(dynamic=...)` on each block (one code object
shared by identical blocks, so dynamo's graphs are per input shape, not per block) and has every
call hand the compiled region its tensor arguments as contiguous tensors of their own storage.

Why: dynamo guards on a tensor input's layout and, for a view, on its base's sizes and strides. A
DiT whose first block receives the patch embedding's `flatten(2).transpose(1, 2)` as it is (the
example DiT; diffusers' Wan model makes it contiguous first, as of 0.42.1) hands that block a
non-contiguous view of the convolution's output; every later block receives the previous block's
output, a plain contiguous tensor. The first block's guards therefore fail for every other block,
and each graph is compiled twice: once for block 0, once for the rest. Each view or non-contiguous
input is copied once per step (`_own_contiguous`: the first block's hidden states, (B, S, D), and
the inputs every block shares, the time projection (B, 6, D) and the text context (B, L, D), which
are views of a linear's output; the blocks share one copy of each, so a step holds one more of
each, not one per block), against a compile of tens of seconds per graph on a GPU (39-62 s for the shipped 30-block config on an H200,
docs/lightning.md "Compiled training").

What a mixed-shape epoch then compiles (benchmarks/e2e/compile_graphs.py: the example DiT with the
per-step checkpointing switch, 12 shapes of mixed B, T, H, W and blocks checkpointed, on the CPU):
`dynamic` 4 graphs (6 without the copies), `auto` 5 (7). What remains, and why:
- B = 1 against B >= 2: dynamo specializes a size of 1 (its 0/1 specialization), so a batch of one
  sample and a batch of several are different graphs. torch's `backed_size_oblivious` would merge them
  (2 graphs instead of 4 under the aot_eager backend, same losses), but on torch 2.13 inductor's backward
  then asserts a saved attention output's stride (`assert_size_stride`: sizes symbolic, strides of the
  first shape), and set only around the compiled call it misses the backward AOTAutograd compiles lazily;
  `mark_unbacked` on the batch dim made 7 graphs (2026-12-07, CPU);
- a checkpointed block against a plain one (`checkpointing/switch.py`): torch.utils.checkpoint
  inside the compiled region is another program, kept so selective checkpointing can keep the
  attention outputs (a checkpoint around the compiled region would recompute them);
- `auto` only: its first shape's static graph, before the first recompile makes the sizes dynamic.
T = 1 (images) against T > 1 costs nothing: a block sees S = T H W / patch tokens, never T.

On a GPU inductor added its own size guards on top (`guard_free_options`): its mix-order reduction
fusion (Triton only: a norm's weight gradient, summed over the rows, fused with its input gradient,
summed over the columns) decides by the row count, B*S tokens (B*L for the text context), against
5 Mi elements, twice the columns and 4,096 rows, and under dynamic shapes each decision is a guard. On
one H100 (torch 2.11) the shipped config's grid at 3 blocks compiled again at B = 1 for S = 3,600
and 9,408 after 256 (`1536*S < 5242880`, `3072 <= S <= 4095`) and at B = 8 and 16 (the context's
`1536*B*512 < 5242880`), 20-30 s each (benchmarks/results/gpu_session15); the CPU count above
never meets it. Compiled with dynamic sizes, the blocks therefore run that fusion in torch's
non-strict mode, which skips the size checks (torch's config: "could be helpful to avoid
recompilations"): the fusion applies at every size, its small-workload penalty falls on steps that
are launch-bound anyway. On the CPU, inductor guards at 4,096 rows too: its C++ backend's float-sum
helper (`need_use_acc_helper`, `B*S <= 4096`) and a `2 <= S <= 4096` whose source dynamo's record
does not name; 8 graphs instead of 4 on the shipped grid's sizes under one-process FSDP1
(benchmarks/results/compile_graphs_grid_fsdp_cpu.json), none of them turned off by an option here.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn

from lightning_adaptiveload._validation import require_choice

# mode -> block.compile(dynamic=...): "static" a graph per shape, "auto" torch's default (static,
# dynamic from the first recompile), "dynamic" symbolic sizes from the first shape
COMPILE_MODES = {"static": False, "auto": None, "dynamic": True}


_COPY = "_adaptiveload_contiguous_copy"  # on an original tensor: (its _version when copied, the copy)


def _own_contiguous(value):
    """`value` with every tensor in it (through tuples, lists and dicts) that is a view or not
    contiguous replaced by a contiguous copy of its own storage, one copy per tensor while it lives
    and is not modified in place (its `_version`): the blocks of a step share the copy of an input
    they share. The copy hangs on the original, so it lives as long as the original does; a leaf's
    is not kept (the copy's gradient path holds the leaf, a cycle torch cannot collect).
    Differentiable: a copy is a `clone`, so gradients reach the original once, summed over the
    blocks. Walked by hand: torch's tree_map costs several times more host time, at every block call."""
    if isinstance(value, torch.Tensor):
        if value._base is None and value.is_contiguous():
            return value
        kept = getattr(value, _COPY, None)
        if kept is not None and kept[0] == value._version:
            return kept[1]
        copy = value.clone(memory_format=torch.contiguous_format)
        if not value.is_leaf:
            setattr(value, _COPY, (value._version, copy))
        return copy
    if isinstance(value, (tuple, list)):
        return type(value)(_own_contiguous(v) for v in value)
    if isinstance(value, dict):
        return {k: _own_contiguous(v) for k, v in value.items()}
    return value


def _plain_tensor_attributes(modules: Iterable[nn.Module]) -> Iterator[torch.Tensor]:
    """Every tensor `modules` hold as an attribute that is not an `nn.Parameter`: under FSDP1 with
    `use_orig_params=True`, a unit's parameters during forward (plain tensor views of its flat
    parameter, new ones at every forward)."""
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield value


@contextlib.contextmanager
def _traced_as_plain_views(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Around a compiled call of `modules`: every plain tensor attribute's sizes marked static, and
    the gradient of each such view's base (FSDP1's flat parameter) set aside, put back on exit.

    Sizes: dynamo keeps a parameter's sizes static but, under `dynamic=True`, makes every size of a
    plain tensor symbolic, so the graphs carried the weights' sizes (D, the modulation table's 6) as
    symbols, shared by duck sizing with activation sizes that happen to be equal
    (benchmarks/e2e/fsdp_param_views.py); the views are new tensors at every forward, hence marked at
    every call.

    Gradients: dynamo fakeifies a view's base with its `.grad`, and FSDP1 holds the flat parameter in
    the compute dtype (bf16 under bf16-mixed) or unsharded during forward while its gradient, from the
    previous step (Lightning zeroes gradients after `training_step`) or an earlier micro-batch, stays
    fp32 or sharded: a pairing torch's fake tensors refuse ("attempting to assign a gradient with
    dtype 'float' to a tensor with grad_dtype 'BFloat16'", every compile mode, from the second step
    on; benchmarks/results/gpu_session12). Set aside, the gradient is absent from every trace (and
    from dynamo's guards, consistently). It is put back as FSDP1 itself holds the pair, through a
    `.data` swap, since the `.grad` setter refuses a gradient of another dtype or shape."""
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for value in _plain_tensor_attributes(modules):
        torch._dynamo.mark_static(value)
        base = value._base
        if base is not None and base.grad is not None and id(base) not in held:
            held[id(base)] = (base, base.grad)
            base.grad = None
    try:
        yield
    finally:
        for base, grad in held.values():
            data = base.data
            base.data = grad
            base.grad = grad
            base.data = data


class _ContiguousInputs:
    """The compiled call of one block: traced as plain views (`_traced_as_plain_views`), its tensor
    arguments given through `_own_contiguous` (module docstring)."""

    def __init__(self, compiled: Callable, block: nn.Module):
        self.compiled = compiled
        self.modules = tuple(block.modules())

    def __call__(self, *args, **kwargs):
        with _traced_as_plain_views(self.modules):
            return self.compiled(*_own_contiguous(args), **_own_contiguous(kwargs))


def guard_free_options(known: Collection[str] | None = None) -> dict[str, bool]:
    """The inductor options that keep size decisions out of a dynamic-shape graph's guards (module
    docstring): the mix-order reduction's non-strict mode where this torch has it, else the fusion
    off (a torch that has neither does not guard there). known: the option names inductor accepts
    (default: this torch's)."""
    if known is None:
        from torch._inductor import config

        known = config.get_config_copy().keys()
    if "triton.mix_order_reduction_non_strict_mode" in known:
        return {"triton.mix_order_reduction_non_strict_mode": True}
    if "triton.mix_order_reduction" in known:
        return {"triton.mix_order_reduction": False}
    return {}


def compile_blocks(blocks: Iterable[nn.Module], mode: str, **compile_kwargs) -> int:
    """Compile each block that is not compiled yet (`nn.Module.compile`, so parameter names and
    `state_dict` keys stay), with `dynamic` from `mode` (a key of COMPILE_MODES) and
    `compile_kwargs` passed to torch.compile (e.g. backend); returns how many it compiled. With
    inductor (the default backend) and sizes that may be dynamic (`dynamic`, `auto`), inductor's
    `guard_free_options()` come first in `options` (a caller's options win). Call it
    after any surgery that rebinds the blocks' forward (the compiled call traces what is bound
    then), as the examples' `configure_model` does."""
    dynamic = COMPILE_MODES[require_choice("compile mode", mode, COMPILE_MODES)]
    if dynamic is not False and compile_kwargs.get("backend", "inductor") == "inductor":
        compile_kwargs["options"] = {**guard_free_options(), **(compile_kwargs.get("options") or {})}
    compiled = 0
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is not None:
            continue
        block.compile(dynamic=dynamic, **compile_kwargs)
        block._compiled_call_impl = _ContiguousInputs(block._compiled_call_impl, block)
        compiled += 1
    return compiled
