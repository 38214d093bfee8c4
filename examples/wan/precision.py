"""fp32 for what diffusers keeps in fp32 (`WanTransformer3DModel._keep_in_fp32_modules`: rope,
time_embedder, scale_shift_table, norm1/2/3; matched as diffusers matches them, against the
components of a parameter's dotted name) while the rest computes in bf16.

What each strategy gets (docs/lightning.md, "FSDP1 or FSDP2"):

- Every strategy: the time embedder (`condition_embedder.time_embedder`) runs with autocast off in
  its weights' dtype (`keep_time_embedder_fp32`), so bf16-mixed's autocast does not turn its two
  matmuls (over the sinusoidal features of timestep = 1000 sigma) into bf16 ones; the norms
  compute in fp32 by themselves (diffusers' FP32LayerNorm upcasts input and weights; norm1 and
  norm3 have no weights), and the blocks add scale_shift_table to an fp32 timestep projection.
- FSDP2 (`shard_with_fp32_groups`): every WanTransformerBlock one group in the compute dtype; the
  root group, which holds the output scale_shift_table and the time embedder, in fp32
  (MixedPrecisionPolicy(param_dtype=fp32)); the root's other modules (patch embedding, text
  embedder, time projection, output projection) one compute-dtype group each. Inside a block the
  weights kept in fp32 elsewhere (scale_shift_table, norm2's affine) enter compute in the block's
  dtype: an fp32 group inside a block would be an FSDP unit inside a switchable-checkpointing block,
  which all-gathers again when a rank recomputes the block (a hang when ranks checkpoint different
  blocks; PerBucketCheckpointing refuses it) and breaks the block's compiled region at its hooks.
  Their master copies, gradients and optimizer state stay fp32; `fsdp2_param_dtype: float32` makes
  every group fp32.
- FSDP1 under bf16-mixed (`fsdp1_mixed_precision`, set on the strategy when the config gives none):
  Lightning's default would gather every parameter, reduce every gradient and cast every buffer in
  bf16, the RoPE tables included, and cast the batch to bf16 before training_step. Instead:
  parameters gathered in bf16, gradients reduced in fp32, buffers left in their dtype (the RoPE
  tables), the batch left as it comes (x_t and the target are formed from exact latents; autocast
  casts inside the ops), and the time embedder its own FSDP1 unit with mixed precision off (FSDP1's
  `_module_classes_to_ignore`, outside every block). The output and block
  scale_shift_tables and norm2's affine are gathered in bf16 (an FSDP1 unit per module inside a
  block would break checkpointing as above; FSDP1 has no per-parameter policy).
"""
from __future__ import annotations

import types

import torch
from torch import nn


def keep_fp32_names() -> tuple[str, ...]:
    from diffusers import WanTransformer3DModel

    return tuple(WanTransformer3DModel._keep_in_fp32_modules)


def kept_in_fp32(name: str, keep: tuple[str, ...]) -> bool:
    """Whether diffusers keeps the parameter `name` (dotted, e.g. "blocks.0.norm2.weight") in fp32."""
    return any(part in keep for part in name.split("."))


def _fp32_time_embedder_forward(self: nn.Module, sample: torch.Tensor, condition: torch.Tensor | None = None):
    # in the weights' dtype, not autocast's: fp32 wherever the module sets the time embedder up
    with torch.autocast(device_type=sample.device.type, enabled=False):
        return type(self).forward(self, sample.to(self.linear_1.weight.dtype), condition)


def keep_time_embedder_fp32(transformer: nn.Module) -> None:
    """Bind the autocast-free forward on the transformer's time embedder instance (its class, state
    dict and parameters unchanged). Idempotent."""
    embedder = transformer.condition_embedder.time_embedder
    embedder.forward = types.MethodType(_fp32_time_embedder_forward, embedder)


def shard_with_fp32_groups(transformer: nn.Module, mesh, compute_dtype: torch.dtype) -> None:
    """FSDP2 `fully_shard` of every block (compute_dtype), of each of the root's modules holding only
    parameters diffusers does not keep in fp32 (compute_dtype), then of the root (fp32: what is left
    is kept in fp32). Gradients are reduced in fp32; inputs are never cast (the timestep stays fp32,
    the RoPE tables fp64; the caller feeds latents and text in compute_dtype). ValueError if the
    root is left holding a parameter diffusers does not keep in fp32 (a model this layout does not
    know)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    keep = keep_fp32_names()
    compute = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in transformer.blocks:
        fully_shard(block, mesh=mesh, mp_policy=compute)
    in_blocks = {id(p) for p in transformer.blocks.parameters()}

    def split(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            kept = {kept_in_fp32(f"{prefix}{name}.{n}", keep) for n, p in child.named_parameters()
                    if id(p) not in in_blocks}
            if kept == {False}:
                fully_shard(child, mesh=mesh, mp_policy=compute)
            elif kept == {True, False}:
                split(child, f"{prefix}{name}.")
        direct = [f"{prefix}{n}" for n, _ in module.named_parameters(recurse=False)]
        if any(not kept_in_fp32(n, keep) for n in direct):
            raise ValueError(f"WanModule: {direct} would shard in fp32 beside modules kept in fp32; this layout "
                             "knows diffusers' WanTransformer3DModel only")

    split(transformer, "")
    fully_shard(transformer, mesh=mesh, mp_policy=fp32)


def fsdp1_mixed_precision():
    """FSDP1's MixedPrecision for bf16-mixed training of Wan (module docstring)."""
    from diffusers.models.embeddings import TimestepEmbedding
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=None,
                          cast_root_forward_inputs=False, _module_classes_to_ignore=(TimestepEmbedding,))
