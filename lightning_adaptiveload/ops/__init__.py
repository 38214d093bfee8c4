"""Fused AdaLN: `adaln_modulate` (CUDA kernels or reference), `backend()` and `ensure_extension()`."""
from lightning_adaptiveload.ops.adaln import adaln_modulate, backend
from lightning_adaptiveload.ops.extension import ensure_extension

__all__ = ["adaln_modulate", "backend", "ensure_extension"]
