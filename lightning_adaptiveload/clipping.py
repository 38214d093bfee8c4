"""FSDPNormClipping: gradient-norm clipping that works under Lightning's FSDPStrategy (FSDP1).

Lightning's FSDP precision plugin raises for the Trainer's `gradient_clip_val` with norm clipping
(Lightning issue #19235; the example's h200_fsdp.yaml stopped at its first optimizer step on two
H200s). FSDP1's own `clip_grad_norm_` computes the norm over every shard. Under
`ModelParallelStrategy` (FSDP2) and without sharding Lightning's default already clips the global
norm (`torch.nn.utils.clip_grad_norm_` is DTensor-aware), so everything else is left to it.
"""
from __future__ import annotations

import lightning as L
import torch
from torch.distributed.fsdp import FullyShardedDataParallel


class FSDPNormClipping(L.LightningModule):
    """Mix into a LightningModule (before `L.LightningModule` in its bases, or as its base) to clip by
    norm under FSDP1 with FSDP's `clip_grad_norm_`, and by Lightning's default otherwise."""

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        model = self.trainer.model  # the strategy's wrapped root module
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") \
                and isinstance(model, FullyShardedDataParallel):
            model.clip_grad_norm_(gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
