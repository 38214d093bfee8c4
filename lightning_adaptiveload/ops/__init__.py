"""Fused AdaLN: `adaln_modulate` (torch.library custom ops, CUDA kernels or reference) and `backend()`."""
from lightning_adaptiveload.ops.adaln import adaln_modulate, backend

__all__ = ["adaln_modulate", "backend"]
