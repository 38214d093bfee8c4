"""Loss scaling for unequal per-rank batches.

DDP and FSDP average gradients over ranks with equal weight 1/world_size. When ranks hold
different numbers of samples (dual-constraint batches: long videos give small B, images
large B) the averaged gradient is a mean of per-rank means, which over-weights samples on
ranks with few samples. Scaling each rank's mean loss by world_size * n_local / n_global
makes the averaged gradient the mean over every sample (or token) of the global batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_adaptiveload._distributed import is_distributed


def scale_loss_to_global_mean(loss_mean: Tensor, local_count: int | Tensor, process_group=None) -> Tensor:
    """Return loss_mean * world_size * local_count / global_count.

    loss_mean: this rank's loss averaged over its `local_count` samples (or tokens).
    global_count: sum of local_count over the ranks of `process_group` (one all_reduce of a
    single number; a collective, so every rank of the group must call this each step).
    Without an initialized process group this returns `loss_mean` unchanged. The counts carry
    no gradient, so backward only sees the constant factor. If every rank's count is 0 this
    raises on CPU; on GPU (no host sync) the result is NaN, like the mean of an empty batch.
    """
    if not isinstance(local_count, Tensor) and local_count < 0:
        raise ValueError(f"local_count must be >= 0, got {local_count}")
    count = torch.as_tensor(local_count, dtype=torch.float64, device=loss_mean.device).detach()
    if count.numel() != 1:
        raise ValueError(f"local_count must be a single number, got a tensor of shape {tuple(count.shape)}")
    if not is_distributed():
        return loss_mean
    global_count = count.reshape(1).clone()
    dist.all_reduce(global_count, op=dist.ReduceOp.SUM, group=process_group)
    # Checked only on CPU: .item() on a GPU tensor would stall the host once per step.
    if global_count.device.type == "cpu" and global_count.item() <= 0:
        # Same value on every rank, so every rank raises together: no rank waits in a collective.
        raise ValueError("scale_loss_to_global_mean: the global count is 0 (every rank has an empty batch)")
    factor = dist.get_world_size(process_group) * count.reshape(()) / global_count[0]
    return loss_mean * factor.to(loss_mean.dtype)
