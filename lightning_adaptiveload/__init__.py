"""lightning-adaptiveload: load-balanced bucketing and a fused AdaLN kernel for video DiT
training under PyTorch Lightning."""
from lightning_adaptiveload.scheduling.policies import batch_sizes, dual_constraint_batch_size, token_equal_batch_size
from lightning_adaptiveload.scheduling.shapes import ShapeMix, TokenSpec, read_shapes_jsonl

__version__ = "0.1.0"

__all__ = [
    "ShapeMix",
    "TokenSpec",
    "batch_sizes",
    "dual_constraint_batch_size",
    "read_shapes_jsonl",
    "token_equal_batch_size",
]
