"""A model under FSDP1 in one process, as Lightning's FSDPStrategy wraps it for
`auto_wrap_policy=[DiTBlock]` and `precision: bf16-mixed` (one unit per block, `use_orig_params=True`,
parameters, reductions and buffers in bf16; NO_SHARD at world size 1): the layout the shipped config
compiles its blocks under, for benchmarks that look at what dynamo traces there. On the CPU through
gloo (Lightning refuses FSDP on the CPU; torch's FSDP1 runs there), on CUDA through NCCL."""
from __future__ import annotations

import torch


def single_process_fsdp1(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """`model` (on `device`) wrapped as above; starts the one-process group the wrap needs (an
    in-process store: no port)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from examples.video_dit.model import DiTBlock

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), world_size=1, rank=0)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    device_id = torch.cuda.current_device() if device == "cuda" else torch.device("cpu")
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({DiTBlock}), mixed_precision=policy,
                                    use_orig_params=True, device_id=device_id)
